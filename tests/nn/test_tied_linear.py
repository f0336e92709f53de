"""TiedLinear: its laws for every shape, dtype and device, then examples, then the errors.

The property tests draw cases from ``tests.strategies.linear_cases``, weighted towards real
arithmetic (``--hypothesis-show-statistics`` prints the mix); each also runs one fixed
``meta`` example. Where a law compares TiedLinear with ``F.linear``, it also compares with an
``einsum`` in double precision that does not call ``F.linear``, within a rounding bound.
"""

from __future__ import annotations

import copy
import pickle
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.nn.utils import parametrize

from tests.nn.distributed.tiny_lm import TinyLM
from tests.nn.models import TiedPair
from tests.strategies import DEVICES, LinearCase, linear_cases, make_tensor
from toolkit.nn import TiedLinear

# Laws -----------------------------------------------------------------------------------------


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal shape, dtype and device, and, where there is data, equal bit for bit."""
    assert (actual.shape, actual.dtype, actual.device) == (
        expected.shape,
        expected.dtype,
        expected.device,
    )
    if actual.device.type != "meta":
        assert torch.equal(actual, expected)


def assert_matches_the_oracle(actual: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``actual`` equals ``x @ w.T`` by ``einsum`` in double precision, within rounding.

    Each output element may be off by ``(k + 2) * eps`` times the sum of the magnitudes of its
    ``k`` products (a dot product accumulated in the dtype, with room for the final rounding
    and complex products), and by the smallest normal number, for results that underflow.
    """
    assert actual.shape == (*x.shape[:-1], w.shape[0])
    if actual.device.type == "meta":
        return
    wide = torch.complex128 if x.dtype.is_complex else torch.float64
    x64, w64 = x.detach().cpu().to(wide), w.detach().cpu().to(wide)
    exact = torch.einsum("...i,oi->...o", x64, w64)
    scale = torch.einsum("...i,oi->...o", x64.abs(), w64.abs())
    eps, tiny = torch.finfo(x.dtype).eps, torch.finfo(x.dtype).tiny  # of the real part
    bound = (x.shape[-1] + 2) * eps * scale + tiny
    error = (actual.detach().cpu().to(wide) - exact).abs()
    assert bool((error <= bound).all()), f"max error {error.max()} over bound"


def build_tied_module(case: LinearCase, kind: str) -> nn.Module:
    """An embedding or a bias-free linear whose weight is (out_features, in_features)."""
    options = {"device": case.device, "dtype": case.dtype}
    if kind == "embedding":
        module: nn.Module = nn.Embedding(case.out_features, case.in_features, **options)
    else:
        module = nn.Linear(case.in_features, case.out_features, bias=False, **options)
    with torch.no_grad():
        module.weight.copy_(make_tensor((case.out_features, case.in_features), case, offset=1))
    return module


@pytest.fixture(autouse=True, scope="module")
def _warm_up() -> None:
    """Run each device's first build, call and backward here, outside the deadline."""
    for device in DEVICES:
        for dtype in (torch.float32, torch.float16):
            case = LinearCase(device, dtype, (2, 1), 3, 4, seed=0)
            for kind in ("embedding", "linear"):
                TiedLinear(build_tied_module(case, kind))(make_tensor(case.x_shape, case))
            model = TiedPair(4, 3, dtype=dtype, device=device)
            model(torch.zeros(2, dtype=torch.long, device=device)).sum().backward()
    torch.einsum("...i,oi->...o", torch.ones(2, 3), torch.ones(4, 3))


_F = TypeVar("_F", bound=Callable[..., Any])
tied_kinds = st.sampled_from(["embedding", "linear"])
# The draws put ``meta`` in about one case in twelve; this example keeps it in every run.
META_CASE = LinearCase("meta", torch.float32, (2, 3), 4, 5, seed=0)


def with_meta_example(**arguments: object) -> Callable[[_F], _F]:
    """``@example(case=META_CASE, **arguments)`` where ``meta`` is one of the devices."""
    if "meta" not in DEVICES:
        return lambda test: test
    return example(case=META_CASE, **arguments)


@given(case=linear_cases(), kind=tied_kinds)
@with_meta_example(kind="linear")
def test_agrees_with_f_linear_bit_for_bit(case: LinearCase, kind: str) -> None:
    tied = build_tied_module(case, kind)
    x = make_tensor(case.x_shape, case)
    out = TiedLinear(tied)(x)
    assert out.shape == (*case.lead, case.out_features)
    assert_same(out, F.linear(x, tied.weight))
    assert_matches_the_oracle(out, x, tied.weight)


