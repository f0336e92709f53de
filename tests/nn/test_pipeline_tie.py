"""PipelineTie and pipeline_clip_grad_norm_ in one process: every stage on a one-rank group."""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel

from tests.nn.distributed.pipeline_lm import (
    MAX_NORM,
    MICROBATCHES,
    STEPS,
    random_grads,
    reference_pipeline_training,
    split,
    stages_of,
    whole_clip,
    whole_model,
)
from tests.nn.distributed.tiny_lm import LR, batches, initial_state, loss_fn
from toolkit.nn import PipelineTie, TiedLinear, clip_grad_norm_, pipeline_clip_grad_norm_

pytestmark = pytest.mark.usefixtures("one_rank")
INF = float("inf")


def tied(module: nn.Module, *, registered: bool = True) -> nn.Module:
    """A stage whose TiedLinear ``head`` reads ``module``, registered as ``table`` or not."""
    stage = nn.Module()
    if registered:
        stage.table = module
    stage.head = TiedLinear(module)
    return stage


def last_without_emb() -> Any:
    first, last = stages_of(0, 2)
    last.emb = None  # type: ignore[assignment] # the head still reads the dropped copy
    return [first, last]


def buffer_weight() -> nn.Module:
    module = nn.Module()
    module.register_buffer("weight", torch.ones(3, 4))
    return tied(module)


def deleted_weight() -> nn.Module:
    stage = tied(nn.Embedding(5, 4))
    del stage.table.weight
    return stage


def other_shapes() -> list[nn.Module]:
    first, last = stages_of(0, 2)
    last.emb = nn.Embedding(5, 8)
    last.out.head = TiedLinear(last.emb)
    return [first, last]


UNREGISTERED = (
    "PipelineTie refused group rank 0's stages: its stage 1 has a TiedLinear at 'out.head' that "
    "reads Embedding(17, 8), a module not registered in that stage, so its weight would be "
    "neither trained, synchronised nor saved. Keep the tied module in the stage under its name "
    "in the whole model (do not set it to None or replace it) and let the TiedLinear read that "
    "copy, as a deep copy of the whole model does"
)
NOT_A_PARAMETER = (
    "PipelineTie refused group rank 0's stages: its tied module 'table' (Module()) has a weight "
    "that is not a Parameter but a Tensor; the stages share a trained weight, so tie to a module "
    "whose weight is a registered Parameter"
)
# Each refused set-up, and its error: once whole, else the facts it names.
REFUSED: dict[str, tuple[Callable[[], Any], str | tuple[str, ...]]] = {
    "unregistered": (last_without_emb, UNREGISTERED),
    "head-of-the-stage": (
        lambda: tied(nn.Embedding(5, 4), registered=False),
        ("stage 0", "at 'head'", "Embedding(5, 4)", "deep copy"),
    ),
    "no-tied-linear": (
        lambda: stages_of(0, 2)[0],
        "PipelineTie found no TiedLinear in the stages of any rank of the group; pass the stage "
        "modules that hold the tied module and the TiedLinear head",
    ),
    "bias": (
        lambda: tied(nn.Linear(4, 3)),
        "PipelineTie refused group rank 0's stages: its tied module 'table' (Linear(in_features=4, "
        "out_features=3, bias=True)) has parameters other than its weight: ['bias']; only the "
        "weight is shared between stages, so tie to a module whose only parameter is the weight",
    ),
    "buffer": (buffer_weight, NOT_A_PARAMETER),
    "deleted": (deleted_weight, ("'table'", "not a Parameter but a NoneType")),
    "shapes": (
        other_shapes,
        "PipelineTie needs every copy of the tied weight 'emb.weight' to have one shape, but "
        "group rank 0 has (17, 8) and group rank 0 has (5, 8); build every stage from the same "
        "model",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_stage_the_tie_cannot_keep_equal_is_refused_with_the_fix(case: str) -> None:
    make, expected = REFUSED[case]
    with pytest.raises(ValueError, match=r"^PipelineTie") as info:
        PipelineTie(make())
    message = " ".join(str(info.value).split())
    if isinstance(expected, str):
        assert message == expected
    for fact in () if isinstance(expected, str) else expected:
        assert fact in message


def test_a_two_dimensional_mesh_is_refused_and_its_pipeline_dimension_accepted(
    one_rank: DeviceMesh,
) -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "pp"))
    with pytest.raises(ValueError, match=r"^PipelineTie") as info:
        PipelineTie(stages_of(0, 2), mesh)
    assert str(info.value) == (
        "PipelineTie needs a 1-D DeviceMesh of the pipeline ranks, got a 2-D mesh; pass the "
        'pipeline dimension, such as mesh["pp"]'
    )
    assert PipelineTie(stages_of(0, 2), mesh["pp"]).names == ("emb",)
    assert PipelineTie(stages_of(0, 2), one_rank).names == ("emb",)


