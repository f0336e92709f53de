"""PipelineTie on 2 to 4 thread ranks, against the whole model in one process with plain torch.

The threaded backend has no point-to-point send, so a schedule's messages between stages are
passed with ``all_gather_object`` (``pipeline_backward``); real schedules run on gloo in
``tests/nn/distributed/test_pipeline_tie.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tests.nn.distributed.pipeline_lm import (
    StageLM,
    random_grads,
    split,
    stages_of,
    whole_clip,
    whole_model,
)
from tests.nn.distributed.tiny_lm import initial_state
from tests.nn.ranks import run_threads
from toolkit.nn import PipelineTie, TiedLinear, pipeline_clip_grad_norm_

INF = float("inf")


def moved(tie: PipelineTie, param: torch.Tensor, total: torch.Tensor | None) -> Any:
    """What ``param``'s gradient holds after ``reduce_grads()``: the first copy the sum of the
    copies' gradients, ``total``; every other copy none."""
    return None if any(param is d for d in tie.duplicates()) else total


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[str]]:
    """The collectives each rank calls through ``torch.distributed``, in order."""
    log: dict[int, list[str]] = {rank: [] for rank in range(4)}
    for name in ("all_reduce", "broadcast", "all_gather", "all_gather_object"):
        real = getattr(dist, name)

        def logged(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            log[dist.get_rank()].append(_name)
            return _real(*args, **kw)

        monkeypatch.setattr(dist, name, logged)
    return log


# Set-up and the check: one rank's problem is raised on every rank. ---------------------------


def refused_stages(case: str) -> list[Any]:
    """Two ranks' stages, rank 1's refused."""
    if case == "shared-weight":  # rank 0's two stages share one embedding object
        first, middle, last = stages_of(0, 3)
        last.emb = first.emb
        last.out.head = TiedLinear(first.emb)
        return [[middle], [first, last]]
    first, last = stages_of(0, 2)
    if case == "replicas":  # group= forgotten: both ranks hold the last stage
        return [last, last]
    if case == "dtype":
        return [first, copy.deepcopy(last).double()]
    if case == "wrapped-module":  # its copy under torch.compile's wrapper: 'emb._orig_mod'
        last.emb = torch.compile(last.emb)  # type: ignore[assignment]
        return [first, last]
    if case == "unregistered":
        last.emb = None  # type: ignore[assignment]
    else:
        last.emb = nn.Embedding(5, 8)
        last.out.head = TiedLinear(last.emb)
    return [first, last]


# Each case's error on every rank: once whole, else the facts it names.
REFUSED: dict[str, str | tuple[str, ...]] = {
    "unregistered": ("group rank 1's stages", "'out.head'", "not registered"),
    "shared-weight": (
        "PipelineTie refused group rank 1's stages: two of its stages share one weight object as "
        "the tied module 'emb', so its gradient would be summed twice and left out of the "
        "clipping norm; give each stage its own copy (copy.deepcopy of the whole model, one per "
        "stage)"
    ),
    "shapes": (
        "PipelineTie needs every copy of the tied weight 'emb.weight' to have one shape, but "
        "group rank 0 has (17, 8) and group rank 1 has (5, 8); build every stage from the same "
        "model"
    ),
    "replicas": (
        "PipelineTie found the same stages on group ranks 0 and 1: its group holds replicas of a "
        "stage, as the default group (the world) does under data parallelism, and it would sum "
        "their tied gradients as the copies of different stages. Pass the pipeline's group, one "
        'rank per stage, such as group=mesh["pp"]'
    ),
    "wrapped-module": (
        "PipelineTie refused group rank 1's stages: its stage 0 holds its tied module as "
        "'emb._orig_mod', inside a wrapper of torch.compile, under a name that the other "
        "stages' copies do not have; compile that module in place with its .compile(), or the "
        "whole stage"
    ),
    "dtype": (
        "PipelineTie needs every copy of the tied weight 'emb.weight' to have one dtype, but "
        "group rank 0 has torch.float32 and group rank 1 has torch.float64; give every stage's "
        "copy one dtype, such as with stage.to(dtype)"
    ),
}


def test_copies_sharded_differently_are_refused_on_every_rank_with_the_fix() -> None:
    # The group= forgotten under FSDP2: each stage is sharded over the tie's own two ranks.
    stages = stages_of(0, 2)

    def rank_main(rank: int) -> str:
        mesh = init_device_mesh("cpu", (2,))
        stage = copy.deepcopy(stages[rank])
        for s in stages:  # every rank shards both stages' copies, to hold its own
            shard = distribute_tensor(s.emb.weight.detach(), mesh, [Shard(0)])
            if s is stages[rank]:
                stage.emb.weight = nn.Parameter(shard)
        with pytest.raises(ValueError, match=r"^PipelineTie") as info:
            PipelineTie(stage)
        return " ".join(str(info.value).split())

    assert (
        run_threads(2, rank_main)
        == [
            "PipelineTie needs every copy of the tied weight 'emb.weight' to have one local shard "
            "shape, but group rank 0 has (9, 8) and group rank 1 has (8, 8); shard every "
            "stage's copy alike over the same data-parallel mesh, as fully_shard(stage, "
            'mesh=mesh["dp"]) does, and pass the pipeline\'s group, such as group=mesh["pp"]'
        ]
        * 2
    )


@pytest.mark.parametrize("case", REFUSED)
def test_one_ranks_refused_stages_are_refused_on_every_rank(case: str) -> None:
    stages = refused_stages(case)

    def rank_main(rank: int) -> str:
        with pytest.raises(ValueError, match=r"^PipelineTie") as info:
            PipelineTie(copy.deepcopy(stages[rank]))
        return " ".join(str(info.value).split())

    messages = run_threads(2, rank_main)
    assert messages[0] == messages[1]
    if isinstance(expected := REFUSED[case], str):
        assert messages[0] == expected
    for fact in () if isinstance(expected, str) else expected:
        assert fact in messages[0]


def test_a_stage_left_unsharded_by_a_forward_on_one_rank_is_refused_on_every_rank() -> None:
    # Rank 1 shards its stage over its data-parallel dimension (one rank here) and runs a
    # forward that keeps it unsharded before the tie is built: its copy is no DTensor.
    stages = stages_of(0, 2)
    hidden = stages[0](torch.tensor([[1, 2, 3]])).detach()

    def rank_main(rank: int) -> str:
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
        stage = copy.deepcopy(stages[rank])
        if rank == 1:
            fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=False)
            stage(hidden)
        dist.barrier()  # rank 1's forward has run before either rank builds the tie
        with pytest.raises(ValueError, match=r"^PipelineTie") as info:
            PipelineTie(stage, mesh["pp"])
        return str(info.value)

    message = (  # the one whole-message check of this error
        "PipelineTie refused group rank 1's stages: its tied module 'emb' (Embedding(17, 8)) is "
        "under fully_shard but unsharded, as a forward leaves it; build the PipelineTie after "
        "fully_shard and before the stages' first forward"
    )
    assert run_threads(2, rank_main) == [message] * 2


