"""clip_grad_norm_ and pipeline_clip_grad_norm_ on thread ranks, against torch's in one process.

clip_grad_norm_'s model has the layout of FSDP2 with tensor parallelism on a 2 x 2 ``(dp, tp)``
mesh: DTensors on ``(dp, tp)`` and on ``dp``, and a plain Parameter, which torch's own function
cannot combine (pytorch#180346). Every sharding but the hidden width is uneven.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests.nn.ranks import run_threads
from toolkit.nn import clip_grad_norm_, pipeline_clip_grad_norm_
from toolkit.nn._clip_grad import presence

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
def test_clip_grad_norm_over_mixed_meshes_is_torchs_over_the_full_gradients(
    foreach: bool | None,
) -> None:
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
        # A single tensor and an empty list mean what they mean to torch.
        params[0].grad = saved[0].clone()  # type: ignore[union-attr]
        norm_expected, (grad_expected,) = expected_clip([full(saved[0])], 0.1, 2.0)  # type: ignore[arg-type]
        torch.testing.assert_close(clip_grad_norm_(params[0], 0.1, foreach=foreach), norm_expected)
        torch.testing.assert_close(full(params[0].grad), grad_expected)  # type: ignore[arg-type]
        torch.testing.assert_close(
            clip_grad_norm_([], 0.1), torch.nn.utils.clip_grad_norm_([], 0.1)
        )
        return norms

    results = run_threads(4, rank_main)
    assert all(r == results[0] for r in results)


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


# pipeline_clip_grad_norm_: the norm over every stage of the pipeline group. -------------------

SHAPES = [[(5, 3), (5,)], [(4, 5), (4,)], [(2, 4)]]  # the parameters of three uneven stages


def stage_params(rank: int | None, frozen_middle: bool) -> list[nn.Parameter]:
    """Stage ``rank``'s parameters with their gradients; every stage's if ``rank`` is None."""
    gen = torch.Generator().manual_seed(7)
    params = []
    for stage, shapes in enumerate(SHAPES):
        for shape in shapes:
            param = nn.Parameter(torch.zeros(shape))
            grad = torch.randn(shape, generator=gen)
            param.grad = None if frozen_middle and stage == 1 else grad
            if rank in (None, stage):
                params.append(param)
    return params


@pytest.mark.parametrize("frozen_middle", [False, True], ids=["all", "frozen-middle"])
@pytest.mark.parametrize("norm_type", [0.0, 1.0, 2.0, 3.0, 0.5, -0.5, -1.0, INF, -INF])
def test_pipeline_clipping_is_torchs_over_the_whole_model(
    norm_type: float, frozen_middle: bool
) -> None:
    # A frozen middle stage takes no part: with -inf its norm would otherwise be the smallest,
    # and a negative p would raise its 0 to an infinite power.
    whole = stage_params(None, frozen_middle)
    max_norm = (
        float(
            torch.nn.utils.get_total_norm([p.grad for p in whole if p.grad is not None], norm_type)
        )
        / 2
    )
    expected = torch.nn.utils.clip_grad_norm_(whole, max_norm, norm_type)

    def rank_main(rank: int) -> torch.Tensor:
        mine = stage_params(rank, frozen_middle)
        # Rank 2 passes a single tensor; the ranks' foreach may differ.
        arg = mine[0] if rank == 2 else mine
        foreach = [None, True, False][rank]
        norm = pipeline_clip_grad_norm_(
            arg, max_norm, norm_type, True, foreach, group=dist.group.WORLD
        )
        offset = sum(len(shapes) for shapes in SHAPES[:rank])
        for param, twin in zip(mine, whole[offset:], strict=False):
            torch.testing.assert_close(param.grad, twin.grad)
        return norm

    for norm in run_threads(3, rank_main):
        assert norm.dtype == torch.float32
        torch.testing.assert_close(norm, expected)


def test_pipeline_clipping_without_the_pipeline_group_on_a_larger_world_is_refused() -> None:
    def rank_main(rank: int) -> str:
        layer = nn.Linear(3, 2)
        layer.weight.grad = torch.ones(2, 3)
        with pytest.raises(ValueError, match=r"^pipeline_clip_grad_norm_") as info:
            pipeline_clip_grad_norm_(layer.parameters(), 0.5)
        assert torch.equal(layer.weight.grad, torch.ones(2, 3))
        return str(info.value)

    assert set(run_threads(2, rank_main)) == {
        "pipeline_clip_grad_norm_ needs the pipeline's process group: the default group has 2 "
        "ranks, which are one pipeline only without data or tensor parallelism. Pass group=, "
        'such as group=mesh["pp"] (or group=dist.group.WORLD when every rank is a stage of one '
        "pipeline), or the tie= built on that group"
    }


@pytest.fixture
def detail() -> Iterator[None]:
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL`` as torch reads it: the checks that need collectives."""
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    yield
    dist.set_debug_level(level)


@pytest.fixture
def reduced(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[torch.dtype]]:
    """The dtypes each rank all-reduces; gloo's MAX made to drop a nan, as it may."""
    log: dict[int, list[torch.dtype]] = {0: [], 1: []}
    real = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        log[dist.get_rank()].append(tensor.dtype)
        if kwargs.get("op") == dist.ReduceOp.MAX:
            tensor.nan_to_num_(nan=-INF)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return log


