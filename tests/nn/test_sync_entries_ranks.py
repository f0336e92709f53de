"""sync_entries on 2 and 3 threaded ranks of one process, against values written out here.

Each rank's model is built in the calling thread with its own seed, so an entry that
several ranks hold differs between them until the call; the expected state of every rank is
assembled from those models: each entry's tensors from the lowest rank that had it (the
innermost entry deciding), everything else from the rank itself. The ranks hold uneven,
overlapping sets of entries, nested ones, integer buffers and a non-contiguous parameter.
Also proven: a process group of some ranks only (its ranks counted in the group, not the
world), and the whole errors that every rank raises when one rank cannot take part: a
DTensor parameter, a failed creation (with every created entry removed again), and meta
tensors on some ranks only.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate

from tests.nn.distributed.entries_checks import Heads as Model
from tests.nn.distributed.entries_checks import Inner, _state
from tests.nn.ranks import run_threads
from toolkit.nn import ModuleDefaultDict, sync_entries
from toolkit.nn._entries import _BUILD_ALIKE


def _entry_names(model: Model) -> dict[str, list[str]]:
    names = {"heads": list(model.heads), "outer": list(model.outer)}
    for key, entry in model.outer.items():
        names[f"outer.{key}.inner"] = list(entry.inner)
    return names


def _models(build: Callable[[int], nn.Module], world_size: int) -> list[nn.Module]:
    """Each rank's model, built here in turn with its own seed."""
    models = []
    for rank in range(world_size):
        torch.manual_seed(100 + rank)
        models.append(build(rank))
    return models


def _assert_states_equal(actual: dict[str, torch.Tensor], expected: dict[str, Any]) -> None:
    assert list(actual) == list(expected)
    for key, tensor in expected.items():
        assert torch.equal(actual[key], tensor), key


# Values, order and what each rank created -----------------------------------------------------


def _uneven(rank: int) -> Model:
    model = Model()
    for key in (["a", "s"], ["s", "b"], ["c", "a"])[rank]:
        model.heads[key]
    if rank < 2:
        model.outer["x"].count += rank + 1
    if rank == 1:
        model.outer["x"].inner["y"]  # inside an entry that rank 0 owns
        model.outer["z"]
        # A non-contiguous parameter on a rank that receives the value of rank 0.
        model.heads["s"].weight = nn.Parameter(torch.randn(2, 2).t())
    return model


def test_three_ranks_end_with_the_union_in_rank_order_valued_by_the_lowest_owner() -> None:
    models = _models(_uneven, 3)
    assert not models[1].heads["s"].weight.is_contiguous()
    before = [_state(m) for m in models]

    def rank_main(rank: int) -> dict[str, Any]:
        model = copy.deepcopy(models[rank])
        created = sync_entries(model)
        return {"created": created, "names": _entry_names(model), "state": _state(model)}

    results = run_threads(3, rank_main)

    assert [r["created"] for r in results] == [
        ["heads.b", "outer.z", "outer.x.inner.y", "heads.c"],
        ["heads.a", "heads.c"],
        ["heads.s", "outer.x", "heads.b", "outer.z", "outer.x.inner.y"],
    ]
    names = {
        "heads": ["a", "s", "b", "c"],
        "outer": ["x", "z"],
        "outer.x.inner": ["y"],
        "outer.z.inner": [],
    }
    owner_of = {
        "heads.a": 0,
        "heads.s": 0,
        "heads.b": 1,
        "heads.c": 2,
        "outer.x.proj": 0,
        "outer.x.count": 0,
        "outer.x.inner.y": 1,
        "outer.z": 1,
    }
    keys = [
        *(f"heads.{h}.{p}" for h in "asbc" for p in ("weight", "bias")),
        "outer.x.count",
        "outer.x.proj.weight",
        "outer.x.proj.bias",
        "outer.x.inner.y.weight",
        "outer.x.inner.y.bias",
        "outer.z.count",
        "outer.z.proj.weight",
        "outer.z.proj.bias",
    ]
    for rank, result in enumerate(results):
        assert result["names"] == names, rank
        expected = {k: before[rank][k] for k in ("trunk.weight", "trunk.bias")}
        for key in keys:
            owner = next(o for prefix, o in owner_of.items() if key.startswith(prefix))
            expected[key] = before[owner][key]
        _assert_states_equal(result["state"], expected)
    # The values really differed before: the seeds, and the counts 1 and 2.
    assert not torch.equal(before[0]["heads.s.weight"], before[1]["heads.s.weight"])
    assert [s["outer.x.count"].item() for s in before[:2]] == [1, 2]


