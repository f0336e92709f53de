"""PipelineTie and pipeline_clip_grad_norm_ on 2, 3 and 4 ranks, each rank a thread.

The ranks are threads of this process (``tests.nn.ranks.run_threads``), so every collective
of the set-up, the gradient sum and the clipping runs here, in sight of the test. What this file
proves, against references computed in one process with plain torch:

* A set-up error of one rank is raised on every rank, naming the group rank refused.
* Two pipelines side by side, each on its own group (a subgroup or a 1-D DeviceMesh), keep to
  it: the broadcast, the gradient sum, the duplicates and the clipping of one never mix with
  the other's.
* ``reduce_grads`` on DTensor weights sums the local shards and fills a missing gradient with a
  DTensor laid out as the weight, with one ``all_reduce`` and no other collective.
* ``pipeline_clip_grad_norm_`` over three uneven stages gives the norm and the clipped
  gradients of ``torch.nn.utils.clip_grad_norm_`` over the whole model, for the 1-, 2-, 3- and
  inf-norm, with a stage that has no gradient at all; a one-rank pipeline communicates nothing.

Every rank of a test reaches the same collectives on the same groups, so a rank that fails
wakes the others instead of leaving them waiting.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tests.nn.distributed.pipeline_lm import StageLM, split, whole_model
from tests.nn.distributed.tiny_lm import batches, initial_state, loss_fn
from tests.nn.ranks import run_threads
from toolkit.nn import PipelineTie, TiedLinear, pipeline_clip_grad_norm_

INF = float("inf")


def stages_of(seed: int, num_stages: int) -> list[StageLM]:
    """The tiny tied LM of ``seed`` cut into ``num_stages`` stages."""
    model = whole_model(initial_state(seed=seed))
    return [split(model, i, num_stages) for i in range(num_stages)]


def refusal(make: Callable[[int], Any]) -> Callable[[int], str]:
    """A rank function returning the ValueError that ``make(rank)`` raises on that rank."""

    def rank_main(rank: int) -> str:
        with pytest.raises(ValueError, match=r"^PipelineTie") as info:
            make(rank)
        return " ".join(str(info.value).split())

    return rank_main


# Collectives seen per rank: torch.distributed's functions, wrapped while a test records. ------

_recording = threading.local()
SPIED = ("all_reduce", "broadcast", "all_gather_object", "all_gather", "barrier")


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the collectives called through ``torch.distributed`` log into ``recorded()``."""
    for name in SPIED:
        real = getattr(dist, name)

        def logged(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            log = getattr(_recording, "log", None)
            if log is not None:
                log.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, logged)


class recorded:  # noqa: N801 - used as a context manager, like a function
    """The names of the collectives this rank's thread calls inside the block."""

    def __enter__(self) -> list[str]:
        _recording.log = []
        return _recording.log  # type: ignore[no-any-return]

    def __exit__(self, *exc: object) -> None:
        _recording.log = None


# Set-up errors: raised on every rank. ----------------------------------------------------------


def test_copies_of_different_shapes_on_two_ranks_are_refused_on_every_rank() -> None:
    first, last = stages_of(0, 2)
    last.emb = nn.Embedding(5, 8)
    last.out.head = TiedLinear(last.emb)
    messages = run_threads(2, refusal(lambda rank: PipelineTie(copy.deepcopy([first, last][rank]))))
    expected = (
        "PipelineTie needs every copy of the tied weights to have one shape, but group rank 0 "
        "has {'emb': (17, 8)} and group rank 1 has {'emb': (5, 8)}; build every stage from the "
        "same model"
    )
    assert messages == [expected] * 2


def test_stages_of_one_rank_sharing_one_tied_module_are_refused_on_every_rank() -> None:
    first, _, last = stages_of(0, 3)
    _, middle, _ = stages_of(0, 3)
    last.emb = first.emb  # one object, not a deep copy per stage
    last.out.head = TiedLinear(first.emb)
    messages = run_threads(2, refusal(lambda rank: PipelineTie([[first, last], [middle]][rank])))
    expected = (
        "PipelineTie refused group rank 0's stages: two of its stages share one weight object "
        "as the tied module 'emb', so its gradient would be summed twice and left out of the "
        "clipping norm; give each stage its own copy (copy.deepcopy of the whole model, one "
        "per stage)"
    )
    assert messages == [expected] * 2