@pytest.mark.parametrize("norm_type", [2.0, 3.0])
def test_pipeline_clipping_of_float64_gradients_past_float32s_range_is_torchs(
    norm_type: float,
) -> None:
    # Each stage's norm is a float64 below float32's largest value, its square or cube is not:
    # the stages combine theirs in float64, as torch takes the whole model's norm.
    grads = [torch.tensor(g, dtype=torch.float64) for g in ([3e30, -4e30], [12e30])]
    expected_norm, expected = expected_clip(grads, 1.0, norm_type)
    assert expected_norm.isfinite()

    def rank_main(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = plain_with_grad(grads[rank])
        norm = pipeline_clip_grad_norm_(weight, 1.0, norm_type, group=dist.group.WORLD)
        return norm, weight.grad  # type: ignore[return-value]

    for rank, (norm, grad) in enumerate(run_threads(2, rank_main)):
        assert norm.dtype == torch.float64
        torch.testing.assert_close(norm, expected_norm)
        torch.testing.assert_close(grad, expected[rank])


@pytest.mark.parametrize("last", ["float64", "float32", "frozen"])
def test_pipeline_clipping_stages_whose_gradients_differ_in_dtype_reduces_one_dtype(
    last: str, reduced: dict[int, list[torch.dtype]]
) -> None:
    first = torch.tensor([3.0, 4.0, 12.0], dtype=torch.float64)
    grads = [first, torch.tensor([1.0, 2.0], dtype=getattr(torch, last, torch.float32))]
    counted = grads if last != "frozen" else grads[:1]
    expected = torch.linalg.vector_norm(torch.cat([g.double() for g in counted]))

    def rank_main(rank: int) -> None:
        weight = nn.Parameter(torch.zeros_like(grads[rank]))
        if rank == 0 or last != "frozen":
            weight.grad = grads[rank].clone()
        norm = pipeline_clip_grad_norm_([weight], 1e9, group=dist.group.WORLD)
        with_float64 = weight.grad is not None and weight.grad.dtype == torch.float64
        assert norm.dtype == (torch.float64 if with_float64 else torch.float32)
        torch.testing.assert_close(norm.double(), expected)

    run_threads(2, rank_main)
    # gloo and NCCL need every rank to reduce one dtype; the threaded backend would not notice.
    assert reduced[0] == reduced[1] != []


def test_a_one_rank_pipeline_in_a_larger_world_communicates_nothing(
    reduced: dict[int, list[torch.dtype]],
) -> None:
    layers = [stage_params(rank, frozen_middle=False) for rank in range(2)]
    expected = [torch.nn.utils.clip_grad_norm_(copy.deepcopy(ps), 0.5, 3.0) for ps in layers]

    def rank_main(rank: int) -> torch.Tensor:
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "pp"))
        return pipeline_clip_grad_norm_(copy.deepcopy(layers[rank]), 0.5, 3.0, group=mesh["pp"])

    for norm, reference in zip(run_threads(2, rank_main), expected, strict=True):
        torch.testing.assert_close(norm, reference, rtol=0, atol=0)
    assert reduced == {0: [], 1: []}


@pytest.mark.parametrize("norm_type", [2.0, 0.5, 0.0, -1.0, INF, -INF])
def test_pipeline_clipping_without_any_gradient_gives_zero_as_torch(norm_type: float) -> None:
    expected = torch.nn.utils.clip_grad_norm_([nn.Parameter(torch.zeros(2))], 1.0, norm_type)

    def rank_main(rank: int) -> torch.Tensor:
        frozen = nn.Parameter(torch.zeros(3))
        return pipeline_clip_grad_norm_(frozen, 1.0, norm_type, group=dist.group.WORLD)

    for norm in run_threads(2, rank_main):
        torch.testing.assert_close(norm, expected)


@pytest.mark.parametrize("default", [torch.bfloat16, torch.float64], ids=str)
def test_pipeline_clipping_without_any_gradient_is_float32_or_wider_whatever_the_default_dtype(
    default: torch.dtype,
) -> None:
    # As with gradients of any dtype (the norms of bfloat16 ones combine in float32), and on
    # one rank: a default dtype narrower than float32 does not narrow the zero.
    expected = torch.zeros((), dtype=torch.promote_types(default, torch.float32))

    def rank_main(rank: int) -> torch.Tensor:
        frozen = nn.Parameter(torch.zeros(3))
        return pipeline_clip_grad_norm_(frozen, 1.0, group=dist.group.WORLD)

    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        norms = run_threads(2, rank_main)
    finally:
        torch.set_default_dtype(previous)
    for norm in norms:
        torch.testing.assert_close(norm, expected, rtol=0, atol=0)


def test_pipeline_clipping_honours_foreach_true_where_a_gradient_has_no_foreach_kernels() -> None:
    # As clip_grad_norm_: a stage's meta gradient whose shards are empty takes no part in the
    # norm, and foreach=True is refused at its scaling, as torch refuses it, on every rank.
    weight = nn.Parameter(torch.zeros(2, device="meta"))
    weight.grad = torch.ones(2, device="meta")
    with pytest.raises(RuntimeError, match=r"foreach=True") as info:
        torch.nn.utils.clip_grad_norm_([weight], 1.0, foreach=True)

    def rank_main(rank: int) -> str:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        frozen = nn.Parameter(distribute_tensor(torch.zeros(2), mesh["dp"], [Shard(0)]))
        local = torch.ones(0, device="meta")
        meta = nn.Parameter(DTensor.from_local(local, mesh["dp"], [Shard(0)], run_check=False))
        meta.grad = DTensor.from_local(local.clone(), mesh["dp"], [Shard(0)], run_check=False)
        with pytest.raises(RuntimeError, match=r"foreach=True") as ours:
            pipeline_clip_grad_norm_([frozen, meta], 1.0, foreach=True, group=mesh["pp"])
        return str(ours.value)

    assert run_threads(4, rank_main) == [str(info.value)] * 4


@pytest.mark.parametrize(
    ("norm_type", "bad", "holder"),
    [(2.0, INF, 1), (INF, math.nan, 0), (INF, math.nan, 1), (-INF, math.nan, 1)],
)
def test_a_nonfinite_gradient_on_one_rank_is_refused_on_every_rank_and_nothing_is_scaled(
    norm_type: float, bad: float, holder: int, reduced: dict[int, list[torch.dtype]]
) -> None:
    def rank_main(rank: int) -> str:
        weight = nn.Parameter(torch.zeros(3))
        weight.grad = torch.tensor([1.0, 5.0, bad if rank == holder else 3.0])
        before = weight.grad.clone()
        with pytest.raises(RuntimeError, match="non-finite") as info:
            pipeline_clip_grad_norm_(
                weight, 1.0, norm_type, error_if_nonfinite=True, group=dist.group.WORLD
            )
        assert torch.equal(weight.grad.nan_to_num(), before.nan_to_num())
        # Without the error, as torch's, the gradients are scaled by the non-finite norm.
        norm = pipeline_clip_grad_norm_(weight, 1.0, norm_type, group=dist.group.WORLD)
        assert norm.isnan() if math.isnan(bad) else norm.isinf()
        return str(info.value)

    assert len(set(run_threads(2, rank_main))) == 1


def test_a_partial_dtensor_gradient_counts_its_sum_over_the_mesh() -> None:
    # A replicated weight used on sharded activations, as under sequence parallelism, may
    # hold a gradient whose value is the sum of the ranks' local tensors.
    expected_norm, (expected,) = expected_clip([torch.tensor([3.0, 6.0, 9.0])], 1.0, 2.0)

    def rank_main(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        mesh = init_device_mesh("cpu", (2,))
        weight = nn.Parameter(distribute_tensor(torch.zeros(3), mesh, [Replicate()]))
        local = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)
        weight.grad = DTensor.from_local(local, mesh, [Partial()])
        norm = clip_grad_norm_([weight], 1.0)
        return norm, weight.grad.full_tensor()

    for norm, grad in run_threads(2, rank_main):
        torch.testing.assert_close(norm, expected_norm)
        torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("norm_type", [2.0, INF])
