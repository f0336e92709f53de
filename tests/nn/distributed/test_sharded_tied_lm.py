"""TiedLinear under FSDP2, FSDP1 and DDP: a tied LM trained on gloo ranks against one process.

Each setup trains the tiny tied LM of ``tiny_lm`` for several SGD steps on 2 ranks (and some
on 3). The expected values come from ``ReferenceLM``, trained in this process on the global
batches, whose logits are written out as ``F.linear(h, emb.weight)`` without TiedLinear.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.nn.distributed.tiny_lm import (
    ReferenceLM,
    ReferenceTaskLM,
    reference_path_updates,
    reference_training,
)
from tests.nn.distributed.worlds import WORLDS, Worlds, per_rank

CASES = [(world, setup) for world, setups in WORLDS.items() for setup in setups]
IDS = [f"{world}ranks-{setup}" for world, setup in CASES]
# World sizes that run the setups above; others serve only ``workers.CHECK_MODULES``.
SETUP_WORLDS = [world for world, setups in WORLDS.items() if setups]
FSDP2_CASES = [(world, setup) for world, setup in CASES if setup.startswith("fsdp2")]


def assert_close(actual: Any, expected: Any, msg: str | None = None) -> None:
    """Equal up to float32 rounding in a different order of operations."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=msg)


def assert_states_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert_close(actual[key], value, msg=key)


@pytest.fixture(scope="module")
def references() -> dict[int, dict[str, Any]]:
    return {world: reference_training(world) for world in SETUP_WORLDS}


@pytest.mark.parametrize(("world_size", "setup"), CASES, ids=IDS)
def test_training_matches_the_single_process_reference(
    worlds: Worlds, references: dict[int, dict[str, Any]], world_size: int, setup: str
) -> None:
    expected = references[world_size]
    for rank, result in enumerate(per_rank(worlds, world_size, f"setup/{setup}")):
        assert_close(result["losses"], [step[rank] for step in expected["losses"]])
        assert len(result["states"]) == len(expected["states"])
        for actual_state, expected_state in zip(result["states"], expected["states"], strict=True):
            assert_states_close(actual_state, expected_state)


@pytest.mark.parametrize(("world_size", "setup"), CASES, ids=IDS)
def test_every_embedding_row_is_updated_through_both_paths(
    worlds: Worlds, world_size: int, setup: str
) -> None:
    lookup, head = reference_path_updates(world_size)
    # The data puts every token in every step's inputs, so each path alone moves every row.
    assert (lookup.abs().amax(dim=1) > 1e-4).all()
    assert (head.abs().amax(dim=1) > 1e-4).all()
    for result in per_rank(worlds, world_size, f"setup/{setup}"):
        before, after = (result["states"][i]["emb.weight"] for i in (0, 1))
        update = after - before
        assert_close(update, lookup + head)
        # Row by row, the update is neither path's alone.
        assert ((update - lookup).abs().amax(dim=1) > 1e-4).all()
        assert ((update - head).abs().amax(dim=1) > 1e-4).all()


@pytest.mark.parametrize(("world_size", "setup"), CASES, ids=IDS)
def test_the_head_adds_no_parameter_and_no_state_dict_key(
    worlds: Worlds, world_size: int, setup: str
) -> None:
    reference = ReferenceLM()
    names = [n for n, _ in reference.named_parameters()]
    for result in per_rank(worlds, world_size, f"setup/{setup}"):
        assert result["unwrapped_parameter_names"] == names
        # FSDP1 with use_orig_params=False shows flat parameters instead of the originals.
        wrapped = result["wrapped_parameter_names"]
        assert wrapped == (None if setup == "fsdp1_flat_params" else names)
        assert result["wrapped_state_keys"] == list(reference.state_dict())
        assert result["head_tied_to_the_wrapped_embedding"]


@pytest.mark.parametrize(("world_size", "setup"), CASES, ids=IDS)
def test_a_distributed_checkpoint_round_trips(worlds: Worlds, world_size: int, setup: str) -> None:
    for result in per_rank(worlds, world_size, f"setup/{setup}"):
        checkpoint = result["checkpoint"]
        trained = result["states"][-1]
        # The fresh copy started elsewhere, so the load is what made it equal.
        assert not torch.allclose(checkpoint["before"]["emb.weight"], trained["emb.weight"])
        assert_states_close(checkpoint["after"], trained)
        assert_close(checkpoint["logits"], checkpoint["trained_logits"])


@pytest.mark.parametrize("world_size", SETUP_WORLDS)
@pytest.mark.parametrize("placement", ["own_unit", "grouped_resharding"])
def test_a_tied_weight_resharded_before_the_head_raises_a_clear_error_on_every_rank(
    worlds: Worlds, world_size: int, placement: str
) -> None:
    messages = per_rank(worlds, world_size, f"unsupported/{placement}")
    assert len(messages) == world_size
    for message in messages:
        error, _, cause = message.partition("\nCAUSE ")
        assert error.startswith("RuntimeError: TiedLinear cannot use the weight of the tied ")
        assert "tied module FSDPEmbedding(17, 8)" in error
        assert "sharded (a DTensor with placements (Shard(dim=0),)) when TiedLinear reads" in error
        assert "Keep the tied module in the unit whose forward calls TiedLinear" in error
        assert "fully_shard([tied_module, caller])" in error
        assert "fully_shard(tied_module, reshard_after_forward=False)" in error
        # torch's own error stays attached as the cause.
        assert cause.startswith("RuntimeError: aten.mm.default got mixed torch.Tensor and DTensor")


# ModuleDefaultDict ------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["iterate_keys", "restore_checkpoint"])
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_module_default_dict_entries_created_before_wrapping_train_like_the_reference(
    worlds: Worlds, kind: str, recipe: str
) -> None:
    expected = reference_training(2, ReferenceTaskLM)
    for rank, result in enumerate(per_rank(worlds, 2, f"mdd/{kind}/{recipe}")):
        assert result["keys_before_wrapping"] == ["a", "b"]
        assert_close(result["losses"], [step[rank] for step in expected["losses"]])
        assert_states_close(result["states"][-1], expected["states"][-1])


def test_a_module_default_dict_entry_created_after_ddp_wrapped_is_not_managed(
    worlds: Worlds,
) -> None:
    rank0, rank1 = per_rank(worlds, 2, "mdd/after_wrapping")
    for key in rank0:
        same = torch.equal(rank0[key], rank1[key])
        # Entries that existed at wrapping are averaged; the late one trains on local data only.
        assert same == (not key.startswith("adapters.b.")), key


def test_a_module_default_dict_entry_created_after_fully_shard_is_not_sharded(
    worlds: Worlds,
) -> None:
    for sharded in per_rank(worlds, 2, "mdd/after_fully_shard"):
        assert sharded == {"a": True, "b": False}


def test_fsdp1_on_a_cpu_only_machine_needs_the_device_named(worlds: Worlds) -> None:
    # The FSDP1 setups above pass device_id=torch.device("cpu"), as the docs page says.
    for message in per_rank(worlds, 2, "fsdp1/without_device_id"):
        assert "FSDP needs a non-CPU accelerator device" in message
