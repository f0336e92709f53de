"""TiedLinear against its specification: the missing-weight error, exact weight reads, 2-D calls.

- Whatever ``tied_module`` is, if it has no ``weight`` the error is an ``AttributeError``, as
  the reference page says and as torchtune 0.6.1 raises, so migrating code that catches it
  keeps working.
- A call uses exactly what ``tied_module.weight`` gives, even where that is not the
  Parameter registered under ``_parameters["weight"]``, which the fast path reads.
- A weight that is not a 2-D tensor when TiedLinear is called raises, naming its shape.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from benchmarks.torchtune_reference import load_tied_linear
from toolkit.nn import TiedLinear, _tied_linear

# No weight: AttributeError, whatever the type -----------------------------------------------

_TENSOR_FIX = (
    "pass the module that owns this tensor (such as the nn.Embedding), not the tensor itself"
)
_MODULE_FIX = "pass the module that owns the shared weight, such as the token embedding"


@pytest.mark.parametrize(
    ("no_weight", "name", "fix"),
    [
        (nn.Embedding(7, 3).weight, "Parameter", _TENSOR_FIX),
        (torch.randn(7, 3), "Tensor", _TENSOR_FIX),
        (object(), "object", _MODULE_FIX),
        (nn.ReLU(), "ReLU", _MODULE_FIX),
        (None, "NoneType", _MODULE_FIX),
    ],
    ids=["parameter", "tensor", "object", "module", "none"],
)
def test_no_weight_is_an_attribute_error_whatever_the_type(
    no_weight: object, name: str, fix: str
) -> None:
    with pytest.raises(AttributeError) as info:
        TiedLinear(no_weight)  # type: ignore[arg-type]
    assert str(info.value) == (
        f"TiedLinear needs a module with a 'weight' attribute to tie to, but {name} has none; {fix}"
    )


@pytest.mark.parametrize(
    "no_weight",
    [nn.Embedding(7, 3).weight, torch.randn(7, 3), object(), nn.ReLU(), None],
    ids=["parameter", "tensor", "object", "module", "none"],
)
def test_torchtune_raises_the_same_error_type(no_weight: object) -> None:
    reference, _ = load_tied_linear()
    with pytest.raises(AttributeError):
        reference(no_weight)
    with pytest.raises(AttributeError):
        TiedLinear(no_weight)  # type: ignore[arg-type]


# Every call uses exactly ``tied_module.weight`` ----------------------------------------------


class _PropertyOverParameter(nn.Embedding):
    """Keeps the table as the Parameter ``weight`` but presents it scaled, via a property."""

    scale = 2.0

    @property  # type: ignore[override]
    def weight(self) -> torch.Tensor:
        raw = self._parameters.get("weight")
        if raw is None:  # while nn.Embedding.__init__ registers it
            raise AttributeError("weight")
        return raw * self.scale

    def reset_parameters(self) -> None:
        with torch.no_grad():  # nn.Embedding's would initialise a scaled copy
            self._parameters["weight"].normal_()  # type: ignore[union-attr]


class _ClassAttributeOverParameter(nn.Module):
    """A class attribute ``weight`` hides the Parameter registered under the same name."""

    weight = torch.ones(7, 3)

    def __init__(self) -> None:
        super().__init__()
        self._parameters["weight"] = nn.Parameter(torch.randn(7, 3))


class _GetattrOverParameter(nn.Embedding):
    """Forwards ``weight`` to another tensor, as wrappers that forward attributes do."""

    def __init__(self) -> None:
        super().__init__(7, 3)
        self.register_buffer("other", torch.randn(7, 3))

    def __getattr__(self, name: str) -> Any:
        if name == "weight" and "other" in self._buffers:
            return self._buffers["other"]
        return super().__getattr__(name)


class _GetattributeOverParameter(nn.Embedding):
    """Intercepts every attribute read and answers ``weight`` with its rows reversed."""

    def __init__(self) -> None:
        super().__init__(7, 3)
        with torch.no_grad():  # reset_parameters initialised a reversed copy
            self._parameters["weight"].normal_()  # type: ignore[union-attr]

    def __getattribute__(self, name: str) -> Any:
        if name == "weight":
            return super().__getattr__("weight").flip(0)
        return super().__getattribute__(name)


def _instance_dict_over_parameter() -> nn.Module:
    emb = nn.Embedding(7, 3)
    # Written past Module.__setattr__, which would otherwise register it as the Parameter.
    emb.__dict__["weight"] = torch.randn(7, 3)
    return emb


class _Negate(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return -weight


_SHADOWED: dict[str, Callable[[], nn.Module]] = {
    "property": lambda: _PropertyOverParameter(7, 3),
    "class attribute": _ClassAttributeOverParameter,
    "__getattr__": _GetattrOverParameter,
    "__getattribute__": _GetattributeOverParameter,
    "instance __dict__": _instance_dict_over_parameter,
}


def _registered(module: nn.Module) -> torch.Tensor:
    """The Parameter under ``_parameters["weight"]``, or the original of a parametrization."""
    if parametrize.is_parametrized(module, "weight"):
        return module.parametrizations.weight.original  # type: ignore[union-attr,return-value]
    weight = module._parameters["weight"]
    assert weight is not None
    return weight


@pytest.mark.parametrize("kind", list(_SHADOWED))
def test_a_call_uses_the_attribute_where_it_differs_from_the_parameter(kind: str) -> None:
    module = _SHADOWED[kind]()
    head = TiedLinear(module)
    x = torch.randn(2, 3)
    expected = F.linear(x, module.weight)  # type: ignore[arg-type]
    # The case is real: the registered Parameter gives another answer.
    assert not torch.equal(F.linear(x, _registered(module)), expected)
    assert torch.equal(head(x), expected)
    assert torch.equal(head(x), expected)  # and again, once anything is cached


def _become(cls: type[nn.Module]) -> Callable[[nn.Module], None]:
    def change(module: nn.Module) -> None:
        module.__class__ = cls

    return change


def _forward_weight_to_a_buffer(module: nn.Module) -> None:
    module.register_buffer("other", torch.randn(7, 3))
    module.__class__ = _GetattrOverParameter


def _shadow_in_instance_dict(module: nn.Module) -> None:
    module.__dict__["weight"] = torch.randn(7, 3)


# The same kinds, brought about on a plain nn.Embedding after TiedLinear has read it.
_LATER: dict[str, Callable[[nn.Module], None]] = {
    "property": _become(_PropertyOverParameter),
    "class attribute": _become(_ClassAttributeOverParameter),
    "__getattr__": _forward_weight_to_a_buffer,
    "__getattribute__": _become(_GetattributeOverParameter),
    "instance __dict__": _shadow_in_instance_dict,
}


@pytest.mark.parametrize("kind", list(_LATER))
def test_a_call_sees_the_attribute_once_it_starts_to_differ(kind: str) -> None:
    """The type of the tied module, and its ``__dict__``, may change after TiedLinear is built."""
    emb = nn.Embedding(7, 3)
    head = TiedLinear(emb)
    x = torch.randn(2, 3)
    assert torch.equal(head(x), F.linear(x, emb.weight))
    _LATER[kind](emb)
    expected = F.linear(x, emb.weight)
    assert not torch.equal(F.linear(x, _registered(emb)), expected)
    assert torch.equal(head(x), expected)


def test_a_parametrization_registered_after_building_is_used() -> None:
    emb = nn.Embedding(7, 3)
    head = TiedLinear(emb)
    x = torch.randn(2, 3)
    head(x)
    parametrize.register_parametrization(emb, "weight", _Negate())
    assert torch.equal(head(x), F.linear(x, -_registered(emb)))
    assert torch.equal(head(x), F.linear(x, emb.weight))


def test_a_buffer_that_replaces_the_parameter_is_used() -> None:
    emb = nn.Embedding(7, 3)
    head = TiedLinear(emb)
    x = torch.randn(2, 3)
    head(x)
    del emb.weight
    emb.register_buffer("weight", torch.randn(7, 3))
    assert torch.equal(head(x), F.linear(x, emb.weight))


def test_a_weight_property_compiles_to_what_the_attribute_gives() -> None:
    torch._dynamo.reset()
    module = _PropertyOverParameter(7, 3)
    head = TiedLinear(module)
    x = torch.randn(2, 3)
    compiled = torch.compile(head, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), F.linear(x, module.weight))


class _PlainEmbedding(nn.Embedding):
    """A subclass that changes nothing about how ``weight`` is found."""


def test_a_plain_module_is_read_without_module_getattr() -> None:
    """The fast path is taken for a registered Parameter: no Python-level ``__getattr__``."""
    emb = nn.Embedding(7, 3)
    head = TiedLinear(emb)
    x = torch.randn(2, 3)
    getattr_code = nn.Module.__getattr__.__code__
    called: list[str] = []

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        if event == "call" and frame.f_code is getattr_code:
            called.append(frame.f_locals["name"])

    sys.setprofile(profile)
    try:
        out = head(x)  # the first call too: the type was examined when TiedLinear was built
    finally:
        sys.setprofile(None)
    assert torch.equal(out, F.linear(x, emb.weight))
    assert "weight" not in called

    # A module whose class changes to another plain one is read fast again after one call.
    emb.__class__ = _PlainEmbedding
    head(x)
    sys.setprofile(profile)
    try:
        out = head(x)
    finally:
        sys.setprofile(None)
    assert torch.equal(out, F.linear(x, emb.weight))
    assert "weight" not in called

    # The same watch does see the attribute read where the fast path does not apply.
    del emb.weight
    emb.register_buffer("weight", torch.randn(7, 3))
    sys.setprofile(profile)
    try:
        head(x)
    finally:
        sys.setprofile(None)
    assert called == ["weight"]


# A weight that is not 2-D when called ------------------------------------------------------


def _value_error(owner: str, shape: tuple[int, ...]) -> str:
    return (
        f"TiedLinear needs {owner}.weight to be 2-D (out_features, in_features) when called, "
        f"got shape {shape}; a weight assigned to the tied module after TiedLinear was built "
        "must be 2-D too"
    )


@pytest.mark.parametrize("shape", [(3,), (), (1, 7, 3)], ids=["1-D", "0-D", "3-D"])
def test_a_parameter_that_is_not_2d_when_called_raises(shape: tuple[int, ...]) -> None:
    emb = nn.Embedding(7, 3)
    head = TiedLinear(emb)
    emb.weight = nn.Parameter(torch.randn(shape))
    with pytest.raises(ValueError, match=r"^TiedLinear needs") as info:
        head(torch.randn(2, 3))
    assert str(info.value) == _value_error("Embedding", shape)


def test_a_1d_weight_never_gives_a_wrongly_shaped_output() -> None:
    """Without a check, ``F.linear`` accepts a 1-D weight and drops the output feature axis."""
    emb = nn.Embedding(7, 3)
    head = TiedLinear(emb)
    emb.weight = nn.Parameter(torch.randn(3))
    assert F.linear(torch.randn(2, 3), emb.weight).shape == (2,)  # what torch would give
    with pytest.raises(ValueError, match=r"got shape \(3,\)"):
        head(torch.randn(2, 3))


@pytest.mark.parametrize("kind", ["buffer", "property"])
def test_a_1d_weight_read_through_the_attribute_raises(kind: str) -> None:
    if kind == "buffer":
        module: nn.Module = nn.Embedding(7, 3)
        head = TiedLinear(module)
        del module.weight
        module.register_buffer("weight", torch.randn(3))
        owner = "Embedding"
    else:
        module = _PropertyOverParameter(7, 3)
        head = TiedLinear(module)
        module._parameters["weight"] = nn.Parameter(torch.randn(3))
        owner = "_PropertyOverParameter"
    with pytest.raises(ValueError, match=r"^TiedLinear needs") as info:
        head(torch.randn(2, 3))
    assert str(info.value) == _value_error(owner, (3,))


def test_a_weight_that_is_no_longer_a_tensor_raises_a_type_error() -> None:
    emb = nn.Embedding(7, 3)
    head = TiedLinear(emb)
    emb.weight = None  # Module.__setattr__ keeps the name registered, with no Parameter
    with pytest.raises(TypeError, match=r"^TiedLinear needs") as info:
        head(torch.randn(2, 3))
    assert str(info.value) == (
        "TiedLinear needs Embedding.weight to be a 2-D tensor when called, got NoneType; a "
        "weight assigned to the tied module after TiedLinear was built must be a 2-D tensor too"
    )


def test_an_uninitialized_lazy_weight_raises_torchs_error_when_called() -> None:
    head = TiedLinear(nn.LazyLinear(5, bias=False))
    with pytest.raises(ValueError, match=r"^Attempted to use an uninitialized parameter"):
        head(torch.randn(2, 3))


def test_the_type_of_the_tied_module_is_examined_once_per_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Examining a type walks its MRO; calls repeat it only when the type has changed."""
    # Counted through the module attribute, which TiedLinear looks up on each use, rather
    # than by profiling its code object: that also holds when the function is wrapped.
    examine = _tied_linear._resolves_weight_plainly
    examined: list[type] = []

    def counting(cls: type) -> bool:
        examined.append(cls)
        return examine(cls)

    monkeypatch.setattr(_tied_linear, "_resolves_weight_plainly", counting)
    x = torch.randn(2, 3)
    plain, shadowed = nn.Embedding(7, 3), _PropertyOverParameter(7, 3)
    heads = [TiedLinear(plain), TiedLinear(shadowed)]
    for _ in range(3):
        for head in heads:
            head(x)
    plain.__class__ = _PlainEmbedding
    for _ in range(3):
        heads[0](x)
    assert examined == [nn.Embedding, _PropertyOverParameter, _PlainEmbedding]