def test_a_plain_parameter_with_a_dtensor_gradient_is_reduced_over_the_gradients_mesh(
    norm_type: float,
) -> None:
    full = torch.tensor([1.0, -5.0, 2.0, 4.0, -3.0])
    expected_norm, (expected,) = expected_clip([full], 1.0, norm_type)

    def rank_main(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        mesh = init_device_mesh("cpu", (2,))
        weight = nn.Parameter(torch.zeros(5))  # plain, as left by hand-written sharding
        local = full[:3] if rank == 0 else full[3:]
        weight.grad = DTensor.from_local(local, mesh, [Shard(0)], shape=(5,), stride=(1,))
        norm = clip_grad_norm_([weight], 1.0, norm_type)
        return norm, weight.grad.full_tensor()

    for norm, grad in run_threads(2, rank_main):
        torch.testing.assert_close(norm, expected_norm)
        torch.testing.assert_close(grad, expected)


def test_a_gradient_sharded_and_partial_is_clipped_exactly_as_torch_clips_its_shards() -> None:
    """Sharded on ``dp`` and partial on ``tp``, its partial sums are reduced over ``tp`` alone:
    the norm and the clipping are then exactly torch's over the ``dp`` shards, in bfloat16
    too, where each shard's norm is rounded. The whole gradient's norm rounds otherwise
    (12.0625, not 12.125), so a reduction over ``dp`` as well would change both."""
    full = torch.arange(-6.0, 6.0, dtype=torch.bfloat16).reshape(4, 3)
    expected_norm, expected = expected_clip([full[:2], full[2:]], 1.0, 2.0)
    whole_norm, _ = expected_clip([full], 1.0, 2.0)
    assert expected_norm.dtype == whole_norm.dtype == torch.bfloat16
    assert not torch.equal(expected_norm, whole_norm)

    def rank_main(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        mesh = init_device_mesh("cpu", (2, 2))
        dp, _ = mesh.get_coordinate()  # type: ignore[misc]
        # Halves, which sum to the rows over tp, and scale to exact halves of the scaled rows.
        local = full[2 * dp : 2 * dp + 2] / 2
        weight = nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16))
        weight.grad = DTensor.from_local(
            local, mesh, [Shard(0), Partial()], shape=(4, 3), stride=(3, 1)
        )
        norm = clip_grad_norm_([weight], 1.0)
        return norm, weight.grad.full_tensor()

    for norm, grad in run_threads(4, rank_main):
        assert norm.dtype == grad.dtype == torch.bfloat16
        assert torch.equal(norm, expected_norm)
        assert torch.equal(grad, torch.cat(expected))


def test_plain_tensors_are_this_ranks_and_take_no_part_in_the_reduction() -> None:
    # A plain tensor's gradient is the rank's own, as in torch's clip_grad_norm_: the total is
    # the same on every rank when the plain gradients are (as after DDP), not otherwise.
    sharded = torch.tensor([1.0, 2.0, 2.0, 4.0])

    def rank_main(rank: int) -> torch.Tensor:
        mesh = init_device_mesh("cpu", (2,))
        weight = nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Shard(0)]))
        weight.grad = distribute_tensor(sharded, mesh, [Shard(0)])
        bias = nn.Parameter(torch.zeros(2))
        bias.grad = torch.tensor([2.0, 0.0]) if rank == 0 else None
        return clip_grad_norm_([weight, bias], 100.0)

    norms = run_threads(2, rank_main)
    torch.testing.assert_close(norms[0], torch.tensor(29.0).sqrt())  # 1 + 4 + 4 + 16, and 4
    torch.testing.assert_close(norms[1], torch.tensor(5.0))


@pytest.mark.usefixtures("detail")
def test_under_detail_a_plain_parameter_of_one_rank_ahead_of_the_dtensors_is_clipped() -> None:
    # Plain parameters are each rank's own: rank 0 passes one that rank 1 has not, so the
    # DTensors' positions differ by rank. Only a plain parameter's DTensor gradient must sit
    # at one position on every rank of its mesh; a DTensor parameter's may sit anywhere.
    sharded = torch.tensor([1.0, 2.0, 2.0, 4.0])

    def rank_main(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        mesh = init_device_mesh("cpu", (2,))
        weight = nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Shard(0)]))
        weight.grad = distribute_tensor(sharded, mesh, [Shard(0)])
        params = [weight] if rank else [plain_with_grad(torch.tensor([2.0, 0.0])), weight]
        return clip_grad_norm_(params, 100.0), weight.grad.full_tensor()

    (norm_0, grad_0), (norm_1, grad_1) = run_threads(2, rank_main)
    torch.testing.assert_close(norm_0, torch.tensor(29.0).sqrt())  # 1 + 4 + 4 + 16, and 4
    torch.testing.assert_close(norm_1, torch.tensor(5.0))
    assert torch.equal(grad_0, sharded)  # below max_norm: unscaled
    assert torch.equal(grad_1, sharded)


@pytest.mark.usefixtures("detail")
@pytest.mark.parametrize("norm_type", [2.0, INF])
def test_under_detail_a_dtensor_without_a_gradient_on_any_rank_is_clipped_as_torch(
    norm_type: float,
) -> None:
    # A frozen DTensor beside a trained one on the same mesh: its gradient is absent on every
    # rank, which is not one on some ranks only, and takes no part, as in torch.
    whole = torch.tensor([3.0, -4.0, 12.0, 1.0])
    expected_norm, (expected,) = expected_clip([whole], 1.0, norm_type)

    def rank_main(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        mesh = init_device_mesh("cpu", (2,))
        frozen = nn.Parameter(distribute_tensor(torch.ones(3), mesh, [Shard(0)]))
        weight = nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Shard(0)]))
        weight.grad = distribute_tensor(whole, mesh, [Shard(0)])
        norm = clip_grad_norm_([frozen, weight], 1.0, norm_type)
        return norm, weight.grad.full_tensor(), frozen.grad

    for norm, grad, frozen_grad in run_threads(2, rank_main):
        torch.testing.assert_close(norm, expected_norm)
        torch.testing.assert_close(grad, expected)
        assert frozen_grad is None