# Two pipelines side by side: ranks 0 and 1 run pipeline 0, ranks 2 and 3 pipeline 1. ---------


def pipeline_group(kind: str) -> tuple[Any, dist.ProcessGroup]:
    """This rank's pipeline as ``PipelineTie`` takes it, and as the process group it means."""
    if kind == "mesh":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        return mesh["pp"], mesh["pp"].get_group()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[dist.get_rank() // 2]
    return group, group


def whole_grads(stages: list[StageLM], grads: list[dict[str, torch.Tensor]]) -> list[nn.Parameter]:
    """The whole model's parameters, each once, holding the gradients the pipeline should give.

    The tied weight's gradient is the sum of the two copies'; every other parameter lives in
    one stage and keeps its gradient.
    """
    params = []
    for index, stage in enumerate(stages):
        for name, param in stage.named_parameters():
            if index == 1 and name == "emb.weight":
                continue
            twin = nn.Parameter(param.detach().clone())
            twin.grad = grads[index][name].clone()
            if name == "emb.weight":
                twin.grad += grads[1][name]
            params.append(twin)
    assert len(params) == len(dict(whole_model(initial_state()).named_parameters()))
    return params


@pytest.mark.parametrize("pass_group", [True, False], ids=["group", "tie-group"])
@pytest.mark.parametrize("kind", ["subgroup", "mesh"])
def test_two_pipelines_on_their_own_groups_do_not_mix(kind: str, pass_group: bool) -> None:
    pipelines = [stages_of(seed, 2) for seed in (0, 1)]
    torch.manual_seed(5)
    grads = [
        [{n: torch.randn_like(p) for n, p in stage.named_parameters()} for stage in stages]
        for stages in pipelines
    ]
    expected: dict[tuple[int, float], Any] = {}
    for p, stages in enumerate(pipelines):
        for norm_type in (0.0, 2.0, INF):
            whole = whole_grads(stages, grads[p])
            norm = torch.nn.utils.clip_grad_norm_(whole, 0.5, norm_type)
            expected[p, norm_type] = (norm, [w.grad for w in whole])
    emb = [initial_state(seed=seed)["emb.weight"] for seed in (0, 1)]
    assert not torch.equal(emb[0], emb[1])

    def rank_main(rank: int) -> None:
        p, s = divmod(rank, 2)
        stage = copy.deepcopy(pipelines[p][s])
        if s == 1:  # set-up must replace this copy by the first stage's
            stage.emb.weight.data.add_(1.0)
        group, process_group = pipeline_group(kind)
        tie = PipelineTie(stage, group)
        assert tie.group is process_group
        assert repr(tie) == (
            "PipelineTie(names=['emb'], copies_on_this_rank={emb: 1}, group_size=2)"
        )
        assert torch.equal(stage.emb.weight, emb[p])  # this pipeline's first copy, not rank 0's
        assert [id(w) for w in tie.duplicates()] == ([] if s == 0 else [id(stage.emb.weight)])
        for norm_type in (0.0, 2.0, INF):
            for name, param in stage.named_parameters():
                param.grad = grads[p][s][name].clone()
            tie.reduce_grads()
            torch.testing.assert_close(
                stage.emb.weight.grad, grads[p][0]["emb.weight"] + grads[p][1]["emb.weight"]
            )
            # Without group=, the tie's group is the pipeline: not the world of 4 ranks.
            norm = pipeline_clip_grad_norm_(
                stage.parameters(), 0.5, norm_type, group=group if pass_group else None, tie=tie
            )
            expected_norm, expected_grads = expected[p, norm_type]
            assert norm > 0.5
            torch.testing.assert_close(norm, expected_norm)
            # The whole model's parameters in order: the first stage's, then the last's others.
            mine = list(stage.parameters())
            theirs = expected_grads[: len(mine)] if s == 0 else expected_grads[-len(mine) + 1 :]
            if s == 1:
                mine = mine[1:]  # the copy of emb.weight, compared with the first stage's below
                torch.testing.assert_close(stage.emb.weight.grad, expected_grads[0])
            for param, grad in zip(mine, theirs, strict=True):
                torch.testing.assert_close(param.grad, grad)

    run_threads(4, rank_main)


# DTensor weights: rank dp * 2 + pp holds stage pp, the tied weight sharded over "dp". ---------


def test_reduce_grads_on_dtensor_weights_fills_a_missing_gradient_as_the_weight(spy: None) -> None:
    stages = stages_of(0, 2)
    emb = initial_state()["emb.weight"]
    torch.manual_seed(6)
    head_grad = torch.randn(17, 8)

    def rank_main(rank: int) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        pp = mesh["pp"].get_local_rank()
        stage = copy.deepcopy(stages[pp])
        weight = stage.emb.weight.detach() + (1.0 if pp == 1 else 0.0)
        stage.emb.weight = nn.Parameter(distribute_tensor(weight, mesh["dp"], [Shard(0)]))
        tie = PipelineTie(stage, mesh["pp"])
        shard = stage.emb.weight
        assert isinstance(shard, DTensor)
        assert shard.to_local().shape == ((9, 8) if mesh["dp"].get_local_rank() == 0 else (8, 8))
        torch.testing.assert_close(shard.full_tensor(), emb, rtol=0, atol=0)

        # No copy has a gradient: every copy keeps None, after the one all_reduce.
        with recorded() as collectives:
            tie.reduce_grads()
        assert collectives == ["all_reduce"]
        assert shard.grad is None

        # Only the head's copy has a gradient: the lookup's copy is given it.
        local = distribute_tensor(head_grad, mesh["dp"], [Shard(0)], src_data_rank=None)
        shard.grad = local if pp == 1 else None
        with recorded() as collectives:
            tie.reduce_grads()
        assert collectives == ["all_reduce"]
        grad = shard.grad
        assert isinstance(grad, DTensor)
        assert grad.device_mesh == shard.device_mesh
        assert grad.placements == (Shard(0),)
        assert (grad.shape, grad.stride()) == ((17, 8), (8, 1))
        torch.testing.assert_close(grad.full_tensor(), head_grad, rtol=0, atol=0)

        # Clipping counts the tied weight once and returns a plain tensor, on every rank.
        norm = pipeline_clip_grad_norm_([shard], 0.5, group=mesh["pp"], tie=tie)
        assert type(norm) is torch.Tensor
        torch.testing.assert_close(norm, torch.linalg.vector_norm(head_grad))
        torch.testing.assert_close(grad.full_tensor(), head_grad * (0.5 / (norm + 1e-6)))

    run_threads(4, rank_main)


# Clipping three uneven stages, the middle one possibly without any gradient. ------------------


def three_stages() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4), nn.Linear(4, 2, bias=False))


