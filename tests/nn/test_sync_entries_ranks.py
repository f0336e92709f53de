"""sync_entries on 2 and 3 threaded ranks of one process, against values written out here.

Each rank builds its model from the one generator the threads share, so an entry that several
ranks hold differs between them until the call. Afterwards every rank holds the union, in
rank order, each entry's tensors from the lowest rank that had it (the innermost entry
deciding), everything else its own. A call that is refused raises on every rank and changes
nothing on any.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate
from torch.nn.parallel import DistributedDataParallel

from tests.nn.distributed.tiny_lm import (
    ReferenceTaskLM,
    TaskLM,
    initial_state,
    reference_training,
    train,
)
from tests.nn.ranks import run_threads
from toolkit.nn import ModuleDefaultDict, create_entries, sync_entries


class Inner(nn.Module):
    """An entry holding a parameter, an integer buffer and a dict of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)
        self.register_buffer("count", torch.tensor([0]))
        self.inner = ModuleDefaultDict(functools.partial(nn.Linear, 2, 2))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(2, 2)
        self.heads = ModuleDefaultDict(functools.partial(nn.Linear, 2, 2))
        self.outer = ModuleDefaultDict(Inner)


def _snapshot(model: nn.Module) -> tuple[dict[str, list[str]], dict[str, torch.Tensor]]:
    """Every dict's entry names, and the state (local parts of DTensors, meta as meta)."""
    names = {n: list(d) for n, d in model.named_modules() if isinstance(d, ModuleDefaultDict)}
    state = {
        k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    return names, state


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for key, tensor in expected.items():
        assert actual[key].device == tensor.device, key
        assert tensor.is_meta or torch.equal(actual[key], tensor), key


def _with_heads(*per_rank: str | list[str]) -> Callable[[int], nn.Module]:
    """Models whose rank r creates the heads per_rank[r] names."""

    def build(rank: int) -> nn.Module:
        model = Model()
        for key in per_rank[rank]:
            model.heads[key]
        return model

    return build


def _sync(
    build: Callable[[int], nn.Module], world_size: int, groups: list[list[int]] | None = None
) -> list[dict[str, Any]]:
    """Run sync_entries on each rank's model ``build(rank)``, in the group of ``groups`` that
    holds the rank: what it returned or raised, and the snapshots before and after."""

    def rank_main(rank: int) -> dict[str, Any]:
        made = [dist.new_group(ranks) for ranks in groups or []]
        holding = [g for g, ranks in zip(made, groups or [], strict=True) if rank in ranks]
        group = (holding or made or [None])[0]  # a rank in no group is given the first
        model = build(rank)  # values drawn on every rank from one generator: they differ
        before = _snapshot(model)
        try:
            outcome: Any = sync_entries(model, group)
        except (RuntimeError, ValueError) as error:
            outcome = (type(error), str(error), repr(error.__cause__))
        return {"outcome": outcome, "before": before, "after": _snapshot(model)}

    return run_threads(world_size, rank_main)


# The union, in rank order, valued by the lowest owner ------------------------------------------


def _nested(rank: int) -> nn.Module:
    model = _with_heads(["a", "s"], ["s", "b"], ["c", "a"])(rank)
    if rank < 2:
        model.outer["x"].count += rank + 1
    if rank == 1:
        model.outer["x"].inner["y"]  # inside an entry that rank 0 owns
        model.outer["z"]
        # A non-contiguous parameter on a rank that receives the value of rank 0.
        model.heads["s"].weight = nn.Parameter(torch.randn(2, 2).t())
    return model


def _the_dict_itself(rank: int) -> nn.Module:
    heads = ModuleDefaultDict(functools.partial(nn.Linear, 2, 2))
    for key in (["b", "a"], ["a", "c"])[rank]:
        heads[key]
    return heads


class Pair(nn.Module):  # two parameters, registered in either order
    def __init__(self, flip: bool) -> None:
        super().__init__()
        for name in ["q", "p"] if flip else ["p", "q"]:
            self.register_parameter(name, nn.Parameter(torch.randn(2 if name == "p" else 3)))


NESTED = {"heads": ["a", "s", "b", "c"], "outer": ["x", "z"], "outer.x.inner": ["y"]}
UNION = {
    # id: (build, groups, what each rank creates, each rank's dicts' entries afterwards)
    "nested": (
        _nested,
        None,
        [
            ["heads.b", "outer.z", "outer.x.inner.y", "heads.c"],
            ["heads.a", "heads.c"],
            ["heads.s", "outer.x", "heads.b", "outer.z", "outer.x.inner.y"],
        ],
        [NESTED] * 3,
    ),
    "the-dict-itself": (_the_dict_itself, None, [["c"], ["b"]], [{"": ["b", "a", "c"]}] * 2),
    # Group rank 1 is world rank 2: the owner of "b" must be taken as a rank of the group.
    "groups": (
        _with_heads(["p", "q"], ["a"], ["b"]),
        [[0], [1, 2]],
        [[], ["heads.b"], ["heads.a"]],
        [{"heads": ["p", "q"]}, {"heads": ["a", "b"]}, {"heads": ["a", "b"]}],
    ),
    "registered-in-another-order": (
        lambda rank: ModuleDefaultDict(None, {"a": Pair(flip=rank == 1)}),
        None,
        [[], []],
        [{"": ["a"]}] * 2,
    ),
}


@pytest.mark.parametrize("case", list(UNION))
def test_every_rank_ends_with_the_union_in_rank_order_valued_by_the_lowest_owner(
    case: str,
) -> None:
    build, groups, created, names = UNION[case]
    results = _sync(build, len(created), groups)
    befores = [r["before"] for r in results]
    for rank, result in enumerate(results):
        assert result["outcome"] == created[rank]
        after_names, state = result["after"]
        assert {k: v for k, v in after_names.items() if v} == names[rank]
        # Each entry's lowest owner in the group; a state key takes the value of its
        # innermost entry's owner.
        owners: dict[str, int] = {}
        for other in next((g for g in groups or [] if rank in g), range(len(results))):
            for path, keys in befores[other][0].items():
                for key in keys:
                    owners.setdefault(f"{path}.{key}" if path else key, other)
        assert state.keys() == results[min(owners.values(), default=rank)]["after"][1].keys()
        for key, value in state.items():
            entries = [e for e in owners if key.startswith(e + ".")]
            owner = owners[max(entries, key=len)] if entries else rank
            assert torch.equal(value, befores[owner][1][key]), (rank, key)
    if case == "nested":  # the values really differed before: each rank drew its own
        assert not torch.equal(befores[0][1]["heads.s.weight"], befores[1][1]["heads.s.weight"])
        assert [b[1]["outer.x.count"].item() for b in befores[:2]] == [1, 2]
        assert not befores[1][1]["heads.s.weight"].is_contiguous()


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


# A refused call raises on every rank and changes nothing ---------------------------------------


def _no_inner() -> Inner:
    raise RuntimeError("no outer entry on rank 1")


def _refused_model(case: str, rank: int) -> nn.Module:
    """This rank's model for a call that ``case`` makes every rank refuse."""
    model = Model()
    if case == "dtensor":  # on ranks 0 and 2
        model.heads["a"]
        if rank == 1:
            model.heads["b"]
        owner = {0: model.heads["a"], 2: model.trunk}.get(rank)
        mesh = DeviceMesh("cpu", [0, 1, 2])
        if owner is not None:
            owner.weight = nn.Parameter(
                DTensor.from_local(owner.weight.detach(), mesh, [Replicate()])
            )
    elif case == "aliased":
        if rank == 0:
            model.heads["b"] = model.heads["a"]
    elif case == "failed-creation":  # rank 1's outer factory raises; rank 2 cannot create "b"
        if rank == 0:
            model.outer["x"].inner["y"]
        else:
            model.heads["bc"[rank - 1]]
        if rank == 1:
            model.outer.default_factory = _no_inner
        if rank == 2:
            model.heads.default_factory = None
    elif case == "module-dict":
        if rank == 0:
            model.heads["a"]
        else:
            model.heads = nn.ModuleDict()  # type: ignore[assignment]
    elif case == "meta-on-some-ranks":
        model.heads["a"]
        model.to("meta" if rank == 0 else "cpu")
        model.heads["bc"[rank]]
    elif case == "dtype":  # the bytes would be reinterpreted
        model.heads["a"].to(torch.bfloat16 if rank == 0 else torch.float32)
        model.heads[f"only{rank}"]
    elif case in ("shape", "missing-tensor"):
        shapes = (
            [(3, 2, False), (2, 3, False)] if case == "shape" else [(2, 2, True), (2, 2, False)]
        )
        model.heads["a"] = nn.Linear(*shapes[rank][:2], bias=shapes[rank][2])
        model.outer["x" if rank else "y"]  # entries the other rank would create
    else:  # "created-in-another-dtype": rank 1's dict was cast; only creating shows it
        model.outer["x"]
        if rank == 1:
            model.heads.bfloat16()
        model.heads["ab"[rank]]
    return model


NONE = "sync_entries created no entry: "
FAILED = NONE + "creating the missing entries failed on rank 1: "
META = "are on the meta device on some ranks only; move or materialise the model"
ALIKE = "the same factory and the model cast alike before they are created"
REFUSED = {
    # id: (world size, facts the message names, the last one its end)
    "dtensor": (
        3,
        ["rank 0: parameter heads.a.weight", "; rank 2: parameter trunk", "fully_shard"],
    ),
    "aliased": (2, ["rank 0: heads.a and heads.b are one", "would create a separate", "one name"]),
    "failed-creation": (3, [FAILED + "RuntimeError('no outer", "'); rank 2: KeyError('b')"]),
    "module-dict": (2, [FAILED + "TypeError(\"'heads' is a ModuleDict", 'ModuleDefaultDict")']),
    "meta-on-some-ranks": (2, [NONE + "heads.a.bias, heads.a.weight, heads.b.bias", META, "rank"]),
    "dtype": (3, ["heads.a: weight is torch.bfloat16 of shape (2, 2) on rank 0", "rank 2", ALIKE]),
    "shape": (2, ["of shape (2, 3) on rank 0 but torch.float32 of shape (3, 2) on rank 1", ALIKE]),
    "missing-tensor": (
        2,
        ["heads.a: bias is torch.float32 of shape (2,) on rank 0 but missing", ALIKE],
    ),
    "created-in-another-dtype": (2, [NONE, "entry heads.a", "; entry heads.b", "bfloat16", ALIKE]),
}
# Where creating failed: a RuntimeError, raised on the ranks that failed from their failure.
CAUSED = {"failed-creation": (1, 2), "module-dict": (1,)}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refused_call_raises_on_every_rank_and_changes_nothing(case: str) -> None:
    world_size, facts = REFUSED[case]
    results = _sync(functools.partial(_refused_model, case), world_size)
    messages = {r["outcome"][1] for r in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("sync_entries")
    for fact in facts:
        assert fact in message, fact
    assert message.endswith(facts[-1])
    assert "heads.only" not in message  # an entry that one rank alone has is no difference
    for rank, result in enumerate(results):
        kind, _, cause = result["outcome"]
        assert kind is (RuntimeError if case in CAUSED else ValueError)
        # A rank whose creation failed raises from its own failure.
        assert (cause != "None") == (rank in CAUSED.get(case, ())), rank
        assert cause == "None" or f"rank {rank}: {cause}" in message, (rank, cause)
        assert result["after"][0] == result["before"][0], rank
        _assert_same(result["after"][1], result["before"][1])


def test_on_each_group_of_a_device_mesh_the_ranks_take_their_own_groups_union() -> None:
    """Each ``tp`` group of a 2 x 2 ``(dp, tp)`` mesh synchronises its two ranks alone, through
    the objects gathered on that group: ranks 0 and 1 end with heads a and b, ranks 2 and 3
    with c and d, each valued by the rank of the group that had it."""

    def rank_main(rank: int) -> tuple[list[str], Any, Any]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = _with_heads("a", "b", "c", "d")(rank)
        before = _snapshot(model)
        created = sync_entries(model, mesh.get_group("tp"))
        return created, before, _snapshot(model)

    results = run_threads(4, rank_main)
    for rank, (created, (_, own), (names, state)) in enumerate(results):
        first, pair = rank - rank % 2, "abcd"[rank - rank % 2 : rank - rank % 2 + 2]
        assert created == [f"heads.{pair[1 - rank % 2]}"]
        assert {k: v for k, v in names.items() if v} == {"heads": list(pair)}
        expected = {k: v for k, v in own.items() if k.startswith("trunk.")}
        for owner, key in enumerate(pair, start=first):
            prefix = f"heads.{key}."
            expected.update((k, v) for k, v in results[owner][1][1].items() if k.startswith(prefix))
        _assert_same(state, expected)
    assert not torch.equal(results[0][1][1]["trunk.weight"], results[1][1][1]["trunk.weight"])


def _meta_gloo(store: Any, rank: int, size: int, timeout: Any) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(store, rank, size)


def test_a_group_on_another_backend_than_the_default_groups_gathers_on_its_own() -> None:
    """``sync_entries`` gathers on the device of the group it is given: a gloo subgroup beside
    a default group whose backend names another device (as an NCCL default group names
    CUDA) syncs on the CPU, as the one-process model does, here with nothing to create."""
    if "toolkit_meta" not in dist.Backend.backend_list:
        dist.Backend.register_backend("toolkit_meta", _meta_gloo, devices=["meta"])
    dist.init_process_group("toolkit_meta", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0], backend="gloo")
        model = _with_heads("a")(0)
        before = _snapshot(model)
        assert sync_entries(model, group) == []
        _assert_same(_snapshot(model)[1], before[1])
    finally:
        dist.destroy_process_group()


def test_a_rank_outside_the_group_is_refused_without_entering_its_collectives() -> None:
    """Ranks 0 and 1 synchronise in their group; rank 2, not in it, is told so at once."""
    results = _sync(_with_heads("a", "b", "c"), 3, [[0, 1]])
    assert [r["outcome"] for r in results[:2]] == [["heads.b"], ["heads.a"]]
    kind, message, _ = results[2]["outcome"]
    assert kind is ValueError
    assert "rank 2 of the default group, is not a rank of the group it was given; " in message
    assert message.endswith("; call sync_entries on the ranks of the group only")
    assert results[2]["after"][0] == results[2]["before"][0]


# Synchronised entries train as one process does ------------------------------------------------


def _task_model(rank: int) -> TaskLM:
    """TaskLM with this rank's adapters only; those of the reference on ranks 0 and 1."""
    state = initial_state(ReferenceTaskLM)
    torch.manual_seed(200 + rank)
    model = TaskLM()
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith("adapters.")})
    own = {0: ["a"], 1: ["b"]}.get(rank, ["b", "a"])  # rank 2 holds both, with its own values
    for task in own:
        model.adapters[task]
    if rank < 2:
        prefix = f"adapters.{own[0]}."
        model.adapters[own[0]].load_state_dict(
            {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
        )
    return model


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_synced_entries_train_under_ddp_and_fsdp2_like_one_process(
    kind: str, tmp_path: Path
) -> None:
    """Three ranks: FSDP2 splits the vocabulary of 17 unevenly (6, 6 and 5 rows). Saved with
    DCP, the sharded model resumes into a fresh one that creates its entries from the keys."""
    models = [_task_model(rank) for rank in range(3)]

    def rank_main(rank: int) -> dict[str, Any]:
        model = copy.deepcopy(models[rank])
        sync_entries(model)
        model.adapters.default_factory = None
        wrapped: nn.Module = DistributedDataParallel(model) if kind == "ddp" else model
        if kind == "fsdp2":
            fully_shard(model)
        losses, states = train(wrapped, 3)
        with pytest.raises(KeyError, match="late"):  # the closed dict refuses a miss
            model.adapters["late"]
        if kind == "ddp":
            return {"keys": list(model.adapters), "losses": losses, "states": states}
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=tmp_path)
        fresh = TaskLM()
        keys = dcp.FileSystemReader(tmp_path).read_metadata().state_dict_metadata
        created = create_entries(fresh, keys, prefix="model.")
        fully_shard(fresh)
        loaded = {"model": get_model_state_dict(fresh)}
        dcp.load(loaded, checkpoint_id=tmp_path)
        set_model_state_dict(fresh, loaded["model"])
        resumed = get_model_state_dict(fresh, options=StateDictOptions(full_state_dict=True))
        states.append(resumed)  # must equal the last state
        return {"keys": created, "losses": losses, "states": states}

    expected = reference_training(3, ReferenceTaskLM)
    if kind == "fsdp2":
        expected["states"].append(expected["states"][-1])
    for rank, result in enumerate(run_threads(3, rank_main)):
        assert result["keys"] == (["a", "b"] if kind == "ddp" else ["adapters.a", "adapters.b"])
        close = functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)
        close(result["losses"], [step[rank] for step in expected["losses"]])
        for got, want in zip(result["states"], expected["states"], strict=True):
            assert list(got) == list(want)
            for key, value in want.items():
                close(got[key], value, msg=key)
