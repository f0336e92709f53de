"""ModuleDefaultDict: the laws of a dict with a factory, then examples, then the errors.

The stateful test compares the dict with a plain dict plus the factory after every step, on
keys that mix short names (so keys repeat), unicode, attribute names (``training``,
``keys``), look-alikes (``weight``) and invalid keys (empty, dotted, not a str);
``pytest --hypothesis-show-statistics`` shows the mix as events.
"""

from __future__ import annotations

import copy
import functools
import io
import pickle
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from torch import nn

from tests.nn.models import Counter, CountingFactory
from toolkit.nn import ModuleDefaultDict
from toolkit.nn._entry_placement import EntryPlacement

Lin = functools.partial(nn.Linear, 2, 2)

# Laws: the dict against a reference model ------------------------------------------------------

# The attributes a new key must not shadow, taken from a fresh dict of the class under test.
_FRESH = ModuleDefaultDict()


def valid_new_key(key: object) -> bool:
    """The documented rule: a non-empty str without ``"."`` that is not an attribute."""
    return isinstance(key, str) and key != "" and "." not in key and not hasattr(_FRESH, key)


keys: st.SearchStrategy[object] = st.one_of(
    st.sampled_from(["a", "b", "head_0", "é"]),
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=6),
    st.sampled_from(["training", "__class__", "__dict__", "keys", "forward", "default_factory"]),
    st.sampled_from(["weight", "bias", "Training"]),  # look like attributes, but are free
    st.sampled_from(["", "a.b", ".", "a."]),
    st.integers(-3, 3),
    st.none(),
    st.tuples(st.just("a")),
)


def key_kind(key: object) -> str:
    """For the statistics: which part of the mix ``key`` belongs to."""
    if not isinstance(key, str):
        return "not a str"
    if key == "" or "." in key:
        return "empty or dotted"
    if not valid_new_key(key):
        return "an attribute"
    return "valid, ascii" if key.isascii() else "valid, unicode"


def bad_key_error(key: object) -> type[Exception]:
    return KeyError if isinstance(key, str) else TypeError


