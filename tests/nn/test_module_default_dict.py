"""Example tests for ModuleDefaultDict: construction, misses, errors, copies, loading, compile."""

from __future__ import annotations

import copy
import functools
import io
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from tests.nn.models import Counter, CountingFactory
from toolkit.nn import ModuleDefaultDict

Lin = functools.partial(nn.Linear, 2, 2)


def snapshot(d: nn.ModuleDict) -> list[tuple[str, nn.Module]]:
    """Everything a failed call must leave alone: entries, their order and identity."""
    return list(d.items())


# Construction ------------------------------------------------------------------------------


def test_is_a_generic_module_dict() -> None:
    d = ModuleDefaultDict[nn.Linear](Lin)
    assert isinstance(d, nn.ModuleDict)
    assert isinstance(d, ModuleDefaultDict)
    assert isinstance(d["a"], nn.Linear)


def test_the_factory_can_be_passed_by_keyword_or_position() -> None:
    assert ModuleDefaultDict(default_factory=Lin).default_factory is Lin
    assert ModuleDefaultDict(Lin).default_factory is Lin
    assert ModuleDefaultDict().default_factory is None


def test_initial_entries_from_mapping_pairs_and_kwargs_keep_their_order() -> None:
    a, b, c, e = Counter(), Counter(), Counter(), Counter()
    d = ModuleDefaultDict(Lin, OrderedDict([("b", b), ("a", a)]), e=e, c=c)
    assert list(d.items()) == [("b", b), ("a", a), ("e", e), ("c", c)]
    pairs = ModuleDefaultDict(None, [("z", a), ("y", b)])
    assert list(pairs.items()) == [("z", a), ("y", b)]


def test_more_than_one_initial_mapping_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="at most 2 positional arguments"):
        ModuleDefaultDict(Lin, {"a": Counter()}, {"b": Counter()})  # type: ignore[call-arg]