def test_set_up_and_broadcast_make_every_copy_the_first() -> None:
    first, last = stages_of(0, 2)
    other = initial_state(seed=1)["emb.weight"]
    last.emb.weight.data.copy_(other)
    tie = PipelineTie([first, last])
    assert tie.names == ("emb",)
    assert tie.group is dist.group.WORLD
    assert torch.equal(last.emb.weight, first.emb.weight)
    assert not torch.equal(first.emb.weight, other)
    assert last.out.head.weight is last.emb.weight  # still the last stage's own copy
    assert repr(tie) == "PipelineTie(names=['emb'], copies_on_this_rank={emb: 2}, group_size=1)"
    last.load_state_dict(split(whole_model(initial_state(seed=2)), 1, 2).state_dict())
    assert not torch.equal(first.emb.weight, last.emb.weight)
    tie.broadcast()
    assert torch.equal(first.emb.weight, last.emb.weight)


def test_a_stage_whose_only_parameter_is_the_tied_weight_takes_its_gradient() -> None:
    stage = tied(nn.Embedding(5, 3))
    tie = PipelineTie(stage)
    x = torch.randn(2, 3)
    stage.head(x).sum().backward()
    tie.reduce_grads()
    torch.testing.assert_close(stage.table.weight.grad, torch.ones(2, 5).T @ x)


def test_the_check_names_the_first_difference_and_the_fix() -> None:
    first, last = stages_of(0, 2)
    tie = PipelineTie([first, last])
    tie.check()  # equal: no error
    with torch.no_grad():
        last.emb.weight[3, 2] = 7.0
        last.emb.weight[5, 0] = 7.0
    expected = first.emb.weight[3, 2].item()
    with pytest.raises(RuntimeError) as info:
        tie.check()
    assert str(info.value) == (
        "the copies of the tied weight 'emb.weight' differ: copy 1 on group rank 0 has 7.0 at "
        f"index (3, 2), where the first copy on group rank 0 has {expected!r} (2 of 136 "
        "elements differ). Call PipelineTie.broadcast() after every optimizer step and after "
        "loading a state dict other than with DCP"
    )


@pytest.mark.parametrize("before_set_up", [False, True])
def test_a_copy_frozen_alone_is_refused_and_nothing_changes(before_set_up: bool) -> None:
    # One model has one tied Parameter, frozen or trained: a stage that froze its copy while
    # another trains it has no one-process result.
    first, last = stages_of(0, 2)
    first.emb.weight.requires_grad_(not before_set_up)
    tie = PipelineTie([first, last])
    first.emb.weight.requires_grad_(False)  # the lookup's copy only
    last.emb.weight.grad = torch.full_like(last.emb.weight, 2.0)
    with pytest.raises(ValueError, match=r"^PipelineTie") as info:
        tie.reduce_grads()
    assert "'emb.weight'" in str(info.value)
    assert "requires_grad_" in str(info.value)
    assert first.emb.weight.grad is None
    assert torch.equal(last.emb.weight.grad, torch.full_like(last.emb.weight, 2.0))
    first.emb.weight.requires_grad_(True)  # trained alike again: summed as one weight
    tie.reduce_grads()
    assert torch.equal(first.emb.weight.grad, torch.full_like(first.emb.weight, 2.0))


def two_stage_loss(first: nn.Module, last: nn.Module) -> torch.Tensor:
    return last(first(torch.tensor([[1, 2, 3]]))).square().sum()  # type: ignore[no-any-return]


def whole_gradient(backward_passes: int = 1) -> torch.Tensor:
    """The tied weight's gradient of ``backward_passes`` of ``two_stage_loss`` in one process."""
    whole = whole_model(initial_state())
    (backward_passes * whole(torch.tensor([[1, 2, 3]])).square().sum()).backward()
    return whole.emb.weight.grad  # type: ignore[return-value]