def test_the_module_itself_can_be_the_dict() -> None:
    def build(rank: int) -> nn.Module:
        heads = ModuleDefaultDict(functools.partial(nn.Linear, 2, 2))
        for key in (["b", "a"], ["a", "c"])[rank]:
            heads[key]
        return heads

    models = _models(build, 2)
    before = [_state(m) for m in models]

    def rank_main(rank: int) -> tuple[list[str], list[str], dict[str, torch.Tensor]]:
        heads = copy.deepcopy(models[rank])
        created = sync_entries(heads)
        return created, list(heads), _state(heads)

    results = run_threads(2, rank_main)
    assert [r[0] for r in results] == [["c"], ["b"]]
    owner_of = {"b": 0, "a": 0, "c": 1}
    for rank, (_, names, state) in enumerate(results):
        assert names == ["b", "a", "c"], rank
        expected = {
            f"{k}.{p}": before[o][f"{k}.{p}"]
            for k, o in owner_of.items()
            for p in ("weight", "bias")
        }
        _assert_states_equal(state, expected)


def test_a_group_of_some_ranks_counts_ranks_in_the_group() -> None:
    """Ranks 1 and 2 synchronise in their group; rank 0 alone in its own, with as many tensors.

    Group rank 1 is world rank 2: the owner of "b" must be taken as a rank of the group.
    """

    def build(rank: int) -> nn.Module:
        model = Model()
        for key in (["p", "q"], ["a"], ["b"])[rank]:
            model.heads[key]
        return model

    models = _models(build, 3)
    before = [_state(m) for m in models]

    def rank_main(rank: int) -> tuple[list[str], list[str], dict[str, torch.Tensor]]:
        alone = dist.new_group([0])
        pair = dist.new_group([1, 2])
        model = copy.deepcopy(models[rank])
        created = sync_entries(model, group=alone if rank == 0 else pair)
        return created, list(model.heads), _state(model)

    results = run_threads(3, rank_main)
    created, names, state = results[0]
    assert (created, names) == ([], ["p", "q"])
    _assert_states_equal(state, before[0])
    assert [r[:2] for r in results[1:]] == [(["heads.b"], ["a", "b"]), (["heads.a"], ["a", "b"])]
    for rank in (1, 2):
        expected = {k: before[rank][k] for k in ("trunk.weight", "trunk.bias")}
        expected |= {k: before[1][k] for k in ("heads.a.weight", "heads.a.bias")}
        expected |= {k: before[2][k] for k in ("heads.b.weight", "heads.b.bias")}
        _assert_states_equal(results[rank][2], expected)


# Every rank raises the same error --------------------------------------------------------------


def _refused(model: nn.Module) -> tuple[str, str, str]:
    """The type, message and cause of the error that sync_entries raises."""
    try:
        sync_entries(model)
    except (RuntimeError, ValueError) as error:
        return type(error).__name__, str(error), repr(error.__cause__)
    raise AssertionError("sync_entries did not refuse")


