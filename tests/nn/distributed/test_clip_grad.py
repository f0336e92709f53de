"""clip_grad_norm_ on gloo ranks under FSDP2 against torch's on the whole model in one process.

The model shards unevenly: a one-row weight and bias leave every rank but the first with an
empty shard, and 17 rows split 9 + 8 on two ranks and 6 + 6 + 5 on three. Its two layers
differ in dtype (float32, then float64) on one mesh. With the wide layer frozen, every rank but
the first holds only empty shards. pipeline_clip_grad_norm_ runs one stage per rank, the second
frozen. Each rank counts the collectives of one call with ``CommDebugMode``, by default and
under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``. One launch per world size.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from tests.nn.ranks import process_group, run_processes
from toolkit.nn import clip_grad_norm_, pipeline_clip_grad_norm_

INF = math.inf
NORM_TYPES = [2.0, 1.0, 3.0, 0.5, -0.5, -1.0, INF, -INF, 0.0]


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


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part, without communication: ranks that differ in kind do not all-gather."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


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
            results[f"narrow-{norm_type}"] = narrow_only(norm_type)
            results[f"pipeline-{norm_type}"] = pipeline_with_a_frozen_stage(norm_type)
        results["counts"] = collectives()
        results["missing"] = missing_on_some_ranks(swapped=False)
        results["swapped"] = missing_on_some_ranks(swapped=True)
        for norm_type in (INF, -INF, -1.0, 2.0):
            results[f"empty-{norm_type}"] = without_elements(norm_type)
        with debug_level(dist.DebugLevel.DETAIL):  # what would hang the others by default
            for beside in (False, True):
                results[f"kinds-{beside}"] = kinds_differ(beside)
            results["no-dtensor"] = no_dtensor_on_some_ranks()
        return results


def narrow_only(norm_type: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The wide layer frozen: every rank but the first holds only empty shards, and the frozen
    DTensors take no part, as frozen parameters in torch."""
    whole = model_after_backward(sharded=False)
    model = model_after_backward(sharded=True)
    for layer in (whole.wide, model.wide):
        layer.weight.grad = layer.bias.grad = None
    expected = torch.nn.utils.clip_grad_norm_(whole.parameters(), 1e-3, norm_type)
    return clip_grad_norm_(model.parameters(), 1e-3, norm_type), expected


STAGES = [[(5, 3), (5,)], [(4, 5), (4,)], [(2, 4)]]  # the parameters of three uneven stages


def stage_params(stage: int) -> list[nn.Parameter]:
    """Stage ``stage``'s parameters, with gradients but on the frozen second stage."""
    gen = torch.Generator().manual_seed(8 + stage)
    params = [nn.Parameter(torch.zeros(shape)) for shape in STAGES[stage]]
    for param in params:
        param.grad = None if stage == 1 else torch.randn(param.shape, generator=gen)
    return params