class ModuleDefaultDictMachine(RuleBasedStateMachine):
    """Each operation runs on the subject and on a reference: a dict, the factory, the misses."""

    def __init__(self) -> None:
        super().__init__()
        self.factories = [CountingFactory()]
        self.factory: CountingFactory | None = self.factories[0]
        self.subject: ModuleDefaultDict[Counter] = ModuleDefaultDict(self.factory)
        self.model: dict[object, Counter] = {}
        self.misses = 0

    @rule(key=keys)
    def getitem(self, key: object) -> None:
        event(f"getitem key: {key_kind(key)}")
        if key in self.model:
            assert self.subject[key] is self.model[key]  # type: ignore[index]
        elif self.factory is None:
            with pytest.raises(KeyError) as info:
                self.subject[key]  # type: ignore[index]
            assert info.value.args == (key,)
            assert info.value.__context__ is None  # not chained to the internal lookup
        elif not valid_new_key(key):
            with pytest.raises(bad_key_error(key)):
                self.subject[key]  # type: ignore[index]
        else:
            created = self.subject[key]  # type: ignore[index]
            assert all(created is not m for m in self.model.values())
            self.model[key] = created  # type: ignore[index]
            self.misses += 1

    @rule(key=keys)
    def setitem(self, key: object) -> None:
        event(f"setitem key: {key_kind(key)}")
        module = Counter()
        if key in self.model or valid_new_key(key):
            self.subject[key] = module  # type: ignore[index]
            self.model[key] = module  # type: ignore[index]
        else:
            with pytest.raises(bad_key_error(key)):
                self.subject[key] = module  # type: ignore[index]

    @rule(key=keys)
    def delitem(self, key: object) -> None:
        if key in self.model:
            del self.subject[key]
            del self.model[key]
        else:
            with pytest.raises(KeyError):
                del self.subject[key]

    @rule(key=keys)
    def pop(self, key: object) -> None:
        if key in self.model:
            assert self.subject.pop(key) is self.model.pop(key)  # type: ignore[arg-type]
        else:
            with pytest.raises(KeyError) as info:
                self.subject.pop(key)  # type: ignore[arg-type]
            assert info.value.args == (key,)

    @rule(key=keys)
    def get_and_contains(self, key: object) -> None:
        assert self.subject.get(key) is self.model.get(key)  # type: ignore[arg-type]
        assert (key in self.subject) == (key in self.model)

    @rule(names=st.lists(keys, max_size=4), as_mapping=st.booleans())
    def update(self, names: list[object], as_mapping: bool) -> None:
        pairs = [(name, Counter()) for name in names]
        # All or nothing: one key that could not be set rejects the whole update.
        fine = all(name in self.model or valid_new_key(name) for name in names)
        event(f"update: {'accepted' if fine else 'rejected'}")
        if fine:
            self.subject.update(dict(pairs) if as_mapping else pairs)  # type: ignore[arg-type]
            self.model.update(pairs)  # type: ignore[arg-type]
        else:
            with pytest.raises((TypeError, KeyError)):
                self.subject.update(dict(pairs) if as_mapping else pairs)  # type: ignore[arg-type]

    @rule()
    def clear(self) -> None:
        self.subject.clear()
        self.model.clear()

    @rule(use_a_factory=st.booleans())
    def reassign_factory(self, use_a_factory: bool) -> None:
        self.factory = CountingFactory() if use_a_factory else None
        if self.factory is not None:
            self.factories.append(self.factory)
        self.subject.default_factory = self.factory

    @rule()
    def save_and_restore_into_a_fresh_instance(self) -> None:
        state = self.subject.state_dict()
        fresh: ModuleDefaultDict[Counter] = ModuleDefaultDict(self.factory)
        if self.factory is None and self.model:
            with pytest.raises(RuntimeError, match="Unexpected key"):
                fresh.load_state_dict(state, strict=True)
            return
        fresh.load_state_dict(state, strict=True)
        assert list(fresh) == list(self.model)
        for name, module in self.model.items():
            assert torch.equal(fresh.get(name).value, module.value)  # type: ignore[union-attr]
        self.misses += len(self.model)
        self.subject = fresh
        self.model = dict(fresh.items())

    @invariant()
    def same_entries_in_the_same_order(self) -> None:
        assert list(self.subject) == list(self.model)
        assert len(self.subject) == len(self.model)
        assert [(n, id(m)) for n, m in self.subject.named_children()] == [
            (n, id(m)) for n, m in self.model.items()
        ]
        assert list(self.subject.state_dict()) == [f"{name}.value" for name in self.model]

    @invariant()
    def factory_calls_equal_misses(self) -> None:
        assert sum(f.calls for f in self.factories) == self.misses
        assert self.subject.default_factory is self.factory


TestModuleDefaultDictMachine = ModuleDefaultDictMachine.TestCase


# Construction and misses ----------------------------------------------------------------------


def test_construction_like_defaultdict_and_module_dict() -> None:
    d = ModuleDefaultDict[nn.Linear](Lin)
    assert isinstance(d, nn.ModuleDict)
    assert d.default_factory is Lin
    assert ModuleDefaultDict(default_factory=Lin).default_factory is Lin
    assert ModuleDefaultDict().default_factory is None
    assert list(ModuleDefaultDict(None, None)) == list(nn.ModuleDict(None)) == []
    a, b, c, e = Counter(), Counter(), Counter(), Counter()
    d = ModuleDefaultDict(Lin, OrderedDict([("b", b), ("a", a)]), e=e, c=c)
    assert list(d.items()) == [("b", b), ("a", a), ("e", e), ("c", c)]
    assert list(ModuleDefaultDict(None, [("z", a), ("y", b)]).items()) == [("z", a), ("y", b)]
    assert list(ModuleDefaultDict(Counter, None, a=a)) == ["a"]
    assert d.__missing__("task") is d["task"] is d.task  # as for a dict; a real submodule


def test_only_getitem_calls_the_factory() -> None:
    """The stateful test covers the rest: ``get``, ``in``, ``pop``, ``update``."""
    factory = CountingFactory()
    kept = Counter()
    d = ModuleDefaultDict(factory, kept=kept)
    sentinel, first, other = object(), Counter(), Counter()
    assert (list(d.keys()), list(d.values()), list(d.items())) == (
        ["kept"],
        [kept],
        [("kept", kept)],
    )
    assert d.get("x", sentinel) is sentinel
    assert d.pop("x", sentinel) is sentinel
    assert d.setdefault("a", first) is first
    assert d.setdefault("a", other) is first
    assert factory.calls == 0


# Drop-in for ModuleDict -----------------------------------------------------------------------