@pytest.mark.parametrize("calls", ["each", "once", "twice"])
def test_the_first_copy_takes_every_gradient_once_and_the_others_none(calls: str) -> None:
    # Three copies on one rank; the second backward's gradient of the last copy is added by hand,
    # as no autograd hook would see it: what reduce_grads() moved, it moves no more.
    first, last = stages_of(0, 2)
    third = deepcopy(last)
    tie = PipelineTie([first, last, third])
    for step in range(2):
        two_stage_loss(first, last).backward()
        third.out.head(torch.ones(1, 8)).sum().backward()
        if step == 1:
            last.emb.weight.grad += torch.ones(17, 8)  # type: ignore[operator, union-attr]
        if calls == "each":
            tie.reduce_grads()
    for _ in range({"each": 0, "once": 1, "twice": 2}[calls]):
        tie.reduce_grads()
    expected = whole_gradient(2) + 3 * torch.ones(17, 8)  # the third's head: all ones, twice
    torch.testing.assert_close(first.emb.weight.grad, expected)
    assert last.emb.weight.grad is None
    assert third.emb.weight.grad is None
    assert [id(p) for p in tie.duplicates()] == [id(last.emb.weight), id(third.emb.weight)]


def test_a_backward_of_a_forward_run_before_reduce_grads_counts_once() -> None:
    # A loop that runs both forwards, then reduces between the two backward passes.
    first, last = stages_of(0, 2)
    tie = PipelineTie([first, last])
    early, late = two_stage_loss(first, last), two_stage_loss(first, last)
    early.backward()
    tie.reduce_grads()
    late.backward()
    tie.reduce_grads()
    torch.testing.assert_close(first.emb.weight.grad, whole_gradient(2))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_copies_take_one_weights_steps_and_the_others_no_optimizer_state(
    set_to_none: bool,
) -> None:
    first, last = stages_of(0, 2)
    tie = PipelineTie([first, last])
    whole = whole_model(initial_state())
    ours = torch.optim.AdamW([*first.parameters(), *last.parameters()], lr=0.1, weight_decay=0.5)
    theirs = torch.optim.AdamW(whole.parameters(), lr=0.1, weight_decay=0.5)
    tie.broadcast()  # before any step, and twice after each: the copies are one weight either way
    for _ in range(3):
        ours.zero_grad(set_to_none=set_to_none)
        theirs.zero_grad(set_to_none=set_to_none)
        two_stage_loss(first, last).backward()
        whole(torch.tensor([[1, 2, 3]])).square().sum().backward()
        tie.reduce_grads()
        ours.step()
        theirs.step()
        tie.broadcast()
        tie.broadcast()
    for stage in (first, last):
        torch.testing.assert_close(stage.emb.weight, whole.emb.weight)
    assert last.emb.weight not in ours.state  # 2 moments the size of the weight, saved
    assert first.emb.weight in ours.state
    tie.check()


def test_a_forgotten_broadcast_is_refused_and_nothing_changes() -> None:
    # The old contract's loop: no broadcast() after the step, which moved the first copy only.
    first, last = stages_of(0, 2)
    tie = PipelineTie([first, last])
    optimizer = torch.optim.SGD([*first.parameters(), *last.parameters()], lr=0.1)
    two_stage_loss(first, last).backward()
    tie.reduce_grads()
    optimizer.step()
    optimizer.zero_grad()
    two_stage_loss(first, last).backward()
    before = [p.grad.clone() for p in (first.emb.weight, last.emb.weight)]  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=r"tie\.broadcast\(\)") as info:
        tie.reduce_grads()
    assert "'emb.weight'" in str(info.value)
    assert all(
        torch.equal(p.grad, g)  # type: ignore[arg-type]
        for p, g in zip((first.emb.weight, last.emb.weight), before, strict=True)
    )
    # As it says: zeroed, broadcast and redone, the step is right.
    optimizer.zero_grad()
    tie.broadcast()
    two_stage_loss(first, last).backward()
    tie.reduce_grads()
    tie.check()


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    ],
)
def test_copies_one_bit_apart_are_told_apart_in_every_dtype(dtype: torch.dtype) -> None:
    first, last = (stage.to(dtype) for stage in stages_of(0, 2))
    tie = PipelineTie([first, last])
    tie.reduce_grads()  # equal: nothing to say
    bits = last.emb.weight.data.view(-1).view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    )
    bits[5] += 1  # the next value of one element
    with pytest.raises(RuntimeError, match=r"tie\.broadcast\(\)"):
        tie.reduce_grads()
    tie.broadcast()
    tie.reduce_grads()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_copies_gradients_are_summed_in_float32_and_rounded_once(dtype: torch.dtype) -> None:
    first, last = (stage.to(dtype) for stage in stages_of(0, 2))
    tie = PipelineTie([first, last])
    grads = [torch.full((17, 8), 0.3).to(dtype), torch.full((17, 8), 0.4).to(dtype)]
    first.emb.weight.grad, last.emb.weight.grad = (g.clone() for g in grads)  # type: ignore[union-attr]
    tie.reduce_grads()
    expected = (grads[0].float() + grads[1].float()).to(dtype)
    assert torch.equal(first.emb.weight.grad.view(torch.uint8), expected.view(torch.uint8))  # type: ignore[union-attr]
    assert last.emb.weight.grad is None  # type: ignore[union-attr]