STAGE_OF = [0, 0, 1, 2]  # the layers of three_stages held by each rank


def stage_grads(frozen_middle: bool) -> list[torch.Tensor | None]:
    """The gradients of ``three_stages()`` after one backward, in ``parameters()`` order."""
    model = three_stages()
    gen = torch.Generator().manual_seed(8)
    model(torch.randn(6, 3, generator=gen)).square().sum().backward()
    grads: list[torch.Tensor | None] = [p.grad for p in model.parameters()]
    if frozen_middle:
        grads[2:4] = [None, None]  # the middle stage's Linear(5, 4)
    return grads


@pytest.mark.parametrize("frozen_middle", [False, True], ids=["all", "frozen-middle"])
@pytest.mark.parametrize("norm_type", [0.0, 1.0, 2.0, 3.0, INF])
def test_clipping_three_stages_matches_one_process(norm_type: float, frozen_middle: bool) -> None:
    grads = stage_grads(frozen_middle)
    whole = three_stages()
    for param, grad in zip(whole.parameters(), grads, strict=True):
        param.grad = None if grad is None else grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(whole.parameters(), 0.05, norm_type)
    assert expected > 0.05
    expected_grads = [p.grad for p in whole.parameters()]
    per_layer = [len(list(layer.parameters())) for layer in three_stages()]
    starts = [sum(per_layer[:i]) for i in range(len(per_layer))]

    def rank_main(rank: int) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        model = three_stages()
        mine: list[nn.Parameter] = []
        expected_mine: list[torch.Tensor | None] = []
        for index, layer in enumerate(model):
            if STAGE_OF[index] != rank:
                continue
            for offset, param in enumerate(layer.parameters()):
                grad = grads[starts[index] + offset]
                param.grad = None if grad is None else grad.clone()
                mine.append(param)
                expected_mine.append(expected_grads[starts[index] + offset])
        norm = pipeline_clip_grad_norm_(mine, 0.05, norm_type, group=dist.group.WORLD)
        for param, grad in zip(mine, expected_mine, strict=True):
            torch.testing.assert_close(param.grad, grad)
        return norm, expected_mine

    results = run_threads(3, rank_main)
    for norm, _ in results:
        assert norm.dtype == torch.float32
        torch.testing.assert_close(norm, expected)
    assert all(g is None for g in results[1][1]) == frozen_middle


