"""sync_entries and create_entries on gloo ranks, against values written out here.

The ranks run ``entries_checks``: rank-specific heads synchronised, then the tiny task LM
trained under DDP and FSDP2 (on 2 and 3 ranks, an uneven split of the vocabulary of 17)
against ``ReferenceTaskLM`` trained in this process, and a DCP resume under FSDP2.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.nn.distributed.tiny_lm import ReferenceTaskLM, reference_training
from tests.nn.distributed.worlds import Worlds, per_rank

# The lowest rank that had each entry before the sync (see entries_checks.HEADS_BY_RANK).
OWNERS = {
    2: {"heads.a": 0, "heads.s": 0, "heads.b": 1, "outer.x": 0, "outer.x.inner.y": 1},
    3: {"heads.a": 0, "heads.s": 0, "heads.b": 1, "heads.c": 2, "outer.x": 0, "outer.x.inner.y": 1},
}
CREATED = {
    2: [["heads.b", "outer.x.inner.y"], ["heads.a"]],
    3: [
        ["heads.b", "outer.x.inner.y", "heads.c"],
        ["heads.a", "heads.c"],
        ["heads.s", "heads.b", "outer.x.inner.y"],
    ],
}


def _owner(world_size: int, key: str) -> int | None:
    """The owner of the innermost entry holding state-dict ``key``, None outside entries."""
    entries = [e for e in OWNERS[world_size] if key.startswith(e + ".")]
    return OWNERS[world_size][max(entries, key=len)] if entries else None


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_ends_with_the_union_in_one_order_valued_by_the_lowest_owner(
    worlds: Worlds, world_size: int
) -> None:
    results = per_rank(worlds, world_size, "entries/sync")
    heads = ["a", "s", "b", "c"][: 3 if world_size == 2 else 4]
    for rank, result in enumerate(results):
        assert result["created"] == CREATED[world_size][rank]
        assert result["heads"] == heads
        assert result["inner"] == ["y"]
        assert list(result["after"]) == list(results[0]["after"])
        for key, value in result["after"].items():
            owner = _owner(world_size, key)
            source = result if owner is None else results[owner]
            assert torch.equal(value, source["before"][key]), (rank, key)
    # The seeds differ, so the shared heads really were different before.
    assert not torch.equal(
        results[0]["before"]["heads.s.weight"], results[1]["before"]["heads.s.weight"]
    )
    assert [r["after"]["outer.x.count"].item() for r in results] == [1] * world_size


def assert_close(actual: Any, expected: Any, msg: str | None = None) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=msg)


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_synced_entries_train_like_the_single_process_reference(
    worlds: Worlds, world_size: int, kind: str
) -> None:
    expected = reference_training(world_size, ReferenceTaskLM)
    for rank, result in enumerate(per_rank(worlds, world_size, f"entries/train/{kind}")):
        assert result["keys"] == ["a", "b"]
        assert_close(result["losses"], [step[rank] for step in expected["losses"]])
        for got, want in zip(result["states"], expected["states"], strict=True):
            assert list(got) == list(want)
            for key, value in want.items():
                assert_close(got[key], value, msg=key)
        # The closed dict refuses a miss after wrapping.
        assert result["refused"] == ("late",)


def test_a_dcp_resume_under_fsdp2_restores_every_entry(worlds: Worlds) -> None:
    for result in per_rank(worlds, 2, "entries/dcp_resume"):
        assert result["created"] == ["adapters.a", "adapters.b"]
        assert list(result["resumed"]) == list(result["trained"])
        for key, value in result["trained"].items():
            assert torch.equal(result["resumed"][key], value), key


def test_a_creation_that_fails_on_one_rank_raises_on_every_rank_and_creates_nothing(
    worlds: Worlds,
) -> None:
    message = (
        "sync_entries created no entry: creating the missing entries failed on "
        "rank 1: KeyError('a')"
    )
    rank0, rank1 = per_rank(worlds, 2, "entries/failed_create")
    assert rank0 == {"error": ("RuntimeError", message), "heads": ["a"]}
    assert rank1 == {"error": ("RuntimeError", message), "heads": ["b"]}


def test_tensors_on_meta_on_some_ranks_only_are_refused_on_every_rank(worlds: Worlds) -> None:
    message = (
        "sync_entries created no entry: heads.a.bias, heads.a.weight, heads.b.bias, "
        "heads.b.weight, heads.c.bias, heads.c.weight are on the meta device on some ranks "
        "only; move or materialise the model alike on every rank"
    )
    rank0, rank1 = per_rank(worlds, 2, "entries/meta_on_some_ranks")
    assert rank0 == {"error": ("ValueError", message), "heads": ["a", "b"]}
    assert rank1 == {"error": ("ValueError", message), "heads": ["a", "c"]}


def test_on_the_meta_device_the_names_are_synchronised(worlds: Worlds) -> None:
    rank0, rank1 = per_rank(worlds, 2, "entries/meta_on_every_rank")
    assert rank0["created"] == ["heads.b"]
    assert rank1["created"] == ["heads.a"]
    for result in (rank0, rank1):
        assert result["heads"] == ["a", "b"]
        assert set(result["devices"]) == {"meta"}
