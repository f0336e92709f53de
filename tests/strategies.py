"""Hypothesis strategies shared by the suite: devices, dtypes, shapes and seeds.

Devices are every device this machine has: ``cpu`` and ``meta`` always, ``cuda`` and ``mps``
when present. ``TOOLKIT_TEST_DEVICES`` (comma separated, such as ``cpu,meta``) restricts
them; naming a device that is not available is an error rather than a silent skip.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

__all__ = [
    "DEVICES",
    "LinearCase",
    "available_devices",
    "dtypes_for",
    "linear_cases",
    "make_tensor",
    "seeds",
]

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
COMPLEX_DTYPES = (torch.complex64, torch.complex128)


def available_devices() -> tuple[str, ...]:
    """Every device type usable here, restricted by ``TOOLKIT_TEST_DEVICES`` when set."""
    found = ["cpu", "meta"]
    if torch.cuda.is_available():
        found.append("cuda")
    if torch.backends.mps.is_available():
        found.append("mps")
    wanted = os.environ.get("TOOLKIT_TEST_DEVICES")
    if not wanted:
        return tuple(found)
    chosen = tuple(name.strip() for name in wanted.split(",") if name.strip())
    missing = [name for name in chosen if name not in found]
    if missing or not chosen:
        raise RuntimeError(
            f"TOOLKIT_TEST_DEVICES={wanted!r} names {missing or 'no device'}, "
            f"but this machine has {found}"
        )
    return chosen


DEVICES = available_devices()


def dtypes_for(device: str) -> tuple[torch.dtype, ...]:
    """The dtypes ``F.linear`` supports on ``device``."""
    if device == "mps":
        return (torch.float32, torch.bfloat16, torch.float16)
    return FLOAT_DTYPES + COMPLEX_DTYPES


seeds = st.integers(min_value=0, max_value=2**32 - 1)


@dataclass(frozen=True)
class LinearCase:
    """One drawn configuration for a tied linear layer and its input."""

    device: str
    dtype: torch.dtype
    lead: tuple[int, ...]
    in_features: int
    out_features: int
    seed: int

    @property
    def x_shape(self) -> tuple[int, ...]:
        """The input's shape: the leading dims, then ``in_features``."""
        return (*self.lead, self.in_features)

    @property
    def is_meta(self) -> bool:
        """Whether tensors have no data, so only shapes and dtypes can be compared."""
        return self.device == "meta"


@st.composite
def linear_cases(
    draw: st.DrawFn,
    *,
    max_lead_dims: int = 4,
    max_side: int = 5,
    min_out: int = 0,
    devices: tuple[str, ...] = DEVICES,
    float_only: bool = False,
) -> LinearCase:
    """Draw a device, a dtype, leading dims (none for a 1-D input; zero sizes included),
    feature sizes and a seed."""
    device = draw(st.sampled_from(devices))
    allowed = dtypes_for(device)
    if float_only:
        allowed = tuple(d for d in allowed if d.is_floating_point)
    dtype = draw(st.sampled_from(allowed))
    lead = tuple(draw(st.lists(st.integers(0, max_side), max_size=max_lead_dims)))
    in_features = draw(st.integers(0, max_side + 3))
    out_features = draw(st.integers(min_out, max_side + 3))
    return LinearCase(device, dtype, lead, in_features, out_features, draw(seeds))


def make_tensor(
    shape: tuple[int, ...], case: LinearCase, *, offset: int = 0, requires_grad: bool = False
) -> torch.Tensor:
    """A reproducible random tensor for ``case``: seeded on the CPU, then moved."""
    if case.is_meta:
        return torch.empty(shape, dtype=case.dtype, device="meta", requires_grad=requires_grad)
    generator = torch.Generator().manual_seed(case.seed + offset)
    base = torch.complex128 if case.dtype.is_complex else torch.float64
    values = torch.randn(shape, dtype=base, generator=generator)
    return values.to(case.device, case.dtype).requires_grad_(requires_grad)