def test_an_initial_value_that_is_not_a_module_is_rejected_as_by_module_dict() -> None:
    with pytest.raises(TypeError, match="int is not a Module subclass"):
        ModuleDefaultDict(Lin, a=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int is not a Module subclass"):
        nn.ModuleDict({"a": 3})  # type: ignore[dict-item]


@pytest.mark.parametrize("bad", [3, "nn.Linear", nn.Linear(2, 2).weight])
def test_a_factory_that_is_not_callable_is_rejected_at_construction(bad: object) -> None:
    with pytest.raises(TypeError, match="must be callable or None"):
        ModuleDefaultDict(bad)  # type: ignore[arg-type]


def test_a_factory_that_is_not_callable_is_rejected_on_assignment_and_the_old_one_kept() -> None:
    d = ModuleDefaultDict(Lin)
    with pytest.raises(TypeError, match="must be callable or None, got int 3"):
        d.default_factory = 3  # type: ignore[assignment]
    assert d.default_factory is Lin
    d.default_factory = None
    assert d.default_factory is None
    d.default_factory = Counter
    assert d.default_factory is Counter


def test_a_module_instance_as_factory_is_not_registered_as_an_entry() -> None:
    maker = nn.Sequential()  # callable, so accepted, but it must not become a child
    d = ModuleDefaultDict(Lin)
    d.default_factory = maker  # type: ignore[assignment]
    assert d.default_factory is maker
    assert list(d.named_children()) == []
    assert list(d) == []


# Misses ------------------------------------------------------------------------------------


def test_a_miss_creates_registers_and_returns_the_same_module_afterwards() -> None:
    factory = CountingFactory()
    d = ModuleDefaultDict(factory)
    first = d["task"]
    assert factory.calls == 1
    assert d["task"] is first
    assert factory.calls == 1
    assert dict(d.named_children()) == {"task": first}
    assert list(d.state_dict()) == ["task.value"]
    assert d.task is first  # registered as a real submodule


def test_without_a_factory_a_miss_is_a_key_error_like_a_dict() -> None:
    d: ModuleDefaultDict[nn.Module] = ModuleDefaultDict()
    with pytest.raises(KeyError) as info:
        d["missing"]
    assert info.value.args == ("missing",)
    assert info.value.__context__ is None  # not chained to an internal lookup
    assert len(d) == 0


def test_only_getitem_creates_entries() -> None:
    factory = CountingFactory()
    kept = Counter()
    d = ModuleDefaultDict(factory, kept=kept)
    assert "x" not in d
    assert len(d) == 1
    assert list(d) == ["kept"]
    assert list(d.keys()) == ["kept"]
    assert list(d.values()) == [kept]
    assert list(d.items()) == [("kept", kept)]
    assert d.get("x") is None
    sentinel = object()
    assert d.get("x", sentinel) is sentinel
    assert d.get("kept") is kept
    with pytest.raises(KeyError) as info:
        d.pop("x")
    assert info.value.args == ("x",)
    assert d.pop("kept") is kept
    assert factory.calls == 0
    assert len(d) == 0


@pytest.mark.parametrize(
    ("key", "error", "match"),
    [
        (3, TypeError, "keys must be str, got int 3"),
        (("a",), TypeError, "keys must be str, got tuple"),
        ("", KeyError, "non-empty"),
        ("a.b", KeyError, r"contains '\.'.*'_'"),
        ("training", KeyError, r"clashes with the existing attribute ModuleDefaultDict\.training"),
        ("forward", KeyError, "clashes with the existing attribute"),
        ("default_factory", KeyError, "clashes with the existing attribute"),
    ],
)
def test_a_bad_missing_key_is_rejected_before_the_factory_runs(
    key: Any, error: type[Exception], match: str
) -> None:
    factory = CountingFactory()
    d = ModuleDefaultDict(factory, a=Counter())
    before = snapshot(d)
    with pytest.raises(error, match=match):
        d[key]
    assert factory.calls == 0
    assert snapshot(d) == before


@pytest.mark.parametrize("result", [None, torch.zeros(1), nn.Linear, "head"])
def test_a_factory_returning_a_non_module_is_a_type_error_naming_both(result: object) -> None:
    def factory() -> Any:
        return result

    d = ModuleDefaultDict(factory, a=Counter())
    before = snapshot(d)
    with pytest.raises(
        TypeError, match=rf"default_factory .*factory.* returned .*{type(result).__name__}"
    ):
        d["b"]
    assert snapshot(d) == before
    assert "b" not in d


def test_errors_on_a_miss_are_not_chained_to_the_lookup() -> None:
    d = ModuleDefaultDict(lambda: None)  # type: ignore[arg-type, return-value]
    with pytest.raises(TypeError) as info:
        d["b"]
    assert info.value.__context__ is None
    with pytest.raises(KeyError) as key_info:
        d["a.b"]
    assert key_info.value.__context__ is None


def test_a_factory_that_raises_leaves_nothing_behind() -> None:
    def factory() -> nn.Module:
        raise ValueError("no head for you")

    d = ModuleDefaultDict(factory, a=Counter())
    before = snapshot(d)
    with pytest.raises(ValueError, match="no head for you"):
        d["b"]
    assert snapshot(d) == before


def test_missing_can_be_called_directly_as_for_a_dict() -> None:
    d = ModuleDefaultDict(Counter)
    created = d.__missing__("x")
    assert d["x"] is created


# repr, copies, pickling ----------------------------------------------------------------------


def test_repr_shows_the_factory_like_defaultdict() -> None:
    assert repr(ModuleDefaultDict()) == "ModuleDefaultDict(default_factory=None)"
    d = ModuleDefaultDict(nn.Identity)
    d["a"]
    assert repr(d) == (
        "ModuleDefaultDict(\n"
        "  default_factory=<class 'torch.nn.modules.linear.Identity'>\n"
        "  (a): Identity()\n"
        ")"
    )


def _torch_save_load(d: ModuleDefaultDict[Any]) -> ModuleDefaultDict[Any]:
    buffer = io.BytesIO()
    torch.save(d, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "clone",
    [copy.deepcopy, lambda d: pickle.loads(pickle.dumps(d)), _torch_save_load],
    ids=["deepcopy", "pickle", "torch.save"],
)
@pytest.mark.parametrize(
    "factory", [Lin, nn.Identity, CountingFactory()], ids=["partial", "class", "object"]
)
def test_copies_keep_the_factory_and_the_children(
    clone: Callable[[Any], Any], factory: Any
) -> None:
    d = ModuleDefaultDict(factory)
    d["a"]
    copied = clone(d)
    assert type(copied.default_factory) is type(factory)
    assert list(copied) == ["a"]
    assert copied["a"] is not d["a"]
    for name, value in d.state_dict().items():
        assert torch.equal(copied.state_dict()[name], value)
    assert isinstance(copied["b"], type(d["a"]))  # the copied factory works
    assert "b" not in d


def test_a_lambda_factory_deep_copies_but_cannot_be_pickled() -> None:
    d = ModuleDefaultDict(lambda: nn.Linear(2, 2))
    assert copy.deepcopy(d).default_factory is d.default_factory
    with pytest.raises((pickle.PicklingError, AttributeError), match="lambda"):
        pickle.dumps(d)


# Checkpoints -------------------------------------------------------------------------------


class _MultiTask(nn.Module):
    def __init__(self, factory: Callable[[], nn.Module] | None) -> None:
        super().__init__()
        self.trunk = nn.Linear(2, 2)
        self.inner = nn.Module()
        self.inner.heads = ModuleDefaultDict(factory)


def test_a_checkpoint_restores_into_a_fresh_model_creating_its_entries() -> None:
    trained = _MultiTask(Lin)
    for task in ("zeta", "alpha", "mid"):
        trained.inner.heads[task]
    calls: list[None] = []

    def factory() -> nn.Module:
        calls.append(None)
        return Lin()

    fresh = _MultiTask(factory)
    fresh.load_state_dict(trained.state_dict(), strict=True)

    assert list(fresh.inner.heads) == ["zeta", "alpha", "mid"]
    assert len(calls) == 3
    for key, value in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)