@given(case=linear_cases(min_out=1, float_only=True))
@with_meta_example()
def test_gradient_is_the_sum_of_both_uses(case: LinearCase) -> None:
    model = TiedPair(case.out_features, case.in_features, dtype=case.dtype, device=case.device)
    with torch.no_grad():
        model.emb.weight.copy_(make_tensor((case.out_features, case.in_features), case, offset=1))
    generator = torch.Generator().manual_seed(case.seed)
    idx = torch.randint(0, case.out_features, case.lead, generator=generator).to(case.device)
    grad_out = make_tensor((*case.lead, case.out_features), case, offset=2)

    model(idx).backward(grad_out)

    # Functional reference: differentiate each use of the weight on its own, then add.
    w = model.emb.weight.detach().clone().requires_grad_()
    (through_embedding,) = torch.autograd.grad(
        F.linear(F.embedding(idx, w), w.detach()), w, grad_out
    )
    (through_head,) = torch.autograd.grad(F.linear(F.embedding(idx, w.detach()), w), w, grad_out)
    grad = model.emb.weight.grad
    expected = through_embedding + through_head
    assert grad is not None
    assert (grad.shape, grad.dtype) == (expected.shape, expected.dtype)
    if not case.is_meta:
        torch.testing.assert_close(grad, expected)


# Each transformation returns a new model (or the same one changed) and the weight values it
# should hold, computed without TiedLinear.
Transform = Callable[[TiedPair, LinearCase, torch.Tensor], tuple[TiedPair, torch.Tensor]]


def _fresh(model: TiedPair, device: str | torch.device) -> TiedPair:
    weight = model.emb.weight
    return TiedPair(*weight.shape, dtype=weight.dtype, device=device)


def _to_dtype(model: TiedPair, case: LinearCase, ref: torch.Tensor) -> Any:
    target = torch.float64 if model.emb.weight.dtype != torch.float64 else torch.float32
    return model.to(dtype=target), ref.to(target)


def _meta_to_empty(model: TiedPair, case: LinearCase, ref: torch.Tensor) -> Any:
    fresh = _fresh(model, "meta").to_empty(device=case.device)
    with torch.no_grad():
        fresh.emb.weight.copy_(model.emb.weight)
    return fresh, ref


def _load_copy(model: TiedPair, case: LinearCase, ref: torch.Tensor) -> Any:
    fresh = _fresh(model, case.device)
    fresh.load_state_dict(model.state_dict(), strict=True)
    return fresh, ref


def _load_assign(model: TiedPair, case: LinearCase, ref: torch.Tensor) -> Any:
    fresh = _fresh(model, "meta")
    fresh.load_state_dict(model.state_dict(), strict=True, assign=True)
    return fresh, ref


def _replace_weight(model: TiedPair, case: LinearCase, ref: torch.Tensor) -> Any:
    ref = ref + 0.5
    model.emb.weight = nn.Parameter(ref.to(model.emb.weight.device))
    return model, ref


TRANSFORMS: dict[str, Transform] = {
    "deepcopy": lambda model, case, ref: (copy.deepcopy(model), ref),
    "pickle": lambda model, case, ref: (pickle.loads(pickle.dumps(model)), ref),
    "pickle0": lambda model, case, ref: (pickle.loads(pickle.dumps(model, protocol=0)), ref),
    "to_dtype": _to_dtype,
    "meta_to_empty": _meta_to_empty,
    "load_copy": _load_copy,
    "load_assign": _load_assign,
    "replace_weight": _replace_weight,
}


@given(
    case=linear_cases(min_out=1, float_only=True),
    steps=st.lists(st.sampled_from(sorted(TRANSFORMS)), min_size=1, max_size=6),
)
@with_meta_example(steps=sorted(TRANSFORMS))
def test_the_tie_survives_any_sequence_of_transformations(
    case: LinearCase, steps: list[str]
) -> None:
    """Copies, pickling, casts, meta init, loading (with assign) and a new Parameter."""
    model = TiedPair(case.out_features, case.in_features, dtype=case.dtype, device=case.device)
    ref = make_tensor((case.out_features, case.in_features), case, offset=1).detach()
    with torch.no_grad():
        model.emb.weight.copy_(ref)
    ref = ref.cpu() if not case.is_meta else ref

    for step in steps:
        model, ref = TRANSFORMS[step](model, case, ref)
        weight = model.emb.weight
        assert list(model.parameters()) == [weight]
        assert list(model.state_dict()) == ["emb.weight"]
        assert model.head.tied_module is model.emb
        assert model.head.weight is weight
        x = make_tensor(case.x_shape, case).to(weight.dtype)
        out = model.head(x)
        assert_same(out, F.linear(x, weight))
        assert_matches_the_oracle(out, x, weight)
        if not case.is_meta:
            assert torch.equal(weight.detach().cpu(), ref)