def test_copies_viewing_a_flat_buffer_at_any_offset_are_checked() -> None:
    # As parameters packed in one buffer are: each copy's storage starts 4 bytes past a word.
    first, last = stages_of(0, 2)
    for stage in (first, last):
        weight = stage.emb.weight  # type: ignore[union-attr]
        flat = torch.zeros(1 + weight.numel())
        flat[1:] = weight.detach().view(-1)
        stage.emb.weight = nn.Parameter(flat[1:].view(weight.shape))  # type: ignore[union-attr]
    tie = PipelineTie([first, last])
    two_stage_loss(first, last).backward()
    tie.reduce_grads()
    torch.testing.assert_close(first.emb.weight.grad, whole_gradient())
    with torch.no_grad():
        last.emb.weight[3, 5] += 1  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=r"tie\.broadcast\(\)"):
        tie.reduce_grads()


def test_a_backward_after_reduce_grads_is_refused_at_the_next_once() -> None:
    # Its gradient reached the last copy after the sum was taken: the step missed it.
    first, last = stages_of(0, 2)
    tie = PipelineTie([first, last])
    optimizer = torch.optim.SGD([*first.parameters(), *last.parameters()], lr=0.1)
    two_stage_loss(first, last).backward()
    tie.reduce_grads()
    last.out.head(torch.ones(1, 8)).sum().backward()
    optimizer.step()
    tie.broadcast()
    optimizer.zero_grad()
    with pytest.raises(RuntimeError, match=r"after reduce_grads\(\)"):
        tie.reduce_grads()
    tie.reduce_grads()  # told once: the step redone is right


def test_a_loop_without_reduce_grads_is_refused_at_the_next_step() -> None:
    # The step trained each copy on its own part of the gradient; broadcast() kept the first's.
    first, last = stages_of(0, 2)
    tie = PipelineTie([first, last])
    optimizer = torch.optim.SGD([*first.parameters(), *last.parameters()], lr=0.1)
    two_stage_loss(first, last).backward()
    optimizer.step()
    tie.broadcast()
    optimizer.zero_grad()
    two_stage_loss(first, last).backward()
    with pytest.raises(RuntimeError, match=r"reduce_grads\(\) after the last backward"):
        tie.reduce_grads()
    assert last.emb.weight.grad is not None  # type: ignore[union-attr] # nothing moved


@pytest.mark.parametrize("compiled", [0, 1])
def test_a_stage_wrapped_by_torch_compile_is_tied_by_the_whole_models_names(compiled: int) -> None:
    # torch.compile(stage) holds the stage as `_orig_mod`: its names are not the whole model's.
    stages = stages_of(0, 2)
    passed = [torch.compile(s) if i == compiled else s for i, s in enumerate(stages)]
    tie = PipelineTie(passed)  # type: ignore[arg-type] # an OptimizedModule is a Module
    assert tie.names == ("emb",)
    assert [id(p) for p in tie.duplicates()] == [id(stages[1].emb.weight)]  # type: ignore[union-attr]
    two_stage_loss(*stages).backward()  # the wrapper's forward runs the same Parameters
    tie.reduce_grads()
    torch.testing.assert_close(stages[0].emb.weight.grad, whole_gradient())