def _outcome(action: Callable[[nn.ModuleDict], object], d: nn.ModuleDict) -> tuple[Any, ...]:
    try:
        result = action(d)
    except Exception as error:  # the outcome being compared is the error's type
        return ("raised", type(error), list(d.items()))
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
    "setitem-overwrite": lambda d: d.__setitem__("first", B),
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
    """The same result or error type, and the same entries after, but update is all or nothing."""
    outcomes = []
    for d in (nn.ModuleDict(), ModuleDefaultDict()):
        d["first"] = A
        outcomes.append(_outcome(DROP_IN_ACTIONS[name], d))
    expected, ours = outcomes
    if name.startswith("update-") and expected[0] == "raised":
        assert ours == (*expected[:2], [("first", A)])
    else:
        assert ours == expected


# Conversions that nn.ModuleDict survives, compared by outcome and tensors (each dict holds its
# own entry); the entries created afterwards are tested below.
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
    for d in (nn.ModuleDict(), ModuleDefaultDict()):
        if entry:
            d["first"] = nn.Linear(2, 2, bias=False)
        outcome = _outcome(CONVERSIONS_MODULE_DICT_SURVIVES[name], d)
        tensors = [(k, v.dtype, v.device, v.shape) for k, v in d.state_dict().items()]
        outcomes.append((outcome[:2] if outcome[0] == "raised" else "returned", tensors))
    assert outcomes[1] == outcomes[0]
    if not entry:
        assert outcomes[0][0] == "returned"


# Where late entries go ------------------------------------------------------------------------