@pytest.mark.parametrize(
    ("rows", "norm_type"),
    [(0, 2.0), (2, 2.0), (2, INF)],
    ids=["empty-2.0", "nonempty-2.0", "nonempty-inf"],
)
def test_foreach_true_with_gradients_where_foreach_kernels_are_missing_is_refused_as_torch(
    rows: int, norm_type: float
) -> None:
    # foreach=True is honoured for the norm and for the scaling, as in torch: a gradient on a
    # device without foreach kernels (meta here) is refused, even when its shards are empty
    # and take no part in the norm. (Under inf, a gradient without elements is refused first:
    # test_an_inf_norm_over_a_gradient_without_elements_is_refused_on_every_rank_as_torch.)
    weight = nn.Parameter(torch.zeros(2, device="meta"))
    weight.grad = torch.ones(2, device="meta")
    with pytest.raises(RuntimeError, match=r"foreach=True") as info:
        torch.nn.utils.clip_grad_norm_([weight], 1.0, norm_type, foreach=True)

    def rank_main(rank: int) -> str:
        mesh = init_device_mesh("cpu", (2,))
        frozen = nn.Parameter(distribute_tensor(torch.zeros(2), mesh, [Shard(0)]))
        local = torch.ones(rows, device="meta")
        meta = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
        meta.grad = DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=False)
        with pytest.raises(RuntimeError, match=r"foreach=True") as ours:
            clip_grad_norm_([frozen, meta], 1.0, norm_type, foreach=True)
        return str(ours.value)

    assert run_threads(2, rank_main) == [str(info.value)] * 2


@pytest.mark.parametrize("meta_first", [False, True], ids=["cpu-first", "meta-first"])
def test_gradients_on_two_devices_raise_torchs_error_and_nothing_is_scaled(
    meta_first: bool,
) -> None:
    """The meshes' norms are combined on the device of the first, as torch combines its
    devices' norms: a CPU gradient beside a meta one raises torch's error for the same
    gradients as plain tensors (a meta tensor's value cannot be copied to the CPU), whichever
    comes first, before any gradient changes."""

    def ordered(cpu: nn.Parameter, meta: nn.Parameter) -> list[nn.Parameter]:
        return [meta, cpu] if meta_first else [cpu, meta]

    def meta_bias() -> nn.Parameter:
        bias = nn.Parameter(torch.zeros(2, device="meta"))
        bias.grad = torch.ones(2, device="meta")
        return bias

    plain = nn.Parameter(torch.zeros(4))
    plain.grad = torch.tensor([1.0, 2.0, 2.0, 4.0])
    with pytest.raises(NotImplementedError) as info:
        torch.nn.utils.clip_grad_norm_(ordered(plain, meta_bias()), 1.0)

    def rank_main(rank: int) -> tuple[type[BaseException], str, torch.Tensor]:
        mesh = init_device_mesh("cpu", (2,))
        weight = nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Shard(0)]))
        weight.grad = distribute_tensor(torch.tensor([1.0, 2.0, 2.0, 4.0]), mesh, [Shard(0)])
        with pytest.raises(NotImplementedError) as ours:
            clip_grad_norm_(ordered(weight, meta_bias()), 1.0)
        return type(ours.value), str(ours.value), weight.grad.full_tensor()

    for kind, message, grad in run_threads(2, rank_main):
        assert kind is type(info.value)  # exactly torch's, not a subclass
        assert message == str(info.value)
        assert torch.equal(grad, torch.tensor([1.0, 2.0, 2.0, 4.0]))


@pytest.mark.parametrize("norm_type", [INF, -INF, 2.0, 0.5, 0.0, -1.0])
def test_a_mesh_whose_dtensors_have_no_gradient_on_any_rank_takes_no_part(
    norm_type: float,
) -> None:
    def bias() -> nn.Parameter:
        param = nn.Parameter(torch.zeros(2))
        param.grad = torch.tensor([2.0, -3.0])
        return param

    expected = torch.nn.utils.clip_grad_norm_([bias()], 1.0, norm_type)
    assert expected >= 1.0

    def rank_main(rank: int) -> torch.Tensor:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("frozen",))
        frozen = nn.Parameter(distribute_tensor(torch.ones(3), mesh, [Shard(0)]))
        return clip_grad_norm_([frozen, bias()], 1.0, norm_type)

    for norm in run_threads(2, rank_main):
        torch.testing.assert_close(norm, expected)


@pytest.mark.parametrize("norm_type", [INF, -INF, 1.0])
def test_a_nan_in_one_ranks_shard_gives_a_nan_norm_on_every_rank_as_torch(
    norm_type: float, reduced: dict[int, list[torch.dtype]]
) -> None:
    full_grad = torch.tensor([1.0, 5.0, math.nan, 3.0])
    assert torch.nn.utils.get_total_norm(full_grad, norm_type).isnan()

    def rank_main(rank: int) -> torch.Tensor:
        mesh = init_device_mesh("cpu", (2,))
        weight = nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Shard(0)]))
        weight.grad = distribute_tensor(full_grad, mesh, [Shard(0)])
        return clip_grad_norm_([weight], 1.0, norm_type)

    assert all(norm.isnan() for norm in run_threads(2, rank_main))


def test_the_0_norm_counts_each_dtensor_with_a_nonzero_element_once_as_torch() -> None:
    # Zeros everywhere (one with an empty shard on rank 1), and a nonzero element in one shard.
    grads = [torch.zeros(3), torch.tensor([5.0]), torch.zeros(1)]
    expected = torch.nn.utils.get_total_norm(grads, 0.0)
    assert expected == 1

    def rank_main(rank: int) -> torch.Tensor:
        mesh = init_device_mesh("cpu", (2,))
        params = []
        for grad in grads:
            param = nn.Parameter(distribute_tensor(torch.zeros_like(grad), mesh, [Shard(0)]))
            param.grad = distribute_tensor(grad, mesh, [Shard(0)])
            params.append(param)
        return clip_grad_norm_(params, 1.0, 0.0)

    for norm in run_threads(2, rank_main):
        torch.testing.assert_close(norm, expected)


@pytest.mark.parametrize("norm_type", [INF, -INF, 2.0, 0.5, 0.0, -0.5, -1.0])
def test_a_rank_whose_shards_are_all_empty_takes_no_part_in_the_norm(
    norm_type: float,
) -> None:
    # nn.Linear(8, 1)'s bias under FSDP2 on two ranks: rank 1 holds no element of it.
    expected = torch.nn.utils.get_total_norm(torch.tensor([-5.0]), norm_type)

    def rank_main(rank: int) -> torch.Tensor:
        mesh = init_device_mesh("cpu", (2,))
        bias = nn.Parameter(distribute_tensor(torch.zeros(1), mesh, [Shard(0)]))
        bias.grad = distribute_tensor(torch.tensor([-5.0]), mesh, [Shard(0)])
        assert bias.grad.to_local().numel() == 1 - rank
        return clip_grad_norm_([bias], 1.0, norm_type)

    for norm in run_threads(2, rank_main):
        torch.testing.assert_close(norm, expected)