def test_a_tied_module_inside_a_torch_compile_wrapper_is_refused_with_the_fix() -> None:
    first, last = stages_of(0, 2)
    last.emb = torch.compile(last.emb)  # type: ignore[assignment] # its copy: 'emb._orig_mod'
    with pytest.raises(ValueError, match=r"\.compile\(\)") as info:
        PipelineTie([first, last])
    assert "'emb._orig_mod'" in str(info.value)


@pytest.mark.parametrize("norm_type", [INF, -INF, 2.0])
def test_one_rank_treats_a_gradient_without_elements_as_torch(norm_type: float) -> None:
    def params() -> list[nn.Parameter]:
        full, empty = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(0))
        full.grad, empty.grad = torch.full((3,), 2.0), torch.ones(0)
        return [full, empty]

    try:
        expected: Any = torch.nn.utils.clip_grad_norm_(params(), 1.0, norm_type)
    except RuntimeError as error:
        expected = type(error)
    try:
        result: Any = pipeline_clip_grad_norm_(params(), 1.0, norm_type)
    except RuntimeError as error:
        result = type(error)
    assert (result == expected) if isinstance(expected, type) else torch.equal(result, expected)


def test_a_second_tie_on_the_same_copies_moves_nothing_twice() -> None:
    # What the first tie moved into the first copy, the second finds there alone.
    first, last = stages_of(0, 2)
    ties = [PipelineTie([first, last]), PipelineTie([first, last])]
    two_stage_loss(first, last).backward()
    for tie in ties:
        tie.reduce_grads()
    torch.testing.assert_close(first.emb.weight.grad, whole_gradient())
    assert last.emb.weight.grad is None


# Both stages on this rank under a looped schedule: the whole model, without communication. ----

LOOPED = [ScheduleLoopedBFS, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble]


def looped_training(schedule_type: Any, *, broadcast: bool) -> dict[str, Any]:
    stages = stages_of(0, 2)
    tie = PipelineTie(stages)
    schedule = schedule_type(
        [PipelineStage(s, i, 2, torch.device("cpu")) for i, s in enumerate(stages)],
        n_microbatches=MICROBATCHES,
        loss_fn=loss_fn,
    )
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    losses, norms, counts = [], [], []
    for idx, targets in batches(2, STEPS):
        opt.zero_grad()
        step_losses: list[torch.Tensor] = []
        schedule.step(idx, target=targets, losses=step_losses)
        with CommDebugMode() as comm:
            tie.reduce_grads()
            norms.append(pipeline_clip_grad_norm_(params, MAX_NORM, tie=tie).item())
        counts.append(comm.get_total_counts())
        opt.step()
        if broadcast:
            tie.broadcast()
        losses.append([loss.item() for loss in step_losses])
    state = {**stages[1].state_dict(), **stages[0].state_dict()}
    return {"losses": losses, "norms": norms, "counts": counts, "tie": tie, "state": state}