class Head(nn.Module):
    """A head with a floating parameter, an integer buffer, a bool buffer and a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 2)
        self.norm = nn.LayerNorm(2)
        self.register_buffer("steps", torch.tensor([7], dtype=torch.long))
        self.register_buffer("mask", torch.tensor([True, False]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


class Model(nn.Module):
    def __init__(self, factory: Callable[[], nn.Module] | None = Head) -> None:
        super().__init__()
        self.trunk = nn.Linear(3, 3)
        self.heads = ModuleDefaultDict(factory)

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        return self.heads[task](self.trunk(x))  # type: ignore[no-any-return]


def _placement(module: nn.Module) -> dict[str, tuple[torch.dtype, torch.device]]:
    return {name: (t.dtype, t.device) for name, t in module.state_dict().items()}


CONVERSIONS: dict[str, Callable[[nn.Module], Any]] = {
    "to-float64": lambda m: m.to(torch.float64),
    "to-device-and-dtype": lambda m: m.to("cpu", torch.bfloat16),
    "double": lambda m: m.double(),
    "half": lambda m: m.half(),
    "bfloat16": lambda m: m.bfloat16(),
    "type-float64": lambda m: m.type(torch.float64),
    "to-meta": lambda m: m.to("meta"),
    "half-then-float": lambda m: m.half().float(),
    "meta-then-to_empty": lambda m: m.to("meta").to_empty(device="cpu"),
}
if torch.cuda.is_available():
    CONVERSIONS |= {
        "cuda": lambda m: m.cuda(),
        "to-cuda-bfloat16": lambda m: m.to("cuda", torch.bfloat16),
    }


@pytest.mark.parametrize("on", ["model", "dict"])
@pytest.mark.parametrize("conversion", sorted(CONVERSIONS))
def test_a_late_entry_is_placed_as_an_entry_that_existed_all_along(
    conversion: str, on: str
) -> None:
    """Same device and dtype per tensor (int and bool buffers keep theirs); same values."""
    convert = CONVERSIONS[conversion]
    torch.manual_seed(0)
    existing = Model()
    existing.heads["a"]  # built before the conversion; torch converts it
    convert(existing if on == "model" else existing.heads)
    torch.manual_seed(0)
    late = Model()
    convert(late if on == "model" else late.heads)
    entry = late.heads["a"]  # built after the conversion

    assert _placement(entry) == _placement(existing.heads["a"])
    if conversion in ("meta-then-to_empty", "half-then-float"):
        # Only the net effect counts: to_empty leaves memory uninitialised and a round trip
        # through float16 rounds, but a late entry keeps the factory's values.
        torch.manual_seed(0)
        Model()
        expected = Head()
    else:
        expected = existing.heads["a"]
    if conversion != "to-meta":
        for name, tensor in expected.state_dict().items():
            assert torch.equal(entry.state_dict()[name].cpu(), tensor.cpu()), name


F64 = functools.partial(Lin, dtype=torch.float64)
# A conversion, and the dtype and device of the entry that the factory gives afterwards.
FACTORY_PLACEMENTS: dict[str, tuple[Callable[[], nn.Module], Callable[[Model], object], Any]] = {
    "never-moved": (Lin, lambda m: m.trunk.float(), (torch.float32, "cpu")),  # a sibling's
    "never-moved-float64": (F64, lambda m: None, (torch.float64, "cpu")),
    "move-keeps-factory-dtype": (F64, lambda m: m.to("meta"), (torch.float64, "meta")),
    "cast-keeps-factory-device": (
        functools.partial(Lin, device="meta"),
        lambda m: m.half(),
        (torch.float16, "meta"),
    ),
    "last-cast-wins": (Lin, lambda m: m.half().bfloat16().to("meta"), (torch.bfloat16, "meta")),
    "cast-after-meta-stays-on-meta": (
        Lin,
        lambda m: m.to("meta").double(),
        (torch.float64, "meta"),
    ),
    "meta-and-back": (Lin, lambda m: m.heads.to("meta").to("cpu"), (torch.float32, "cpu")),
    "meta-and-back-float64": (
        Lin,
        lambda m: m.heads.to("meta").to("cpu", torch.float64),
        (torch.float64, "cpu"),
    ),
    "no-recurse-leaves-alone": (
        Lin,
        lambda m: m.heads.to_empty(device="meta", recurse=False),
        (torch.float32, "cpu"),
    ),
}


@pytest.mark.parametrize("name", list(FACTORY_PLACEMENTS))
def test_only_what_the_dict_was_moved_or_cast_to_changes_the_factory_result(name: str) -> None:
    factory, convert, placed = FACTORY_PLACEMENTS[name]
    model = Model(factory)
    convert(model)
    weight = model.heads["a"].weight
    assert (weight.dtype, weight.device.type) == placed


def test_a_conversion_that_does_not_recurse_leaves_the_entries_alone() -> None:
    model = Model()
    entry = model.heads["a"]
    model.heads.to_empty(device="meta", recurse=False)
    assert model.heads["a"] is entry
    assert {t.device.type for t in entry.state_dict().values()} == {"cpu"}


def test_a_conversion_that_fails_on_an_entry_leaves_where_new_entries_go() -> None:
    heads = ModuleDefaultDict(Head)
    heads["kept"]
    heads.to("meta")
    with pytest.raises(NotImplementedError, match="meta tensor"):
        heads.to("cpu")  # the kept entry has no data to copy; the probes would move
    assert heads["a"].proj.weight.device.type == "meta"


@pytest.mark.parametrize(
    ("fn", "placement"),
    [
        (
            lambda t: t.to("meta") if t.dtype == torch.float32 else t,
            EntryPlacement(torch.device("meta")),
        ),
        (lambda t: t.to("meta") if t.dtype == torch.float16 else t, EntryPlacement()),
        (lambda t: t.double() if t.dtype == torch.float32 else t, EntryPlacement()),
        (lambda t: t / t.abs().max(), EntryPlacement(other_dtype=torch.float32)),
    ],
    ids=["move-float32", "move-float16", "cast-float32-alone", "needs-values"],
)
def test_a_conversion_is_learnt_from_probe_tensors(
    fn: Callable[[torch.Tensor], torch.Tensor], placement: EntryPlacement
) -> None:
    """A move of float32 tensors sets the device, of float16 alone not; a cast of one
    floating dtype alone sets no dtype; probes hold values, so ``t / t.abs().max()`` works."""
    assert EntryPlacement().after(fn) == placement


def test_a_conversion_that_needs_data_is_learnt_on_the_cpu_from_meta() -> None:
    cpu = torch.device("cpu")
    on_meta = EntryPlacement(device=torch.device("meta"), dtype=torch.float16)
    assert on_meta.after(lambda t: t.to("cpu")) == EntryPlacement(cpu, torch.float16)
    assert on_meta.after(lambda t: t.to("cpu", torch.float64)) == EntryPlacement(
        cpu, torch.float64, torch.float64
    )
    assert on_meta.after(lambda t: t.clone() if t.sum() > 0 else t) == EntryPlacement(
        cpu, torch.float16
    )
    with torch.device("meta"):  # the first probe is on the default device, meta
        heads = ModuleDefaultDict(Head)
        heads.to("cpu")
    assert heads["a"].proj.weight.device.type == "cpu"


@pytest.mark.parametrize("start", ["cpu", "meta"])
def test_a_conversion_that_fails_on_the_probes_runs_and_then_a_miss_raises(start: str) -> None:
    """The probes hold one element: a reshape to two fails on them, not on the entry."""
    heads = ModuleDefaultDict(Head).to(start)
    heads["kept"] = nn.Linear(2, 1, bias=False).to(start)
    assert heads._apply(lambda t: t.reshape(2)) is heads
    assert heads["kept"].weight.shape == (2,)
    heads.to(start)  # a conversion afterwards cannot tell where entries would be either
    with pytest.raises(RuntimeError, match=r"^ModuleDefaultDict cannot place a new entry") as info:
        heads["a"]
    assert "(RuntimeError: shape '[2]' is invalid" in str(info.value)  # the probe's error
    assert "Create the entries before such a conversion" in str(info.value)  # the fix
    heads["b"] = Head()  # inserting a module is unaffected
    assert list(heads) == ["kept", "b"]


@pytest.mark.parametrize("on", ["model", "dict"])
def test_a_late_entry_takes_the_training_mode_of_the_dict(on: str) -> None:
    model = Model(lambda: Head().eval())  # a factory result in eval mode is switched too
    assert all(m.training for m in model.heads["a"].modules())
    (model if on == "model" else model.heads).eval()
    assert not any(m.training for m in model.heads["b"].modules())
    (model if on == "model" else model.heads).train()
    assert all(m.training for m in model.heads["c"].modules())


# Loading --------------------------------------------------------------------------------------


class _MultiTask(nn.Module):
    def __init__(self, factory: Callable[[], nn.Module] | None) -> None:
        super().__init__()
        self.trunk = nn.Linear(2, 2)
        self.inner = nn.Module()
        self.inner.heads = ModuleDefaultDict(factory)


def test_loading_creates_entries_cast_and_with_assign() -> None:
    trained = Model()
    trained.heads["a"]
    fresh = Model().to(torch.float64)
    fresh.load_state_dict(trained.state_dict(), strict=True)
    assert torch.equal(fresh.heads["a"].proj.weight, trained.heads["a"].proj.weight.double())
    assert fresh(torch.randn(2, 3, dtype=torch.float64), "a").dtype == torch.float64
    with torch.device("meta"):
        assigned = Model()
    assigned.load_state_dict(trained.state_dict(), strict=True, assign=True)
    assert torch.equal(assigned.heads["a"].proj.weight, trained.heads["a"].proj.weight)


def test_a_checkpoint_restores_into_a_fresh_model_creating_its_entries_whole() -> None:
    """In the checkpoint's order, inside a model, entries that are containers or dicts too:
    in keys with several dots, an entry's name is the part before the first, at every level."""

    def block() -> nn.Module:
        calls.append(None)
        return nn.Sequential(nn.Linear(2, 3), nn.ReLU(), ModuleDefaultDict(Lin))

    calls: list[None] = []
    trained = _MultiTask(block)
    for task in ("zeta", "alpha", "mid"):
        trained.inner.heads[task]
    trained.inner.heads["zeta"][2]["inner"]
    fresh = _MultiTask(block)
    result = fresh.load_state_dict(trained.state_dict(), strict=True)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    assert list(fresh.inner.heads) == ["zeta", "alpha", "mid"]
    assert list(fresh.inner.heads["zeta"][2]) == ["inner"]
    assert len(calls) == 6
    assert list(fresh.state_dict()) == list(trained.state_dict())
    torch.testing.assert_close(fresh.state_dict(), trained.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize("stray", ["training.weight", "stray"])
def test_keys_that_cannot_name_entries_are_reported_not_created(stray: str) -> None:
    """An attribute's name, and a key for a tensor of the dict itself, create no entry."""
    fresh = _MultiTask(Lin)
    state = {**_MultiTask(Lin).state_dict(), f"inner.heads.{stray}": torch.zeros(2)}
    with pytest.raises(RuntimeError, match=rf"Unexpected key\(s\).*inner\.heads\.{stray}"):
        fresh.load_state_dict(state, strict=True)
    assert len(fresh.inner.heads._modules) == 0


def test_a_load_that_fails_part_way_keeps_the_entries_it_created() -> None:
    # As documented: like load_state_dict itself, a failed load is not rolled back.
    trained = _MultiTask(functools.partial(nn.Linear, 2, 3))
    trained.inner.heads["h"]
    fresh = _MultiTask(Lin)
    with pytest.raises(RuntimeError, match=r"size mismatch for inner\.heads\.h\.weight"):
        fresh.load_state_dict(trained.state_dict(), strict=True)
    assert list(fresh.inner.heads) == ["h"]


def _rename_old_keys(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: object
) -> None:
    for key in list(state_dict):
        if key.startswith(prefix + "old_"):
            state_dict[prefix + key[len(prefix) + 4 :]] = state_dict.pop(key)


def test_the_dict_own_load_pre_hooks_run_before_entries_are_named() -> None:
    model = nn.Module()
    model.heads = ModuleDefaultDict(Lin)
    model.heads.register_load_state_dict_pre_hook(_rename_old_keys)
    old = {"heads.old_a.weight": torch.ones(2, 2), "heads.old_a.bias": torch.zeros(2)}
    result = model.load_state_dict(old, strict=True)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    assert list(model.heads) == ["a"]
    assert torch.equal(model.heads["a"].weight, torch.ones(2, 2))
    assert len(model.heads._load_state_dict_pre_hooks) == 1  # only the user's hook stays


def test_the_load_step_keeps_what_torchs_pre_hooks_report() -> None:
    """A pre-hook fills the very lists that the dict's own load step then adds to."""
    trained = ModuleDefaultDict(Lin)
    trained["a"]

    def pre_hook(module: nn.Module, *args: Any) -> None:
        _state, _prefix, _meta, _strict, missing, unexpected, errors = args
        missing.append("from_the_hook")
        unexpected.append("unexpected_from_the_hook")
        if fail:
            errors.append("the hook found a problem")

    for fail in (False, True):
        fresh = ModuleDefaultDict(Lin)
        fresh._register_load_state_dict_pre_hook(pre_hook, with_module=True)
        state = {**trained.state_dict(), "stray": torch.zeros(1)}
        if fail:
            with pytest.raises(RuntimeError, match="the hook found a problem"):
                fresh.load_state_dict(state, strict=False)
        else:
            result = fresh.load_state_dict(state, strict=False)
            assert result.missing_keys == ["from_the_hook"]
            assert result.unexpected_keys == ["unexpected_from_the_hook", "stray"]
            assert list(fresh) == ["a"]


# repr, copies, TorchScript, compile -----------------------------------------------------------


class SelfBuilding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = ModuleDefaultDict(self.new_head)

    def new_head(self) -> nn.Module:
        return nn.Identity()


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
    # A factory whose repr shows the dict again shows as "..." there, as in defaultdict's.
    model = SelfBuilding()
    model.heads["x"]
    assert repr(model).count("default_factory=<bound method SelfBuilding.new_head") == 1
    assert "        default_factory=...\n" in repr(model)


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
def test_copies_keep_the_factory_the_children_and_where_entries_go(
    clone: Callable[[Any], Any], factory: Any
) -> None:
    d = ModuleDefaultDict(factory)
    d["a"]
    d.double()
    copied = clone(d)
    assert type(copied.default_factory) is type(factory)
    assert list(copied) == ["a"]
    assert copied["a"] is not d["a"]
    for name, value in d.state_dict().items():
        assert torch.equal(copied.state_dict()[name], value)
    assert isinstance(copied["b"], type(d["a"]))  # the copied factory works
    assert all(t.dtype == torch.float64 for t in copied["b"].state_dict().values())
    assert "b" not in d


def test_a_lambda_factory_deep_copies_but_cannot_be_pickled() -> None:
    d = ModuleDefaultDict(lambda: nn.Linear(2, 2))
    assert copy.deepcopy(d).default_factory is d.default_factory
    with pytest.raises((pickle.PicklingError, AttributeError), match="lambda"):
        pickle.dumps(d)


class Scripted(nn.Module):
    def __init__(self, heads: nn.ModuleDict) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads["a"](x) + self.heads["b"](x)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("factory", [None, Counter], ids=["no-factory", "factory"])
def test_scripts_and_runs_as_a_module_dict(factory: Callable[[], nn.Module] | None) -> None:
    torch.manual_seed(0)
    entries = {"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)}
    plain = torch.jit.script(Scripted(nn.ModuleDict(entries)))
    ours = torch.jit.script(Scripted(ModuleDefaultDict(factory, entries)))
    x = torch.randn(3, 2)
    assert torch.equal(ours(x), plain(x))
    assert list(ours.state_dict()) == list(plain.state_dict())


class _Router(nn.Module):
    def __init__(self, *keys: str) -> None:
        super().__init__()
        self.heads = ModuleDefaultDict(Lin)
        self.keys = keys
        for key in keys:
            self.heads[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(self.heads[key](x) for key in self.keys)  # type: ignore[return-value]


def test_reading_existing_keys_compiles_in_one_graph_with_no_break() -> None:
    torch._dynamo.reset()
    model = _Router("a", "b")
    x = torch.randn(3, 2)
    explanation = torch._dynamo.explain(model)(x)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)
    torch.testing.assert_close(torch.compile(model, fullgraph=True, backend="eager")(x), model(x))


def test_a_miss_in_a_compiled_region_raises_with_fullgraph_or_falls_back() -> None:
    torch._dynamo.reset()
    model = _Router()
    model.keys = ("new",)
    x = torch.randn(3, 2)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(model, fullgraph=True, backend="eager")(x)
    assert "new" not in model.heads
    out = torch.compile(model, backend="eager")(x)
    assert "new" in model.heads
    torch.testing.assert_close(out, model(x))


# Errors: the type, the offending value and the fix; nothing is left half-done -----------------


def test_more_than_one_initial_mapping_or_a_value_not_a_module_is_a_type_error() -> None:
    for extra in (1, 2):  # counting every argument
        with pytest.raises(TypeError, match=rf"at most 2 positional arguments .*got {2 + extra}$"):
            ModuleDefaultDict(None, *[{}] * (1 + extra))
    with pytest.raises(TypeError, match="int is not a Module subclass"):
        ModuleDefaultDict(Lin, a=3)  # type: ignore[arg-type]


BAD_FACTORIES: dict[str, tuple[object, list[str]]] = {
    # Not callable: the type, the value and what to pass.
    "int": (3, ["callable or None", "int 3", "functools.partial"]),
    "str": ("nn.Linear", ["callable or None", "str 'nn.Linear'", "functools.partial"]),
    "tensor": (nn.Linear(2, 2).weight, ["callable or None", "Parameter"]),
    # A mapping: ModuleDict(x) converted to ModuleDefaultDict(x) would drop x's entries.
    "dict": ({"a": Counter()}, ["got a dict", "ModuleDefaultDict(None, mapping)"]),
    "OrderedDict": (OrderedDict(a=Counter()), ["got a OrderedDict", "(factory, mapping)"]),
    "ModuleDict": (nn.ModuleDict({"a": Counter()}), ["got a ModuleDict", "(None, mapping)"]),
    "ModuleDefaultDict": (ModuleDefaultDict(Counter, {"a": Counter()}), ["ModuleDefaultDict"]),
    # A module: its call is its forward, which would run on every miss.
    "module": (nn.Linear(4, 2), ["Linear instance", "lambda: Linear(", "partial(Linear, "]),
    # A class, or a partial, that needs arguments.
    "class": (nn.Linear, ["needs in_features, out_features", "partial(Linear, in_features"]),
    "partial": (
        functools.partial(nn.Linear, 4),
        ["needs out_features", "with functools.partial, or"],
    ),
}


# One golden message each: the rest of the tests assert their facts.
GOLDEN_FACTORY_ERRORS = {
    "int": (
        "ModuleDefaultDict.default_factory must be callable or None, got int 3; pass a Module "
        "class or a functools.partial that builds one"
    ),
    "dict": (
        "ModuleDefaultDict.default_factory must build a new Module, got a dict; to start from a "
        "mapping's entries, pass it second: ModuleDefaultDict(None, mapping) or "
        "ModuleDefaultDict(factory, mapping)"
    ),
    "module": (
        "ModuleDefaultDict.default_factory must build a new Module on each call, got a Linear "
        "instance, whose call is its forward; pass a callable that builds one, such as "
        "lambda: Linear(...) or functools.partial(Linear, ...)"
    ),
    "class": (
        "ModuleDefaultDict.default_factory is called with no arguments, but <class "
        "'torch.nn.modules.linear.Linear'> needs in_features, out_features; bind them with "
        "functools.partial(Linear, in_features, out_features), or pass a lambda that builds "
        "the module"
    ),
}


@pytest.mark.parametrize("name", list(BAD_FACTORIES))
def test_a_factory_that_cannot_build_entries_is_refused_naming_the_fix(name: str) -> None:
    """At construction and on assignment; an assignment keeps the factory and the entries."""
    bad, facts = BAD_FACTORIES[name]
    with pytest.raises(TypeError) as info:
        ModuleDefaultDict(bad)  # type: ignore[arg-type]
    assert all(fact in str(info.value) for fact in facts), str(info.value)
    assert str(info.value) == GOLDEN_FACTORY_ERRORS.get(name, str(info.value))
    d = ModuleDefaultDict(nn.ReLU)
    d["x"]
    with pytest.raises(TypeError) as assigned:
        d.default_factory = bad  # type: ignore[assignment]
    assert str(assigned.value) == str(info.value)
    assert d.default_factory is nn.ReLU
    assert list(d.named_children()) == [("x", d["x"])]  # a module was not registered either
    if isinstance(bad, nn.Module):
        assert bad.training  # nothing ran


class _Heads(ModuleDefaultDict[nn.Module]):
    """A subclass, so that a clash must name the class of the dict itself."""


BAD_KEYS: dict[str, tuple[Any, type[Exception], list[str]]] = {
    "int": (3, TypeError, ["must be str", "int 3"]),
    "tuple": (("a",), TypeError, ["must be str", "tuple ('a',)"]),
    "empty": ("", KeyError, ["non-empty"]),
    "dotted": ("a.b", KeyError, ["'a.b'", "contains '.'", "'_'"]),
    "attribute": ("training", KeyError, ["'training'", "_Heads.training", "another name"]),
    "method": ("forward", KeyError, ["_Heads.forward"]),
    "mapping method": ("keys", KeyError, ["_Heads.keys"]),
    "property": ("default_factory", KeyError, ["_Heads.default_factory"]),
}


KEY_USES: dict[str, Callable[[ModuleDefaultDict[Any], Any], object]] = {
    "read": lambda d, key: d[key],
    "set": lambda d, key: d.__setitem__(key, Counter()),
    "setdefault": lambda d, key: d.setdefault(key, Counter()),
}


GOLDEN_KEY_ERRORS = {
    "int": "ModuleDefaultDict keys must be str, got int 3; module names are strings",
    "empty": "ModuleDefaultDict key must be a non-empty string, got ''",
    "dotted": (
        "ModuleDefaultDict key 'a.b' contains '.', which separates submodule names in "
        "state_dict keys; use another character such as '_'"
    ),
    "attribute": (
        "ModuleDefaultDict key 'training' clashes with the existing attribute _Heads.training; "
        "choose another name"
    ),
}


@pytest.mark.parametrize("how", list(KEY_USES))
@pytest.mark.parametrize("name", list(BAD_KEYS))
def test_a_key_that_cannot_be_an_entry_is_refused_naming_it_and_the_fix(
    name: str, how: str
) -> None:
    """Reading it (before the factory runs) and setting it give the same error."""
    key, error, facts = BAD_KEYS[name]
    factory = CountingFactory()
    d = _Heads(factory, a=Counter())
    before = list(d.items())
    with pytest.raises(error) as info:
        KEY_USES[how](d, key)
    message = str(info.value.args[0])
    assert all(fact in message for fact in facts), message
    assert message == GOLDEN_KEY_ERRORS.get(name, message)
    assert info.value.__context__ is None  # not chained to the internal lookup
    assert factory.calls == 0
    assert list(d.items()) == before


@pytest.mark.parametrize("result", [3, None, torch.zeros(1), nn.Linear, "head"])
def test_a_factory_returning_a_non_module_is_a_type_error_naming_factory_result_and_key(
    result: object,
) -> None:
    factory = functools.partial(lambda r: r, result)
    d = ModuleDefaultDict(factory, a=Counter())
    before = list(d.items())
    with pytest.raises(TypeError) as info:
        d["head"]
    for fact in (repr(factory), f"type {type(result).__name__}", "'head'", "nn.Module"):
        assert fact in str(info.value)
    if isinstance(result, int):  # the one golden message
        assert str(info.value) == (
            f"ModuleDefaultDict.default_factory {factory!r} returned 3 (type int) for key "
            "'head'; it must return an nn.Module instance"
        )
    assert info.value.__context__ is None
    assert list(d.items()) == before


def test_a_factory_that_raises_leaves_nothing_behind() -> None:
    def factory() -> nn.Module:
        raise ValueError("no head for you")

    d = ModuleDefaultDict(factory, a=Counter())
    before = list(d.items())
    with pytest.raises(ValueError, match="no head for you"):
        d["b"]
    assert list(d.items()) == before