def test_pipeline_clipping_of_a_dtensor_gradient_on_some_replicas_only_is_refused_on_each() -> None:
    """A stage's FSDP2 replicas must agree which parameters have a gradient."""

    def rank_main(rank: int) -> tuple[str, torch.Tensor]:
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "pp"))

        def shard() -> DTensor:
            local = torch.ones(3 - rank)  # rows 3 + 2 of 5
            return DTensor.from_local(local, mesh["dp"], [Shard(0)], shape=(5,), stride=(1,))

        whole = nn.Parameter(DTensor.from_local(torch.ones(1), mesh["dp"], [Replicate()]))
        whole.grad = torch.ones_like(whole)  # on every rank: named by no refusal
        weight = nn.Parameter(shard())
        bias = nn.Parameter(torch.zeros(2))
        bias.grad = torch.tensor([3.0, 4.0])
        if rank == 0:
            weight.grad = shard()
        with pytest.raises(ValueError, match=r"\(5,\)") as raised:
            pipeline_clip_grad_norm_([whole, weight, bias], 1.0, group=mesh["pp"])
        return str(raised.value), bias.grad

    results = run_threads(2, rank_main)
    assert (
        results[0][0]
        == results[1][0]
        == (  # the one whole-message check of this error
            "clip_grad_norm_: a DTensor parameter of shape (5,) has a gradient on some ranks of "
            "its device mesh and None on others, so its gradient is neither whole nor absent. "
            "Give it a gradient on every rank (zeros where a rank has none: param.grad = "
            "torch.zeros_like(param)) or on none (param.grad = None)"
        )
    )
    for _, grad in results:
        torch.testing.assert_close(grad, torch.tensor([3.0, 4.0]))


def test_pipeline_clipping_refused_on_one_stages_mesh_is_refused_on_every_stage() -> None:
    # Stage 0 (ranks 0, 1) refuses its gradients on its dp mesh; stage 1 (ranks 2, 3) holds
    # nothing wrong, and would wait for stage 0 in the pipeline's all-reduce.
    def rank_main(rank: int) -> tuple[str, torch.Tensor | None]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        weight = nn.Parameter(DTensor.from_local(torch.zeros(2), mesh["dp"], [Shard(0)]))
        if rank != 0:  # rank 0 lacks the gradient its dp rank holds
            weight.grad = DTensor.from_local(torch.ones(2), mesh["dp"], [Shard(0)])
        with pytest.raises(ValueError, match=r"^clip_grad_norm_|^pipeline_clip_grad_norm_") as info:
            pipeline_clip_grad_norm_([weight], 1e-3, group=mesh["pp"])
        return str(info.value), None if weight.grad is None else weight.grad.to_local()

    results = run_threads(4, rank_main)
    assert results[0][0] == results[1][0] != results[2][0] == results[3][0]
    assert "shape (4,)" in results[0][0]
    assert "stage" in results[2][0]
    for _, grad in results[1:]:
        assert torch.equal(grad, torch.ones(2))  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, INF])
def test_half_precision_gradients_are_combined_without_overflow_as_torch(
    dtype: torch.dtype, norm_type: float
) -> None:
    # Each shard's squares sum past float16's largest value (65504); the total norm does not.
    full_grad = torch.linspace(-300.0, 290.0, 7).to(dtype)
    expected_norm, (expected,) = expected_clip([full_grad], 1.0, norm_type)
    assert expected_norm.dtype == dtype
    assert expected_norm.isfinite()

    def rank_main(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        mesh = init_device_mesh("cpu", (2,))

        def shard(tensor: torch.Tensor) -> DTensor:
            local = tensor[:4] if rank == 0 else tensor[4:]  # rows 4 + 3 of 7
            return DTensor.from_local(local.clone(), mesh, [Shard(0)], shape=(7,), stride=(1,))

        weight = nn.Parameter(shard(torch.zeros(7, dtype=dtype)))
        weight.grad = shard(full_grad)
        norm = clip_grad_norm_([weight], 1.0, norm_type)
        return norm, weight.grad.full_tensor()

    for norm, grad in run_threads(2, rank_main):
        assert norm.dtype == dtype
        torch.testing.assert_close(norm, expected_norm)
        torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize(
    ("dtype", "count"), [(torch.float32, 2), (torch.bfloat16, 257)], ids=["few", "many"]
)
def test_ranks_passing_different_dtensor_parameters_are_refused_on_each(
    dtype: torch.dtype, count: int
) -> None:
    # The common [p for p in params if p.grad is not None], where a DTensor has a gradient on
    # rank 0 only: rank 1 passes one parameter fewer. (bfloat16 cannot tell 257 from 256.)

    def rank_main(rank: int) -> tuple[str, list[torch.Tensor]]:
        mesh = init_device_mesh("cpu", (2,))
        params = []
        for _ in range(count):
            local = torch.ones(1, dtype=dtype)
            param = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)]))
            param.grad = DTensor.from_local(local * 3.0, mesh, [Shard(0)])
            params.append(param)
        if rank == 1:
            params[0].grad = None
        passed = [p for p in params if p.grad is not None]
        with pytest.raises(
            ValueError, match=r"different numbers.*model\.parameters\(\).*p\.grad is not None"
        ) as raised:
            clip_grad_norm_(passed, 1.0)
        return str(raised.value), [p.grad.to_local() for p in passed]  # type: ignore[union-attr]

    results = run_threads(2, rank_main)
    assert results[0][0] == results[1][0]
    for _, grads in results:
        for grad in grads:
            torch.testing.assert_close(grad, torch.full((1,), 3.0, dtype=dtype))


