"""Where a ModuleDefaultDict puts the entries it creates: the net effect of its moves and casts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["EntryPlacement"]

# Two floating dtypes that every device supports: a conversion that maps both to one dtype
# casts floating tensors to it; one that keeps them apart leaves the dtype alone. The integer
# probe tells the rare conversion that casts every tensor (``Module.type``) from the rest.
_PROBE_DTYPES = (torch.float32, torch.float16, torch.int32)


@dataclass(frozen=True)
class EntryPlacement:
    """The device and dtypes that the dict's conversions have set, each None if none has.

    ``nn.Module.to``, ``.cuda()``, ``.half()``, ``to_empty()`` and the like all reach a child
    through ``_apply(fn)``, where ``fn`` converts one tensor. Rather than keep every ``fn``
    (an unbounded chain, and replaying ``to_empty`` would leave new entries uninitialised), the
    dict applies each ``fn`` to one-element probe tensors and keeps only its net effect, as for
    a parameter that had been there all along: the last device and the last floating dtype set,
    and the dtype of the other tensors if a conversion set theirs too. ``unknown`` says why
    that effect could not be learnt, if it could not.
    """

    device: torch.device | None = None
    dtype: torch.dtype | None = None
    other_dtype: torch.dtype | None = None
    unknown: str | None = None

    def after(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> EntryPlacement:
        """The placement after ``fn``, learnt from what ``fn`` does to probe tensors.

        A probe starts on the device set so far, or on the default device, where a factory
        builds by default. ``fn`` sets the device if the probes leave that device, and sets the
        dtype if it maps both probe dtypes to one. A probe on the meta device has no data to
        copy out: if ``fn`` fails on it, ``fn`` is learnt on the CPU instead, and sets the
        device it puts that probe on. If ``fn`` fails on the probes, the placement is unknown
        from then on; the conversion itself is not affected.
        """
        if self.unknown is not None:
            return self
        start = self.device if self.device is not None else torch.get_default_device()
        try:
            outs = _probe(fn, start)
            moved = outs[0].device != start
        except Exception as error:  # the conversion runs all the same
            unknown = EntryPlacement(unknown=f"{type(error).__name__}: {error}")
            if start.type != "meta":
                return unknown
            try:
                outs = _probe(fn, torch.device("cpu"))
            except Exception:  # reported as the failure on the first probe
                return unknown
            moved = True  # fn needs data, so a tensor on the meta device cannot stay there
        device = outs[0].device if moved else self.device
        dtypes = {outs[0].dtype, outs[1].dtype}
        dtype = dtypes.pop() if len(dtypes) == 1 else self.dtype
        other = outs[2].dtype if outs[2].dtype != _PROBE_DTYPES[2] else self.other_dtype
        return EntryPlacement(device, dtype, other)

    def apply(self, module: nn.Module) -> None:
        """Move ``module`` to the device and cast its tensors to the dtypes that are set.

        Tensors that are not floating point keep their dtype, as ``nn.Module.to`` does, unless
        a conversion such as ``Module.type`` set theirs too. Nothing happens if nothing is set,
        so a dict that was never moved leaves the factory's result where the factory put it.

        Raises:
            RuntimeError: If the placement is unknown.
        """
        if self.unknown is not None:
            raise RuntimeError(
                "ModuleDefaultDict cannot place a new entry: the dict was converted by a "
                f"function that failed on a probe tensor ({self.unknown}), so where an entry "
                "that had been there all along would be is unknown. Create the entries before "
                "such a conversion, or insert them with d[key] = module"
            )
        if self == UNMOVED:
            return
        device, dtype, other = self.device, self.dtype, self.other_dtype
        module._apply(  # type: ignore[no-untyped-call]
            lambda t: t.to(device, dtype if t.is_floating_point() else other)
        )


def _probe(fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """What ``fn`` makes of a one-element tensor of each probe dtype on ``device``."""
    return [fn(torch.ones(1, dtype=dtype, device=device)) for dtype in _PROBE_DTYPES]


UNMOVED = EntryPlacement()
