"""Stateful test: ModuleDefaultDict against a reference model, a plain dict plus the factory."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tests.nn.models import Counter, CountingFactory
from toolkit.nn import ModuleDefaultDict

keys = st.sampled_from(["a", "b", "c", "head_0", "fr"])
bad_keys = st.sampled_from(["", "a.b", "training", "forward", "default_factory", 3, ("a",)])


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
        self.model: dict[str, Counter] = {}
        self.misses = 0

    @rule(key=keys)
    def getitem(self, key: str) -> None:
        if key in self.model:
            assert self.subject[key] is self.model[key]
        elif self.factory is None:
            with pytest.raises(KeyError) as info:
                self.subject[key]
            assert info.value.args == (key,)
        else:
            created = self.subject[key]
            assert isinstance(created, Counter)
            assert all(created is not m for m in self.model.values())
            self.model[key] = created
            self.misses += 1

    @rule(key=bad_keys)
    def getitem_with_a_bad_key(self, key: object) -> None:
        with pytest.raises((KeyError, TypeError)):
            self.subject[key]  # type: ignore[index]

    @rule(key=keys)
    def setitem(self, key: str) -> None:
        module = Counter()
        self.subject[key] = module
        self.model[key] = module

    @rule(key=keys)
    def delitem(self, key: str) -> None:
        if key in self.model:
            del self.subject[key]
            del self.model[key]
        else:
            with pytest.raises(KeyError):
                del self.subject[key]

    @rule(key=keys)
    def pop(self, key: str) -> None:
        if key in self.model:
            assert self.subject.pop(key) is self.model.pop(key)
        else:
            with pytest.raises(KeyError) as info:
                self.subject.pop(key)
            assert info.value.args == (key,)

    @rule(key=keys)
    def get(self, key: str) -> None:
        assert self.subject.get(key) is self.model.get(key)

    @rule(key=keys)
    def contains(self, key: str) -> None:
        assert (key in self.subject) == (key in self.model)

    @rule(names=st.lists(keys, max_size=4), as_mapping=st.booleans())
    def update(self, names: list[str], as_mapping: bool) -> None:
        pairs = [(name, Counter()) for name in names]
        self.subject.update(dict(pairs) if as_mapping else pairs)
        self.model.update(pairs)

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

    @invariant()
    def factory_calls_equal_misses(self) -> None:
        assert sum(f.calls for f in self.factories) == self.misses
        assert self.subject.default_factory is self.factory


TestModuleDefaultDictMachine = ModuleDefaultDictMachine.TestCase