def test_dtensor_parameters_on_some_ranks_are_refused_on_every_rank_naming_each() -> None:
    models = _models(lambda rank: Model(), 3)
    for model in models:
        model.heads["a"]

    def rank_main(rank: int) -> tuple[tuple[str, str, str], dict[str, list[str]]]:
        mesh = DeviceMesh("cpu", [0, 1, 2])
        model = copy.deepcopy(models[rank])
        if rank == 1:
            model.heads["b"]
        owner = {0: model.heads["a"], 2: model.trunk}.get(rank)
        if owner is not None:
            local = owner.weight.detach()
            owner.weight = nn.Parameter(DTensor.from_local(local, mesh, [Replicate()]))
        return _refused(model), _entry_names(model)

    results = run_threads(3, rank_main)
    reason = "is a DTensor: the model is already sharded; create the entries before fully_shard"
    message = (
        f"sync_entries: rank 0: parameter heads.a.weight {reason}; "
        f"rank 2: parameter trunk.weight {reason}"
    )
    assert [r[0] for r in results] == [("ValueError", message, "None")] * 3
    assert [r[1]["heads"] for r in results] == [["a"], ["a", "b"], ["a"]]


def _failing(rank: int) -> Model:
    """Rank 1's outer factory raises; rank 2's heads are closed, so it cannot create "b"."""
    model = Model()
    if rank == 0:
        model.outer["x"].inner["y"]
    elif rank == 1:
        model.heads["b"]

        def no_inner() -> Inner:
            raise RuntimeError("no outer entry on rank 1")

        model.outer.default_factory = no_inner
    else:
        model.heads["c"]
        model.heads.default_factory = None
    return model


def test_a_failed_creation_on_some_ranks_removes_every_created_entry_on_every_rank() -> None:
    """Rank 0 creates heads "b" and "c"; rank 2 creates the nested entries, then fails."""
    models = _models(_failing, 3)
    before = [(_state(m), _entry_names(m)) for m in models]

    def rank_main(rank: int) -> tuple[tuple[str, str, str], Any]:
        model = copy.deepcopy(models[rank])
        return _refused(model), (_state(model), _entry_names(model))

    results = run_threads(3, rank_main)
    message = (
        "sync_entries created no entry: creating the missing entries failed on "
        "rank 1: RuntimeError('no outer entry on rank 1'); rank 2: KeyError('b')"
    )
    causes = ["None", "RuntimeError('no outer entry on rank 1')", "KeyError('b')"]
    assert [r[0] for r in results] == [("RuntimeError", message, c) for c in causes]
    for rank, (_, (state, names)) in enumerate(results):
        assert names == before[rank][1], rank
        _assert_states_equal(state, before[rank][0])


def test_an_entry_under_a_module_dict_on_another_rank_is_a_type_error_reported() -> None:
    def build(rank: int) -> Model:
        model = Model()
        if rank == 0:
            model.heads["a"]
        else:
            model.heads = nn.ModuleDict()  # type: ignore[assignment]
        return model

    models = _models(build, 2)

    def rank_main(rank: int) -> tuple[tuple[str, str, str], list[str]]:
        model = copy.deepcopy(models[rank])
        return _refused(model), list(model.heads)

    results = run_threads(2, rank_main)
    error = "TypeError(\"'heads' is a ModuleDict, not a ModuleDefaultDict\")"
    message = (
        f"sync_entries created no entry: creating the missing entries failed on rank 1: {error}"
    )
    assert results == [
        (("RuntimeError", message, "None"), ["a"]),
        (("RuntimeError", message, error), []),
    ]


