"""What several modules of the package share.

The DTensor test, whether ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` asks for checks, a module's
one-line description, the module that computes a TiedLinear
head's ``x @ weight.T``, a pipeline's process group from a 1-D mesh, and the gathering of each
rank's Python object.

This is the one module whose private names other modules of the package import.
"""

from __future__ import annotations

import pickle
import sys
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def _is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor, without importing ``torch.distributed.tensor``.

    No DTensor exists before that module is imported, so a plain tensor is told apart
    without paying for the import (seconds on a busy machine).
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _detail() -> bool:
    """Whether ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` asks for checks with collectives of their own."""
    if not dist.is_available():
        return False
    from torch.distributed.distributed_c10d import DebugLevel, get_debug_level  # noqa: PLC0415

    return get_debug_level() == DebugLevel.DETAIL


def _describe(module: nn.Module) -> str:
    """A one-line description of ``module``, such as ``Embedding(17, 8)``."""
    return f"{type(module).__name__}({module.extra_repr()})"


class _Linear(nn.Module):
    """The module that performs ``F.linear(x, weight)``, so that hooks can observe it."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


def _process_group(
    group: dist.ProcessGroup | DeviceMesh | None, caller: str
) -> dist.ProcessGroup | None:
    """The process group of ``group``, a 1-D DeviceMesh of the pipeline's ranks, or itself."""
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415 - needs distributed

    if not isinstance(group, DeviceMesh):
        return group
    if group.ndim != 1:
        raise ValueError(
            f"{caller} needs a 1-D DeviceMesh of the pipeline ranks, got a {group.ndim}-D mesh; "
            'pass the pipeline dimension, such as mesh["pp"]'
        )
    return group.get_group()


def _gather_objects(obj: object, group: dist.ProcessGroup | None) -> list[Any]:
    """``obj`` of every rank of ``group`` (the default group if None), in group rank order.

    ``dist.all_gather_object`` does this, but decodes the bytes through numpy, which torch
    does not depend on, nor this package: on an install of torch alone it raises "Numpy is
    not available". Here the pickled bytes travel as uint8 tensors, padded to the longest,
    on the device torch's object collectives use for the group's backend.
    """
    from torch.distributed.distributed_c10d import _get_object_coll_device  # noqa: PLC0415

    world = dist.get_world_size(group)
    # Tensors made in the block are on the group's device; the bytes stay on the CPU.
    with torch.device(_get_object_coll_device(group)):
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([len(data)]), group=group)
        padded = torch.zeros(max(int(size) for size in sizes), dtype=torch.uint8)
        padded[: len(data)] = data
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=group)
    return [pickle.loads(bytes(gathered[r][: int(sizes[r])].tolist())) for r in range(world)]
