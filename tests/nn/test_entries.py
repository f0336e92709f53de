"""create_entries in one process; what both entry functions refuse on one rank, and what
sync_entries passes to a model's own code there.

sync_entries across ranks is tested in ``test_sync_entries_ranks.py``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from toolkit.nn import ModuleDefaultDict, create_entries, sync_entries


class Inner(nn.Module):
    """An entry that holds a dict of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)
        self.inner = ModuleDefaultDict(functools.partial(nn.Linear, 2, 2))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(2, 2)
        self.heads = ModuleDefaultDict(functools.partial(nn.Linear, 2, 2))
        self.outer = ModuleDefaultDict(Inner)
        self.closed = ModuleDefaultDict(None, {"kept": nn.Linear(2, 2)})


def _entry_names(model: nn.Module) -> dict[str, list[str]]:
    return {name: list(d) for name, d in model.named_modules() if isinstance(d, ModuleDefaultDict)}


def test_creates_the_named_entries_nested_ones_included_in_key_order() -> None:
    model = Model()
    keys = [
        "model.trunk.weight",
        "model.heads.b.weight",
        "model.outer.x.inner.y.bias",
        "optim.heads.c.weight",  # without the prefix: ignored
        "model.heads.a.bias",
        "model.heads.b.bias",
        "model.outer.x.proj.weight",
    ]
    created = create_entries(model, keys, prefix="model.")
    assert created == ["heads.b", "outer.x", "outer.x.inner.y", "heads.a"]
    names = {"heads": ["b", "a"], "outer": ["x"], "outer.x.inner": ["y"], "closed": ["kept"]}
    assert _entry_names(model) == names
    assert create_entries(model, keys, prefix="model.") == []


def test_keys_match_the_module_itself_its_tensors_and_existing_entries() -> None:
    heads = ModuleDefaultDict(functools.partial(nn.Linear, 2, 2))
    assert create_entries(heads, ["a.weight", "b.bias", "weight"]) == ["a", "b"]
    assert create_entries(heads, ["a.renamed_weight"]) == []  # whatever follows an entry
    assert create_entries(nn.Linear(2, 2), ["weight", "model.weight"]) == []


class WithExtraState(nn.Module):
    """A module whose state dict holds a dict, which DCP flattens into keys below its name."""

    def get_extra_state(self) -> dict[str, int]:
        return {"step": 3}

    def set_extra_state(self, state: dict[str, int]) -> None:
        pass


@pytest.mark.parametrize(
    "keys",
    [
        # Names that cannot be entries, and a closed dict; "trunk.weight" makes the keys match.
        ["trunk.weight", "heads.training.weight", "heads.weight", "closed.new.w", "trunk.x.w"],
        ["trunk.weight", "extra._extra_state.step", "step"],
        ["extra._extra_state.step"],
        [],
    ],
    ids=["not-entries", "trunk-only", "extra-state", "no-keys"],
)
def test_keys_that_name_no_new_entry_create_nothing_and_raise_nothing(keys: list[str]) -> None:
    model = Model()
    model.extra = WithExtraState()
    assert create_entries(model, keys) == []
    assert _entry_names(model) == {"heads": [], "outer": [], "closed": ["kept"]}


def test_creates_exactly_the_entries_a_load_creates_and_they_follow_the_dict() -> None:
    trained = Model()
    for name in ("c", "a"):
        trained.heads[name]
    trained.outer["x"].inner["y"]
    keys = list(trained.state_dict())
    by_load, by_keys = Model(), Model().to(torch.float64).eval()
    by_load.load_state_dict(trained.state_dict())
    create_entries(by_keys, keys)
    assert list(by_keys.state_dict()) == list(by_load.state_dict()) == keys
    assert by_keys.heads["a"].weight.dtype == torch.float64
    assert not by_keys.heads["a"].training


@pytest.mark.parametrize(
    ("keys", "prefix", "fix"),
    [
        # The keys of dcp.save({"model": sd, "step": 3}): the prefix they need is named.
        ("model.heads.a.weight model.trunk.weight model.outer.x.proj.bias step", "", "'model.'"),
        ("model.heads.a.weight model.trunk.weight step", "module.", "'model.'"),
        # The prefix most keys share.
        ("step ema.heads.a.weight model.trunk.bias model.heads.b.weight", "", "'model.'"),
        ("step model.heads.a.weight ema.trunk.bias ema.heads.b.weight", "", "'ema.'"),
        ("heads.a.weight trunk.weight", "model.", "''"),
        ("model.encoder.weight model.closed.new.weight", "model.", None),
    ],
    ids=[
        "needs-prefix",
        "wrong-prefix",
        "most-shared",
        "most-shared-2",
        "no-prefix",
        "other-model",
    ],
)
def test_keys_that_match_nothing_are_an_error_naming_the_prefix_that_would(
    keys: str, prefix: str, fix: str | None
) -> None:
    """A resume with such keys would silently lose every entry; nothing is created."""
    model = Model()
    with pytest.raises(ValueError, match=r"^create_entries: ") as info:
        create_entries(model, keys.split(), prefix=prefix)
    message = str(info.value)
    first, *rest = keys.split()
    removed = f"prefix {prefix!r} is removed, so a resume would restore nothing of it; "
    for fact in (f"{len(rest) + 1} keys", repr(first), removed):
        assert fact in message
    if fix is None:
        assert message.endswith("pass the keys of a checkpoint of this model")
        assert "prefix=" not in message
    else:
        assert message.endswith(f"pass prefix={fix}")
    assert _entry_names(model) == {"heads": [], "outer": [], "closed": ["kept"]}


