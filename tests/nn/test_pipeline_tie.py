"""PipelineTie in one process: set-up errors, the check, and two stages held by one rank.

A one-rank gloo group is enough for everything that needs no second rank: a looped schedule
puts both stages of the tiny tied LM on this rank, where the tie needs no communication.
The multi-rank cases are in ``tests/nn/distributed/pipeline_checks.py``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from copy import deepcopy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleLoopedBFS
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel

from tests.nn.distributed.pipeline_lm import (
    MAX_NORM,
    MICROBATCHES,
    STEPS,
    StageLM,
    reference_pipeline_training,
    split,
    whole_model,
)
from tests.nn.distributed.tiny_lm import LR, batches, initial_state, loss_fn
from toolkit.nn import PipelineTie, TiedLinear, clip_grad_norm_, pipeline_clip_grad_norm_


@pytest.fixture(autouse=True, scope="module")
def one_rank() -> Iterator[None]:
    """A default process group of this process alone."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def two_stages(seed: int = 0) -> list[StageLM]:
    model = whole_model(initial_state(seed=seed))
    return [split(model, i, 2) for i in range(2)]


def refused(stages: Any) -> str:
    with pytest.raises(ValueError, match=r"^PipelineTie") as info:
        PipelineTie(stages)
    return " ".join(str(info.value).split())


def test_a_head_reading_an_unregistered_embedding_is_refused() -> None:
    _, last = two_stages()
    head_module = last.emb
    last.emb = None  # type: ignore[assignment]
    assert last.out.head.tied_module is head_module  # the head still reads the dropped copy
    assert refused(last) == (
        "PipelineTie refused group rank 0's stages: its stage 0 has a TiedLinear at "
        "'out.head' that reads Embedding(17, 8), a module not registered in that stage, so "
        "its weight would be neither trained, synchronised nor saved. Keep the tied module in "
        "the stage under its name in the whole model (do not set it to None or replace it) "
        "and let the TiedLinear read that copy, as a deep copy of the whole model does"
    )


def test_the_stage_index_named_is_the_one_refused() -> None:
    first, last = two_stages()
    last.emb = None  # type: ignore[assignment]
    assert "its stage 1 has a TiedLinear at 'out.head'" in refused([first, last])


def test_stages_without_a_tied_linear_are_refused() -> None:
    first, _ = two_stages()
    assert refused(first) == (
        "PipelineTie found no TiedLinear in the stages of any rank of the group; pass the "
        "stage modules that hold the tied module and the TiedLinear head"
    )


class LinearTied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.head = TiedLinear(self.proj)


def test_a_tied_module_with_more_than_its_weight_is_refused() -> None:
    assert refused(LinearTied()) == (
        "PipelineTie refused group rank 0's stages: its tied module 'proj' "
        "(Linear(in_features=4, out_features=3, bias=True)) has parameters other than its "
        "weight: ['bias']; only the weight is shared between stages, so tie to a module whose "
        "only parameter is the weight"
    )


class BufferWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.ones(3, 4))


class BufferTied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = BufferWeight()
        self.head = TiedLinear(self.table)


def test_a_tied_module_whose_weight_is_not_a_parameter_is_refused() -> None:
    assert refused(BufferTied()) == (
        "PipelineTie refused group rank 0's stages: its tied module 'table' (BufferWeight()) "
        "has a weight that is not a Parameter but a Tensor; the stages share a trained weight, "
        "so tie to a module whose weight is a registered Parameter"
    )


def test_copies_of_different_shapes_on_one_rank_are_refused() -> None:
    first, last = two_stages()
    last.emb = nn.Embedding(5, 8)
    last.out.head = TiedLinear(last.emb)
    assert refused([first, last]) == (
        "PipelineTie refused group rank 0's stages: its copies of 'emb' differ in shape; "
        "build every stage from the same model"
    )


