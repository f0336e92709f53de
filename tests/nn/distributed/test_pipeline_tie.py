"""PipelineTie on gloo ranks: a tied LM over pipeline stages trains as one model in one process.

The ranks run ``pipeline_checks``: two stages on two ranks under ``ScheduleGPipe`` and
``Schedule1F1B``, and two stages times two data-parallel replicas on four ranks under DDP and
under FSDP2. The expected values come from ``reference_pipeline_training``, ``ReferenceLM``
trained in this process with ``torch.nn.utils.clip_grad_norm_``, without PipelineTie.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.nn.distributed.pipeline_lm import MAX_NORM, STEPS, reference_pipeline_training
from tests.nn.distributed.tiny_lm import ReferenceLM
from tests.nn.distributed.worlds import Worlds, per_rank

TRAINED = [(2, "gpipe"), (2, "1f1b"), (4, "ddp"), (4, "fsdp2")]
REPLICAS = {2: 1, 4: 2}


def assert_close(actual: Any, expected: Any, msg: str | None = None) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=msg)


@pytest.fixture(scope="module")
def references() -> dict[int, dict[str, Any]]:
    return {replicas: reference_pipeline_training(replicas) for replicas in (1, 2)}


@pytest.mark.parametrize(("world_size", "setup"), TRAINED, ids=[s for _, s in TRAINED])
def test_training_matches_the_single_process_reference(
    worlds: Worlds, references: dict[int, dict[str, Any]], world_size: int, setup: str
) -> None:
    expected = references[REPLICAS[world_size]]
    assert min(expected["norms"]) > MAX_NORM  # clipping scales every step
    results = per_rank(worlds, world_size, f"pipeline/{setup}")
    losses: list[list[float]] = [[] for _ in range(STEPS)]
    for result in sorted(results, key=lambda r: r["dp_rank"]):
        for step, values in enumerate(result["steps"]):
            assert_close(values["norm"], expected["norms"][step])
            losses[step] += values["losses"]  # only the last stage has losses
        assert result["check"] is None
        state = result["state"]
        assert "emb.weight" in state  # both stages hold the tied weight
        for key, value in state.items():
            assert_close(value, expected["state"][key], msg=key)
    assert_close(losses, expected["losses"])
    keys = {key for result in results for key in result["state"]}
    assert keys == set(ReferenceLM().state_dict())


@pytest.mark.parametrize(("world_size", "setup"), TRAINED, ids=[s for _, s in TRAINED])
def test_the_tie_adds_one_all_reduce_per_step(worlds: Worlds, world_size: int, setup: str) -> None:
    for result in per_rank(worlds, world_size, f"pipeline/{setup}"):
        for step in result["steps"]:
            assert step["tie_collectives"] == {"c10d.allreduce_": 1}
            # Clipping combines the stages' norms: one more all-reduce over the pipeline,
            # and under FSDP2 DTensor's own reduction of the sharded norm over the replicas.
            expected = {"c10d.allreduce_": 1}
            if setup == "fsdp2":
                expected["c10d_functional.all_reduce"] = 1
            assert step["clip_collectives"] == expected


def test_set_up_and_the_check_cost_what_the_page_states(worlds: Worlds) -> None:
    for result in per_rank(worlds, 2, "pipeline/gpipe"):
        # Two all_gather_object calls (each gathers the sizes, then the data) and the
        # broadcast of the first stage's copy; the check: one broadcast, one all_gather_object.
        assert result["setup_collectives"] == {"c10d.allgather_": 4, "c10d.broadcast_": 1}
        assert result["check_collectives"] == {"c10d.allgather_": 2, "c10d.broadcast_": 1}


@pytest.mark.parametrize("kind", ["interleaved", "zbv"])
def test_several_stages_per_rank_train_as_one_model(
    worlds: Worlds, references: dict[int, dict[str, Any]], kind: str
) -> None:
    expected = references[1]
    first, last = per_rank(worlds, 2, f"pipeline/{kind}")
    if kind == "interleaved":  # stages 0 and 2 on rank 0, 1 and 3 on rank 1: one copy each
        assert (first["copies"], last["copies"]) == ([True, False], [False, True])
        tie = {"c10d.allreduce_": 1}
    else:  # stages 0 and 3 on rank 0: both copies on one rank, no communication
        assert (first["copies"], last["copies"]) == ([True, True], [False, False])
        tie = {}
    losses = first if kind == "zbv" else last  # the rank of the last stage
    assert_close([step["losses"] for step in losses["steps"]], expected["losses"])
    for result in (first, last):
        assert_close([step["norm"] for step in result["steps"]], expected["norms"])
        assert all(step["tie_collectives"] == tie for step in result["steps"])
        for key, value in result["state"].items():
            assert_close(value, expected["state"][key], msg=key)
    assert set(first["state"]) | set(last["state"]) == set(ReferenceLM().state_dict())


def test_without_the_gradient_sum_the_copies_drift_apart(worlds: Worlds) -> None:
    for result in per_rank(worlds, 2, "pipeline/gpipe_without_sum"):
        assert result["check"] is not None
        assert result["check"].startswith(
            "the copies of the tied weight 'emb.weight' differ: copy 0 on group rank 1 has "
        )
        assert "(136 of 136 elements differ)" in result["check"]
        assert all(step["tie_collectives"] == {} for step in result["steps"])


def test_every_rank_refuses_a_head_reading_an_unregistered_embedding(worlds: Worlds) -> None:
    for message in per_rank(worlds, 2, "pipeline/refused"):
        assert message == (
            "PipelineTie refused group rank 1's stages: its stage 0 has a TiedLinear at "
            "'out.head' that reads Embedding(17, 8), a module not registered in that stage, so "
            "its weight would be neither trained, synchronised nor saved. Keep the tied module "
            "in the stage under its name in the whole model (do not set it to None or replace "
            "it) and let the TiedLinear read that copy, as a deep copy of the whole model does"
        )


def test_a_rank_of_the_group_without_a_copy_takes_part_and_needs_no_communication(
    worlds: Worlds,
) -> None:
    without, holder = per_rank(worlds, 2, "pipeline/accepted_without_a_copy")
    assert (
        without["repr"] == "PipelineTie(names=['emb'], copies_on_this_rank={emb: 0}, group_size=2)"
    )
    assert (
        holder["repr"] == "PipelineTie(names=['emb'], copies_on_this_rank={emb: 1}, group_size=2)"
    )
    for result in (without, holder):
        assert result["collectives"] == {}
    assert without["grad"] is None
    assert torch.equal(holder["grad"], torch.ones(17, 8))


def test_every_rank_refuses_copies_of_different_shapes(worlds: Worlds) -> None:
    for message in per_rank(worlds, 2, "pipeline/refused_shapes"):
        assert message == (
            "PipelineTie needs every copy of the tied weights to have one shape, but group "
            "rank 0 has {'emb': (17, 8)} and group rank 1 has {'emb': (5, 8)}; build every "
            "stage from the same model"
        )


def test_dcp_stores_the_tied_weight_once(worlds: Worlds) -> None:
    result = per_rank(worlds, 2, "pipeline/checkpoint")[0]
    assert result["chunks"]["emb.weight"] == [((0, 0), (17, 8))]
    tied = [entry for entry in result["entries"] if entry[0] == "emb.weight"]
    assert len(tied) == 1
    assert sorted(result["chunks"]) == sorted(ReferenceLM().state_dict())
    # Every byte of the data files belongs to one entry: no second copy was written.
    assert result["file_bytes"] == sum(entry[3] for entry in result["entries"])


def test_a_dcp_load_restores_both_copies_and_resumes_to_the_same_losses(
    worlds: Worlds, references: dict[int, dict[str, Any]]
) -> None:
    expected = references[1]
    for result in per_rank(worlds, 2, "pipeline/checkpoint"):
        assert not torch.equal(result["before"]["emb.weight"], result["saved"]["emb.weight"])
        assert list(result["loaded"]) == list(result["saved"])
        for key, value in result["saved"].items():
            assert torch.equal(result["loaded"][key], value), key
        for resumed, uninterrupted in zip(result["resumed"], result["uninterrupted"], strict=True):
            assert resumed["losses"] == uninterrupted["losses"]
    last = per_rank(worlds, 2, "pipeline/checkpoint")[1]
    assert_close([step["losses"] for step in last["resumed"]], expected["losses"][1:])


def test_a_safetensors_export_holds_one_tied_weight(
    worlds: Worlds, references: dict[int, dict[str, Any]]
) -> None:
    exported = per_rank(worlds, 2, "pipeline/checkpoint")[0]["export"]
    expected = references[1]["state"]
    assert list(exported) == list(expected)
    for key, value in expected.items():
        assert_close(exported[key], value, msg=key)