@pytest.mark.parametrize("norm_type", [2.0, INF])
@pytest.mark.parametrize("size", [3, 300])
def test_dtensors_whose_gradients_are_missing_on_different_ranks_are_refused_on_each(
    size: int, norm_type: float
) -> None:
    # Rank 0 lacks the gradient of one DTensor, rank 1 of another (data-dependent branches):
    # the numbers of gradients agree, the norms would not. Among 300, rank 1 lacks two whose
    # positions sum as rank 0's do (1 + 4 == 2 + 3), which a sum of positions would miss.
    missing = {0: [1, 4], 1: [2, 3]} if size == 300 else {0: [1], 1: [2]}

    def rank_main(rank: int) -> tuple[str, list[torch.Tensor]]:
        mesh = init_device_mesh("cpu", (2,))
        params = []
        for i in range(size):
            param = nn.Parameter(distribute_tensor(torch.zeros(i % 4 + 2), mesh, [Shard(0)]))
            param.grad = distribute_tensor(torch.ones(i % 4 + 2), mesh, [Shard(0)])
            params.append(param)
        for i in missing[rank]:
            params[i].grad = None
        with pytest.raises(ValueError, match=r"shape \(3,\).*zeros_like") as info:
            clip_grad_norm_(params, 1e-3, norm_type)
        return str(info.value), [p.grad.to_local() for p in params if p.grad is not None]

    results = run_threads(2, rank_main)
    assert results[0][0] == results[1][0]
    for _, grads in results:
        assert all(torch.equal(grad, torch.ones_like(grad)) for grad in grads)  # none scaled


@pytest.mark.parametrize("norm_type", [2.0, 0.0])
def test_a_rank_without_any_gradient_of_its_mesh_is_refused_like_the_others(
    norm_type: float,
) -> None:
    # The mesh's only DTensor has a gradient on rank 1 alone: rank 0 holds no gradient there,
    # and raises the same error as rank 1, not one of its own.
    def rank_main(rank: int) -> str:
        mesh = init_device_mesh("cpu", (2,))
        weight = nn.Parameter(DTensor.from_local(torch.zeros(2), mesh, [Shard(0)]))
        if rank == 1:  # without a collective: rank 0 makes none
            weight.grad = DTensor.from_local(torch.ones(2), mesh, [Shard(0)])
        with pytest.raises(ValueError, match=r"shape \(4,\).*zeros_like") as info:
            clip_grad_norm_([weight], 1e-3, norm_type)
        return str(info.value)

    messages = run_threads(2, rank_main)
    assert messages[0] == messages[1]


def plain_with_grad(grad: torch.Tensor) -> nn.Parameter:
    param = nn.Parameter(torch.zeros_like(grad))
    param.grad = grad.clone()
    return param


@pytest.mark.parametrize("norm_type", [INF, -INF, -1.0])
@pytest.mark.parametrize("empty", ["dtensor", "plain-on-rank-0"])
def test_an_inf_or_negative_norm_over_a_gradient_without_elements_is_refused_on_every_rank(
    empty: str, norm_type: float
) -> None:
    # torch refuses the largest or smallest absolute value of no elements, and a negative power
    # of none (a sum without an identity to start from); so does a process
    # without a process group, and so does every rank, wherever the empty gradient is.
    bias = torch.tensor([2.0, -3.0])
    with pytest.raises(RuntimeError):
        torch.nn.utils.clip_grad_norm_([plain_with_grad(torch.zeros(0)), bias], 1.0, norm_type)
    nothing = plain_with_grad(torch.zeros(0))
    with pytest.raises(RuntimeError):
        clip_grad_norm_([nothing, plain_with_grad(bias)], 1.0, norm_type)
    assert torch.equal(nothing.grad, torch.zeros(0))  # type: ignore[arg-type]
    sharded = torch.zeros(0) if empty == "dtensor" else torch.tensor([1.0, -4.0, 2.0])

    def rank_main(rank: int) -> tuple[str, list[torch.Tensor], torch.Tensor, torch.Tensor]:
        mesh = init_device_mesh("cpu", (2,))
        weight = nn.Parameter(distribute_tensor(torch.zeros_like(sharded), mesh, [Shard(0)]))
        weight.grad = distribute_tensor(sharded, mesh, [Shard(0)])
        params = [weight, plain_with_grad(bias)]
        if empty != "dtensor" and rank == 0:
            params.append(plain_with_grad(torch.zeros(0)))  # this rank's own, empty
        with pytest.raises(RuntimeError) as info:
            clip_grad_norm_(params, 1e-3, norm_type)
        grads = [full(p.grad) for p in params]  # type: ignore[arg-type]
        # A p-norm counts a gradient without elements as nothing, as torch's.
        expected = torch.nn.utils.get_total_norm(grads, 2.0)
        return str(info.value), grads, clip_grad_norm_(params, 1e9), expected

    results = run_threads(2, rank_main)
    assert results[0][0] == results[1][0]
    for _, grads, norm, expected in results:
        assert torch.equal(grads[0], sharded)  # nothing was scaled
        assert torch.equal(grads[1], bias)
        torch.testing.assert_close(norm, expected)


@pytest.mark.parametrize("norm_type", [INF, -1.0])
def test_an_empty_gradient_beside_a_mesh_without_any_gradient_is_refused_on_every_rank(
    norm_type: float,
) -> None:
    # Rank 0's own gradient without elements; the only mesh holds a frozen DTensor, whose
    # all-reduce tells rank 1 of it all the same.
    def rank_main(rank: int) -> tuple[str, torch.Tensor]:
        mesh = init_device_mesh("cpu", (2,))
        frozen = nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Shard(0)]))
        bias = plain_with_grad(torch.tensor([2.0, -3.0]))
        params = [frozen, bias, plain_with_grad(torch.zeros(0))] if rank == 0 else [frozen, bias]
        with pytest.raises(RuntimeError) as info:
            clip_grad_norm_(params, 1e-3, norm_type)
        return str(info.value), bias.grad  # type: ignore[return-value]

    results = run_threads(2, rank_main)
    assert {message for message, _ in results} == {  # the one whole-message check of this error
        f"clip_grad_norm_: the {norm_type} norm of a gradient without elements is undefined "
        "(there is no largest or smallest value to take, nor a negative power to add), and "
        "torch.nn.utils.clip_grad_norm_ refuses it too. Leave the parameter out or set its "
        "grad to None, or clip with a positive p-norm such as norm_type=2.0"
    }
    for _, grad in results:
        assert torch.equal(grad, torch.tensor([2.0, -3.0]))  # nothing scaled