def test_a_one_rank_pipeline_in_a_larger_world_communicates_nothing(spy: None) -> None:
    torch.manual_seed(9)
    layers = [nn.Linear(4, 3), nn.Linear(3, 5)]  # one pipeline per rank, each of one stage
    grads = [[torch.randn_like(p) for p in layer.parameters()] for layer in layers]
    expected = []
    for layer, layer_grads in zip(layers, grads, strict=True):
        twin = copy.deepcopy(layer)
        for param, grad in zip(twin.parameters(), layer_grads, strict=True):
            param.grad = grad.clone()
        expected.append(torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5, 3.0))

    def rank_main(rank: int) -> torch.Tensor:
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "pp"))
        layer = copy.deepcopy(layers[rank])
        for param, grad in zip(layer.parameters(), grads[rank], strict=True):
            param.grad = grad.clone()
        with recorded() as collectives:
            norm = pipeline_clip_grad_norm_(layer.parameters(), 0.5, 3.0, group=mesh["pp"])
        assert collectives == []
        return norm

    norms = run_threads(2, rank_main)
    for norm, reference in zip(norms, expected, strict=True):
        torch.testing.assert_close(norm, reference, rtol=0, atol=0)


# Training loops on thread ranks: one stage per rank, the hidden states passed as a schedule's
# point-to-point messages would be, the reference the whole model in one process. ------------