def test_middle_stages_without_a_copy_alike_in_their_names_are_no_replicas() -> None:
    # Four stages whose blocks are numbered from 0 on each: the two middle stages hold no copy
    # and the same parameter names, which makes them no replicas of one stage.
    model = whole_model(initial_state())
    middle = split(model, 1, 3, renumber=True)  # one block, numbered 0
    stages = [split(model, 0, 2), middle, copy.deepcopy(middle), split(model, 1, 2)]
    assert sorted(dict(stages[1].named_parameters())) == sorted(dict(stages[2].named_parameters()))
    torch.manual_seed(3)
    grads = [torch.randn(17, 8), torch.randn(17, 8)]

    def rank_main(rank: int) -> list[int]:
        stage = copy.deepcopy(stages[rank])
        tie = PipelineTie(stage, dist.group.WORLD)
        if stage.emb is not None:
            stage.emb.weight.grad = grads[rank // 3].clone()
            tie.reduce_grads()
            total = moved(tie, stage.emb.weight, grads[0] + grads[1])
            torch.testing.assert_close(stage.emb.weight.grad, total)
        else:
            tie.reduce_grads()
        return repr(tie).split("copies_on_this_rank=")[1]

    copies = ["{emb: 1}, group_size=4)", "{emb: 0}, group_size=4)"]
    assert run_threads(4, rank_main) == [copies[0], copies[1], copies[1], copies[0]]


@pytest.mark.parametrize("norm_type", [INF, -INF])
def test_an_inf_norm_over_a_gradient_without_elements_is_refused_on_every_stage(
    norm_type: float,
) -> None:
    # torch refuses it in one process; a stage holding such a gradient, here the last, must
    # not leave the others waiting in the pipeline's all-reduce.
    alone = nn.Parameter(torch.ones(0))
    alone.grad = torch.ones(0)
    with pytest.raises(RuntimeError):
        torch.nn.utils.clip_grad_norm_([alone], 1.0, norm_type)
    stages = stages_of(0, 2)

    def rank_main(rank: int) -> bool:
        stage = copy.deepcopy(stages[rank])
        empty = nn.Parameter(torch.ones(0, 8))
        empty.grad = torch.ones(0, 8)
        params = [*stage.parameters(), *([empty] if rank == 1 else [])]
        for param in stage.parameters():
            param.grad = torch.ones_like(param)
        with pytest.raises(RuntimeError, match="inf"):
            pipeline_clip_grad_norm_(params, 0.5, norm_type, group=dist.group.WORLD)
        return all(torch.equal(p.grad, torch.ones_like(p)) for p in stage.parameters())

    assert run_threads(2, rank_main) == [True, True]  # nothing was scaled


def test_a_copy_replaced_after_the_tie_was_built_is_refused_on_every_rank() -> None:
    # The last stage's copy is a new Parameter after set-up (as fully_shard applied after the
    # tie makes): every rank raises, the middle one, without a copy, included.
    stages = stages_of(0, 3)

    def rank_main(rank: int) -> tuple[str, bool]:
        stage = copy.deepcopy(stages[rank])
        tie = PipelineTie(stage, dist.group.WORLD)
        if stage.emb is not None:
            if rank == 2:
                stage.emb.weight = nn.Parameter(stage.emb.weight.detach()[:9].clone())
            stage.emb.weight.grad = torch.ones_like(stage.emb.weight)
        with pytest.raises(ValueError) as info:  # noqa: PT011 - the message is checked below
            tie.reduce_grads()
        kept = stage.emb is None or torch.equal(
            stage.emb.weight.grad, torch.ones_like(stage.emb.weight)
        )
        return str(info.value), kept

    message = (  # the one whole-message check of this error
        "PipelineTie.reduce_grads() found a tied copy whose Parameter is not the one the tie was "
        "built with (fully_shard after it, say); build it after wrapping the stages"
    )
    assert run_threads(3, rank_main) == [(message, True)] * 3


def test_a_copy_frozen_on_one_stage_is_refused_on_every_rank_and_nothing_changes() -> None:
    # The last stage froze its copy while the first trains it; the middle holds none.
    stages = stages_of(0, 3)

    def rank_main(rank: int) -> tuple[str, bool]:
        stage = copy.deepcopy(stages[rank])
        tie = PipelineTie(stage, dist.group.WORLD)
        if rank == 0:
            stage.emb.weight.grad = torch.ones_like(stage.emb.weight)
        if rank == 2:
            stage.emb.weight.requires_grad_(False)
        with pytest.raises(ValueError) as info:  # noqa: PT011 - the message is checked below
            tie.reduce_grads()
        kept = rank != 0 or torch.equal(stage.emb.weight.grad, torch.ones_like(stage.emb.weight))
        return str(info.value), kept and (rank != 2 or stage.emb.weight.grad is None)

    message = (  # the one whole-message check of this error
        "PipelineTie.reduce_grads() found copies of the tied weight 'emb.weight' frozen beside "
        "copies that train; one Parameter in one model, it is frozen or not: call "
        "stage.get_submodule('emb').weight.requires_grad_(...) on every stage alike"
    )
    assert run_threads(3, rank_main) == [(message, True)] * 3


def test_a_weight_frozen_in_one_of_one_ranks_stages_is_refused_where_another_is_summed() -> None:
    # "emb" is shared by rank 0 (stage 0) and rank 1 (stage 2); "aux_emb" is held by rank 1
    # alone, in stages 1 and 2, and frozen in stage 1: neither rank writes any sum.
    model = StageLM(n_blocks=3)
    model.aux_emb = nn.Embedding(5, 8)
    model.aux = TiedLinear(model.aux_emb)
    stages = [split(model, stage, 3) for stage in range(3)]
    stages[0].aux_emb, stages[0].aux = None, None

    def rank_main(rank: int) -> tuple[str, list[torch.Tensor | None]]:
        mine = [copy.deepcopy(stages[s]) for s in ([0] if rank == 0 else [1, 2])]
        tie = PipelineTie(mine, dist.group.WORLD)
        weights = [p for s in mine for n, p in s.named_parameters() if n.endswith("emb.weight")]
        for weight in weights:
            weight.grad = torch.ones_like(weight)
        if rank == 1:
            mine[0].aux_emb.weight.requires_grad_(False)
        with pytest.raises(ValueError) as info:  # noqa: PT011 - the facts are checked below
            tie.reduce_grads()
        return str(info.value), [w.grad for w in weights]

    for message, grads in run_threads(2, rank_main):
        assert "'aux_emb.weight'" in message
        assert all(torch.equal(grad, torch.ones_like(grad)) for grad in grads)  # type: ignore[arg-type]


# Groups: two pipelines side by side, ranks 0 and 1 in one, 2 and 3 in the other. -------------


def pipeline_group(kind: str) -> tuple[Any, dist.ProcessGroup]:
    """This rank's pipeline as ``PipelineTie`` takes it, and as the process group it means."""
    if kind == "mesh":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        return mesh["pp"], mesh["pp"].get_group()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return groups[dist.get_rank() // 2], groups[dist.get_rank() // 2]


def with_aux(stage: nn.Module) -> nn.Module:
    """``stage`` with a second head, tied to an embedding only this stage has."""
    stage = copy.deepcopy(stage)
    stage.aux_emb = nn.Embedding(5, 8)
    stage.aux = TiedLinear(stage.aux_emb)
    return stage


@pytest.mark.parametrize("clip_over", ["group", "tie-group", "world"])
@pytest.mark.parametrize("kind", ["subgroup", "mesh"])
def test_two_pipelines_on_their_own_groups_do_not_mix(
    kind: str, clip_over: str, calls: dict[int, list[str]]
) -> None:
    pipelines = [stages_of(seed, 2) for seed in (0, 1)]
    pipelines[1][1] = with_aux(pipelines[1][1])  # pipeline 1 ties one more module
    grads = [random_grads(stages, seed=5 + p) for p, stages in enumerate(pipelines)]
    norm_types = (0.0, 2.0, INF)
    expected = {(p, t): whole_clip(pipelines[p], grads[p], t) for p in (0, 1) for t in norm_types}
    emb = [initial_state(seed=seed)["emb.weight"] for seed in (0, 1)]

    def rank_main(rank: int) -> str:
        p, s = divmod(rank, 2)
        stage = copy.deepcopy(pipelines[p][s])
        if s == 1:  # set-up must replace this copy by the first stage's
            stage.emb.weight.data.add_(1.0)
        group, process_group = pipeline_group(kind)
        calls[rank].clear()
        tie = PipelineTie(stage, group)
        # As the guide says: two gathers, of the sizes then the bytes, each twice, one broadcast.
        assert sorted(calls[rank]) == ["all_gather"] * 4 + ["broadcast"]
        assert tie.group is process_group
        assert tie.names == (("emb",), ("aux_emb", "emb"))[p]
        assert repr(tie).endswith("group_size=2)")
        assert torch.equal(stage.emb.weight, emb[p])  # this pipeline's first copy, not rank 0's
        assert [id(w) for w in tie.duplicates()] == ([] if s == 0 else [id(stage.emb.weight)])
        for norm_type in norm_types:
            for name, param in stage.named_parameters():
                param.grad = grads[p][s][name].clone()
            tie.reduce_grads()
            assert calls[rank][-1] == "all_reduce"
            tie_grad = stage.emb.weight.grad
            # Without group=, the tie's group is the pipeline: not the world of 4 ranks. An
            # explicit group wins over the tie's: over the world, both pipelines count.
            clip_group = {"group": group, "tie-group": None, "world": dist.group.WORLD}
            norm = pipeline_clip_grad_norm_(
                stage.parameters(), 0.5, norm_type, group=clip_group[clip_over], tie=tie
            )
            expected_norm, expected_grads = expected[p, norm_type]
            if clip_over == "world":
                both = torch.stack([expected[0, norm_type][0], expected[1, norm_type][0]])
                union = both.sum() if norm_type == 0 else torch.linalg.vector_norm(both, norm_type)
                torch.testing.assert_close(norm, union)
                continue
            torch.testing.assert_close(norm, expected_norm)
            for name, param in stage.named_parameters():
                wanted = moved(tie, param, expected_grads[name])
                torch.testing.assert_close(param.grad, wanted, msg=name)
            assert tie_grad is None or tie_grad is stage.emb.weight.grad
        calls[rank].clear()
        tie.check()
        assert sorted(calls[rank]) == ["all_gather"] * 2 + ["broadcast"]
        if p == 1:
            tie.check()  # a problem of the other pipeline's is not this one's
            return ""
        stage.emb.weight.data[0, 0] += s  # the last stage's copy differs: both ranks raise
        with pytest.raises(RuntimeError, match="copies of the tied weight") as info:
            tie.check()
        return str(info.value)

    messages = run_threads(4, rank_main)
    assert messages[2:] == ["", ""]
    for message in messages[:2]:
        assert "copy 0 on group rank 1" in message
        assert "index (0, 0)" in message


@pytest.mark.parametrize("first", ["no-parameters", "first-stage"])
def test_a_tie_the_last_stage_holds_alone_is_kept_there_without_communication(
    calls: dict[int, list[str]], first: str
) -> None:
    base = stages_of(0, 2)
    stages = [nn.Tanh() if first == "no-parameters" else base[0], with_aux(base[1])]
    torch.manual_seed(11)
    emb_grads, aux_grad = [torch.randn(17, 8) for _ in range(2)], torch.randn(5, 8)

    def rank_main(rank: int) -> None:
        stage = copy.deepcopy(stages[rank])
        tie = PipelineTie(stage, dist.group.WORLD)
        assert tie.names == ("aux_emb", "emb")
        assert calls[rank].count("broadcast") == (first == "first-stage")
        if rank == 1 or first == "first-stage":
            stage.emb.weight.grad = emb_grads[rank].clone()
        if rank == 1:
            stage.aux_emb.weight.grad = aux_grad.clone()
        calls[rank].clear()
        tie.reduce_grads()
        tie.broadcast()
        if first == "no-parameters":
            assert calls[rank] == []
        else:
            assert calls[rank] == ["all_reduce", "broadcast"]
            total = moved(tie, stage.emb.weight, emb_grads[0] + emb_grads[1])
            torch.testing.assert_close(stage.emb.weight.grad, total)
        if rank == 1:
            torch.testing.assert_close(stage.aux_emb.weight.grad, aux_grad, rtol=0, atol=0)
            assert [id(w) for w in tie.duplicates()] == (
                [] if first == "no-parameters" else [id(stage.emb.weight)]
            )
        tie.check()

    run_threads(2, rank_main)


def test_three_copies_on_three_ranks_are_summed_and_clipped_as_one_weight() -> None:
    stages = stages_of(0, 3)
    stages[1].emb = copy.deepcopy(stages[0].emb)  # the middle stage's copy, for an auxiliary head
    stages[1].aux = TiedLinear(stages[1].emb)
    grads = random_grads(stages, seed=12)
    expected_norm, expected_grads = whole_clip(stages, grads, 2.0)

    def rank_main(rank: int) -> None:
        stage = copy.deepcopy(stages[rank])
        tie = PipelineTie(stage)
        for name, param in stage.named_parameters():
            param.grad = grads[rank][name].clone()
        tie.reduce_grads()
        torch.testing.assert_close(
            pipeline_clip_grad_norm_(stage.parameters(), 0.5, tie=tie), expected_norm
        )
        for name, param in stage.named_parameters():
            wanted = moved(tie, param, expected_grads[name])
            torch.testing.assert_close(param.grad, wanted, msg=name)

    run_threads(3, rank_main)


def test_the_ties_buffers_are_made_on_the_stages_device_not_the_default_one() -> None:
    # As stages on cuda:1 under a default device of cpu: here CPU stages under a default
    # device of meta, whose tensors hold no values. The middle rank holds no copy.
    stages = stages_of(0, 3)
    grads = random_grads(stages, seed=13)
    total = grads[0]["emb.weight"] + grads[2]["emb.weight"]

    def rank_main(rank: int) -> torch.Tensor | None:
        stage = copy.deepcopy(stages[rank])
        if rank == 2:
            with torch.no_grad():
                stage.emb.weight.add_(1.0)  # set-up makes it the first copy again
        for name, param in stage.named_parameters():
            param.grad = grads[rank][name].clone()
        with torch.device("meta"):
            tie = PipelineTie(stage)
            tie.reduce_grads()
            tie.check()
        assert all(p.device.type == "cpu" for p in stage.parameters())
        return None if rank == 1 else stage.emb.weight.grad  # the middle holds no copy

    first, middle, last = run_threads(3, rank_main)
    torch.testing.assert_close(first, total, rtol=0, atol=0)
    assert middle is None
    assert last is None


# What reduce_grads() moves; training itself runs on gloo in tests/nn/distributed. --------------


def test_reduce_grads_without_gradients_keeps_none_and_again_moves_nothing(
    calls: dict[int, list[str]],
) -> None:
    torch.manual_seed(6)
    grads = [torch.randn(17, 8), torch.randn(17, 8)]
    stages = stages_of(0, 2)

    def rank_main(rank: int) -> None:
        stage = copy.deepcopy(stages[rank])
        tie = PipelineTie(stage, dist.group.WORLD)
        calls[rank].clear()
        tie.reduce_grads()
        assert calls[rank] == ["all_reduce"]
        assert all(p.grad is None for p in stage.parameters())
        stage.emb.weight.grad = grads[rank].clone()
        for _ in range(3):  # what one call has moved, the next moves no more
            calls[rank].clear()
            tie.reduce_grads()
            assert calls[rank] == ["all_reduce"]
            total = moved(tie, stage.emb.weight, grads[0] + grads[1])
            torch.testing.assert_close(stage.emb.weight.grad, total)

    run_threads(2, rank_main)


def test_dtensor_copies_are_summed_by_shard_into_a_first_copy_without_a_gradient(
    calls: dict[int, list[str]],
) -> None:
    # Rank dp * 2 + pp holds stage pp, its copy sharded over "dp" (17 rows: 9 and 8). FSDP2 sets
    # a reduce-scattered gradient on the sharded Parameter, as fsdp2_gradient does; training
    # under FSDP2 itself is tested below.
    stages = stages_of(0, 2)
    emb = initial_state()["emb.weight"]
    head_grad = torch.arange(17 * 8, dtype=torch.float32).view(17, 8)

    def fsdp2_gradient(param: nn.Parameter, local: torch.Tensor) -> None:
        param.grad = DTensor.from_local(
            local.clone(),
            param.device_mesh,
            param.placements,
            shape=param.shape,
            stride=param.stride(),
        )

    def rank_main(rank: int) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        pp = mesh["pp"].get_local_rank()
        stage = copy.deepcopy(stages[pp])
        shard = distribute_tensor(stage.emb.weight.detach() + pp, mesh["dp"], [Shard(0)])
        stage.emb.weight = nn.Parameter(shard)  # set-up must replace the last stage's copy
        weight = stage.emb.weight
        tie = PipelineTie(stage, mesh["pp"])
        assert weight.to_local().shape == ((9, 8) if mesh["dp"].get_local_rank() == 0 else (8, 8))
        torch.testing.assert_close(weight.full_tensor(), emb, rtol=0, atol=0)
        calls[rank].clear()
        tie.reduce_grads()  # no copy has a gradient: every copy keeps None
        assert calls[rank] == ["all_reduce"]
        assert weight.grad is None
        local = distribute_tensor(head_grad, mesh["dp"], [Shard(0)]).to_local()
        if pp == 1:  # only the head's copy has a gradient: the lookup's copy is given it
            fsdp2_gradient(weight, local)
        tie.reduce_grads()
        if pp == 1:  # the head's copy holds none, and takes part in the clip
            assert weight.grad is None
            norm = pipeline_clip_grad_norm_([weight], 0.5, group=mesh["pp"], tie=tie)
            torch.testing.assert_close(norm, torch.linalg.vector_norm(head_grad))
            return
        grad = weight.grad
        assert isinstance(grad, DTensor)
        assert (grad.device_mesh, grad.placements) == (weight.device_mesh, (Shard(0),))
        assert (grad.shape, grad.stride()) == ((17, 8), (8, 1))
        torch.testing.assert_close(grad.full_tensor(), head_grad, rtol=0, atol=0)
        # Clipping counts the tied weight once and returns a plain tensor, on every rank.
        norm = pipeline_clip_grad_norm_([weight], 0.5, group=mesh["pp"], tie=tie)
        assert type(norm) is torch.Tensor
        torch.testing.assert_close(norm, torch.linalg.vector_norm(head_grad))
        torch.testing.assert_close(grad.full_tensor(), head_grad * (0.5 / (norm + 1e-6)))

    run_threads(4, rank_main)


def test_float64_tied_weights_are_broadcast_and_summed_in_float64() -> None:
    # The middle stage holds no copy: it receives the set-up's and check()'s broadcasts into a
    # buffer of its own, which a real backend needs in the copies' dtype.
    stages = [stage.double() for stage in stages_of(0, 3)]
    small = torch.full((17, 8), 1e-12, dtype=torch.float64)

    def rank_main(rank: int) -> None:
        stage = copy.deepcopy(stages[rank])
        tie = PipelineTie(stage)
        if stage.emb is not None:
            grad = torch.ones_like(stage.emb.weight) if rank == 0 else small.clone()
            stage.emb.weight.grad = grad
        tie.reduce_grads()
        tie.check()
        if rank == 0:
            assert stage.emb.weight.grad.dtype == torch.float64
            assert torch.equal(stage.emb.weight.grad, 1.0 + small)

    assert not torch.equal(1.0 + small, (1.0 + small.float()).double())  # float32 would round
    assert stages[1].emb is None
    run_threads(3, rank_main)


def test_a_stage_local_tie_beside_placeholders_of_other_stages_is_tied_on_its_stage() -> None:
    # The first stage keeps an nn.Identity under the name of the last stage's own tied module.
    first, last = stages_of(0, 2)
    first.aux_emb = nn.Identity()
    last = with_aux(last)

    def rank_main(rank: int) -> str:
        tie = PipelineTie([first, last][rank])
        return repr(tie)

    assert run_threads(2, rank_main) == [
        "PipelineTie(names=['aux_emb', 'emb'], copies_on_this_rank={aux_emb: 0, emb: 1}, "
        "group_size=2)",
        "PipelineTie(names=['aux_emb', 'emb'], copies_on_this_rank={aux_emb: 1, emb: 1}, "
        "group_size=2)",
    ]


def test_a_rank_outside_the_ties_group_is_told_so() -> None:
    stages = stages_of(0, 2)

    def rank_main(rank: int) -> str | None:
        group = dist.new_group([0, 1])
        if rank < 2:
            PipelineTie(copy.deepcopy(stages[rank]), group)
            return None
        with pytest.raises(ValueError, match=r"^PipelineTie") as info:
            PipelineTie(copy.deepcopy(stages[rank - 2]), group)
        return str(info.value)

    assert run_threads(3, rank_main)[2] == (
        "PipelineTie was set up on global rank 2, which is not a rank of its group; set it up on "
        "the ranks of the group only, each with the group of its own pipeline, such as "
        'group=mesh["pp"]'
    )


def test_replicas_after_a_rank_without_a_copy_are_refused_on_every_rank() -> None:
    # A copy-less middle stage on group rank 0, then the last stage twice: group= forgotten.
    _first, middle, last = stages_of(0, 3)
    stages = [middle, last, last]

    def rank_main(rank: int) -> str:
        with pytest.raises(ValueError, match=r"^PipelineTie") as info:
            PipelineTie(copy.deepcopy(stages[rank]))
        return str(info.value)

    messages = run_threads(3, rank_main)
    assert messages == [messages[0]] * 3
    assert "group ranks 1 and 2" in messages[0]


def test_tied_modules_nested_in_the_stages_are_summed_as_one_weight() -> None:
    # The embedding at "trunk.emb" on both stages, as a model keeps it inside a decoder.
    stages = stages_of(0, 2)
    for stage in stages:
        stage.trunk = nn.Module()
        stage.trunk.emb = stage.emb
        del stage.emb
    stages[1].out.head = TiedLinear(stages[1].trunk.emb)
    torch.manual_seed(4)
    grads = [torch.randn(17, 8), torch.randn(17, 8)]

    def rank_main(rank: int) -> tuple[tuple[str, ...], torch.Tensor | None]:
        stage = copy.deepcopy(stages[rank])
        tie = PipelineTie(stage)
        stage.trunk.emb.weight.grad = grads[rank].clone()
        tie.reduce_grads()
        return tie.names, stage.trunk.emb.weight.grad

    (names, first), (_, last) = run_threads(2, rank_main)
    assert names == ("trunk.emb",)
    assert torch.equal(first, grads[0] + grads[1])  # type: ignore[arg-type]
    assert last is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_copies_one_bit_apart_on_two_ranks_are_refused_on_every_rank(dtype: torch.dtype) -> None:
    # The checksums ride the all_reduce in the gradients' dtype (float32 for float8): 8 bytes
    # a copy, each exact.
    stages = [stage.to(dtype) for stage in stages_of(0, 3)]

    # Any one bit of the last element flipped, the low bit (the next value) to the sign bit.
    bits_type = torch.int16 if dtype.itemsize == 2 else torch.int32
    flips = [torch.tensor(1 << bit).to(bits_type) for bit in range(8 * dtype.itemsize)]

    def rank_main(rank: int) -> list[str]:
        stage = copy.deepcopy(stages[rank])
        tie = PipelineTie(stage)
        tie.reduce_grads()  # equal: nothing to say
        messages = []
        for flip in flips:
            if rank == 2:
                bits = stage.emb.weight.data.view(bits_type)
                bits[16, 7] ^= flip
            with pytest.raises(RuntimeError) as info:
                tie.reduce_grads()
            messages.append(str(info.value))
            tie.broadcast()
            tie.reduce_grads()  # as it says: broadcast, and the copies are one again
        return messages

    messages = run_threads(3, rank_main)
    assert messages == [[messages[0][0]] * len(flips)] * 3
    assert messages[0][0] == (  # the one whole-message check of this error
        "PipelineTie.reduce_grads() found the copies of 'emb.weight' unequal: call "
        "tie.broadcast() after every optimizer.step() and non-DCP load; this step read an old "
        "copy, so zero the gradients, broadcast and redo it"
    )


def test_a_gradient_after_reduce_grads_on_one_rank_is_refused_on_every_rank_once() -> None:
    # The last stage's copy took a gradient after the sum was taken (a backward run late):
    # the step missed it. The first rank, whose copy is the weight, is told as well.
    stages = stages_of(0, 2)

    def rank_main(rank: int) -> tuple[str, torch.Tensor | None]:
        stage = copy.deepcopy(stages[rank])
        tie = PipelineTie(stage, dist.group.WORLD)
        tie.reduce_grads()
        if rank == 1:
            stage.emb.weight.grad = torch.ones_like(stage.emb.weight)  # the late backward's
        tie.broadcast()
        stage.emb.weight.grad = None  # optimizer.zero_grad()
        with pytest.raises(RuntimeError) as info:
            tie.reduce_grads()
        tie.reduce_grads()  # told once: the step redone is right
        return str(info.value), stage.emb.weight.grad

    message = (  # the one whole-message check of this error
        "PipelineTie.reduce_grads() found that a copy of a tied weight but the first held a "
        "gradient at the last broadcast(): a backward ran after reduce_grads(), or none was "
        "called, so the optimizer step missed that part of the tied gradient; call "
        "reduce_grads() after the last backward and broadcast() right after optimizer.step(), "
        "and redo that step"
    )
    assert run_threads(2, rank_main) == [(message, None)] * 2