@pytest.mark.parametrize("kind", ["embedding", "linear"])
def test_laws_hold_for_a_fixed_example(kind: str) -> None:
    # A fixed, hand-checked instance of the laws above, so a broken strategy cannot hide them.
    case = LinearCase("cpu", torch.float64, (2,), 2, 3, seed=0)
    tied = build_tied_module(case, kind)
    with torch.no_grad():
        tied.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
    x = torch.tensor([[2.0, 3.0], [-1.0, 4.0]], dtype=torch.float64)
    expected = torch.tensor([[2.0, 3.0, 5.0], [-1.0, 4.0, 3.0]], dtype=torch.float64)
    assert torch.equal(TiedLinear(tied)(x), expected)


# Every call uses exactly what ``tied_module.weight`` gives ------------------------------------


class _BufferWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.randn(7, 3))


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


class _ClassAttributeOverParameter(nn.Embedding):
    """A class attribute ``weight`` hides the Parameter registered under the same name."""

    weight = torch.ones(7, 3)  # type: ignore[assignment]


class _GetattrOverParameter(nn.Embedding):
    """Forwards ``weight`` to another tensor, as wrappers that forward attributes do."""

    def __getattr__(self, name: str) -> Any:
        if name == "weight" and "other" in self._buffers:
            return self._buffers["other"]
        return super().__getattr__(name)


class _GetattributeOverParameter(nn.Embedding):
    """Intercepts every attribute read and answers ``weight`` with its rows reversed."""

    def __getattribute__(self, name: str) -> Any:
        if name == "weight":
            return super().__getattr__("weight").flip(0)
        return super().__getattribute__(name)


class _ParametersProperty(nn.Embedding):
    """Presents another ``weight`` in a ``_parameters`` property; ``Module.__getattr__``, and
    so the ``weight`` attribute, reads the registered Parameter from the instance dict."""

    @property  # type: ignore[misc]
    def _parameters(self) -> dict[str, Any]:  # type: ignore[override]
        real: dict[str, Any] = self.__dict__["_parameters"]
        return {**real, "weight": -real["weight"]} if "weight" in real else real

    @_parameters.setter
    def _parameters(self, value: dict[str, Any]) -> None:
        self.__dict__["_parameters"] = value


class _ReportsModuleGetattr(type):
    """A metaclass that answers ``cls.__getattr__`` with ``nn.Module``'s, whatever ``cls``
    defines: a property of the metaclass comes before the class's own ``__dict__``."""

    __getattr__ = property(lambda cls: nn.Module.__getattr__)


class _GetattrBehindTheMetaclass(_GetattrOverParameter, metaclass=_ReportsModuleGetattr):
    """Its own ``__getattr__`` answers ``weight``, while its class reports ``nn.Module``'s."""


class _PlainEmbedding(nn.Embedding):
    """A subclass that changes nothing about how ``weight`` is found."""


_INSTANCE_DICT = vars(nn.Module)["__dict__"]  # the descriptor of the instance's own dict


class _OwnDictOverParameter(nn.Embedding):
    """A class whose ``__dict__`` is a view of its own, where ``_parameters`` holds another
    ``weight``: ``Module.__getattr__`` reads the attributes through it."""

    @property  # type: ignore[misc]
    def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
        return _shadow(_INSTANCE_DICT.__get__(self))  # type: ignore[attr-defined]


def _shadow(real: dict[str, Any]) -> dict[str, Any]:
    """The instance dict ``real`` with another ``weight`` in its ``_parameters``."""
    weight = -real["_parameters"]["weight"]
    return {**real, "_parameters": {**real["_parameters"], "weight": weight}}


_REAL_DICTS: dict[int, dict[str, Any]] = {}  # by id: the instance dicts of the class below


class _OutsideTheMroMeta(type):
    """A metaclass whose classes have themselves alone as MRO: not even ``object``."""

    def mro(cls) -> list[type]:
        return [cls] if "alone" in vars(cls) else super().mro()


class _WeightOutsideTheMro(nn.Embedding, metaclass=_OutsideTheMroMeta):
    """A class attribute ``weight`` in a class whose MRO holds it alone; it resolves
    attributes as ``nn.Module`` does and presents itself as one."""

    alone = True
    __getattribute__ = object.__getattribute__
    __getattr__ = nn.Module.__getattr__
    __class__ = property(lambda self: nn.Module)  # type: ignore[assignment]
    weight = torch.full((7, 3), 2.0)  # type: ignore[assignment]


class _OwnDictOutsideTheMro(nn.Embedding, metaclass=_OutsideTheMroMeta):
    """A ``__dict__`` of the class's own, as in ``_OwnDictOverParameter``, in a class whose
    MRO holds it alone; it resolves attributes as ``nn.Module`` does."""

    alone = True
    __getattribute__ = object.__getattribute__
    __getattr__ = nn.Module.__getattr__
    __class__ = property(lambda self: nn.Module)  # type: ignore[assignment]
    __dict__ = property(lambda self: _shadow(_REAL_DICTS[id(self)]))  # type: ignore[assignment]