def test_a_prefix_without_a_final_dot_is_an_error_naming_the_fix() -> None:
    model = Model()
    with pytest.raises(ValueError, match="must end with") as info:
        create_entries(model, ["model.heads.a.weight"], prefix="model")
    assert str(info.value) == (  # the one golden message
        "create_entries prefix 'model' must end with '.', as state-dict keys separate names "
        "with it; pass prefix='model.'"
    )
    assert list(model.heads) == []


def test_a_factory_returning_a_non_module_is_a_type_error() -> None:
    model = nn.Module()
    model.heads = ModuleDefaultDict(lambda: 3)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match=r"it must return an nn\.Module instance$"):
        create_entries(model, ["heads.a.weight"])
    assert list(model.heads) == []


# Wrapped models are refused -------------------------------------------------------------------


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize(
    ("wrap", "wrapper"),
    [(DistributedDataParallel, "DistributedDataParallel"), (fully_shard, "FSDPModel")],
    ids=["ddp", "fully_shard"],
)
def test_both_refuse_a_wrapped_model_naming_the_wrapper(wrap: Any, wrapper: str) -> None:
    model = Model()
    model.heads["a"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = wrap(model)
    fix = f"the module is wrapped by {wrapper}, .*; create the entries before wrapping$"
    with pytest.raises(ValueError, match=f"^create_entries: .*{fix}"):
        create_entries(wrapped, ["heads.b.weight"])
    with pytest.raises(ValueError, match=f"^sync_entries: rank 0: .*{fix}"):
        sync_entries(wrapped)
    assert list(model.heads) == ["a"]


@pytest.mark.usefixtures("one_rank")
def test_a_submodule_of_a_sharded_model_is_refused_for_its_dtensors() -> None:
    model = Model()
    model.heads["a"]
    fully_shard(model)
    with pytest.raises(ValueError, match="DTensor") as info:
        create_entries(model.heads, ["b.weight"])
    assert str(info.value) == (  # the one golden message
        "create_entries: parameter a.weight is a DTensor: the model is already sharded; "
        "create the entries before fully_shard"
    )


@pytest.mark.usefixtures("one_rank")
def test_the_model_inside_ddp_and_an_empty_dict_of_a_sharded_model_are_not_recognised() -> None:
    """What the docstrings say cannot be refused: nothing marks these as wrapped."""
    model = Model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp = DistributedDataParallel(model)
    assert create_entries(ddp.module, ["heads.a.weight"]) == ["heads.a"]
    sharded = Model()
    fully_shard(sharded)
    assert create_entries(sharded.heads, ["b.weight"]) == ["b"]
    assert sync_entries(sharded.outer) == []


@pytest.mark.usefixtures("one_rank")
def test_on_one_rank_sync_entries_keeps_every_value_sending_contiguous_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL refuses to send a non-contiguous tensor; gloo takes one, so it is refused here as
    NCCL does. The entry keeps its values and its strides."""
    sent: list[tuple[int, ...]] = []
    broadcast = dist.broadcast

    def nccl_broadcast(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not tensor.is_contiguous():
            raise ValueError("Tensors must be contiguous")
        sent.append(tuple(tensor.shape))
        return broadcast(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "broadcast", nccl_broadcast)
    model = Model()
    model.heads["a"].weight = nn.Parameter(torch.arange(4.0).reshape(2, 2).t())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert sync_entries(model) == []
    assert sent == [(2,), (2, 2)] * 2  # in name order: closed.kept, heads.a; bias, weight
    assert not model.heads["a"].weight.is_contiguous()
    for name, tensor in before.items():
        assert torch.equal(model.state_dict()[name], tensor), name


# What sync_entries gives a model's own code ---------------------------------------------------


class Checked(nn.Linear):
    """An entry whose ``named_modules`` checks the types of its arguments, as a runtime type
    checker (typeguard, beartype) does."""

    def named_modules(
        self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Module]]:
        if not isinstance(remove_duplicate, bool):
            raise TypeError(f"remove_duplicate must be a bool, not {remove_duplicate!r}")
        return super().named_modules(memo, prefix, remove_duplicate)


@pytest.mark.usefixtures("one_rank")
def test_sync_entries_gives_named_modules_the_bools_torch_documents() -> None:
    """A module may check what its ``named_modules`` is given: such an entry is synchronised
    as any other, and one registered under two names is refused for that, not a TypeError."""
    model = Model()
    model.heads = ModuleDefaultDict(functools.partial(Checked, 2, 2))
    model.heads["a"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert sync_entries(model) == []
    assert list(model.state_dict()) == list(before)
    for name, tensor in before.items():
        assert torch.equal(model.state_dict()[name], tensor), name
    model.heads["b"] = model.heads["a"]
    with pytest.raises(ValueError, match=r"^sync_entries: rank 0: heads\.a and heads\.b are one "):
        sync_entries(model)
    assert list(model.heads) == ["a", "b"]
