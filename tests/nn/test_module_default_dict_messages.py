"""ModuleDefaultDict's error messages, matched whole, and loads that other tests leave out.

A user reads these messages to fix a call, so each test writes the expected text out in full:
a changed type name, count or fix fails it. The loading tests restore entries that are
themselves containers, and check that the dict's own load step keeps torch's lists of
missing keys and errors.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from toolkit.nn import ModuleDefaultDict


class _Factory:
    """A factory with a fixed repr, so messages that show it can be written out."""

    def __init__(self, result: object) -> None:
        self.result = result

    def __call__(self) -> Any:
        return self.result

    def __repr__(self) -> str:
        return "<factory>"


@pytest.mark.parametrize("extra", [1, 2])
def test_too_many_positional_arguments_counts_every_one(extra: int) -> None:
    args = [{}] * (1 + extra)
    with pytest.raises(TypeError) as info:
        ModuleDefaultDict(None, *args)
    assert str(info.value) == (
        "ModuleDefaultDict expected at most 2 positional arguments (default_factory and one "
        f"initial mapping), got {2 + extra}"
    )


@pytest.mark.parametrize(("value", "shown"), [(3, "int 3"), ("x", "str 'x'")])
def test_a_factory_that_is_not_callable_names_its_type_value_and_the_fix(
    value: object, shown: str
) -> None:
    expected = (
        f"ModuleDefaultDict.default_factory must be callable or None, got {shown}; pass a "
        "Module class or a functools.partial that builds one"
    )
    with pytest.raises(TypeError) as info:
        ModuleDefaultDict(value)  # type: ignore[arg-type]
    assert str(info.value) == expected
    d = ModuleDefaultDict(nn.ReLU)
    with pytest.raises(TypeError) as info:
        d.default_factory = value  # type: ignore[assignment]
    assert str(info.value) == expected
    assert d.default_factory is nn.ReLU


@pytest.mark.parametrize(("result", "shown"), [(3, "3 (type int)"), (None, "None (type NoneType)")])
def test_a_factory_that_returns_a_non_module_names_factory_result_type_and_key(
    result: object, shown: str
) -> None:
    d = ModuleDefaultDict(_Factory(result))
    with pytest.raises(TypeError) as info:
        d["head"]
    assert str(info.value) == (
        f"ModuleDefaultDict.default_factory <factory> returned {shown} for key 'head'; "
        "it must return an nn.Module instance"
    )
    assert len(d) == 0


@pytest.mark.parametrize(("key", "shown"), [(3, "int 3"), (("a",), "tuple ('a',)")])
def test_a_key_that_is_not_a_str_names_its_type_and_value(key: object, shown: str) -> None:
    d = ModuleDefaultDict(nn.ReLU)
    with pytest.raises(TypeError) as info:
        d[key]  # type: ignore[index]
    assert str(info.value) == (
        f"ModuleDefaultDict keys must be str, got {shown}; module names are strings"
    )
    assert len(d) == 0


def test_an_empty_key_says_so() -> None:
    d = ModuleDefaultDict(nn.ReLU)
    with pytest.raises(KeyError) as info:
        d[""]
    assert info.value.args == ("ModuleDefaultDict key must be a non-empty string, got ''",)
    assert len(d) == 0


def test_a_dotted_key_explains_the_dot_and_the_fix() -> None:
    d = ModuleDefaultDict(nn.ReLU)
    with pytest.raises(KeyError) as info:
        d["a.b"]
    assert info.value.args == (
        "ModuleDefaultDict key 'a.b' contains '.', which separates submodule names in "
        "state_dict keys; use another character such as '_'",
    )
    assert len(d) == 0


class _Heads(ModuleDefaultDict[nn.Module]):
    """A subclass, so that the clash message must name the class of the dict itself."""


@pytest.mark.parametrize("key", ["training", "forward", "keys"])
def test_a_clashing_key_names_the_class_the_attribute_and_the_fix(key: str) -> None:
    d = _Heads(nn.ReLU)
    with pytest.raises(KeyError) as info:
        d[key]
    assert info.value.args == (
        f"ModuleDefaultDict key {key!r} clashes with the existing attribute _Heads.{key}; "
        "choose another name",
    )
    assert len(d) == 0


@pytest.mark.parametrize("key", ["head", 3, None])
def test_a_miss_without_a_factory_is_a_plain_key_error_of_the_key(key: object) -> None:
    with pytest.raises(KeyError) as info:
        ModuleDefaultDict()[key]  # type: ignore[index]
    assert info.value.args == (key,)


# Loading -----------------------------------------------------------------------------------


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))


def test_entries_that_are_containers_are_restored_whole() -> None:
    # Each entry is an nn.Sequential, so its keys have several dots ("a.0.weight"): the entry's
    # name is the part before the first one.
    trained = ModuleDefaultDict(_block)
    trained["a"]
    trained["b"]
    fresh = ModuleDefaultDict(_block)
    result = fresh.load_state_dict(trained.state_dict(), strict=True)
    assert result.missing_keys == []
    assert result.unexpected_keys == []
    assert list(fresh) == ["a", "b"]
    assert list(fresh.state_dict()) == list(trained.state_dict())
    for key, value in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)


def test_nested_dicts_are_restored_at_every_level() -> None:
    inner = functools.partial(ModuleDefaultDict, functools.partial(nn.Linear, 2, 2))
    trained: ModuleDefaultDict[Any] = ModuleDefaultDict(inner)
    trained["outer"]["inner"]
    fresh: ModuleDefaultDict[Any] = ModuleDefaultDict(inner)
    fresh.load_state_dict(trained.state_dict(), strict=True)
    assert list(fresh.state_dict()) == ["outer.inner.weight", "outer.inner.bias"]
    assert torch.equal(fresh["outer"]["inner"].weight, trained["outer"]["inner"].weight)


def test_the_load_step_adds_to_the_lists_that_torch_passes() -> None:
    # A pre-hook sees the very lists that the dict's own load step then fills; anything the
    # hook appends must reach the caller, next to what the dict reports.
    trained = ModuleDefaultDict(functools.partial(nn.Linear, 2, 2))
    trained["a"]
    fresh = ModuleDefaultDict(functools.partial(nn.Linear, 2, 2))

    def pre_hook(
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        missing_keys.append("from_the_hook")
        unexpected_keys.append("unexpected_from_the_hook")

    fresh._register_load_state_dict_pre_hook(pre_hook, with_module=True)
    state = {**trained.state_dict(), "stray": torch.zeros(1)}
    result = fresh.load_state_dict(state, strict=False)
    assert result.missing_keys == ["from_the_hook"]
    assert result.unexpected_keys == ["unexpected_from_the_hook", "stray"]
    assert list(fresh) == ["a"]


def test_an_error_that_a_pre_hook_records_reaches_the_caller() -> None:
    fresh = ModuleDefaultDict(functools.partial(nn.Linear, 2, 2))

    def pre_hook(
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        error_msgs.append("the hook found a problem")

    fresh._register_load_state_dict_pre_hook(pre_hook, with_module=True)
    with pytest.raises(RuntimeError) as info:
        fresh.load_state_dict({}, strict=False)
    assert str(info.value) == (
        "Error(s) in loading state_dict for ModuleDefaultDict:\n\tthe hook found a problem"
    )