def test_without_a_factory_strict_loading_fails_as_it_always_has() -> None:
    trained = _MultiTask(Lin)
    trained.inner.heads["a"]
    fresh = _MultiTask(None)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*inner\.heads\.a\.weight"):
        fresh.load_state_dict(trained.state_dict(), strict=True)
    assert len(fresh.inner.heads) == 0


def test_keys_that_cannot_be_entries_are_reported_not_created() -> None:
    fresh = _MultiTask(Lin)
    state = {**_MultiTask(Lin).state_dict(), "inner.heads.training.weight": torch.zeros(2, 2)}
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*inner\.heads\.training\.weight"):
        fresh.load_state_dict(state, strict=True)
    assert "training" not in fresh.inner.heads._modules


def test_a_key_naming_a_tensor_of_the_dict_itself_creates_no_entry() -> None:
    fresh = _MultiTask(Lin)
    state = {**_MultiTask(Lin).state_dict(), "inner.heads.stray": torch.zeros(2)}
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*inner\.heads\.stray"):
        fresh.load_state_dict(state, strict=True)
    assert len(fresh.inner.heads) == 0


def test_a_load_that_fails_part_way_keeps_the_entries_it_created() -> None:
    # As documented: like load_state_dict itself, a failed load is not rolled back.
    trained = _MultiTask(functools.partial(nn.Linear, 2, 3))
    trained.inner.heads["h"]
    fresh = _MultiTask(Lin)
    with pytest.raises(RuntimeError, match=r"size mismatch for inner\.heads\.h\.weight"):
        fresh.load_state_dict(trained.state_dict(), strict=True)
    assert list(fresh.inner.heads) == ["h"]


def test_loading_with_assign_creates_entries_too() -> None:
    trained = _MultiTask(Lin)
    trained.inner.heads["a"]
    with torch.device("meta"):
        fresh = _MultiTask(Lin)
    fresh.load_state_dict(trained.state_dict(), strict=True, assign=True)
    assert torch.equal(fresh.inner.heads["a"].weight, trained.inner.heads["a"].weight)


# Compile -----------------------------------------------------------------------------------


