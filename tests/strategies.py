"""Hypothesis strategies shared by the suite: devices, dtypes, shapes and seeds.

Devices are every device this machine has: ``cpu`` and ``meta`` always, ``cuda`` and ``mps``
when present. ``TOOLKIT_TEST_DEVICES`` (comma separated, such as ``cpu,meta``) restricts
them; naming a device that is not available is an error rather than a silent skip.

The draws are weighted towards real arithmetic. ``meta`` has no data, so it is one case in
twelve, and the devices with data share the rest; a zero-size dimension (an empty input or
weight) is one case in twelve; every other dimension is at least 1. Each draw records Hypothesis
events (the device, the dtype, the number of input dimensions, and whether the tensors hold
data), so ``pytest --hypothesis-show-statistics`` shows the mix (CONTRIBUTING.md has the table).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from hypothesis import event
from hypothesis import strategies as st

__all__ = ["DEVICES", "LinearCase", "ignored_targets", "linear_cases", "make_tensor", "seeds"]

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


# One draw in META_ONE_IN is on ``meta`` (when it is available), one in ZERO_SIZE_ONE_IN has a
# zero-size dimension.
META_ONE_IN = 12
ZERO_SIZE_ONE_IN = 12


@st.composite
def devices_weighted(draw: st.DrawFn, devices: tuple[str, ...] = DEVICES) -> str:
    """A device: ``meta`` one time in ``META_ONE_IN``, else one of the devices with data.

    Shrinking moves towards the first device with data, not towards ``meta``.
    """
    with_data = tuple(d for d in devices if d != "meta")
    if not with_data or ("meta" in devices and draw(st.integers(1, META_ONE_IN)) == META_ONE_IN):
        device = "meta"
    else:
        device = draw(st.sampled_from(with_data))
    event(f"device: {device}")
    return device


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
    """Draw a device, a dtype, leading dims (none for a 1-D input), feature sizes and a seed.

    One case in ``ZERO_SIZE_ONE_IN`` sets one dimension to zero (a leading one, or a feature
    size unless ``min_out`` forbids it for ``out_features``); all other sizes are at least 1.
    """
    device = draw(devices_weighted(devices))
    allowed = FLOAT_DTYPES if float_only else FLOAT_DTYPES + COMPLEX_DTYPES
    if device == "mps":  # F.linear there has no float64 and no complex dtype
        allowed = tuple(d for d in allowed if d.itemsize < 8)
    dtype = draw(st.sampled_from(allowed))
    lead = draw(st.lists(st.integers(1, max_side), max_size=max_lead_dims))
    in_features = draw(st.integers(1, max_side + 3))
    out_features = draw(st.integers(max(min_out, 1), max_side + 3))
    if draw(st.integers(1, ZERO_SIZE_ONE_IN)) == ZERO_SIZE_ONE_IN:
        places = [*range(len(lead)), "in", *(["out"] if min_out == 0 else [])]
        place = draw(st.sampled_from(places))
        if place == "in":
            in_features = 0
        elif place == "out":
            out_features = 0
        else:
            lead[int(place)] = 0
    case = LinearCase(device, dtype, tuple(lead), in_features, out_features, draw(seeds))
    event(f"dtype: {str(dtype).removeprefix('torch.')}")
    event(f"input dims: {len(case.x_shape)}")
    empty = 0 in (*case.x_shape, case.out_features)
    event(f"tensors: {'meta' if case.is_meta else 'empty' if empty else 'data'}")
    return case


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


@st.composite
def ignored_targets(draw: st.DrawFn, tokens: int) -> list[bool]:
    """Which of ``tokens`` targets a loss ignores: none, all, or some, each drawn.

    Records the share as a Hypothesis event (``ignored: none``, ``some`` or ``all``, read from
    the mask: a drawn "some" may come out as none or all).
    """
    share = draw(st.sampled_from(["none", "some", "all"]))
    if share == "some":
        mask = draw(st.lists(st.booleans(), min_size=tokens, max_size=tokens))
    else:
        mask = [share == "all"] * tokens
    event(f"ignored: {'all' if all(mask) and mask else 'some' if any(mask) else 'none'}")
    return mask
