"""Checks on two gloo ranks for the failures whose diagnosis depends on DTensors.

TiedLinear explains a failed call with the sharded-weight error only when the weight is a
DTensor and the input is a plain tensor. When both are DTensors (a tensor-parallel caller, say)
and the widths differ, the message must be the shape error instead. The weight is sharded
unevenly, 17 rows over 2 ranks, as ``tiny_lm`` shards its vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tests.nn.distributed.tiny_lm import DIM, VOCAB
from toolkit.nn import TiedLinear

WORLD_SIZES = (2,)


def _sharded_head() -> tuple[TiedLinear, torch.Tensor]:
    """A head tied to an embedding whose weight is sharded by rows, and the full weight."""
    torch.manual_seed(0)
    emb = nn.Embedding(VOCAB, DIM)
    full = emb.weight.detach().clone()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    emb.weight = nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    return TiedLinear(emb), full


def both_dtensors_wrong_width() -> str:
    """Call with a replicated DTensor input of the wrong width: return the error's message."""
    head, _ = _sharded_head()
    mesh = head.weight.device_mesh  # type: ignore[attr-defined]
    x = distribute_tensor(torch.ones(2, DIM + 1), mesh, [Replicate()])
    try:
        head(x)
    except RuntimeError as error:
        return str(error)
    raise AssertionError("a DTensor input of the wrong width did not raise")


def both_dtensors_right_width() -> tuple[torch.Tensor, torch.Tensor]:
    """Call with a replicated DTensor input of the right width: the full output and F.linear's."""
    head, full = _sharded_head()
    mesh = head.weight.device_mesh  # type: ignore[attr-defined]
    x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(1))
    out = head(distribute_tensor(x, mesh, [Replicate()]))
    return out.full_tensor(), F.linear(x, full)  # type: ignore[attr-defined]


def checks(world_size: int, checkpoint_dir: Path) -> dict[str, Callable[[], Any]]:
    """The checks of this module at ``world_size``: none but at ``WORLD_SIZES``."""
    del checkpoint_dir
    if world_size not in WORLD_SIZES:
        return {}
    return {
        "mutation/both_dtensors_wrong_width": both_dtensors_wrong_width,
        "mutation/both_dtensors_right_width": both_dtensors_right_width,
    }
