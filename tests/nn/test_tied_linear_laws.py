"""Property tests: the laws TiedLinear obeys for every shape, dtype, device and seed.

The cases come from ``tests.strategies.linear_cases``, weighted towards real arithmetic: with
the ``ci`` profile on a CPU-only machine, 94-100% of each test's examples ran on a device with
data, 76-99% with non-empty tensors, 0-6% on ``meta`` and 0-16% with a zero-size dimension
(``--hypothesis-show-statistics`` prints the mix; the README has the table per test). Each test
also runs one fixed ``meta`` example. Where a law compares TiedLinear with ``F.linear``, it
also compares the result with an ``einsum`` in double precision that does not call
``F.linear``, within a rounding bound for each dtype.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st
from torch import nn

from tests.nn.models import TiedPair
from tests.strategies import DEVICES, LinearCase, linear_cases, make_tensor
from toolkit.nn import TiedLinear


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal shape, dtype and device, and, where there is data, equal bit for bit."""
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    assert actual.device == expected.device
    if actual.device.type != "meta":
        assert torch.equal(actual, expected)


_F = TypeVar("_F", bound=Callable[..., Any])

# The unit roundoff of each dtype's real part: F.linear's error is bounded by it.
EPS = {
    torch.float64: torch.finfo(torch.float64).eps,
    torch.float32: torch.finfo(torch.float32).eps,
    torch.bfloat16: torch.finfo(torch.bfloat16).eps,
    torch.float16: torch.finfo(torch.float16).eps,
    torch.complex64: torch.finfo(torch.float32).eps,
    torch.complex128: torch.finfo(torch.float64).eps,
}


