"""TiedLinear under tensor parallelism, alone on 2 gloo ranks and under FSDP2 on a 2 x 2 mesh.

The checks of ``tp_checks`` train the tiny tied LM with its embedding sharded on the uneven
vocabulary of 17. The expected values come from ``ReferenceLM``, trained here in one process
on the same global batches, whose logits are written out as ``F.linear(h, emb.weight)``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.nn.distributed.test_sharded_tied_lm import assert_close, assert_states_close
from tests.nn.distributed.tiny_lm import LR, ReferenceLM, batches, initial_state, loss_fn, rank_rows
from tests.nn.distributed.tp_checks import ALL_ROWS, DATA_RANKS, STEPS
from tests.nn.distributed.worlds import Worlds, per_rank

SHARDED_LOGITS = ["(Shard(dim=2),)"]
TP_RUNS = {
    "loss_parallel": SHARDED_LOGITS,
    "gathered": ["plain"],
    "sequence_parallel": SHARDED_LOGITS,
    "sequence_parallel_gathered": ["plain"],
    "prepare_module_input": SHARDED_LOGITS,
    "colwise_embedding": SHARDED_LOGITS,
}


def reference(groups: list[slice]) -> dict[str, Any]:
    """Train ReferenceLM in one process: each group of rows is one data-parallel rank's batch.

    Returns ``losses[step][group]`` and ``states[step]`` (``states[0]`` is the initial state).
    """
    model = ReferenceLM()
    model.load_state_dict(initial_state())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, states = [], [initial_state()]
    for idx, targets in batches(DATA_RANKS, STEPS):
        per_group = [loss_fn(model(idx[rows]), targets[rows]) for rows in groups]
        opt.zero_grad()
        torch.stack(per_group).mean().backward()
        opt.step()
        losses.append([loss.item() for loss in per_group])
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return {"losses": losses, "states": states}


def assert_trained_like(result: dict[str, Any], expected: dict[str, Any], group: int) -> None:
    assert len(result["losses"]) == STEPS
    assert_close(result["losses"], [step[group] for step in expected["losses"]])
    assert len(result["states"]) == STEPS + 1
    for actual, wanted in zip(result["states"], expected["states"], strict=True):
        assert_states_close(actual, wanted)


@pytest.mark.parametrize("run", list(TP_RUNS))
def test_tensor_parallel_training_matches_the_single_process_reference(
    worlds: Worlds, run: str
) -> None:
    expected = reference([ALL_ROWS])
    for result in per_rank(worlds, 2, f"tp/train/{run}"):
        assert result["logits"] == TP_RUNS[run]
        assert_trained_like(result, expected, 0)


@pytest.mark.parametrize("run", ["loss_parallel", "gathered"])
def test_fsdp2_with_tensor_parallelism_on_a_2_by_2_mesh_matches_the_reference(
    worlds: Worlds, run: str
) -> None:
    expected = reference([rank_rows(0), rank_rows(1)])
    results = per_rank(worlds, 4, f"tp/fsdp/{run}")
    # Ranks 0, 1 form the tensor-parallel group of the first data rank, ranks 2, 3 the second.
    assert [result["data_rank"] for result in results] == [0, 0, 1, 1]
    for result in results:
        assert result["logits"] == (SHARDED_LOGITS if run == "loss_parallel" else ["plain"])
        assert_trained_like(result, expected, result["data_rank"])


@pytest.mark.parametrize(("world_size", "check"), [(2, "tp/checkpoint"), (4, "tp/fsdp/checkpoint")])
def test_a_distributed_checkpoint_restores_the_tie_and_the_weights(
    worlds: Worlds, world_size: int, check: str
) -> None:
    for result in per_rank(worlds, world_size, check):
        # The fresh model started from other weights, so the load is what made it equal.
        assert not torch.allclose(result["before"]["emb.weight"], result["trained"]["emb.weight"])
        assert_states_close(result["after"], result["trained"])
        assert result["tied"]
        assert result["same_weight"]
        assert_close(result["logits"], result["trained_logits"])


def test_the_compiled_tensor_parallel_model_gives_the_same_loss(worlds: Worlds) -> None:
    idx, targets = batches(DATA_RANKS, 1)[0]
    model = ReferenceLM()
    model.load_state_dict(initial_state())
    expected = loss_fn(model(idx), targets).item()
    for result in per_rank(worlds, 2, "tp/compile"):
        assert_close(result["eager"], expected)
        assert_close(result["compiled"], expected)


def test_the_head_issues_no_collective_on_a_replicated_input(worlds: Worlds) -> None:
    for counts in per_rank(worlds, 2, "tp/communication"):
        assert counts["loss_parallel/head"] == {}
        # Replicated logits gather the vocabulary once; a sequence-sharded input is gathered.
        assert counts["gathered/head"] == {"all_gather_into_tensor": 1}
        assert counts["sequence_parallel/head"] == {"all_gather_into_tensor": 1}
        # An embedding sharded on the hidden dimension makes the head reduce the full logits.
        assert counts["colwise_embedding/head"] == {"reduce_scatter_tensor": 1}


def test_under_loss_parallel_the_full_vocabulary_logits_are_never_gathered(
    worlds: Worlds,
) -> None:
    for counts in per_rank(worlds, 2, "tp/communication"):
        for config in ("loss_parallel", "sequence_parallel"):
            # The loss reduces per-position values: the maximum, the sum, the target logit.
            assert counts[f"{config}/loss"] == {"all_reduce": 3}
        # Backward reduces only the gradient of the head's input, as after any column-sharded
        # layer: all-reduced when replicated, reduce-scattered on the sequence.
        assert counts["loss_parallel/backward"] == {"all_reduce": 1}
        assert counts["sequence_parallel/backward"] == {"reduce_scatter_tensor": 1}
        assert counts["gathered/loss"] == {}
        assert counts["gathered/backward"] == {"all_reduce": 1}


def test_a_plan_on_the_whole_model_cannot_name_the_head(worlds: Worlds) -> None:
    for messages in per_rank(worlds, 2, "tp/plan_by_name"):
        *warnings, hooked = messages
        assert hooked == "hooked=False"
        assert len(warnings) == 1
        assert warnings[0].startswith(
            "Parallelize plan key 'head.linear' could not be resolved: no submodule matching "
            "token 'head' in module Output("
        )


UNPREPARED = (
    "RuntimeError: TiedLinear got a plain-tensor input, but the weight of the tied module "
    "Embedding(17, 8) is sharded by tensor parallelism (a DTensor with placements "
    "(Shard(dim=0),)): the head's input must be a DTensor on the same device mesh. Prepare the "
    "head's input by applying toolkit.nn.TiedLinearParallel to the head's linear module, "
    "parallelize_module(head.linear, tp_mesh, TiedLinearParallel()), with "
    "input_layouts=Shard(1) under sequence parallelism; or apply torch's "
    "PrepareModuleInput(input_layouts=(Replicate(), None), desired_input_layouts=(Replicate(), "
    "None)) to head.linear.\nCAUSE RuntimeError"
)


@pytest.mark.parametrize(("world_size", "check"), [(2, "tp/unprepared"), (4, "tp/fsdp/unprepared")])
def test_a_plain_input_to_a_tensor_parallel_head_names_the_fix_not_fsdp(
    worlds: Worlds, world_size: int, check: str
) -> None:
    for message in per_rank(worlds, world_size, check):
        assert message == UNPREPARED
        assert "FSDP" not in message
        assert "reshard" not in message


def test_fsdp2_resharding_a_tensor_parallel_embedding_keeps_the_fsdp2_error(
    worlds: Worlds,
) -> None:
    for message in per_rank(worlds, 4, "tp/fsdp/resharded"):
        assert message.startswith(
            "RuntimeError: TiedLinear cannot use the weight of the tied module "
            "FSDPEmbedding(17, 8): that weight is sharded (a DTensor with placements "
            "(_StridedShard(dim=0, sf=2), Shard(dim=0))) when TiedLinear reads it"
        )
        assert "fully_shard(tied_module, reshard_after_forward=False)" in message
        assert "TiedLinearParallel" not in message


def test_fsdp2_resharding_through_an_enclosing_unit_keeps_the_fsdp2_error(
    worlds: Worlds,
) -> None:
    # The embedding is no unit of its own, but the trunk unit holding it reshards.
    for message in per_rank(worlds, 2, "tp/fsdp_enclosing_unit"):
        assert message.startswith(
            "RuntimeError: TiedLinear cannot use the weight of the tied module "
            "Embedding(17, 8): that weight is sharded (a DTensor with placements "
            "(Shard(dim=0),)) when TiedLinear reads it"
        )
        assert "TiedLinearParallel" not in message


def test_a_prepared_input_with_an_unsharded_tied_weight_names_the_fix(worlds: Worlds) -> None:
    for message in per_rank(worlds, 2, "tp/unsharded_weight"):
        assert message == (
            "RuntimeError: TiedLinearParallel prepared the head's input for tensor "
            "parallelism, but the weight of the tied module is a plain tensor, not sharded on "
            "the device mesh: the tied module was not parallelised. Shard it on the same mesh "
            "(RowwiseParallel on the embedding shards its weight on the vocabulary), or remove "
            "TiedLinearParallel from head.linear.\nCAUSE NoneType"
        )


def test_the_style_applies_only_to_a_tied_linear_head(worlds: Worlds) -> None:
    for message in per_rank(worlds, 2, "tp/style_on_another_module"):
        assert message == (
            "TiedLinearParallel applies to a TiedLinear's linear module, got Linear; pass the "
            "head's linear module: parallelize_module(head.linear, tp_mesh, "
            "TiedLinearParallel())"
        )