def pipeline_with_a_frozen_stage(norm_type: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One stage per rank, the second frozen, against torch's clip of every stage at once."""
    whole = [p for stage in range(dist.get_world_size()) for p in stage_params(stage)]
    expected = torch.nn.utils.clip_grad_norm_(whole, 1e-3, norm_type)
    mine = stage_params(dist.get_rank())
    return pipeline_clip_grad_norm_(mine, 1e-3, norm_type, group=dist.group.WORLD), expected


@contextlib.contextmanager
def debug_level(level: dist.DebugLevel) -> Iterator[None]:
    """``TORCH_DISTRIBUTED_DEBUG`` as torch reads it, set to ``level`` for the block."""
    default = dist.get_debug_level()
    dist.set_debug_level(level)
    try:
        yield
    finally:
        dist.set_debug_level(default)


def collectives() -> dict[str, dict[str, int]]:
    """The collectives of one call on the FSDP2 model's gradients, by default and under DETAIL."""
    calls: dict[str, Any] = {
        "torch": lambda params: torch.nn.utils.clip_grad_norm_(params, 1e-3),
        "ours": lambda params: clip_grad_norm_(params, 1e-3),
        "ours-0": lambda params: clip_grad_norm_(params, 1e-3, 0.0),
        "pipeline": lambda _: pipeline_clip_grad_norm_(
            stage_params(dist.get_rank()), 1e-3, group=dist.group.WORLD
        ),
    }
    found = {}
    for level in (dist.DebugLevel.OFF, dist.DebugLevel.DETAIL):
        with debug_level(level):
            for name, call in calls.items():
                params = list(model_after_backward(sharded=True).parameters())
                with CommDebugMode() as mode:
                    call(params)
                counted = mode.get_comm_counts()
                found[f"{name}-{level.name}"] = {str(op): n for op, n in counted.items()}
    return found


def missing_on_some_ranks(swapped: bool) -> tuple[str, bool]:
    """A DTensor gradient that rank 1 lacks (or rank 0, while the others lack another, so
    that every rank has as many): the same error on every rank, nothing scaled."""
    model = model_after_backward(sharded=True)
    if swapped and dist.get_rank() == 0:
        model.wide.weight.grad = None
    elif swapped:
        model.wide.bias.grad = None
    elif dist.get_rank() == 1:
        model.wide.weight.grad = None
    before = [p.grad.to_local().clone() for p in model.parameters() if p.grad is not None]
    with pytest.raises(ValueError, match="zeros_like") as info:
        clip_grad_norm_(model.parameters(), 1e-3)
    after = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    unchanged = all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    return str(info.value), unchanged


def with_grad(param: torch.Tensor, grad: torch.Tensor) -> nn.Parameter:
    param = nn.Parameter(param)
    param.grad = grad
    return param


def without_elements(norm_type: float) -> tuple[Any, Any, bool]:
    """The model beside a DTensor without elements and a plain gradient, against torch's.

    Returns our norm or error message, torch's norm or error type, and whether our refusal
    left every gradient as it was.
    """
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    nothing = distribute_tensor(torch.zeros(0, 3), mesh, [Shard(0)])
    scale = torch.tensor([1.5, -0.5])
    model = model_after_backward(sharded=True)
    params = [
        *model.parameters(),
        with_grad(nothing, nothing.clone()),
        with_grad(scale, scale.clone()),
    ]
    whole = model_after_backward(sharded=False)
    twins = [*whole.parameters(), with_grad(torch.zeros(0, 3), torch.zeros(0, 3))]
    twins.append(with_grad(scale.clone(), scale.clone()))
    before = [full(p.grad).clone() for p in params]  # type: ignore[arg-type]
    try:
        expected: Any = torch.nn.utils.clip_grad_norm_(twins, 1e-3, norm_type)
    except RuntimeError as error:
        expected = type(error)
    try:
        norm: Any = clip_grad_norm_(params, 1e-3, norm_type)
    except RuntimeError as error:
        norm = str(error)
    unchanged = all(torch.equal(full(p.grad), b) for p, b in zip(params, before, strict=True))  # type: ignore[arg-type]
    return norm, expected, unchanged


def kinds_differ(beside: bool) -> tuple[str, bool]:
    """A plain weight's gradient: a Replicate DTensor on rank 0, a plain tensor elsewhere."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    grad = torch.tensor([3.0, 4.0])
    if dist.get_rank() == 0:
        scale = with_grad(torch.zeros(2), DTensor.from_local(grad.clone(), mesh, [Replicate()]))
    else:
        scale = with_grad(torch.zeros(2), grad.clone())
    params = [scale, *(model_after_backward(sharded=True).parameters() if beside else [])]
    before = [local(p.grad).clone() for p in params if p.grad is not None]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"parameters\[0\]") as info:
        clip_grad_norm_(params, 1e-3)
    after = [local(p.grad) for p in params if p.grad is not None]  # type: ignore[arg-type]
    return str(info.value), all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def no_dtensor_on_some_ranks() -> tuple[str, bool]:
    """Rank 0 passes the model, the others only a plain parameter."""
    model = model_after_backward(sharded=True)
    scale = with_grad(torch.zeros(1), torch.tensor([7.0]))
    params = [*model.parameters(), scale] if dist.get_rank() == 0 else [scale]
    before = [local(p.grad).clone() for p in params]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"model\.parameters\(\)") as info:
        clip_grad_norm_(params, 1e-3)
    after = [local(p.grad) for p in params]  # type: ignore[arg-type]
    return str(info.value), all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


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
            for case in ("narrow", "pipeline"):
                norm, expected = results[f"{case}-{norm_type}"]
                torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
        reduce = "c10d.allreduce_"  # the functional all_reduce of a DTensor counts the same
        assert results["counts"] == {
            "torch-OFF": {"c10d_functional.all_reduce": 1},
            "ours-OFF": {reduce: 1},
            "ours-0-OFF": {reduce: 2},  # the 0-"norm" needs each gradient's count as well
            "pipeline-OFF": {reduce: 1},
            "torch-DETAIL": {"c10d_functional.all_reduce": 1},
            "ours-DETAIL": {reduce: 3},
            "ours-0-DETAIL": {reduce: 4},
            "pipeline-DETAIL": {reduce: 1},
        }
        for key in ("missing", "swapped"):
            message, unchanged = results[key]
            assert message == (
                "clip_grad_norm_: a DTensor parameter of shape (17, 1) has a gradient on some "
                "ranks of its device mesh and None on others, so its gradient is neither whole "
                "nor absent. Give it a gradient on every rank (zeros where a rank has none: "
                "param.grad = torch.zeros_like(param)) or on none (param.grad = None)"
            )
            assert unchanged
        # inf, -inf and a negative p over a gradient without elements: refused on every rank,
        # as torch refuses them; a positive p-norm counts it as nothing, as torch's.
        for norm_type in (INF, -INF, -1.0):
            message, torch_error, unchanged = results[f"empty-{norm_type}"]
            assert torch_error is RuntimeError
            assert message == ranks[0][f"empty-{norm_type}"][0]
            assert isinstance(message, str)
            assert unchanged
        norm, expected, _ = results["empty-2.0"]
        torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
        # A gradient whose kind differs across ranks, and ranks that pass no DTensor: the
        # same ValueError on every rank, naming the ranks that differ, nothing scaled.
        for key in ("kinds-False", "kinds-True", "no-dtensor"):
            message, unchanged = results[key]
            assert message == ranks[0][key][0]
            assert str(list(range(1, world_size))) in message
            assert unchanged