@pytest.mark.parametrize("schedule_type", LOOPED, ids=lambda s: s.__name__)
def test_two_stages_on_one_rank_train_as_one_model_without_communication(
    schedule_type: Any,
) -> None:
    expected = reference_pipeline_training()
    result = looped_training(schedule_type, broadcast=True)
    assert result["counts"] == [0] * STEPS
    assert min(expected["norms"]) > MAX_NORM  # clipping changed every step
    close = {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(result["losses"], expected["losses"], **close)
    torch.testing.assert_close(result["norms"], expected["norms"], **close)
    assert sorted(result["state"]) == sorted(expected["state"])
    for key, value in expected["state"].items():
        torch.testing.assert_close(result["state"][key], value, **close, msg=key)
    result["tie"].check()


def test_the_old_loop_without_the_broadcast_is_refused_at_its_second_step() -> None:
    with pytest.raises(RuntimeError, match=r"tie\.broadcast\(\) after every optimizer\.step\(\)"):
        looped_training(ScheduleLoopedBFS, broadcast=False)


def test_wrapped_stages_and_a_stage_without_a_copy_are_tied_by_the_whole_models_names() -> None:
    first, last = stages_of(0, 2)
    tie = PipelineTie([DistributedDataParallel(first), DistributedDataParallel(last)])
    assert tie.names == ("emb",)
    assert [id(w) for w in tie.duplicates()] == [id(last.emb.weight)]
    first, middle, last = (split(whole_model(initial_state()), i, 3) for i in range(3))
    assert middle.emb is None
    tie = PipelineTie([first, middle, last])
    assert repr(tie) == "PipelineTie(names=['emb'], copies_on_this_rank={emb: 2}, group_size=1)"
    assert [id(w) for w in tie.duplicates()] == [id(last.emb.weight)]
    two = nn.Module()
    two.words, two.tags = nn.Embedding(6, 4), nn.Embedding(3, 4)
    two.word_head, two.tag_head = TiedLinear(two.words), TiedLinear(two.tags)
    assert repr(PipelineTie(two)) == (
        "PipelineTie(names=['tags', 'words'], copies_on_this_rank={tags: 1, words: 1}, "
        "group_size=1)"
    )


# pipeline_clip_grad_norm_ on one rank. --------------------------------------------------------


@pytest.mark.parametrize("norm_type", [2.0, 1.0, INF])
def test_clipping_counts_the_tied_weight_once(norm_type: float) -> None:
    stages = stages_of(0, 2)
    tie = PipelineTie(stages)
    grads = random_grads(stages, seed=3)
    expected_norm, expected_grads = whole_clip(stages, grads, norm_type)
    for stage, stage_grads in zip(stages, grads, strict=True):
        for name, param in stage.named_parameters():
            param.grad = stage_grads[name].clone()
    tie.reduce_grads()
    params = [p for stage in stages for p in stage.parameters()]
    torch.testing.assert_close(
        pipeline_clip_grad_norm_(params, 0.5, norm_type, tie=tie), expected_norm
    )
    duplicates = list(tie.duplicates())
    for stage in stages:
        for name, param in stage.named_parameters():
            wanted = None if any(param is d for d in duplicates) else expected_grads[name]
            torch.testing.assert_close(param.grad, wanted, msg=name)


@pytest.mark.parametrize("clip", [clip_grad_norm_, pipeline_clip_grad_norm_])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, None], ids=str)
def test_one_rank_without_a_tie_clips_as_torch(clip: Any, dtype: torch.dtype | None) -> None:
    """Every parameter counts; the pipeline's norm is float32 for bfloat16; no gradient, zero."""
    torch.manual_seed(4)
    layer, twin = (nn.Linear(8, 8, dtype=dtype) for _ in range(2))
    for param, copy in zip(layer.parameters(), twin.parameters(), strict=True):
        if dtype is not None:
            copy.grad = torch.randn_like(param)
            param.grad = copy.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
    norm = clip(layer.parameters(), 0.5, error_if_nonfinite=True)
    assert norm.dtype == (torch.float32 if clip is pipeline_clip_grad_norm_ else expected.dtype)
    torch.testing.assert_close(norm.float(), expected.float(), rtol=1e-2 if dtype else 0, atol=0)
    assert (norm > 0.5) == (dtype is not None)
    for param, copy in zip(layer.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(param.grad, copy.grad)


def test_foreach_true_where_no_foreach_kernel_exists_is_refused_as_by_torch() -> None:
    weight = nn.Parameter(torch.ones(3, device="meta"))
    weight.grad = torch.ones(3, device="meta")
    with pytest.raises(RuntimeError, match="foreach=True was passed") as theirs:
        torch.nn.utils.clip_grad_norm_(weight, 1.0, foreach=True, error_if_nonfinite=True)
    for clip in (clip_grad_norm_, pipeline_clip_grad_norm_):
        with pytest.raises(RuntimeError, match="foreach=True was passed") as ours:
            clip(weight, 1.0, foreach=True, error_if_nonfinite=True)
        assert str(ours.value) == str(theirs.value)


def test_clipping_before_reduce_grads_is_refused_and_changes_nothing() -> None:
    # The last stage's copy still holds its part of the tied gradient, which the norm would miss.
    stages = stages_of(0, 2)
    tie = PipelineTie(stages)
    two_stage_loss(*stages).backward()
    params = [p for stage in stages for p in stage.parameters()]
    before = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=r"reduce_grads\(\)") as info:
        pipeline_clip_grad_norm_(params, 1e-3, tie=tie)
    assert str(info.value) == (  # the one whole-message check of this error
        "pipeline_clip_grad_norm_ was called before PipelineTie.reduce_grads(): a copy of the "
        "tied weight but the first still holds its part of the gradient, which the norm would "
        "leave out; call tie.reduce_grads() on every rank first"
    )
    for param, grad in zip(params, before, strict=True):
        assert torch.equal(param.grad, grad)  # type: ignore[arg-type]
    tie.reduce_grads()
    pipeline_clip_grad_norm_(params, 1e-3, tie=tie)  # then it clips