class _Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = ModuleDefaultDict(Lin)
        self.heads["a"]
        self.heads["b"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads["a"](x) + self.heads["b"](x)


def test_reading_existing_keys_compiles_in_one_graph_with_no_break() -> None:
    torch._dynamo.reset()
    model = _Router()
    x = torch.randn(3, 2)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_count == 1
    assert explanation.graph_break_count == 0
    torch.testing.assert_close(torch.compile(model, fullgraph=True, backend="eager")(x), model(x))


class _Lazy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = ModuleDefaultDict(Lin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads["new"](x)  # type: ignore[no-any-return]


def test_a_miss_in_a_fullgraph_compiled_region_raises_and_inserts_nothing() -> None:
    torch._dynamo.reset()
    model = _Lazy()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(model, fullgraph=True, backend="eager")(torch.randn(3, 2))
    assert "new" not in model.heads


def test_a_miss_in_a_compiled_region_without_fullgraph_falls_back_and_creates_it() -> None:
    torch._dynamo.reset()
    model = _Lazy()
    x = torch.randn(3, 2)
    out = torch.compile(model, backend="eager")(x)
    assert "new" in model.heads
    torch.testing.assert_close(out, model.heads["new"](x))


# Drop-in for ModuleDict -----------------------------------------------------------------------


def _both() -> Iterator[nn.ModuleDict]:
    yield nn.ModuleDict()
    yield ModuleDefaultDict()


def _outcome(action: Callable[[nn.ModuleDict], object], d: nn.ModuleDict) -> tuple[Any, ...]:
    try:
        result = action(d)
    except Exception as error:  # the outcome being compared is the error
        return ("raised", type(error), str(error), list(d.items()))
    return ("returned", type(result), list(d.items()))


A, B, C = Counter(), Counter(), Counter()
DROP_IN_ACTIONS: dict[str, Callable[[nn.ModuleDict], object]] = {
    "update-mapping": lambda d: d.update({"b": B, "a": A}),
    "update-pairs": lambda d: d.update([("c", C), ("a", A)]),
    "update-not-iterable": lambda d: d.update(3),  # type: ignore[arg-type]
    "update-bad-pair": lambda d: d.update([("x", A), ("y",)]),  # type: ignore[list-item]
    "update-bad-value": lambda d: d.update({"x": A, "y": 3}),  # type: ignore[dict-item]
    "update-bad-key": lambda d: d.update({"x": A, "y.z": B}),
    "update-overwrite-then-bad-key": lambda d: d.update({"first": B, "y.z": C}),
    "setitem-bad-key": lambda d: d.__setitem__("training", A),
    "setitem-not-module": lambda d: d.__setitem__("k", 3),  # type: ignore[arg-type]
    "getitem-missing": lambda d: d["missing"],
    "delitem-missing": lambda d: d.__delitem__("missing"),
    "pop-present": lambda d: d.pop("first"),
    "pop-missing": lambda d: d.pop("missing"),
    "clear": lambda d: d.clear(),
}


@pytest.mark.parametrize("name", sorted(DROP_IN_ACTIONS))
def test_without_a_factory_it_behaves_like_module_dict(name: str) -> None:
    outcomes = []
    for d in _both():
        d["first"] = A
        outcomes.append(_outcome(DROP_IN_ACTIONS[name], d))
    expected, ours = outcomes
    if name.startswith("update-") and expected[0] == "raised":
        # Same error, but ours is all or nothing where ModuleDict may stop half way.
        assert ours[:3] == expected[:3]
        assert ours[3] == [("first", A)]
    else:
        assert ours == expected


# Conversions that nn.ModuleDict survives: where the dict cannot learn where later entries go,
# the conversion runs all the same (test_module_default_dict_lifecycle.py tests the entries).
CONVERSIONS_MODULE_DICT_SURVIVES: dict[str, Callable[[nn.ModuleDict], object]] = {
    "meta-then-cpu": lambda d: d.to("meta").to("cpu"),
    "apply-normalise": lambda d: d._apply(lambda t: t / t.abs().max()),
    "apply-reshape": lambda d: d._apply(lambda t: t.reshape(2, 2)),
    "cuda": lambda d: d.to("cuda"),  # with or without a CUDA device
}


@pytest.mark.parametrize("name", sorted(CONVERSIONS_MODULE_DICT_SURVIVES))
@pytest.mark.parametrize("entry", [False, True], ids=["empty", "with-entry"])
def test_a_conversion_succeeds_or_fails_as_on_module_dict(name: str, entry: bool) -> None:
    outcomes = []
    for d in _both():
        if entry:
            d["first"] = nn.Linear(2, 2, bias=False)
        outcome = _outcome(CONVERSIONS_MODULE_DICT_SURVIVES[name], d)
        # The error, or that it returned (the dict itself); the entry's tensors, not its
        # identity: each dict holds its own.
        tensors = [(k, v.dtype, v.device, v.shape) for k, v in d.state_dict().items()]
        outcomes.append((outcome[:3] if outcome[0] == "raised" else "returned", tensors))
    expected, ours = outcomes
    assert ours == expected
    if not entry:
        assert expected[0] == "returned"


def test_insertion_order_matches_module_dict() -> None:
    keys = ["q", "b", "z", "a"]
    plain, ours = nn.ModuleDict(), ModuleDefaultDict(Counter)
    for key in keys:
        plain[key] = Counter()
        ours[key]
    del plain["b"]
    del ours["b"]
    plain["b"] = Counter()
    ours["b"]
    assert list(ours) == list(plain) == ["q", "z", "a", "b"]
