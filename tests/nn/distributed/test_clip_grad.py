"""clip_grad_norm_ on gloo ranks under FSDP2 against torch's on the whole model in one process.

The model shards unevenly: a one-row weight and bias leave every rank but the first with an
empty shard, and 17 rows split 9 + 8 on two ranks and 6 + 6 + 5 on three. Its two layers
differ in dtype (float32, then float64) on one mesh. One launch per world size.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tests.nn.ranks import process_group, run_processes
from toolkit.nn import clip_grad_norm_

INF = math.inf
NORM_TYPES = [2.0, 1.0, 3.0, INF, -INF, 0.0]


class Uneven(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.narrow = nn.Linear(8, 1)  # one row: empty shards on every rank but the first
        self.wide = nn.Linear(1, 17, dtype=torch.float64)  # 17 rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wide(self.narrow(x).double())


def model_after_backward(sharded: bool) -> Uneven:
    model = Uneven()
    if sharded:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model.narrow, mesh=mesh)
        fully_shard(model.wide, mesh=mesh)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(6))
    model(x).square().sum().backward()  # the same batch on every rank: FSDP2's mean is it
    return model


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def parity_in_a_process() -> dict[str, Any]:
    """In each rank: every norm type against the whole model's, and the refusals."""
    with process_group():
        results: dict[str, Any] = {}
        for norm_type in NORM_TYPES:
            whole = model_after_backward(sharded=False)
            expected_norm = torch.nn.utils.get_total_norm(
                [p.grad for p in whole.parameters()], norm_type
            )
            max_norm = float(expected_norm) / 2 if norm_type != 0 else 1.0
            torch.nn.utils.clip_grad_norm_(whole.parameters(), max_norm, norm_type)
            model = model_after_backward(sharded=True)
            norm = clip_grad_norm_(model.parameters(), max_norm, norm_type)
            results[f"norm-{norm_type}"] = (norm, expected_norm)
            results[f"grads-{norm_type}"] = [
                (full(p.grad), q.grad)
                for p, q in zip(model.parameters(), whole.parameters(), strict=True)
            ]
        results["missing"] = missing_on_one_rank()
        results["absent"] = absent_on_every_rank()
        return results


def missing_on_one_rank() -> tuple[str, bool]:
    """A DTensor gradient that rank 1 lacks: the same error on every rank, nothing scaled."""
    model = model_after_backward(sharded=True)
    if dist.get_rank() == 1:
        model.wide.weight.grad = None
    before = [p.grad.to_local().clone() for p in model.parameters() if p.grad is not None]
    with pytest.raises(ValueError, match="zeros_like") as info:
        clip_grad_norm_(model.parameters(), 1e-3)
    after = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    unchanged = all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    return str(info.value), unchanged


def absent_on_every_rank() -> tuple[torch.Tensor, torch.Tensor]:
    """A DTensor without a gradient on any rank takes no part, as a frozen one in torch."""
    whole = model_after_backward(sharded=False)
    whole.narrow.weight.grad = None
    expected = torch.nn.utils.clip_grad_norm_(whole.parameters(), 1e-3, -INF)
    model = model_after_backward(sharded=True)
    model.narrow.weight.grad = None
    return clip_grad_norm_(model.parameters(), 1e-3, -INF), expected


@pytest.mark.parametrize("world_size", [2, 3])
def test_clip_grad_norm_on_uneven_and_empty_fsdp2_shards_is_torchs_on_the_whole_model(
    world_size: int,
) -> None:
    ranks = run_processes(world_size, parity_in_a_process, timeout=180.0)
    for results in ranks:
        for norm_type in NORM_TYPES:
            norm, expected = results[f"norm-{norm_type}"]
            assert norm.dtype == expected.dtype == torch.float64
            torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
            for grad, reference in results[f"grads-{norm_type}"]:
                torch.testing.assert_close(grad, reference, rtol=1e-6, atol=0)
        message, unchanged = results["missing"]
        assert message == (
            "clip_grad_norm_: a DTensor parameter of shape (17, 1) has a gradient on some ranks "
            "of its device mesh and None on others, so its gradient is neither whole nor absent. "
            "Give it a gradient on every rank (zeros where a rank has none: param.grad = "
            "torch.zeros_like(param)) or on none (param.grad = None)"
        )
        assert unchanged
        norm, expected = results["absent"]
        torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