def test_meta_tensors_on_some_ranks_only_are_refused_and_the_created_entries_removed() -> None:
    def build(rank: int) -> Model:
        model = Model()
        if rank == 0:
            model.heads["a"]
            model.to("meta")
            model.heads["b"]
        else:
            model.heads["c"]
        return model

    models = _models(build, 2)

    def rank_main(rank: int) -> tuple[tuple[str, str, str], list[str], list[str]]:
        model = copy.deepcopy(models[rank])
        refused = _refused(model)
        return refused, list(model.heads), [str(p.device) for p in model.heads.parameters()]

    results = run_threads(2, rank_main)
    message = (
        "sync_entries created no entry: heads.a.bias, heads.a.weight, heads.b.bias, "
        "heads.b.weight, heads.c.bias, heads.c.weight are on the meta device on some ranks "
        "only; move or materialise the model alike on every rank"
    )
    assert results == [
        (("ValueError", message, "None"), ["a", "b"], ["meta"] * 4),
        (("ValueError", message, "None"), ["c"], ["cpu"] * 2),
    ]


def test_meta_tensors_on_every_rank_are_left_alone_and_the_names_synchronised() -> None:
    def rank_main(rank: int) -> tuple[list[str], list[str], list[str]]:
        model = Model().to("meta")
        model.heads["a" if rank == 0 else "b"]
        created = sync_entries(model)
        return created, list(model.heads), [str(p.device) for p in model.parameters()]

    assert run_threads(2, rank_main) == [
        (["heads.b"], ["a", "b"], ["meta"] * 6),
        (["heads.a"], ["a", "b"], ["meta"] * 6),
    ]


# Entries that differ between ranks, aliases and ranks outside the group ------------------------


def _refused_alike(
    build: Callable[[int], nn.Module], world_size: int
) -> tuple[str, list[Any], list[Any]]:
    """Run sync_entries on each rank's model; the one error, and the states before and after.

    Every rank must raise the same ValueError, without a cause.
    """
    models = _models(build, world_size)
    before = [(_state(m), {k: list(d) for k, d in _dicts(m).items()}) for m in models]

    def rank_main(rank: int) -> tuple[tuple[str, str, str], Any]:
        model = copy.deepcopy(models[rank])
        return _refused(model), (_state(model), {k: list(d) for k, d in _dicts(model).items()})

    results = run_threads(world_size, rank_main)
    errors = {error for error, _ in results}
    assert len(errors) == 1, errors
    kind, message, cause = errors.pop()
    assert (kind, cause) == ("ValueError", "None")
    return message, before, [after for _, after in results]


def _dicts(model: nn.Module) -> dict[str, ModuleDefaultDict[Any]]:
    return {n: m for n, m in model.named_modules() if isinstance(m, ModuleDefaultDict)}


def _assert_unchanged(before: list[Any], after: list[Any]) -> None:
    for rank, ((state, names), (state_after, names_after)) in enumerate(
        zip(before, after, strict=True)
    ):
        assert names_after == names, rank
        _assert_states_equal(state_after, state)


def test_an_entry_of_another_dtype_on_some_rank_is_refused_everywhere_changing_nothing() -> None:
    """bfloat16 on rank 0, float32 on rank 1: the bytes would be reinterpreted."""

    def build(rank: int) -> Model:
        model = Model()
        model.heads["a"]
        model.heads["only" + str(rank)]  # the others would create it
        if rank == 0:
            model.heads["a"].bfloat16()
        return model

    message, before, after = _refused_alike(build, 3)
    assert message.startswith("sync_entries: ")
    for fact in ("entry heads.a", "torch.bfloat16", "rank 0", "torch.float32", "rank 1", "rank 2"):
        assert fact in message, fact
    assert message.endswith(f"; {_BUILD_ALIKE}")
    assert "only" not in message
    _assert_unchanged(before, after)