def exchange(tensor: torch.Tensor | None, source: int) -> torch.Tensor:
    """``tensor`` of group rank ``source``, given to every rank."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tensor, group=None)
    return gathered[source]  # type: ignore[no-any-return]


def pipeline_backward(
    rank: int, n: int, stage: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, scale: float
) -> None:
    """One microbatch's forward and backward through ``n`` stages, stage ``rank`` on this rank.

    The last stage's loss is multiplied by ``scale``, as a schedule with ``scale_grads=False``
    and a loss divided by the number of microbatches does.
    """
    x: torch.Tensor = tokens
    out = inp = None
    for s in range(n):
        if rank == s:
            inp = x if s == 0 else x.detach().requires_grad_()
            out = stage(inp)
        if s < n - 1:
            x = exchange(out.detach() if rank == s else None, s)  # type: ignore[union-attr]
    if rank == n - 1:
        (loss_fn(out, targets) * scale).backward()  # type: ignore[arg-type]
    for s in reversed(range(1, n)):
        grad = exchange(inp.grad if rank == s else None, s)  # type: ignore[union-attr]
        if rank == s - 1:
            out.backward(grad)  # type: ignore[union-attr]


ACCUMULATION = 2  # schedule steps per optimizer step
MICRO = 2  # microbatches per schedule step


def reference_accumulated(steps: int, frozen: bool = False) -> dict[str, Any]:
    """The whole model trained with AdamW and clipping on ``ACCUMULATION * MICRO`` microbatches
    per optimizer step, each of its loss divided by their number."""
    model = whole_model(initial_state())
    model.emb.weight.requires_grad_(not frozen)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5)
    norms = []
    for tokens, targets in batches(2, steps):
        opt.zero_grad()
        for t, y in zip(
            tokens.chunk(ACCUMULATION * MICRO), targets.chunk(ACCUMULATION * MICRO), strict=True
        ):
            (loss_fn(model(t), y) / (ACCUMULATION * MICRO)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
        opt.step()
    return {"norms": norms, "state": model.state_dict()}


def accumulated_training(
    stages: list[StageLM], reduce: str, set_to_none: bool, steps: int, frozen: bool = False
) -> Callable[[int], dict[str, Any]]:
    """A rank function: stage ``rank`` trained as ``reference_accumulated``, the tie on the
    whole group.

    ``reduce`` says when ``reduce_grads()`` is called: ``"once"`` before clipping, ``"each"``
    after every schedule step, ``"twice"`` twice before clipping.
    """
    return lambda rank: _accumulated_training(stages, rank, reduce, set_to_none, steps, frozen)


def _accumulated_training(
    stages: list[StageLM], rank: int, reduce: str, set_to_none: bool, steps: int, frozen: bool
) -> dict[str, Any]:
    n = len(stages)
    stage = copy.deepcopy(stages[rank])
    if stage.emb is not None:
        stage.emb.weight.requires_grad_(not frozen)
    tie = PipelineTie(stage, dist.group.WORLD)
    opt = torch.optim.AdamW(stage.parameters(), lr=0.05, weight_decay=0.5)
    norms = []
    for tokens, targets in batches(2, steps):
        opt.zero_grad(set_to_none=set_to_none)
        chunks = list(
            zip(
                tokens.chunk(ACCUMULATION * MICRO), targets.chunk(ACCUMULATION * MICRO), strict=True
            )
        )
        for step in range(ACCUMULATION):
            for t, y in chunks[step * MICRO : (step + 1) * MICRO]:
                pipeline_backward(rank, n, stage, t, y, 1 / (ACCUMULATION * MICRO))
            if reduce == "each":
                tie.reduce_grads()
        for _ in range({"once": 1, "twice": 2, "each": 0}[reduce]):
            tie.reduce_grads()
        norms.append(pipeline_clip_grad_norm_(stage.parameters(), 0.5, tie=tie))
        opt.step()
    tie.check()
    return {"norms": norms, "state": stage.state_dict(), "tie": repr(tie)}


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
@pytest.mark.parametrize("reduce", ["once", "each", "twice"])
def test_accumulating_over_schedule_steps_counts_every_backward_once(
    reduce: str, set_to_none: bool
) -> None:
    expected = reference_accumulated(steps=2)
    results = run_threads(3, accumulated_training(stages_of(0, 3), reduce, set_to_none, 2))
    # The middle stage holds no copy, and runs the same loop.
    assert results[1]["tie"] == (
        "PipelineTie(names=['emb'], copies_on_this_rank={emb: 0}, group_size=3)"
    )
    for result in results:
        torch.testing.assert_close(result["norms"], expected["norms"])
        for key, value in result["state"].items():
            torch.testing.assert_close(value, expected["state"][key], msg=key)


def test_a_frozen_tied_weight_keeps_no_gradient_and_no_weight_decay() -> None:
    expected = reference_accumulated(steps=2, frozen=True)
    emb = initial_state()["emb.weight"]

    rank_main = accumulated_training(stages_of(0, 2), "each", True, 2, frozen=True)
    for result in run_threads(2, rank_main):
        torch.testing.assert_close(result["state"]["emb.weight"], emb, rtol=0, atol=0)
        for key, value in result["state"].items():
            torch.testing.assert_close(value, expected["state"][key], msg=key)
        torch.testing.assert_close(result["norms"], expected["norms"])


def test_copies_without_gradients_this_step_keep_none_with_one_all_reduce(spy: None) -> None:
    stages = stages_of(0, 3)

    def rank_main(rank: int) -> None:
        stage = copy.deepcopy(stages[rank])
        tie = PipelineTie(stage, dist.group.WORLD)
        with recorded() as collectives:
            tie.reduce_grads()
        assert collectives == ["all_reduce"]  # on every rank, the middle one's included
        assert all(p.grad is None for p in stage.parameters())

    run_threads(3, rank_main)


def test_reduce_grads_twice_leaves_the_sum_unchanged(spy: None) -> None:
    tokens, targets = batches(2, 1)[0]
    whole = whole_model(initial_state())
    loss_fn(whole(tokens), targets).backward()
    expected = whole.emb.weight.grad
    stages = stages_of(0, 2)

    def rank_main(rank: int) -> None:
        stage = copy.deepcopy(stages[rank])
        tie = PipelineTie(stage, dist.group.WORLD)
        pipeline_backward(rank, 2, stage, tokens, targets, 1.0)
        for _ in range(3):
            with recorded() as collectives:
                tie.reduce_grads()
            assert collectives == ["all_reduce"]
            torch.testing.assert_close(stage.emb.weight.grad, expected)
        # Its hooks are registered once per Parameter, not once per call.
        assert len(stage.emb.weight._backward_hooks) == 1  # type: ignore[arg-type]
        assert len(stage.emb.weight._post_accumulate_grad_hooks) == 1  # type: ignore[arg-type]

    run_threads(2, rank_main)


def test_fsdp2_accumulating_onto_the_written_sum_is_refused_on_every_rank() -> None:
    """FSDP2 adds a reduce-scattered gradient into the sharded one and then runs the
    post-accumulate-grad hooks, without autograd's pre-accumulation hooks: as here."""
    head_grad = torch.arange(17 * 8, dtype=torch.float32).view(17, 8)
    stages = stages_of(0, 2)

    def fsdp2_accumulate(param: nn.Parameter, local: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            param.grad = DTensor.from_local(
                local.clone(),
                param.device_mesh,
                param.placements,
                shape=param.shape,
                stride=param.stride(),
            )
        else:
            grad._local_tensor += local  # type: ignore[attr-defined]
        for hook in (param._post_accumulate_grad_hooks or {}).values():
            hook(param)

    def rank_main(rank: int) -> str:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        pp = mesh["pp"].get_local_rank()
        stage = copy.deepcopy(stages[pp])
        stage.emb.weight = nn.Parameter(
            distribute_tensor(stage.emb.weight.detach(), mesh["dp"], [Shard(0)])
        )
        weight = stage.emb.weight
        tie = PipelineTie(stage, mesh["pp"])
        local = distribute_tensor(head_grad, mesh["dp"], [Shard(0)]).to_local()
        fsdp2_accumulate(weight, local * (pp + 1))
        tie.reduce_grads()
        torch.testing.assert_close(weight.grad.full_tensor(), head_grad * 3)
        # zero_grad(set_to_none=False), then a backward: the sum is taken again, once.
        weight.grad.zero_()
        fsdp2_accumulate(weight, local * (pp + 1))
        tie.reduce_grads()
        torch.testing.assert_close(weight.grad.full_tensor(), head_grad * 3)
        # A backward onto the written sum, without zeroing: refused, nothing changed.
        fsdp2_accumulate(weight, local)
        before = weight.grad.to_local().clone()
        with pytest.raises(RuntimeError, match=r"^PipelineTie.reduce_grads\(\)") as info:
            tie.reduce_grads()
        assert torch.equal(weight.grad.to_local(), before)
        with pytest.raises(RuntimeError):  # still refused until the gradient is cleared
            tie.reduce_grads()
        opt = torch.optim.SGD([weight], lr=0.1)
        opt.zero_grad(set_to_none=True)
        fsdp2_accumulate(weight, local * (pp + 1))
        tie.reduce_grads()
        torch.testing.assert_close(weight.grad.full_tensor(), head_grad * 3)
        # Only the first stage's copy, which carries the sum, accumulates onto it: once.
        if pp == 0:
            fsdp2_accumulate(weight, local)
        tie.reduce_grads()
        torch.testing.assert_close(weight.grad.full_tensor(), head_grad * 4)
        return str(info.value)

    messages = run_threads(4, rank_main)
    assert len(set(messages)) == 1
    assert "zero_grad()" in messages[0]


# A tie that one stage holds alone, and one pipeline as the tie's group. ----------------------


class AuxStage(StageLM):
    """The last stage with a second head, tied to an embedding only this stage has."""

    def __init__(self, stage: StageLM) -> None:
        super().__init__()
        self.load_state_dict(stage.state_dict(), strict=False)
        self.aux_emb = nn.Embedding(5, 8)
        self.aux = nn.Module()
        self.aux.head = TiedLinear(self.aux_emb)


def test_a_tie_held_by_one_stage_alone_is_accepted_and_needs_no_communication(
    spy: None,
) -> None:
    torch.manual_seed(11)
    aux_grad = torch.randn(5, 8)
    stages = [nn.Tanh(), AuxStage(stages_of(0, 2)[1])]  # rank 0: no parameter at all

    def rank_main(rank: int) -> None:
        stage = copy.deepcopy(stages[rank])
        with recorded() as collectives:
            tie = PipelineTie(stage, dist.group.WORLD)
        assert "broadcast" not in collectives
        assert tie.names == ("aux_emb", "emb")  # the last stage holds both, rank 0 neither
        if rank == 1:
            stage.aux_emb.weight.grad = aux_grad.clone()
        with recorded() as collectives:
            tie.reduce_grads()
            tie.broadcast()
        assert collectives == []
        if rank == 1:
            torch.testing.assert_close(stage.aux_emb.weight.grad, aux_grad, rtol=0, atol=0)
            assert list(tie.duplicates()) == []

    run_threads(2, rank_main)


def test_a_stage_local_tie_beside_the_pipeline_tie_trains_both() -> None:
    first, last = stages_of(0, 2)
    torch.manual_seed(12)
    emb_grads = [torch.randn(17, 8) for _ in range(2)]
    aux_grad = torch.randn(5, 8)

    stages = [first, AuxStage(last)]

    def rank_main(rank: int) -> None:
        stage = copy.deepcopy(stages[rank])
        tie = PipelineTie(stage, dist.group.WORLD)
        assert tie.names == ("aux_emb", "emb")
        stage.emb.weight.grad = emb_grads[rank].clone()
        if rank == 1:
            stage.aux_emb.weight.grad = aux_grad.clone()
        tie.reduce_grads()
        torch.testing.assert_close(stage.emb.weight.grad, emb_grads[0] + emb_grads[1])
        if rank == 1:
            torch.testing.assert_close(stage.aux_emb.weight.grad, aux_grad, rtol=0, atol=0)
        tie.check()

    run_threads(2, rank_main)


# pipeline_clip_grad_norm_ takes what torch's clip_grad_norm_ takes, and the pipeline's group. --


def test_clipping_without_the_pipeline_group_on_a_larger_world_is_refused() -> None:
    def rank_main(rank: int) -> str:
        layer = nn.Linear(3, 2)
        layer.weight.grad = torch.ones(2, 3)
        with pytest.raises(ValueError, match="group=") as info:
            pipeline_clip_grad_norm_(layer.parameters(), 0.5)
        assert torch.equal(layer.weight.grad, torch.ones(2, 3))
        return str(info.value)

    messages = run_threads(2, rank_main)
    assert messages[0] == messages[1]
    assert "the default group has 2 ranks" in messages[0]
    assert "tensor parallelism. Pass group=, such as group=mesh" in messages[0]
    assert "group=dist.group.WORLD when every rank is a stage" in messages[0]
    assert messages[0].endswith("or the tie= built on that group")


def test_clipping_takes_a_single_tensor_foreach_and_error_if_nonfinite() -> None:
    torch.manual_seed(13)
    grads = [torch.randn(3, 17 - rank) for rank in range(3)]  # one tensor per stage, uneven
    twins = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for twin, grad in zip(twins, grads, strict=True):
        twin.grad = grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(twins, 0.5, 3.0)

    def rank_main(rank: int) -> str:
        world = dist.group.WORLD
        weight = nn.Parameter(torch.zeros_like(grads[rank]))
        for foreach in (True, False):
            weight.grad = grads[rank].clone()
            norm = pipeline_clip_grad_norm_(weight, 0.5, 3.0, True, foreach, group=world)
            torch.testing.assert_close(norm, expected)
            torch.testing.assert_close(weight.grad, twins[rank].grad)
        weight.grad = grads[rank].clone()
        if rank == 2:
            weight.grad[0, 0] = float("inf")
        before = weight.grad.clone()
        with pytest.raises(RuntimeError, match="non-finite") as info:
            pipeline_clip_grad_norm_([weight], 0.5, error_if_nonfinite=True, group=world)
        assert torch.equal(weight.grad, before)  # raised on every rank before scaling
        # By default, as torch's, the gradients are scaled by the non-finite norm.
        assert pipeline_clip_grad_norm_([weight], 0.5, group=world).isinf()
        return str(info.value)

    assert len(set(run_threads(3, rank_main))) == 1


def test_two_pipelines_tying_different_modules_keep_to_their_own_groups() -> None:
    base = stages_of(0, 2)
    stages = [base[0], base[1], base[0], AuxStage(base[1])]  # pipeline 1 adds a local tie

    def rank_main(rank: int) -> tuple[str, ...]:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        return PipelineTie(copy.deepcopy(stages[rank]), groups[rank // 2]).names

    assert run_threads(4, rank_main) == [("emb",)] * 2 + [("aux_emb", "emb")] * 2


def test_float64_tied_gradients_are_summed_in_float64() -> None:
    stages = [stage.double() for stage in stages_of(0, 2)]
    small = torch.full((17, 8), 1e-12, dtype=torch.float64)

    def rank_main(rank: int) -> None:
        stage = copy.deepcopy(stages[rank])
        tie = PipelineTie(stage)
        stage.emb.weight.grad = torch.ones_like(stage.emb.weight) if rank == 0 else small.clone()
        tie.reduce_grads()
        assert stage.emb.weight.grad.dtype == torch.float64
        assert torch.equal(stage.emb.weight.grad, 1.0 + small)

    assert not torch.equal(1.0 + small, (1.0 + small.float()).double())  # float32 would round
    run_threads(2, rank_main)


@pytest.mark.parametrize("last", ["float64", "float32", "frozen"])
def test_clipping_stages_whose_gradients_differ_in_dtype_matches_one_process(
    last: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # gloo and NCCL need every rank to reduce one dtype; the threaded backend would not notice.
    reduced: dict[int, list[torch.dtype]] = {0: [], 1: []}
    real = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        reduced[dist.get_rank()].append(tensor.dtype)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
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
    assert reduced[0] == reduced[1] != []


@pytest.mark.parametrize("holder", [0, 1])
def test_a_nan_on_any_rank_makes_the_inf_norm_nan_on_every_rank(
    holder: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # As gloo's MAX may: keep the other rank's value where one rank holds a nan.
        if kwargs.get("op") == dist.ReduceOp.MAX:
            tensor.nan_to_num_(nan=-INF)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)

    def rank_main(rank: int) -> tuple[bool, bool]:
        weight = nn.Parameter(torch.zeros(3))
        nan = torch.tensor([1.0, 2.0, float("nan")])
        weight.grad = nan if rank == holder else torch.tensor([1.0, 5.0, 3.0])
        world = dist.group.WORLD
        before = weight.grad.clone()
        with pytest.raises(RuntimeError, match="non-finite"):
            pipeline_clip_grad_norm_([weight], 1.0, INF, error_if_nonfinite=True, group=world)
        unchanged = torch.equal(weight.grad.nan_to_num(), before.nan_to_num())
        return unchanged, pipeline_clip_grad_norm_([weight], 1.0, INF, group=world).isnan().item()

    assert run_threads(2, rank_main) == [(True, True)] * 2