def assert_matches_the_oracle(actual: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``actual`` equals ``x @ w.T`` computed by ``einsum`` in double precision, not F.linear.

    The inputs are exact in double precision, so the only error is ``actual``'s own rounding
    in its dtype: each output element may be off by ``(k + 2) * eps`` times the sum of the
    magnitudes of its ``k`` products (the standard bound for a dot product accumulated in
    the dtype, with room for the final rounding and complex products), and by the smallest
    normal number, for results that underflow.
    """
    assert actual.shape == (*x.shape[:-1], w.shape[0])
    if actual.device.type == "meta":
        return
    wide = torch.complex128 if x.dtype.is_complex else torch.float64
    x64, w64 = x.detach().cpu().to(wide), w.detach().cpu().to(wide)
    exact = torch.einsum("...i,oi->...o", x64, w64)
    scale = torch.einsum("...i,oi->...o", x64.abs(), w64.abs())
    bound = (x.shape[-1] + 2) * EPS[x.dtype] * scale + torch.finfo(actual.real.dtype).tiny
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
    """Run each device's first build, copy, call and backward here, outside the deadline.

    The first use of a device loads its kernels (for ``meta``, torch's Python meta functions),
    which can take seconds on a busy machine; the deadline is for slow examples, not for that
    one-time cost.
    """
    for device in DEVICES:
        for dtype in (torch.float32, torch.float16):
            case = LinearCase(device, dtype, (2, 1), 3, 4, seed=0)
            for kind in ("embedding", "linear"):
                TiedLinear(build_tied_module(case, kind))(make_tensor(case.x_shape, case))
            model = TiedPair(4, 3, dtype=dtype, device=device)
            model(torch.zeros(2, dtype=torch.long, device=device)).sum().backward()
    torch.einsum("...i,oi->...o", torch.ones(2, 3), torch.ones(4, 3))


tied_kinds = st.sampled_from(["embedding", "linear"])

# The draws put ``meta`` in about one case in twelve, which a run of 100 examples can miss; this
# example keeps it in every run (unless TOOLKIT_TEST_DEVICES leaves ``meta`` out).
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
    assert_same(out, F.linear(x, tied.weight))
    assert_matches_the_oracle(out, x, tied.weight)


@given(case=linear_cases(), kind=tied_kinds)
@with_meta_example(kind="embedding")
def test_shape_law(case: LinearCase, kind: str) -> None:
    tied = build_tied_module(case, kind)
    out = TiedLinear(tied)(make_tensor(case.x_shape, case))
    assert out.shape == (*case.lead, case.out_features)
    assert out.dtype == case.dtype
    assert out.device.type == case.device


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
    assert grad is not None
    expected = through_embedding + through_head
    assert grad.shape == expected.shape
    assert grad.dtype == expected.dtype
    if not case.is_meta:
        torch.testing.assert_close(grad, expected)


# Each transformation returns a new model (or the same one changed) and the weight values
# it should hold, computed without TiedLinear.
def _deepcopy(
    model: TiedPair, case: LinearCase, ref: torch.Tensor
) -> tuple[TiedPair, torch.Tensor]:
    return copy.deepcopy(model), ref


def _pickle(model: TiedPair, case: LinearCase, ref: torch.Tensor) -> tuple[TiedPair, torch.Tensor]:
    return pickle.loads(pickle.dumps(model)), ref


def _to_dtype(
    model: TiedPair, case: LinearCase, ref: torch.Tensor
) -> tuple[TiedPair, torch.Tensor]:
    target = torch.float64 if model.emb.weight.dtype != torch.float64 else torch.float32
    return model.to(dtype=target), ref.to(target)


def _fresh(model: TiedPair, device: str | torch.device) -> TiedPair:
    weight = model.emb.weight
    return TiedPair(*weight.shape, dtype=weight.dtype, device=device)


def _meta_to_empty(
    model: TiedPair, case: LinearCase, ref: torch.Tensor
) -> tuple[TiedPair, torch.Tensor]:
    fresh = _fresh(model, "meta").to_empty(device=case.device)
    with torch.no_grad():
        fresh.emb.weight.copy_(model.emb.weight)
    return fresh, ref


def _load_copy(
    model: TiedPair, case: LinearCase, ref: torch.Tensor
) -> tuple[TiedPair, torch.Tensor]:
    fresh = _fresh(model, case.device)
    fresh.load_state_dict(model.state_dict(), strict=True)
    return fresh, ref


def _load_assign(
    model: TiedPair, case: LinearCase, ref: torch.Tensor
) -> tuple[TiedPair, torch.Tensor]:
    fresh = _fresh(model, "meta")
    fresh.load_state_dict(model.state_dict(), strict=True, assign=True)
    return fresh, ref


def _replace_weight(
    model: TiedPair, case: LinearCase, ref: torch.Tensor
) -> tuple[TiedPair, torch.Tensor]:
    ref = ref + 0.5
    model.emb.weight = nn.Parameter(ref.to(model.emb.weight.device))
    return model, ref


TRANSFORMS = {
    f.__name__.lstrip("_"): f
    for f in (
        _deepcopy,
        _pickle,
        _to_dtype,
        _meta_to_empty,
        _load_copy,
        _load_assign,
        _replace_weight,
    )
}


@given(
    case=linear_cases(min_out=1, float_only=True),
    steps=st.lists(st.sampled_from(sorted(TRANSFORMS)), min_size=1, max_size=6),
)
@with_meta_example(steps=sorted(TRANSFORMS))
def test_invariants_survive_any_sequence_of_transformations(
    case: LinearCase, steps: list[str]
) -> None:
    model = TiedPair(case.out_features, case.in_features, dtype=case.dtype, device=case.device)
    ref = make_tensor((case.out_features, case.in_features), case, offset=1).detach()
    with torch.no_grad():
        model.emb.weight.copy_(ref)
    ref = ref.cpu() if not case.is_meta else ref

    for step in steps:
        model, ref = TRANSFORMS[step](model, case, ref)

        weight = model.emb.weight
        assert [p for p in model.parameters()] == [weight]
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
