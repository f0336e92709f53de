"""clip_grad_norm_ over parameters on several device meshes, on 4 thread ranks.

The model is the layout that FSDP2 with tensor parallelism gives on a 2 x 2 ``(dp, tp)``
mesh: two linear layers sharded by tensor parallelism and FSDP2 (DTensors on ``(dp, tp)``),
a LayerNorm sharded by FSDP2 alone (DTensors on ``dp``), and a plain Parameter outside FSDP.
torch's own ``clip_grad_norm_`` cannot stack the norms of such a mixture (pytorch#180346).
The expected values are ``torch.nn.utils.clip_grad_norm_`` applied to the full gradients,
gathered, in one process. FSDP2 shards 3 rows over 2 ranks: every sharding but the hidden
width (6, split by tensor parallelism) is uneven.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests.nn.ranks import run_threads
from toolkit.nn import clip_grad_norm_

INF = float("inf")
NORM_TYPES = [0.0, 1.0, 2.0, INF]


def base_model() -> nn.Sequential:
    torch.manual_seed(21)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3), nn.LayerNorm(3))


def sharded_model(base: nn.Sequential, rank: int) -> list[nn.Parameter]:
    """``base`` under TP and FSDP2 on this rank, after one backward; plus a plain Parameter."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = copy.deepcopy(base)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    gen = torch.Generator().manual_seed(22 + mesh["dp"].get_local_rank())
    scale = nn.Parameter(torch.tensor([1.5, -0.5]))
    model(torch.randn(4, 5, generator=gen)).square().sum().backward()
    (scale.square().sum() * 3.0).backward()  # the same on every rank, as after DDP
    params = [*model.parameters(), scale]
    meshes = {p.grad.device_mesh.mesh_dim_names for p in params if isinstance(p.grad, DTensor)}
    assert meshes == {("dp", "tp"), ("dp",)}
    assert not isinstance(scale.grad, DTensor)
    return params


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.clone()


def expected_clip(
    grads: list[torch.Tensor], max_norm: float, norm_type: float, **kwargs: Any
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """torch's result on plain tensors holding the full gradients."""
    twins = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for twin, grad in zip(twins, grads, strict=True):
        twin.grad = grad.clone()
    norm = torch.nn.utils.clip_grad_norm_(twins, max_norm, norm_type, **kwargs)
    return norm, [t.grad for t in twins]  # type: ignore[misc]


@pytest.mark.parametrize("foreach", [None, False])
def test_mixed_meshes_clip_as_torch_does_on_the_full_gradients(foreach: bool | None) -> None:
    base = base_model()

    def rank_main(rank: int) -> list[float]:
        params = sharded_model(base, rank)
        saved = [p.grad for p in params]
        norms = []
        for norm_type in NORM_TYPES:
            for param, grad in zip(params, saved, strict=True):
                param.grad = grad.clone()  # type: ignore[union-attr]
            grads = [full(p.grad) for p in params]  # type: ignore[arg-type]
            norm_expected, grads_expected = expected_clip(grads, 0.1, norm_type)
            assert norm_expected > 0.1  # clipping scales
            norm = clip_grad_norm_(params, 0.1, norm_type, foreach=foreach)
            assert type(norm) is torch.Tensor
            torch.testing.assert_close(norm, norm_expected)
            for param, grad, old in zip(params, grads_expected, saved, strict=True):
                assert type(param.grad) is type(old)  # the layout is kept
                torch.testing.assert_close(full(param.grad), grad)  # type: ignore[arg-type]
            norms.append(norm.item())
        return norms

    results = run_threads(4, rank_main)
    assert all(r == results[0] for r in results)


def test_a_single_tensor_and_an_empty_list_mean_what_they_mean_to_torch() -> None:
    base = base_model()

    def rank_main(rank: int) -> None:
        params = sharded_model(base, rank)
        weight = params[0]
        norm_expected, (grad_expected,) = expected_clip([full(weight.grad)], 0.1, 2.0)  # type: ignore[arg-type]
        torch.testing.assert_close(clip_grad_norm_(weight, 0.1), norm_expected)
        torch.testing.assert_close(full(weight.grad), grad_expected)  # type: ignore[arg-type]
        empty = clip_grad_norm_([], 0.1)
        assert empty.item() == 0.0
        assert empty.dtype == torch.nn.utils.clip_grad_norm_([], 0.1).dtype

    run_threads(4, rank_main)


def test_a_nonfinite_norm_is_refused_on_every_rank_and_nothing_is_scaled() -> None:
    base = base_model()

    def rank_main(rank: int) -> tuple[str, str]:
        params = sharded_model(base, rank)
        if rank == 3:
            params[2].grad.to_local().view(-1)[0] = float("nan")  # type: ignore[union-attr]
        before = [full(p.grad) for p in params]  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="non-finite") as info:
            clip_grad_norm_(params, 0.1, error_if_nonfinite=True)
        for param, grad in zip(params, before, strict=True):
            torch.testing.assert_close(full(param.grad), grad, equal_nan=True)  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="non-finite") as torch_info:
            expected_clip(before, 0.1, 2.0, error_if_nonfinite=True)
        # Without the error, the gradients are scaled by the nan norm, as torch does.
        assert clip_grad_norm_(params, 0.1).isnan()
        return str(info.value), str(torch_info.value)

    results: list[Any] = run_threads(4, rank_main)
    for ours, theirs in results:
        assert ours == theirs