@pytest.mark.parametrize(
    ("entries", "facts"),
    [
        # The same number of bytes in another shape.
        (
            (lambda: nn.Linear(3, 2, bias=False), lambda: nn.Linear(2, 3, bias=False)),
            [
                "entry heads.a: weight is torch.float32 of shape (2, 3) on rank 0 but "
                "torch.float32 of shape (3, 2) on rank 1"
            ],
        ),
        (
            (Model().heads.default_factory, lambda: nn.Linear(2, 2, bias=False)),
            ["bias", "but missing on rank 1"],
        ),
        ((Model().heads.default_factory, lambda: nn.Linear(2, 4)), ["(4, 2)", "bias", "(4,)"]),
    ],
    ids=["shape", "missing-tensor", "size"],
)
def test_an_entry_of_another_shape_or_other_tensors_is_refused_naming_them(
    entries: tuple[Callable[[], nn.Module], ...], facts: list[str]
) -> None:
    def build(rank: int) -> Model:
        model = Model()
        model.heads["a"] = entries[rank]()
        if rank == 1:
            model.outer["x"]  # rank 0 would create it
        return model

    message, before, after = _refused_alike(build, 2)
    assert "entry heads.a" in message
    for fact in facts:
        assert fact in message, fact
    _assert_unchanged(before, after)


def test_an_entry_created_in_another_dtype_is_refused_and_every_created_entry_removed() -> None:
    """Rank 1's dict was cast: it would create rank 0's "a" in bfloat16, and rank 0 its "b"
    in float32. Only creating them shows it; both are removed again on every rank."""

    def build(rank: int) -> Model:
        model = Model()
        model.outer["x"]
        if rank == 1:
            model.heads.bfloat16()
        model.heads["ab"[rank]]
        return model

    message, before, after = _refused_alike(build, 2)
    assert message.startswith("sync_entries created no entry: ")
    for fact in ("entry heads.a", "; entry heads.b", "torch.bfloat16", "torch.float32"):
        assert fact in message, fact
    assert message.endswith(f"; {_BUILD_ALIKE}")
    _assert_unchanged(before, after)


def test_tensors_registered_in_another_order_are_matched_by_name() -> None:
    class Pair(nn.Module):
        def __init__(self, flip: bool) -> None:
            super().__init__()
            names = ["q", "p"] if flip else ["p", "q"]
            for name in names:
                self.register_parameter(name, nn.Parameter(torch.randn(2 if name == "p" else 3)))

    def build(rank: int) -> nn.Module:
        heads = ModuleDefaultDict(None, {"a": Pair(flip=rank == 1)})
        return heads

    models = _models(build, 2)
    expected = _state(models[0])

    def rank_main(rank: int) -> dict[str, torch.Tensor]:
        heads = copy.deepcopy(models[rank])
        sync_entries(heads)
        return _state(heads)

    for state in run_threads(2, rank_main):
        assert {k: v.tolist() for k, v in state.items()} == {
            k: v.tolist() for k, v in expected.items()
        }


def test_an_entry_under_two_names_is_refused_on_every_rank() -> None:
    def build(rank: int) -> Model:
        model = Model()
        if rank == 0:
            model.heads["b"] = model.heads["a"]
        return model

    message, before, after = _refused_alike(build, 2)
    assert message == (
        "sync_entries: rank 0: heads.a and heads.b are one module; the ranks that lack it "
        "would create a separate module for each name: register each entry under one name"
    )
    _assert_unchanged(before, after)


def test_a_rank_outside_the_group_is_refused_without_entering_its_collectives() -> None:
    """Ranks 0 and 1 synchronise in their group; rank 2, not in it, is told so at once."""

    def build(rank: int) -> Model:
        model = Model()
        model.heads["abc"[rank]]
        return model

    models = _models(build, 3)

    def rank_main(rank: int) -> tuple[str, list[str]]:
        pair = dist.new_group([0, 1])
        model = copy.deepcopy(models[rank])
        try:
            outcome = str(sync_entries(model, group=pair))
        except ValueError as error:
            outcome = str(error)
        return outcome, list(model.heads)

    results = run_threads(3, rank_main)
    assert results[:2] == [("['heads.b']", ["a", "b"]), ("['heads.a']", ["a", "b"])]
    message, names = results[2]
    assert names == ["c"]
    assert "rank 2 of the default group, is not a rank of the group" in message
    assert "call sync_entries on the ranks of the group only" in message