def test_a_two_dimensional_mesh_is_refused() -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "pp"))
    with pytest.raises(ValueError, match=r"^PipelineTie needs a 1-D") as info:
        PipelineTie(two_stages(), mesh)
    assert str(info.value) == (
        "PipelineTie needs a 1-D DeviceMesh of the pipeline ranks, got a 2-D mesh; pass the "
        'pipeline dimension, such as mesh["pp"]'
    )
    assert PipelineTie(two_stages(), mesh["pp"]).names == ("emb",)


def test_set_up_makes_the_copies_equal_to_the_first() -> None:
    first, last = two_stages()
    other = initial_state(seed=1)["emb.weight"]
    last.emb.weight.data.copy_(other)
    tie = PipelineTie([first, last])
    assert tie.names == ("emb",)
    torch.testing.assert_close(last.emb.weight, first.emb.weight, rtol=0, atol=0)
    assert not torch.equal(first.emb.weight, other)
    assert last.out.head.weight is last.emb.weight  # still the last stage's own copy
    assert repr(tie) == "PipelineTie(names=['emb'], copies_on_this_rank={emb: 2}, group_size=1)"


def test_broadcast_after_a_load_makes_the_copies_equal_again() -> None:
    first, last = two_stages()
    tie = PipelineTie([first, last])
    last.load_state_dict(split(whole_model(initial_state(seed=2)), 1, 2).state_dict())
    assert not torch.equal(first.emb.weight, last.emb.weight)
    tie.broadcast()
    assert torch.equal(first.emb.weight, last.emb.weight)


def test_the_check_names_the_first_difference() -> None:
    first, last = two_stages()
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
        "elements differ). Call PipelineTie.reduce_grads() after every backward and before the "
        "optimizer step, and broadcast() after loading a state dict other than with DCP"
    )


def test_reduce_grads_sums_the_copies_and_fills_a_missing_gradient() -> None:
    first, last = two_stages()
    tie = PipelineTie([first, last])
    first.emb.weight.grad = torch.full_like(first.emb.weight, 2.0)
    tie.reduce_grads()
    assert torch.equal(last.emb.weight.grad, torch.full_like(last.emb.weight, 2.0))
    last.emb.weight.grad = torch.full_like(last.emb.weight, 3.0)
    tie.reduce_grads()
    assert torch.equal(first.emb.weight.grad, torch.full_like(first.emb.weight, 5.0))
    assert torch.equal(last.emb.weight.grad, torch.full_like(last.emb.weight, 5.0))
    assert first.emb.weight.grad is not last.emb.weight.grad


def test_a_copy_frozen_alone_is_given_the_sum_and_the_copies_stay_equal() -> None:
    first, last = two_stages()
    tie = PipelineTie([first, last])
    first.emb.weight.requires_grad_(False)  # the lookup's copy only
    last.emb.weight.grad = torch.full_like(last.emb.weight, 2.0)
    for _ in range(2):
        tie.reduce_grads()
        assert torch.equal(first.emb.weight.grad, torch.full_like(first.emb.weight, 2.0))
        assert torch.equal(last.emb.weight.grad, torch.full_like(last.emb.weight, 2.0))
    torch.optim.SGD([*first.parameters(), *last.parameters()], lr=0.1).step()
    tie.check()