@pytest.mark.parametrize("norm_type", [0.0, 0.5, 2.0])
def test_a_gradient_without_elements_counts_as_nothing_in_a_norm_torch_accepts_it_in(
    norm_type: float,
) -> None:
    # torch refuses only inf, -inf and a negative p over no elements: the 0-"norm" and a
    # positive p count such a gradient as nothing, without a process group and on every rank.
    def params() -> list[nn.Parameter]:
        return [plain_with_grad(torch.zeros(0)), plain_with_grad(torch.tensor([2.0, -3.0]))]

    expected = params()
    expected_norm = torch.nn.utils.clip_grad_norm_(expected, 1.0, norm_type)
    assert not dist.is_initialized()
    mine = params()
    torch.testing.assert_close(clip_grad_norm_(mine, 1.0, norm_type), expected_norm)
    for param, twin in zip(mine, expected, strict=True):
        torch.testing.assert_close(param.grad, twin.grad)

    def rank_main(rank: int) -> torch.Tensor:
        mesh = init_device_mesh("cpu", (2,))
        weight = nn.Parameter(distribute_tensor(torch.zeros(0), mesh, [Shard(0)]))
        weight.grad = distribute_tensor(torch.zeros(0), mesh, [Shard(0)])
        return clip_grad_norm_([weight, *params()], 1.0, norm_type)

    for norm in run_threads(2, rank_main):
        torch.testing.assert_close(norm, expected_norm)


@pytest.mark.usefixtures("detail")
@pytest.mark.parametrize("other", ["plain", "none"])
@pytest.mark.parametrize("beside", [False, True], ids=["alone", "beside-dtensors"])
def test_a_plain_parameters_gradient_that_is_a_dtensor_on_some_ranks_only_is_refused_on_each(
    beside: bool, other: str
) -> None:
    # A hand-sharded model's plain weight whose gradient is a Replicate DTensor on rank 0 and
    # a plain tensor (or None) on rank 1: rank 0 would wait for rank 1 on the mesh.
    grad = torch.tensor([3.0, 4.0])

    def rank_main(rank: int) -> tuple[str, list[torch.Tensor | None]]:
        mesh = init_device_mesh("cpu", (2,))
        scale, later = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
        for param in (scale, later):
            if rank == 0:
                param.grad = DTensor.from_local(grad.clone(), mesh, [Replicate()])
            elif other == "plain":
                param.grad = grad.clone()
        params = [scale, plain_with_grad(torch.tensor([5.0]))]
        if beside:
            weight = nn.Parameter(distribute_tensor(torch.zeros(3), mesh, [Shard(0)]))
            weight.grad = distribute_tensor(torch.ones(3), mesh, [Shard(0)])
            params.append(weight)
        params.append(later)  # the error names the first such parameter
        with pytest.raises(ValueError, match=r"parameters\[0\].*rank\(s\) \[1\]") as info:
            clip_grad_norm_(params, 1e-3)
        return str(info.value), [None if p.grad is None else full(p.grad) for p in params]

    results = run_threads(2, rank_main)
    assert results[0][0] == results[1][0]
    for rank, (_, grads) in enumerate(results):
        kept = grad if rank == 0 or other == "plain" else None
        assert grads[0] is None if kept is None else torch.equal(grads[0], kept)
        assert torch.equal(grads[1], torch.tensor([5.0]))  # type: ignore[arg-type]
        if beside:
            assert torch.equal(grads[2], torch.ones(3))  # type: ignore[arg-type]


def test_without_detail_a_gradient_kind_that_differs_beside_dtensors_is_refused_by_count() -> None:
    # Rank 0 counts a plain parameter with a DTensor gradient on the mesh, rank 1 does not:
    # the counts that ride the norm's all-reduce differ, and every rank raises.
    def rank_main(rank: int) -> tuple[str, torch.Tensor]:
        mesh = init_device_mesh("cpu", (2,))
        scale = plain_with_grad(torch.tensor([3.0, 4.0]))
        if rank == 0:
            scale.grad = DTensor.from_local(torch.tensor([3.0, 4.0]), mesh, [Replicate()])
        weight = nn.Parameter(distribute_tensor(torch.zeros(3), mesh, [Shard(0)]))
        weight.grad = distribute_tensor(torch.ones(3), mesh, [Shard(0)])
        with pytest.raises(ValueError, match=r"different numbers.*DTensor gradient") as info:
            clip_grad_norm_([scale, weight], 1e-3)
        return str(info.value), weight.grad.full_tensor()

    results = run_threads(2, rank_main)
    assert results[0][0] == results[1][0]
    for _, grad in results:
        assert torch.equal(grad, torch.ones(3))


@pytest.mark.usefixtures("detail")
@pytest.mark.parametrize("passed", ["plain", "nothing"])
def test_a_rank_that_passes_no_dtensor_of_its_mesh_is_refused_on_every_rank(passed: str) -> None:
    # Rank 1 passes only its plain parameters (or none): it cannot know that rank 0 waits for
    # it on the mesh, but the default group tells every rank.
    def rank_main(rank: int) -> tuple[str, torch.Tensor, torch.Tensor]:
        mesh = init_device_mesh("cpu", (2,))
        weight = nn.Parameter(distribute_tensor(torch.zeros(3), mesh, [Shard(0)]))
        weight.grad = distribute_tensor(torch.full((3,), 2.0), mesh, [Shard(0)])
        bias = plain_with_grad(torch.tensor([5.0]))
        params = [weight, bias] if rank == 0 else [bias] if passed == "plain" else []
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\].*model\.parameters\(\)") as info:
            clip_grad_norm_(params, 1e-3)
        return str(info.value), weight.grad.full_tensor(), bias.grad  # type: ignore[return-value]

    results = run_threads(2, rank_main)
    assert results[0][0] == results[1][0]
    for _, weight_grad, bias_grad in results:
        assert torch.equal(weight_grad, torch.full((3,), 2.0))
        assert torch.equal(bias_grad, torch.tensor([5.0]))


