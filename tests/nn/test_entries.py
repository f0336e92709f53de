"""create_entries in one process, a DCP resume end to end, and what both functions refuse.

The multi-rank behaviour of sync_entries and the two-rank FSDP2 resume are checked in
``tests/nn/distributed/entries_checks.py``.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
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


def test_creates_the_named_entries_nested_ones_included_in_key_order() -> None:
    model = Model()
    keys = [
        "trunk.weight",
        "heads.b.weight",
        "outer.x.inner.y.bias",
        "heads.a.bias",
        "heads.b.bias",
        "outer.x.proj.weight",
    ]
    assert create_entries(model, keys) == ["heads.b", "outer.x", "outer.x.inner.y", "heads.a"]
    assert list(model.heads) == ["b", "a"]
    assert list(model.outer) == ["x"]
    assert list(model.outer["x"].inner) == ["y"]
    assert create_entries(model, keys) == []


def test_the_prefix_is_stripped_and_keys_without_it_are_ignored() -> None:
    model = Model()
    keys = ["model.heads.a.weight", "optim.heads.b.weight", "heads.c.weight"]
    assert create_entries(model, keys, prefix="model.") == ["heads.a"]
    assert list(model.heads) == ["a"]


def test_a_prefix_without_a_final_dot_is_an_error_naming_the_fix() -> None:
    model = Model()
    with pytest.raises(ValueError, match="must end with") as info:
        create_entries(model, ["model.heads.a.weight"], prefix="model")
    assert str(info.value) == (  # the one golden message
        "create_entries prefix 'model' must end with '.', as state-dict keys separate names "
        "with it; pass prefix='model.'"
    )
    assert list(model.heads) == []


def test_keys_match_the_module_itself_its_tensors_and_existing_entries() -> None:
    heads = ModuleDefaultDict(functools.partial(nn.Linear, 2, 2))
    assert create_entries(heads, ["a.weight", "b.bias", "weight"]) == ["a", "b"]
    assert create_entries(heads, ["a.renamed_weight"]) == []  # whatever follows an entry
    assert create_entries(nn.Linear(2, 2), ["weight", "model.weight"]) == []


def test_names_that_cannot_be_entries_and_closed_dicts_create_nothing() -> None:
    model = Model()
    keys = [
        "trunk.weight",  # without a key that matches, the call raises (tested below)
        "heads.training.weight",
        "heads.weight",
        "closed.new.weight",
        "trunk.x.weight",
    ]
    assert create_entries(model, keys) == []
    assert list(model.heads) == []
    assert list(model.closed) == ["kept"]


def test_creates_exactly_the_entries_a_load_creates() -> None:
    trained = Model()
    for name in ("c", "a"):
        trained.heads[name]
    trained.outer["x"].inner["y"]
    keys = list(trained.state_dict())
    by_load, by_keys = Model(), Model()
    by_load.load_state_dict(trained.state_dict())
    create_entries(by_keys, keys)
    assert list(by_keys.state_dict()) == list(by_load.state_dict()) == keys


def test_created_entries_follow_the_dict() -> None:
    model = Model().to(torch.float64).eval()
    create_entries(model, ["heads.a.weight"])
    assert model.heads["a"].weight.dtype == torch.float64
    assert not model.heads["a"].training


class WithExtraState(nn.Module):
    """A module whose state dict holds a dict, which DCP flattens into keys below its name."""

    def get_extra_state(self) -> dict[str, int]:
        return {"step": 3}

    def set_extra_state(self, state: dict[str, int]) -> None:
        pass


def test_keys_that_match_only_the_trunk_create_nothing_and_raise_nothing() -> None:
    model = Model()
    model.extra = WithExtraState()
    keys = ["model.trunk.weight", "model.extra._extra_state.step", "step"]
    assert create_entries(model, keys, prefix="model.") == []
    assert create_entries(model, keys[1:], prefix="model.") == []
    assert create_entries(model, []) == []


def _entry_names(model: nn.Module) -> dict[str, list[str]]:
    return {name: list(d) for name, d in model.named_modules() if isinstance(d, ModuleDefaultDict)}


def _no_match(model: nn.Module, keys: list[str], prefix: str = "") -> str:
    before = _entry_names(model)
    with pytest.raises(ValueError, match=r"^create_entries: ") as info:
        create_entries(model, keys, prefix=prefix)
    assert _entry_names(model) == before
    return str(info.value)


@pytest.mark.parametrize("prefix", ["", "module."])
def test_keys_without_the_prefix_they_need_are_an_error_naming_it(prefix: str) -> None:
    """The keys of ``dcp.save({"model": sd, "step": 3})``: not one names part of the model
    until "model." is removed, and a resume would silently lose every entry."""
    keys = ["model.heads.a.weight", "model.trunk.weight", "model.outer.x.proj.bias", "step"]
    message = _no_match(Model(), keys, prefix)
    for fact in ("4 keys", "'model.heads.a.weight'", f"prefix {prefix!r} is removed"):
        assert fact in message
    assert message.endswith("pass prefix='model.'")
    if prefix:  # the one golden message
        assert message == (
            "create_entries: not one of the 4 keys, such as 'model.heads.a.weight', names a "
            "parameter, buffer or entry of the module once the prefix 'module.' is removed, so "
            "a resume would restore nothing of it; the keys name it under the prefix 'model.': "
            "pass prefix='model.'"
        )


def test_the_prefix_named_is_the_one_most_keys_share() -> None:
    keys = ["step", "ema.heads.a.weight", "model.trunk.bias", "model.heads.b.weight"]
    assert _no_match(Model(), keys).endswith("pass prefix='model.'")
    keys = ["step", "model.heads.a.weight", "ema.trunk.bias", "ema.heads.b.weight"]
    assert _no_match(Model(), keys).endswith("pass prefix='ema.'")


def test_keys_saved_without_a_prefix_are_an_error_naming_the_empty_prefix() -> None:
    message = _no_match(Model(), ["heads.a.weight", "trunk.weight"], "model.")
    assert message.endswith("pass prefix=''")


def test_keys_of_another_model_are_an_error_naming_no_prefix() -> None:
    message = _no_match(Model(), ["model.encoder.weight", "model.closed.new.weight"], "model.")
    assert "'model.encoder.weight'" in message
    assert "prefix=" not in message
    assert message.endswith("pass the keys of a checkpoint of this model")


# A DCP resume in one process ----------------------------------------------------------------


def _train(model: Model) -> None:
    for name in ("alpha", "beta"):
        model.heads[name]
    model.outer["x"].inner["y"]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(4, 2)
    loss = sum(m(x).sum() for m in (model.heads["alpha"], model.heads["beta"], model.trunk))
    loss.backward()
    opt.step()


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that no process group is set
def test_a_dcp_resume_into_a_fresh_model_restores_every_entry(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trained = Model()
    _train(trained)
    dcp.save({"model": trained.state_dict(), "step": 3}, checkpoint_id=tmp_path)

    torch.manual_seed(1)
    fresh = Model()
    metadata = dcp.FileSystemReader(tmp_path).read_metadata()
    with pytest.raises(ValueError, match=r"pass prefix='model\.'$"):
        create_entries(fresh, metadata.state_dict_metadata)
    created = create_entries(fresh, metadata.state_dict_metadata, prefix="model.")
    assert created == ["heads.alpha", "heads.beta", "outer.x", "outer.x.inner.y"]
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path)
    fresh.load_state_dict(state["model"], strict=True)

    assert list(fresh.state_dict()) == list(trained.state_dict())
    for name, tensor in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


# Wrapped models are refused -------------------------------------------------------------------


WRAPPED = {
    "ddp": (DistributedDataParallel, "DistributedDataParallel"),
    "fully_shard": (fully_shard, "FSDPModel"),
}


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("kind", sorted(WRAPPED))
def test_both_refuse_a_wrapped_model_naming_the_wrapper(kind: str) -> None:
    wrap, wrapper = WRAPPED[kind]
    model = Model()
    model.heads["a"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = wrap(model)
    fix = f"wrapped by {wrapper}.*create the entries before wrapping$"
    with pytest.raises(ValueError, match=f"^create_entries: .*{fix}"):
        create_entries(wrapped, ["heads.b.weight"])
    with pytest.raises(ValueError, match=f"^sync_entries: rank 0: .*{fix}") as info:
        sync_entries(wrapped)
    if kind == "ddp":  # the one golden message
        assert str(info.value) == (
            "sync_entries: rank 0: the module is wrapped by DistributedDataParallel, which only "
            "manages the parameters that existed when it wrapped; create the entries before "
            "wrapping"
        )
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
def test_on_one_rank_sync_entries_creates_nothing_and_keeps_the_values() -> None:
    model = Model()
    model.heads["a"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert sync_entries(model) == []
    for name, tensor in before.items():
        assert torch.equal(model.state_dict()[name], tensor)


@pytest.mark.usefixtures("one_rank")
def test_a_non_contiguous_parameter_is_sent_through_a_contiguous_copy(
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
    assert sync_entries(model) == []
    assert sent == [(2,), (2, 2)] * 2  # in name order: closed.kept, heads.a; bias, weight
    weight = model.heads["a"].weight
    assert not weight.is_contiguous()
    assert torch.equal(weight, torch.tensor([[0.0, 2.0], [1.0, 3.0]]))


def test_a_factory_returning_a_non_module_is_a_type_error() -> None:
    model = nn.Module()
    model.heads = ModuleDefaultDict(lambda: 3)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match=r"it must return an nn\.Module instance$"):
        create_entries(model, ["heads.a.weight"])
    assert list(model.heads) == []