def looped_training(*, sum_grads: bool) -> dict[str, Any]:
    """Both stages on this rank under ScheduleLoopedBFS, trained with clipping."""
    stages = two_stages()
    tie = PipelineTie(stages)
    schedule = ScheduleLoopedBFS(
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
            if sum_grads:
                tie.reduce_grads()
            norms.append(pipeline_clip_grad_norm_(params, MAX_NORM, tie=tie).item())
        counts.append(comm.get_total_counts())
        opt.step()
        losses.append([loss.item() for loss in step_losses])
    first, last = stages
    state = {**last.state_dict(), **first.state_dict()}
    return {"losses": losses, "norms": norms, "counts": counts, "tie": tie, "state": state}


def test_two_stages_on_one_rank_train_as_one_model_without_communication() -> None:
    expected = reference_pipeline_training()
    result = looped_training(sum_grads=True)
    assert result["counts"] == [0] * STEPS
    torch.testing.assert_close(result["losses"], expected["losses"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result["norms"], expected["norms"], rtol=1e-5, atol=1e-6)
    assert min(expected["norms"]) > MAX_NORM  # clipping changed every step
    assert sorted(result["state"]) == sorted(expected["state"])
    for key, value in expected["state"].items():
        torch.testing.assert_close(result["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    result["tie"].check()


def test_without_the_gradient_sum_the_copies_drift_apart() -> None:
    result = looped_training(sum_grads=False)
    with pytest.raises(RuntimeError, match=re.escape("copies of the tied weight 'emb.weight'")):
        result["tie"].check()


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clipping_counts_the_tied_weight_once(norm_type: float) -> None:
    first, last = two_stages()
    tie = PipelineTie([first, last])
    torch.manual_seed(3)
    for param in [*first.parameters(), *last.parameters()]:
        param.grad = torch.randn_like(param)
    last.emb.weight.grad = first.emb.weight.grad.clone()  # as after reduce_grads
    # The whole model's parameters, each once: the first stage's, then the last's others.
    (emb_name, _), *others = last.named_parameters()
    assert emb_name == "emb.weight"
    unique = [*first.parameters(), *(p for _, p in others)]
    whole = [p.detach().clone().requires_grad_() for p in unique]
    for param, copy in zip(unique, whole, strict=True):
        copy.grad = param.grad.clone()  # type: ignore[union-attr]
    expected = torch.nn.utils.clip_grad_norm_(whole, 0.5, norm_type)
    assert expected > 0.5
    norm = pipeline_clip_grad_norm_(
        [*first.parameters(), *last.parameters()], 0.5, norm_type, tie=tie
    )
    torch.testing.assert_close(norm, expected)
    for param, copy in zip(unique, whole, strict=True):
        torch.testing.assert_close(param.grad, copy.grad)
    torch.testing.assert_close(last.emb.weight.grad, first.emb.weight.grad)


def test_clipping_a_stage_without_a_copy_counts_every_parameter() -> None:
    torch.manual_seed(4)
    middle = nn.Linear(8, 8)
    copy = nn.Linear(8, 8)
    copy.load_state_dict(middle.state_dict())
    for param, twin in zip(middle.parameters(), copy.parameters(), strict=True):
        param.grad = torch.randn_like(param)
        twin.grad = param.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(copy.parameters(), 0.5)
    assert expected > 0.5
    torch.testing.assert_close(pipeline_clip_grad_norm_(middle.parameters(), 0.5), expected)
    for param, twin in zip(middle.parameters(), copy.parameters(), strict=True):
        torch.testing.assert_close(param.grad, twin.grad)


def test_the_default_group_is_the_default_process_group() -> None:
    assert PipelineTie(two_stages()).group is dist.group.WORLD


def test_stages_wrapped_by_ddp_are_tied_under_the_whole_models_names() -> None:
    first, last = two_stages()
    tie = PipelineTie([DistributedDataParallel(first), DistributedDataParallel(last)])
    assert tie.names == ("emb",)
    assert [id(w) for w in tie.duplicates()] == [id(last.emb.weight)]


def test_a_middle_stage_without_a_copy_is_passed_over_on_its_rank() -> None:
    model = whole_model(initial_state())
    first, middle, last = (split(model, i, 3) for i in range(3))
    assert "emb" not in dict(middle.named_children())
    tie = PipelineTie([first, middle, last])
    assert repr(tie) == "PipelineTie(names=['emb'], copies_on_this_rank={emb: 2}, group_size=1)"
    assert [id(w) for w in tie.duplicates()] == [id(last.emb.weight)]


class TwoTables(nn.Module):
    """Two tied modules, each read by its own head."""

    def __init__(self) -> None:
        super().__init__()
        self.words = nn.Embedding(6, 4)
        self.tags = nn.Embedding(3, 4)
        self.word_head = TiedLinear(self.words)
        self.tag_head = TiedLinear(self.tags)


def test_the_repr_lists_every_tied_module() -> None:
    assert repr(PipelineTie(TwoTables())) == (
        "PipelineTie(names=['tags', 'words'], copies_on_this_rank={tags: 1, words: 1}, "
        "group_size=1)"
    )


class TopLevelHead(nn.Module):
    """A TiedLinear held by the stage itself, reading a module registered nowhere."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.head = TiedLinear(nn.Embedding(5, 4))


def test_a_head_held_by_the_stage_itself_is_named_by_its_attribute() -> None:
    assert refused(TopLevelHead()) == (
        "PipelineTie refused group rank 0's stages: its stage 0 has a TiedLinear at 'head' "
        "that reads Embedding(5, 4), a module not registered in that stage, so its weight would "
        "be neither trained, synchronised nor saved. Keep the tied module in the stage under "
        "its name in the whole model (do not set it to None or replace it) and let the "
        "TiedLinear read that copy, as a deep copy of the whole model does"
    )


def test_a_tied_module_whose_weight_was_deleted_is_refused() -> None:
    _, last = two_stages()
    del last.emb.weight
    assert refused(last) == (
        "PipelineTie refused group rank 0's stages: its tied module 'emb' (Embedding(17, 8)) "
        "has a weight that is not a Parameter but a NoneType; the stages share a trained "
        "weight, so tie to a module whose weight is a registered Parameter"
    )


def test_clipping_sums_the_norm_in_float32_for_bfloat16_gradients() -> None:
    torch.manual_seed(10)
    layer = nn.Linear(8, 8).to(torch.bfloat16)
    for param in layer.parameters():
        param.grad = torch.randn_like(param)
    expected = torch.linalg.vector_norm(
        torch.cat([p.grad.double().flatten() for p in layer.parameters()])  # type: ignore[union-attr]
    )
    norm = pipeline_clip_grad_norm_(layer.parameters(), 0.5)
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm.double(), expected, rtol=1e-2, atol=0)


def test_clipping_a_stage_without_gradients_gives_a_zero_norm() -> None:
    frozen = nn.Linear(4, 4)
    norm = pipeline_clip_grad_norm_(frozen.parameters(), 0.5)
    assert norm.dtype == torch.float32
    assert norm.item() == 0.0
    assert all(p.grad is None for p in frozen.parameters())


def test_accumulating_into_three_copies_on_one_rank_counts_each_backward_once() -> None:
    first, last = two_stages()
    third = deepcopy(last)
    tie = PipelineTie([first, last, third])
    tokens = torch.tensor([[1, 2, 3]])
    hidden = torch.ones(1, 3, 8)

    def backward() -> None:
        first.emb(tokens).square().sum().backward()
        for stage in (last, third):
            stage.out.head(hidden).square().sum().backward()

    backward()
    tie.reduce_grads()
    once = first.emb.weight.grad.clone()  # type: ignore[union-attr]
    backward()
    tie.reduce_grads()
    for stage in (first, last, third):
        torch.testing.assert_close(stage.emb.weight.grad, 2 * once)


def test_foreach_true_where_no_foreach_kernel_exists_is_refused_as_by_torch() -> None:
    weight = nn.Parameter(torch.ones(3, device="meta"))
    weight.grad = torch.ones(3, device="meta")
    with pytest.raises(RuntimeError, match="foreach=True was passed") as theirs:
        torch.nn.utils.clip_grad_norm_(weight, 1.0, foreach=True, error_if_nonfinite=True)
    for clip in (clip_grad_norm_, pipeline_clip_grad_norm_):
        with pytest.raises(RuntimeError, match="foreach=True was passed") as ours:
            clip(weight, 1.0, foreach=True, error_if_nonfinite=True)
        assert str(ours.value) == str(theirs.value)


def test_clipping_a_finite_norm_with_error_if_nonfinite_clips() -> None:
    weight = nn.Parameter(torch.zeros(2))
    weight.grad = torch.tensor([3.0, 4.0])
    for clip in (clip_grad_norm_, pipeline_clip_grad_norm_):
        assert clip([weight], 10.0, error_if_nonfinite=True).item() == 5.0