def test_ranks_outside_every_mesh_of_the_others_may_pass_only_plain_tensors() -> None:
    # Per-stage clipping of a two-stage pipeline: stage 0 (ranks 0, 1) is under FSDP2 on its
    # own dp mesh, stage 1 (ranks 2, 3) is plain. Each stage gets its own model's norm.
    sharded, bias = torch.tensor([1.0, -2.0, 2.0]), torch.tensor([4.0])
    expected = [
        torch.nn.utils.get_total_norm([sharded, bias], 1.0),
        torch.nn.utils.get_total_norm([bias * 3.0], 1.0),
    ]

    def rank_main(rank: int) -> torch.Tensor:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        if rank >= 2:
            return clip_grad_norm_([plain_with_grad(bias * 3.0)], 1.0, 1.0)
        weight = nn.Parameter(distribute_tensor(torch.zeros(3), mesh["dp"], [Shard(0)]))
        weight.grad = distribute_tensor(sharded, mesh["dp"], [Shard(0)])
        return clip_grad_norm_([weight, plain_with_grad(bias)], 1.0, 1.0)

    for rank, norm in enumerate(run_threads(4, rank_main)):
        torch.testing.assert_close(norm, expected[rank // 2])


@pytest.mark.parametrize("norm_type", [INF, -INF, -0.5])
def test_without_a_process_group_an_inf_norm_over_an_empty_gradient_is_refused_as_torch(
    norm_type: float,
) -> None:
    assert not dist.is_initialized()

    def params() -> list[nn.Parameter]:
        full, empty = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(0))
        full.grad, empty.grad = torch.full((3,), 2.0), torch.ones(0)
        return [full, empty]

    with pytest.raises(RuntimeError):
        torch.nn.utils.clip_grad_norm_(params(), 1.0, norm_type)
    mine = params()
    with pytest.raises(RuntimeError):
        clip_grad_norm_(mine, 1.0, norm_type)
    assert torch.equal(mine[0].grad, torch.full((3,), 2.0))  # nothing scaled


def test_on_a_torch_built_without_collectives_plain_gradients_are_clipped_as_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Such a build's torch.distributed has is_available(), False, and none of the functions
    # of process groups, nor the debug level: no check may ask for them.
    monkeypatch.setattr(dist, "is_available", lambda: False)
    for name in ("is_initialized", "get_debug_level", "get_rank", "get_world_size"):
        monkeypatch.delattr(dist, name)
    grads = [torch.tensor([3.0, -4.0]), torch.tensor([12.0])]
    expected_norm, expected = expected_clip(grads, 1.0, 2.0)
    params = [plain_with_grad(grad) for grad in grads]
    torch.testing.assert_close(clip_grad_norm_(params, 1.0), expected_norm)
    for param, grad in zip(params, expected, strict=True):
        torch.testing.assert_close(param.grad, grad)


def test_which_gradients_exist_rides_as_a_48_bit_blake2b_digest_in_three_16_bit_digits() -> None:
    # What the ranks of a mesh compare beside their counts: BLAKE2b's 6-byte digest of which
    # parameters have a gradient, as three little-endian 16-bit digits, each exact in float64.
    digest = hashlib.blake2b(bytes([1, 0, 0, 1]), digest_size=6).digest()
    expected = [int.from_bytes(digest[i : i + 2], "little") for i in (0, 2, 4)]
    assert presence([torch.ones(1), None, None, torch.ones(2)]) == expected


@pytest.mark.parametrize("level", [dist.DebugLevel.OFF, dist.DebugLevel.DETAIL], ids=str)
def test_the_checks_ride_the_norms_all_reduce_and_detail_adds_its_own(
    level: dist.DebugLevel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the guide says each check costs: by default the counts ride the norm's one
    # all-reduce of 15 float64 (part, nan, a one, held, empty; 2 counts and the 3 digits of
    # which parameters have a gradient, and their squares); under
    # DETAIL, the agreement over the default group (2 * world + 1 int32) and the flags of
    # which parameters have a gradient (2 int32 a parameter) come in collectives of their own.
    sizes: dict[int, list[tuple[torch.dtype, int]]] = {0: [], 1: []}
    real = dist.all_reduce

    def logged(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes[dist.get_rank()].append((tensor.dtype, tensor.numel()))
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", logged)
    default = dist.get_debug_level()
    dist.set_debug_level(level)

    def rank_main(rank: int) -> None:
        mesh = init_device_mesh("cpu", (2,))
        weight = nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
        weight.grad = distribute_tensor(torch.full((4, 2), 0.5), mesh, [Shard(0)])
        clip_grad_norm_([weight], 1.0)

    try:
        run_threads(2, rank_main)
    finally:
        dist.set_debug_level(default)
    norm = [(torch.float64, 15)]
    expected = norm if level == dist.DebugLevel.OFF else [(torch.int32, 5), *norm, (torch.int32, 2)]
    assert sizes == {0: expected, 1: expected}


@pytest.mark.usefixtures("detail")
def test_plain_parameters_whose_dtensor_gradients_sit_at_other_positions_are_refused_on_each() -> (
    None
):
    # Each rank of the mesh has one plain parameter with a DTensor gradient, but not the same
    # one: the counts agree, the positions do not, and the norms would differ by rank.
    def rank_main(rank: int) -> tuple[str, list[torch.Tensor]]:
        mesh = init_device_mesh("cpu", (2,))
        params = [plain_with_grad(torch.tensor([float(i + 1), 0.0])) for i in range(3)]
        params[1 + rank].grad = distribute_tensor(torch.tensor([3.0, 4.0]), mesh, [Shard(0)])
        with pytest.raises(ValueError, match=r"parameters\[1\].*rank\(s\) \[1\]") as info:
            clip_grad_norm_(params, 1e-3)
        return str(info.value), [full(p.grad) for p in params]  # type: ignore[arg-type]

    results = run_threads(2, rank_main)
    assert results[0][0] == results[1][0]
    for rank, (_, grads) in enumerate(results):
        for i, grad in enumerate(grads):
            expected = torch.tensor([3.0, 4.0] if i == 1 + rank else [i + 1.0, 0.0])
            assert torch.equal(grad, expected)  # nothing was scaled


@pytest.mark.usefixtures("detail")
def test_the_refusal_names_the_first_parameter_whose_gradients_differ_in_kind() -> None:
    # Two meshes, {0, 1} and {2, 3}. parameters[0] has a DTensor gradient on rank 0 only;
    # parameters[3] has one on ranks 2 and 3 alike, which is fine.
    def rank_main(rank: int) -> str:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))["dp"]
        params = [plain_with_grad(torch.tensor([float(i + 1)])) for i in range(4)]
        if rank == 0:
            params[0].grad = DTensor.from_local(torch.tensor([5.0]), mesh, [Replicate()])
        if rank >= 2:
            params[3].grad = DTensor.from_local(torch.tensor([6.0]), mesh, [Replicate()])
        with pytest.raises(ValueError, match=r"parameters\[0\]") as info:
            clip_grad_norm_(params, 1e-3)
        return str(info.value)

    messages = run_threads(4, rank_main)
    assert messages == [messages[0]] * 4
    assert messages[0] == (  # the one whole-message check of this error
        "clip_grad_norm_: parameters[0], a plain tensor, has a DTensor gradient on some ranks "
        "but not on rank(s) [1] of that gradient's device mesh (which have a plain gradient, "
        "None, or a DTensor of another mesh there), so the gradient is neither one DTensor nor "
        "each rank's own. Give it one kind of gradient on every rank: a DTensor on the mesh "
        "everywhere (DTensor.from_local(grad, mesh, placements)) or a plain tensor everywhere "
        "(grad.full_tensor()). list(model.named_parameters())[0] names it when "
        "model.parameters() was passed"
    )