def _own_dict_outside_the_mro(head: TiedLinear) -> None:
    _REAL_DICTS[id(head.tied_module)] = head.tied_module.__dict__
    head.tied_module.__class__ = _OwnDictOutsideTheMro


class _Negate(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return -weight


class _Holder:
    """Something with a weight that is no Module (and no ``__getattr__``)."""

    def __init__(self) -> None:
        self.weight = torch.randn(7, 3)


class _AnsweringParameters(dict):  # type: ignore[type-arg]
    """A ``_parameters`` mapping that answers ``weight`` itself, as DeepSpeed ZeRO-3's does
    for a partitioned parameter that it gathers when it is read."""

    def __getitem__(self, key: str) -> Any:
        value = super().__getitem__(key)
        return -value if key == "weight" else value


def _answering_parameters(head: TiedLinear) -> None:
    module = head.tied_module
    module._parameters = _AnsweringParameters(module._parameters)


def _become(cls: type[nn.Module]) -> Callable[[TiedLinear], None]:
    def change(head: TiedLinear) -> None:
        if issubclass(cls, _GetattrOverParameter):
            head.tied_module.register_buffer("other", torch.randn(7, 3))
        head.tied_module.__class__ = cls

    return change


def _replace(weight: Callable[[], torch.Tensor]) -> Callable[[TiedLinear], None]:
    def change(head: TiedLinear) -> None:
        del head.tied_module.weight
        head.tied_module.weight = weight()

    return change


# Changes made to an nn.Embedding(7, 3) after TiedLinear has read it once.
CHANGES: dict[str, Callable[[TiedLinear], None]] = {
    "new parameter": lambda head: setattr(
        head.tied_module, "weight", nn.Parameter(torch.ones(7, 3))
    ),
    "buffer": lambda head: (
        delattr(head.tied_module, "weight"),
        head.tied_module.register_buffer("weight", torch.randn(7, 3)),
    ),
    "plain attribute": _replace(lambda: torch.randn(7, 3)),
    "parametrization": lambda head: parametrize.register_parametrization(
        head.tied_module, "weight", _Negate()
    ),
    "property": _become(_PropertyOverParameter),
    "class attribute": _become(_ClassAttributeOverParameter),
    "__getattr__": _become(_GetattrOverParameter),
    "__getattribute__": _become(_GetattributeOverParameter),
    "instance __dict__": lambda head: head.tied_module.__dict__.update(weight=torch.randn(7, 3)),
    "plain subclass": _become(_PlainEmbedding),
    "a __dict__ of the class's own": _become(_OwnDictOverParameter),
    "a class attribute in an MRO without object": _become(_WeightOutsideTheMro),
    "a __dict__ of its own in an MRO without object": _own_dict_outside_the_mro,
    "another plain module": lambda head: setattr(head, "tied_module", nn.Linear(3, 7)),
    "not a module": lambda head: setattr(head, "tied_module", _Holder()),
    "to meta": lambda head: head.tied_module.to("meta"),
    "_parameters answering itself": _answering_parameters,
    "_parameters property": _become(_ParametersProperty),
    "__getattr__ behind a metaclass": _become(_GetattrBehindTheMetaclass),
}


HEAD_CHANGES = ("another plain module", "not a module")


@pytest.mark.parametrize(
    ("change", "when"),
    [
        (change, when)
        for when in ("before building", "after a call")
        for change in CHANGES
        if when == "after a call" or change not in HEAD_CHANGES
    ],
)
def test_a_call_uses_exactly_what_tied_module_weight_gives(change: str, when: str) -> None:
    """The law: a call is ``F.linear(x, tied_module.weight)`` bit for bit, whatever the
    module's class does to attribute lookup (a Parameter, a buffer, a plain or class
    attribute, a property, ``__getattr__``, one that a metaclass hides, ``__getattribute__``,
    a parametrization, a ``_parameters`` property or a mapping that answers ``weight``
    itself), whether the module was built so or changed after a call, on every call."""
    emb = nn.Embedding(7, 3)
    head = TiedLinear(emb)
    x = torch.randn(2, 3)
    original = emb.weight.detach().clone()
    if when == "after a call":
        assert torch.equal(head(x), F.linear(x, emb.weight))
        CHANGES[change](head)
    else:
        CHANGES[change](head)
        head = TiedLinear(head.tied_module)
    weight = head.tied_module.weight
    if change not in ("plain subclass", "to meta"):
        # The case is real: the attribute differs from the Parameter registered at first, or
        # from the weight that the module's ``_parameters`` presents.
        presented = getattr(head.tied_module, "_parameters", {}).get("weight", original)
        assert not (torch.equal(weight, original) and torch.equal(weight, presented))
    for _ in range(2):  # and again, once anything is cached
        assert_same(head(x.to(weight.device)), F.linear(x.to(weight.device), weight))


def _negated_weight(module: nn.Module) -> torch.Tensor:
    return -module._parameters["weight"]  # type: ignore[operator]


def _reversed_weight(module: nn.Module, name: str) -> Any:
    value = nn.Module.__getattr__(module, name)
    return value.flip(0) if name == "weight" else value


def _reversed_weight_attribute(module: nn.Module, name: str) -> Any:
    if name == "weight":
        return _reversed_weight(module, name)
    return object.__getattribute__(module, name)


class _WeightProperty(nn.Embedding):
    weight = property(_negated_weight)  # type: ignore[assignment]


# Changes made to the classes of a module built as ``Tied(7, 3)``, ``class Tied(Base)`` and
# ``class Base(nn.Embedding)`` (both made afresh for each test), after TiedLinear was built
# and called: the module keeps its class, the class or a base changes.
CLASS_CHANGES: dict[str, Callable[[type, type], None]] = {
    "weight property on the class": lambda base, cls: setattr(
        cls, "weight", property(_negated_weight)
    ),
    "weight property on a base class": lambda base, cls: setattr(
        base, "weight", property(_negated_weight)
    ),
    "class attribute": lambda base, cls: setattr(cls, "weight", torch.ones(7, 3)),
    "__getattr__ on the class": lambda base, cls: setattr(cls, "__getattr__", _reversed_weight),
    "__getattribute__ on a base class": lambda base, cls: setattr(
        base, "__getattribute__", _reversed_weight_attribute
    ),
    "__bases__ assigned": lambda base, cls: setattr(cls, "__bases__", (_WeightProperty,)),
}


def _fresh_classes() -> tuple[type[nn.Embedding], type[nn.Embedding]]:
    class Base(nn.Embedding):
        pass

    class Tied(Base):
        pass

    return Base, Tied


@pytest.mark.parametrize("change", list(CLASS_CHANGES))
def test_a_call_follows_a_class_changed_after_building(change: str) -> None:
    """``tied_module.weight`` on every call, even once the module's own class (or a base)
    gains a ``weight`` property, a class attribute, ``__getattr__``, ``__getattribute__``,
    or other bases."""
    base, cls = _fresh_classes()
    module = cls(7, 3)
    head = TiedLinear(module)
    x = torch.randn(2, 3)
    assert torch.equal(head(x), F.linear(x, module.weight))
    CLASS_CHANGES[change](base, cls)
    weight = module.weight
    assert not torch.equal(weight, module._parameters["weight"])  # the case is real
    for _ in range(2):
        assert_same(head(x), F.linear(x, weight))
    for name in ("weight", "__getattr__", "__getattribute__"):  # undone, the Parameter again
        for owner in (base, cls):
            if name in vars(owner):
                delattr(owner, name)
    if change == "__bases__ assigned":
        cls.__bases__ = (base,)
    assert_same(head(x), F.linear(x, module._parameters["weight"]))


def test_a_weight_changed_in_place_or_through_functional_call_is_used() -> None:
    model = TiedPair(7, 3)
    idx = torch.tensor([0, 4])
    other = torch.randn(7, 3)
    out = torch.func.functional_call(model, {"emb.weight": other}, (idx,))
    assert torch.equal(out, F.linear(F.embedding(idx, other), other))
    with torch.no_grad():
        model.emb.weight.zero_()
    assert torch.equal(model(idx), torch.zeros(2, 7))


def test_an_uninitialized_lazy_weight_is_accepted_and_read_once_initialized() -> None:
    lazy = nn.LazyLinear(5, bias=False)
    head = TiedLinear(lazy)
    assert repr(head) == (
        "TiedLinear(in_features=<uninitialized>, out_features=<uninitialized>, "
        "tied_to=LazyLinear(in_features=0, out_features=5, bias=False).weight)"
    )
    with pytest.raises(ValueError, match="uninitialized parameter"):
        head(torch.randn(2, 3))
    with pytest.raises(RuntimeError, match="uninitialized parameter"):
        head.in_features  # noqa: B018 - the read is what is tested
    lazy(torch.randn(2, 3))  # materializes a (5, 3) weight
    x = torch.randn(4, 3)
    assert torch.equal(head(x), F.linear(x, lazy.weight))
    assert (head.in_features, head.out_features) == (3, 5)


def test_weight_and_features_are_live_read_only_and_shown_by_repr() -> None:
    lin = nn.Linear(3, 7)
    head = TiedLinear(lin)
    assert head.weight is lin.weight
    assert repr(head) == (
        "TiedLinear(in_features=3, out_features=7, "
        "tied_to=Linear(in_features=3, out_features=7, bias=True).weight)"
    )
    lin.weight = nn.Parameter(torch.zeros(9, 4))
    assert head.weight is lin.weight
    assert (head.in_features, head.out_features) == (4, 9)
    assert repr(head).startswith("TiedLinear(in_features=4, out_features=9, tied_to=Linear(")
    for name in ("weight", "in_features"):
        with pytest.raises(AttributeError):
            setattr(head, name, None)
    # transformers sets out_features after resizing the tied embedding, to the live value.
    head.out_features = 9
    with pytest.raises(AttributeError, match=r"9.*set to 8.*resize tied_module"):
        head.out_features = 8
    assert (head.out_features, head.weight.shape) == (9, (9, 4))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_requires_grad_sets_the_tied_weight_as_a_module_would(requires_grad: bool) -> None:
    emb = nn.Embedding(7, 3)
    emb.weight.requires_grad_(not requires_grad)
    linear = nn.Linear(3, 7, bias=False)
    linear.weight.requires_grad_(not requires_grad)
    head = TiedLinear(emb)
    assert head.requires_grad_(requires_grad) is head
    assert linear.requires_grad_(requires_grad) is linear
    assert emb.weight.requires_grad is linear.weight.requires_grad is requires_grad
    emb.weight.requires_grad_(False)
    head.requires_grad_()  # with no argument it unfreezes, as Module.requires_grad_ does
    assert emb.weight.requires_grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_behaves_as_an_equivalent_linear(dtype: torch.dtype) -> None:
    emb = nn.Embedding(7, 3)
    linear = nn.Linear(3, 7, bias=False)
    with torch.no_grad():
        linear.weight.copy_(emb.weight)
    x = torch.randn(2, 3)
    with torch.autocast("cpu", dtype=dtype):
        ours, expected = TiedLinear(emb)(x), linear(x)
    assert ours.dtype == expected.dtype == dtype
    assert torch.equal(ours, expected)


# Not a Module: what a model sees, hooks, copies, torchtune ------------------------------------


def test_is_not_a_module_and_adds_nothing_to_its_parent() -> None:
    """Its parameters and state dict are the embedding's alone: see the tie's law above."""
    model = TiedPair(7, 3)
    assert not isinstance(model.head, nn.Module)
    assert isinstance(model.head.linear, nn.Module)
    assert [n for n, _ in model.named_modules()] == ["", "emb"]


@contextmanager
def _global_hooks(seen: list[tuple[str, nn.Module, Any]]) -> Iterator[None]:
    handles = [
        module_hooks.register_module_forward_pre_hook(
            lambda m, args: seen.append(("global pre", m, args))
        ),
        module_hooks.register_module_forward_hook(
            lambda m, _args, out: seen.append(("global post", m, out))
        ),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def test_hooks_on_linear_and_global_hooks_see_input_weight_and_output_once_per_call() -> None:
    emb = nn.Embedding(7, 3)
    head = TiedLinear(emb)
    seen: list[tuple[str, nn.Module, Any]] = []
    head.linear.register_forward_pre_hook(lambda m, args: seen.append(("pre", m, args)))
    head.linear.register_forward_hook(lambda m, _args, out: seen.append(("post", m, out)))
    x = torch.randn(2, 3)
    with _global_hooks(seen):
        out = head(x)
        head(x)
    kinds = ["global pre", "pre", "global post", "post"]
    assert [(kind, m) for kind, m, _ in seen] == [(kind, head.linear) for kind in kinds] * 2
    for _, _, (pre_x, pre_weight) in seen[:2]:
        assert pre_x is x
        assert pre_weight is emb.weight
    assert seen[2][2] is out
    assert seen[3][2] is out
    head.linear.register_forward_hook(lambda _m, _args, out: torch.zeros_like(out))
    assert torch.equal(head(x), torch.zeros(2, 7))  # a forward hook can replace the output


def test_safetensors_saves_the_one_weight(tmp_path: Any) -> None:
    model = TiedPair(7, 3)
    safetensors.torch.save_file(model.state_dict(), tmp_path / "tied.safetensors")
    loaded = safetensors.torch.load_file(tmp_path / "tied.safetensors")
    assert list(loaded) == ["emb.weight"]
    assert torch.equal(loaded["emb.weight"], model.emb.weight)


def test_is_a_drop_in_for_torchtunes_tied_linear(torchtune_tied_linear: type) -> None:
    emb = nn.Embedding(11, 4)
    ours, theirs = TiedLinear(emb), torchtune_tied_linear(emb)
    assert ours.tied_module is theirs.tied_module is emb
    assert isinstance(theirs.linear, nn.Module)
    for x in (torch.randn(4), torch.randn(3, 4), torch.randn(2, 0, 4)):
        assert torch.equal(ours(x), theirs(x))


# Compile --------------------------------------------------------------------------------------

COMPILED: dict[str, Callable[[], nn.Module]] = {
    "parameter": lambda: TiedLinear(nn.Embedding(7, 3)),  # type: ignore[dict-item]
    "buffer": lambda: TiedLinear(_BufferWeight()),  # type: ignore[dict-item]
    "property": lambda: TiedLinear(_PropertyOverParameter(7, 3)),  # type: ignore[dict-item]
    "tied-lm": TinyLM,
}


@pytest.mark.parametrize("name", list(COMPILED))
def test_compiles_in_one_graph_with_no_break_to_what_the_attribute_gives(name: str) -> None:
    torch._dynamo.reset()
    model = COMPILED[name]()
    x = torch.tensor([[1, 2, 3], [4, 5, 16]]) if name == "tied-lm" else torch.randn(2, 3)
    explanation = torch._dynamo.explain(model)(x)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    expected = model(x) if name == "tied-lm" else F.linear(x, model.weight)  # type: ignore[arg-type]
    assert torch.equal(compiled(x), expected)


# Errors: the type, the names, the shapes and the fix ------------------------------------------

# One golden message each, by test id: the rest of the tests assert their facts.
GOLDEN = {
    "module": (
        "TiedLinear needs a module with a 'weight' attribute to tie to, but ReLU has none; "
        "pass the module that owns the shared weight, such as the token embedding"
    ),
    "tensor": (
        "TiedLinear needs a module with a 'weight' attribute to tie to, but Tensor has none; "
        "pass the module that owns this tensor (such as the nn.Embedding), not the tensor itself"
    ),
    "namespace": (
        "TiedLinear ties to an nn.Module, got SimpleNamespace, which has a 'weight' but is not "
        "a Module; pass the nn.Module that owns the weight, such as the nn.Embedding"
    ),
    "weight-none": (
        "TiedLinear needs LayerNorm.weight to be a 2-D tensor, got NoneType; tie to a module "
        "whose weight is a tensor"
    ),
    "1-D": (
        "TiedLinear needs LayerNorm.weight to be 2-D (out_features, in_features), got shape "
        "(4,); tie to a module with a matrix weight, such as nn.Embedding or nn.Linear"
    ),
    "parameter": (
        "TiedLinear needs Embedding.weight to be 2-D (out_features, in_features) when called, "
        "got shape (3,); a weight assigned to the tied module after TiedLinear was built must "
        "be 2-D too"
    ),
    "float": (
        "TiedLinear needs Embedding.weight to be a 2-D tensor when called, got float; a weight "
        "assigned to the tied module after TiedLinear was built must be a 2-D tensor too"
    ),
}


class _IntWeight(nn.Module):
    weight = 3


@pytest.mark.parametrize(
    ("module", "error", "facts"),
    [
        (nn.Embedding(7, 3).weight, AttributeError, ["Parameter has none", "not the tensor"]),
        (torch.randn(7, 3), AttributeError, ["Tensor has none", "not the tensor itself"]),
        (object(), AttributeError, ["object has none", "token embedding"]),
        (nn.ReLU(), AttributeError, ["ReLU has none", "token embedding"]),
        (None, AttributeError, ["NoneType has none", "token embedding"]),
        (types.SimpleNamespace(weight=torch.ones(2, 2)), TypeError, ["SimpleNamespace", "Module"]),
        (TiedLinear(nn.Embedding(2, 2)), TypeError, ["got TiedLinear", "nn.Embedding"]),
        (nn.LayerNorm(4, elementwise_affine=False), TypeError, ["LayerNorm.weight", "NoneType"]),
        (_IntWeight(), TypeError, ["_IntWeight.weight", "got int"]),
        (nn.LayerNorm(4), ValueError, ["LayerNorm.weight", "2-D", "(4,)", "nn.Embedding"]),
        (nn.Conv1d(2, 3, 5), ValueError, ["Conv1d.weight", "(3, 2, 5)", "nn.Linear"]),
    ],
    ids=str.split(
        "a-parameter tensor object module none namespace tied-linear weight-none int 1-D 3-D"
    ),
)
def test_a_module_without_a_weight_that_can_work_is_refused_changing_nothing(
    module: Any, error: type[Exception], facts: list[str], request: Any, torchtune_tied_linear: type
) -> None:
    """No weight at all is an AttributeError whatever the type, as in torchtune."""
    before = copy.deepcopy(module.state_dict()) if isinstance(module, nn.Module) else {}
    if error is AttributeError:
        with pytest.raises(AttributeError):
            torchtune_tied_linear(module)
    with pytest.raises(error) as info:
        TiedLinear(module)
    assert all(fact in str(info.value) for fact in facts), str(info.value)
    assert str(info.value) == GOLDEN.get(request.node.callspec.id, str(info.value))
    if error is AttributeError:  # the failed lookup inside is noise to the caller
        assert info.value.__suppress_context__
    if isinstance(module, nn.Module):
        torch.testing.assert_close(module.state_dict(), before, rtol=0, atol=0)
        assert not module._forward_hooks
        assert not module._forward_pre_hooks


@pytest.mark.parametrize(
    ("change", "error", "facts"),
    [
        ("parameter", ValueError, ["Embedding.weight", "2-D", "(3,)"]),
        ("parameter-0d", ValueError, ["Embedding.weight", "shape ()"]),
        ("parameter-3d", ValueError, ["Embedding.weight", "(7, 3, 2)"]),
        ("buffer", ValueError, ["Embedding.weight", "(3,)"]),
        ("property", ValueError, ["_PropertyOverParameter.weight", "(3,)"]),
        ("none", TypeError, ["Embedding.weight", "got NoneType"]),
        ("float", TypeError, ["Embedding.weight", "got float"]),
    ],
    ids=["parameter", "parameter-0d", "parameter-3d", "buffer", "property", "none", "float"],
)
def test_a_weight_that_is_no_longer_a_2d_tensor_when_called_raises(
    change: str, error: type[Exception], facts: list[str], request: Any
) -> None:
    """F.linear would take a 1-D weight and drop the output's last dimension."""
    emb = _PropertyOverParameter(7, 3) if change == "property" else nn.Embedding(7, 3)
    head = TiedLinear(emb)
    head(torch.randn(2, 3))
    shapes = {"parameter-0d": (), "parameter-3d": (7, 3, 2)}
    if change.startswith("parameter"):
        emb.weight = nn.Parameter(torch.randn(shapes.get(change, (3,))))
    elif change == "buffer":
        del emb.weight
        emb.register_buffer("weight", torch.randn(3))
    elif change == "property":
        emb._parameters["weight"] = nn.Parameter(torch.randn(3))
    elif change == "none":
        emb.weight = None  # Module.__setattr__ keeps the name registered, with no Parameter
    else:
        del emb.weight
        emb.weight = 2.5
    with pytest.raises(error) as info:
        head(torch.randn(2, 3))
    assert all(fact in str(info.value) for fact in facts), str(info.value)
    assert "after TiedLinear was built" in str(info.value)
    assert str(info.value) == GOLDEN.get(request.node.callspec.id, str(info.value))


@pytest.mark.parametrize("shape", [(2, 4), (4,), (), (3, 0, 5)])
@pytest.mark.parametrize("owner", ["parameter", "buffer"])
def test_a_wrong_input_width_names_both_shapes_and_in_features(
    shape: tuple[int, ...], owner: str
) -> None:
    emb = nn.Embedding(7, 3) if owner == "parameter" else _BufferWeight()
    before = emb.weight.detach().clone()
    with pytest.raises(RuntimeError) as info:
        TiedLinear(emb)(torch.randn(shape))
    name = type(emb).__name__
    if shape == (2, 4) and owner == "parameter":  # the one golden message
        assert str(info.value) == (
            "TiedLinear input has shape (2, 4), but Embedding.weight has shape (7, 3): the "
            "input's last dimension must equal in_features=3; reshape the input or tie to the "
            "right module"
        )
    for fact in (f"shape {shape}", f"{name}.weight has shape (7, 3)", "in_features=3"):
        assert fact in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)  # torch's own error stays attached
    assert "TiedLinear" not in str(info.value.__cause__)
    assert torch.equal(emb.weight, before)


def _hook_makes_tensors(head: TiedLinear) -> None:
    def to_tensors(module: nn.Module, args: tuple[object, ...]) -> tuple[object, ...]:
        x, weight = args
        return torch.as_tensor(x, dtype=torch.float32), weight

    head.linear.register_forward_pre_hook(to_tensors)
    assert head([1.0, 2.0, 3.0]).shape == (7,)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("x", "prepare", "error"),
    [
        (torch.randn(2, 3, dtype=torch.float64), None, RuntimeError),  # a dtype mismatch
        ([1.0, 2.0, 3.0], None, TypeError),  # not a tensor
        ([1.0, 2.0], _hook_makes_tensors, RuntimeError),  # a hook made the tensors
    ],
    ids=["dtype", "not-a-tensor", "hook-made-tensors"],
)
def test_other_failures_keep_torchs_own_error(
    x: Any, prepare: Callable[[TiedLinear], None] | None, error: type[Exception]
) -> None:
    head = TiedLinear(nn.Embedding(7, 3))
    if prepare is not None:
        prepare(head)
    with pytest.raises(error) as info:
        head(x)
    assert "TiedLinear" not in str(info.value)
    assert info.value.__cause__ is None