def test_clipping_over_a_two_dimensional_mesh_is_refused_and_its_pipeline_dimension_accepted(
    one_rank: DeviceMesh,
) -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "pp"))
    layer = nn.Linear(3, 2)
    grads = [torch.full_like(param, 2.0) for param in layer.parameters()]
    for param, grad in zip(layer.parameters(), grads, strict=True):
        param.grad = grad.clone()
    with pytest.raises(ValueError, match=r"^pipeline_clip_grad_norm_") as info:
        pipeline_clip_grad_norm_(layer.parameters(), 1.0, group=mesh)
    assert str(info.value) == (  # the one whole-message check of this error
        "pipeline_clip_grad_norm_ needs a 1-D DeviceMesh of the pipeline ranks, got a 2-D "
        'mesh; pass the pipeline dimension, such as mesh["pp"]'
    )
    for param, grad in zip(layer.parameters(), grads, strict=True):
        assert torch.equal(param.grad, grad)  # type: ignore[arg-type] # nothing scaled
    expected = torch.nn.utils.get_total_norm(grads)
    norm = pipeline_clip_grad_norm_(layer.parameters(), 1e9, group=mesh["pp"])
    torch.testing.assert_close(norm, expected)


def test_a_copy_replaced_after_set_up_is_refused_beside_copies_that_were_not() -> None:
    # Two tied weights; only the first in name order, aux_emb, was replaced after the tie.
    first, last = stages_of(0, 2)
    last.aux_emb = nn.Embedding(5, 8)
    last.aux = TiedLinear(last.aux_emb)
    tie = PipelineTie([first, last])
    assert tie.names == ("aux_emb", "emb")
    last.aux_emb.weight = nn.Parameter(torch.zeros(5, 8))
    two_stage_loss(first, last).backward()
    with pytest.raises(ValueError, match="Parameter is not the one the tie was built with"):
        tie.reduce_grads()


def test_fsdp2_stages_sharded_after_the_tie_or_unsharded_at_set_up_are_refused(
    one_rank: DeviceMesh,
) -> None:
    first, last = stages_of(0, 2)
    tie = PipelineTie([first, last])
    fully_shard(last, mesh=one_rank)
    with pytest.raises(ValueError, match="after wrapping the stages"):
        tie.reduce_grads()
    first, last = stages_of(0, 2)
    fully_shard(last, mesh=one_rank, reshard_after_forward=False)
    last(first(torch.tensor([[1, 2, 3]])))  # leaves the last stage unsharded
    with pytest.raises(ValueError, match="before the stages' first forward"):
        PipelineTie([first, last])


def test_fsdp2_stages_nested_in_a_model_kept_unsharded_after_backward_are_summed(
    one_rank: DeviceMesh,
) -> None:
    # Each stage sits at "inner" of a module of its own, FSDP2 on the stage and not on the
    # outer module: the tie finds the FSDP2 module that holds "inner.emb" on its path.
    first, last = stages_of(0, 2)
    outers = []
    for stage in (first, last):
        fully_shard(stage, mesh=one_rank)
        stage.set_reshard_after_backward(False)
        outers.append(nn.Module())
        outers[-1].inner = stage
    tie = PipelineTie(outers)
    assert tie.names == ("inner.emb",)
    sharded = first.emb.weight  # the Parameter the optimizer steps, shown until a forward
    for _ in range(2):  # the tie reads the sharded gradients: FSDP2 needs no reshard first
        two_stage_loss(first, last).backward()
        tie.reduce_grads()
    assert first.emb.weight is not sharded  # kept unsharded after backward
    torch.testing.assert_close(sharded.grad.full_tensor(), whole_gradient(2))  # type: ignore[union-attr]
    assert all(p.grad is None for p in tie.duplicates())
