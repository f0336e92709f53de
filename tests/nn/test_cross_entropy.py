"""TiedLinear.cross_entropy in one process: F.cross_entropy of the logits, without the logits.

Laws first (parity over drawn options, a table of edges, then the training regimes), then the
memory law, then errors. The reference is ``F.cross_entropy`` of ``F.linear``, written here.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.autograd import forward_ad
from torch.utils._python_dispatch import TorchDispatchMode

from tests.strategies import LinearCase, ignored_targets, linear_cases, make_tensor
from toolkit.nn import TiedLinear
from toolkit.nn._cross_entropy import default_chunk_size, linear_cross_entropy

Loss = Callable[[Tensor, Tensor], Tensor]


def _inputs(
    tokens: int, vocab: int, width: int, dtype: torch.dtype = torch.float64, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """Tokens of which every third from the second is ignored (-100)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=generator, dtype=torch.float64).to(dtype)
    weight = torch.randn(vocab, width, generator=generator, dtype=torch.float64).to(dtype)
    target = torch.randint(0, max(vocab, 1), (tokens,), generator=generator)
    target[1::3] = -100
    return x, weight, target


def _ours(target: Tensor, **options: Any) -> Loss:
    def loss(x: Tensor, weight: Tensor) -> Tensor:
        owner = nn.Module()
        owner.weight = weight  # a plain tensor (a transform's wrapper, say), read live
        return TiedLinear(owner).cross_entropy(x, target, **options)

    return loss


def _plain(target: Tensor, **options: Any) -> Loss:
    """F.cross_entropy of the flattened logits, widened from 16 bits and soft-capped, plus the
    z-loss of each counted token, reduced as the loss is."""
    options.pop("chunk_size", None)  # the plain path has no chunks
    z_loss, softcap = options.pop("z_loss", 0.0), options.pop("softcap", None)

    def loss(x: Tensor, weight: Tensor) -> Tensor:
        logits = F.linear(x, weight).reshape(target.numel(), weight.shape[0])
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        flat = target.reshape(-1)
        ce = F.cross_entropy(logits, flat, **options)
        counted = flat != options.get("ignore_index", -100)
        extra = torch.where(counted, z_loss * torch.logsumexp(logits, -1).square(), 0.0)
        reduction = options.get("reduction", "mean")
        if reduction == "none":
            return (ce + extra).reshape(target.shape)
        return ce + (extra.sum() / counted.sum() if reduction == "mean" else extra.sum())

    return loss


def _leaves(*tensors: Tensor) -> list[Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def _loss_and_grads(
    loss_of: Loss,
    x: Tensor,
    weight: Tensor,
    upstream: float | Tensor = 1.0,
    create_graph: bool = False,
) -> list[Tensor]:
    """The loss, and the gradients of x and weight for the incoming gradient ``upstream``."""
    leaves = _leaves(x, weight)
    loss = loss_of(*leaves)
    outer = torch.as_tensor(upstream, dtype=loss.dtype, device=loss.device).expand(loss.shape)
    grads = torch.autograd.grad(loss, leaves, outer, create_graph=create_graph)
    return [t.detach() for t in (loss, *grads)]


# Laws -----------------------------------------------------------------------------------------

# rtol = atol against the plain path of the same dtype.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@st.composite
def ce_cases(draw: st.DrawFn) -> dict[str, Any]:
    """A linear case with a vocabulary of at least one, its targets and the loss's options."""
    case = draw(
        linear_cases(
            max_lead_dims=3, min_out=1, devices=("cpu",), float_only=True, max_side=6
        ).filter(lambda c: c.dtype.is_floating_point)
    )
    vocab = case.out_features
    ignore_index = draw(st.sampled_from([-100, -1, 0, vocab - 1]))
    generator = torch.Generator().manual_seed(case.seed)
    target = torch.randint(0, vocab, case.lead, generator=generator)
    ignored = draw(ignored_targets(math.prod(case.lead)))
    target.view(-1)[torch.tensor(ignored, dtype=torch.bool)] = ignore_index
    reduction = draw(st.sampled_from(["mean", "sum", "none"]))
    if reduction == "none":  # a different incoming gradient per token, zeros among them
        upstream = torch.randn(case.lead, generator=generator, dtype=torch.float64)
        upstream.view(-1)[:: draw(st.integers(1, 3))] = 0.0
    else:
        upstream = torch.tensor(draw(st.sampled_from([1.0, -0.5, 3.0])), dtype=torch.float64)
    options = {
        "ignore_index": ignore_index,
        "reduction": reduction,
        "label_smoothing": draw(st.sampled_from([0.0, 1.0]) | st.floats(0.0, 1.0)),
        "z_loss": draw(st.sampled_from([0.0, 1e-4, 0.5])),
        "softcap": draw(st.sampled_from([None, 1.0, 30.0])),
        "chunk_size": draw(st.none() | st.integers(1, 8)),
    }
    return {"case": case, "target": target, "upstream": upstream, "options": options}


# No deadline: the first example pays for loading the kernels, seconds on a busy machine.
@settings(deadline=None)
@given(drawn=ce_cases())
def test_loss_and_gradients_equal_f_cross_entropy_of_the_logits(drawn: dict[str, Any]) -> None:
    case: LinearCase = drawn["case"]
    target, upstream, options = drawn["target"], drawn["upstream"], drawn["options"]
    x = make_tensor(case.x_shape, case)
    weight = make_tensor((case.out_features, case.in_features), case, offset=1)
    ours = _loss_and_grads(_ours(target, **options), x, weight, upstream)
    assert ours[0].dtype == torch.promote_types(case.dtype, torch.float32)
    assert ours[1].dtype == ours[2].dtype == case.dtype
    tol = TOLERANCE[case.dtype]
    plain = _loss_and_grads(_plain(target, **options), x, weight, upstream)
    torch.testing.assert_close(ours, plain, rtol=tol, atol=tol, equal_nan=True)


F16, F32, F64 = torch.float16, torch.float32, torch.float64
BF16 = torch.bfloat16
SUM = {"reduction": "sum"}


@pytest.mark.parametrize(
    ("shape", "vocab", "dtype", "options"),
    [
        pytest.param((6, 3), 5, F32, {}, id="the-defaults-ignore-minus-100"),
        pytest.param((5, 3), 4, F64, {"chunk_size": 2}, id="f64-mean-of-3-in-f64"),
        pytest.param((5, 3), 4, F64, {**SUM, "chunk_size": 2}, id="f64-sum"),
        pytest.param((6, 3), 5, F32, {**SUM, "chunk_size": 4}, id="sum-not-divided"),
        pytest.param((6, 3), 5, F32, {**SUM, "label_smoothing": 0.25}, id="sum-smoothed"),
        pytest.param(
            (7, 3), 5, torch.bfloat16, {"label_smoothing": 0.1, "chunk_size": 3}, id="bf16"
        ),
        pytest.param((0, 3), 0, F32, {}, id="no-tokens-no-vocabulary-nan-mean"),
        pytest.param((0, 3), 4, F32, {}, id="no-tokens-nan-mean"),
        pytest.param((0, 3), 0, F32, SUM, id="no-tokens-no-vocabulary-sum"),
        pytest.param((0, 3), 4, F64, SUM, id="no-tokens-sum"),
        pytest.param((0, 3), 5, torch.bfloat16, {"reduction": "none"}, id="no-tokens-none"),
        pytest.param((2, 3, 5), 7, F32, {}, id="3d-input"),
        pytest.param((3, 4, 3), 5, F32, {"reduction": "none", "softcap": 2.0}, id="3d-none"),
        pytest.param((3, 2), 1, F32, {}, id="one-class-some-ignored"),
        # A loss scale of 65536, beyond float16's range, applied before rounding to float16.
        pytest.param((6, 3), 5, F16, {}, id="f16-loss-scale"),
        pytest.param((10, 3), 5, F16, {"chunk_size": 4}, id="f16-loss-scale-every-chunk"),
        pytest.param((10, 3), 5, F16, {**SUM, "chunk_size": 4}, id="f16-loss-scale-sum"),
    ],
)
def test_edge_cases_give_what_f_cross_entropy_gives(
    shape: tuple[int, ...], vocab: int, dtype: torch.dtype, options: dict[str, Any]
) -> None:
    """Loss and gradients, also without grad mode and through a backward that builds a graph
    (which recomputes the chunks), under a default device (meta) that is not the input's."""
    x, weight, target = _inputs(math.prod(shape[:-1]), vocab, shape[-1], dtype)
    x, target = x.reshape(shape), target.reshape(shape[:-1])
    weight = weight * (0.01 if dtype == F16 else 1.0)  # the plain path's gradient fits float16
    upstream = {F16: 65536.0, F64: 0.7}.get(dtype, 1.0)
    rtol, atol = {F16: (5e-3, 1.0), F64: (1e-13, 1e-15)}.get(dtype, (None, None))
    plain = _loss_and_grads(_plain(target, **options), x, weight, upstream)
    with torch.device("meta"):
        for create_graph in (False, True):
            ours = _loss_and_grads(_ours(target, **options), x, weight, upstream, create_graph)
            assert ours[0].dtype == torch.promote_types(dtype, F32)
            assert ours[1].dtype == ours[2].dtype == dtype
            assert bool(ours[1].isfinite().all())
            torch.testing.assert_close(ours, plain, rtol=rtol, atol=atol, equal_nan=True)
        with torch.no_grad():
            loss = linear_cross_entropy(x, weight, target, **options)
    torch.testing.assert_close(loss, plain[0], equal_nan=True)


def test_the_embedding_receives_the_sum_of_the_lookup_and_head_gradients() -> None:
    torch.manual_seed(0)
    embedding = nn.Embedding(7, 4)
    idx, target = torch.randint(0, 7, (3, 5)), torch.randint(0, 7, (3, 5))
    TiedLinear(embedding).cross_entropy(torch.tanh(embedding(idx)), target).backward()
    weight = embedding.weight.detach().clone().requires_grad_()
    _plain(target)(torch.tanh(F.embedding(idx, weight)), weight).backward()
    torch.testing.assert_close(embedding.weight.grad, weight.grad)


def test_reads_the_weight_live_takes_any_integer_targets_and_calls_no_linear_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The logits never exist, so no hook on ``linear`` could observe them. The new weight's
    logits are hundreds apart: a target's probability underflows, its loss stays exact. torch
    built without distributed has no DTensor: no weight is taken for one."""
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    head, x, target = _small()
    calls: list[str] = []
    head.linear.register_forward_pre_hook(lambda *_: calls.append("pre"))
    head.linear.register_forward_hook(lambda *_: calls.append("post"))
    head.tied_module.weight = nn.Parameter(torch.randn(11, 4) * 100.0)
    with torch.no_grad():
        loss = head.cross_entropy(x, target.int(), reduction="sum")
    torch.testing.assert_close(loss, _plain(target, reduction="sum")(x, head.weight))
    assert 1e3 < loss.item() < math.inf
    assert calls == []
    head(x)
    assert calls == ["pre", "post"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, F16, F64, F32])
@pytest.mark.parametrize("grad_mode", [False, True])
@pytest.mark.parametrize("needs", ["both", "x", "weight"])
@pytest.mark.parametrize("reduction", ["mean", "none"])  # gradients saved, or recomputed
def test_backward_gives_each_gradient_needed_in_its_input_dtype_and_none_other(
    dtype: torch.dtype, grad_mode: bool, needs: str, reduction: str
) -> None:
    """Called on the node, with no engine to convert or drop what it returns, in grad mode off
    (the engine's) and on (create_graph's); float32 under bfloat16 autocast. x's gradient
    does not depend on whether the weight needs one, to the bit."""
    x, weight, target = _inputs(6, 5, 3, dtype)
    x.requires_grad_(needs != "weight")
    weight.requires_grad_(needs != "x")
    with torch.autocast("cpu", torch.bfloat16, enabled=dtype == F32):
        loss = linear_cross_entropy(x, weight, target, chunk_size=4, reduction=reduction)
        both = linear_cross_entropy(*_leaves(x, weight), target, chunk_size=4, reduction=reduction)
    node: Any = loss.grad_fn  # the custom Function's node: one gradient per output
    with torch.set_grad_enabled(grad_mode):
        grad_x, grad_w, *rest = node.apply(torch.ones_like(loss), None, None)
        both_x = both.grad_fn.apply(torch.ones_like(loss), None, None)[0]
    assert all(grad is None for grad in rest)
    assert (grad_x is None, grad_w is None) == (needs == "weight", needs == "x")
    assert grad_x is None or torch.equal(grad_x, both_x)
    plain = _loss_and_grads(_plain(target, reduction=reduction), x, weight)
    for grad, expected in zip((grad_x, grad_w), plain[1:], strict=True):
        assert grad is None or grad.dtype == dtype
        if grad is not None and dtype != F32:  # autocast's products: in the autocast tests
            torch.testing.assert_close(grad, expected, rtol=2e-2, atol=2e-3)


# Regimes: the float16 loss scale, second order, torch.func, autocast, compile, checkpointing ---


def test_a_float16_loss_scale_gives_gradients_as_exact_as_the_plain_path() -> None:
    """1024 tokens, 1024 classes: a token's share of a mean's gradient is below float16's normal
    range. The error of x's gradient, scaled by 65536 then unscaled, is at most twice the
    plain path's, against float64."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=generator).half()
    weight = (torch.randn(1024, 16, generator=generator) * 0.02).half()
    target = torch.randint(0, 1024, (1024,), generator=generator)

    def unscaled_grad_x(loss_of: Loss, x: Tensor, weight: Tensor) -> Tensor:
        return _loss_and_grads(loss_of, x, weight, 65536.0)[1].double() / 65536.0

    exact = unscaled_grad_x(_plain(target), x.double(), weight.double())
    errors = {}
    for name, loss_of in (("plain", _plain(target)), ("ours", _ours(target))):
        grad = unscaled_grad_x(loss_of, x, weight)
        errors[name] = ((grad - exact).norm() / exact.norm()).item(), int((grad == 0).sum())
    assert errors["ours"][0] <= 2 * errors["plain"][0]
    assert errors["ours"][1] <= errors["plain"][1]


@pytest.mark.parametrize(("dtype", "reduction"), [(F16, "mean"), (F16, "sum"), (BF16, "mean")])
@pytest.mark.parametrize(("value", "exact"), [(18.0, -1.5235e-8), (16.0, -1.1252e-7)])
def test_a_loss_scale_reaches_a_confident_tokens_gradient_before_16_bit_rounding(
    dtype: torch.dtype, reduction: str, value: float, exact: float
) -> None:
    """One token, weight [[0], [-1]], target 0: dL/dx = -sigmoid(-x), below float16's smallest
    subnormal at x = 18 and subnormal at 16. Under a loss scale of 65536 it is the plain
    path's, to 0.1% in float16; bfloat16 has float32's range, so it holds it too, to its own
    precision."""
    x = torch.tensor([[value]], dtype=dtype)
    weight = torch.tensor([[0.0], [-1.0]], dtype=dtype)
    target = torch.tensor([0])
    grads = {}
    for name, loss_of in (("plain", _plain), ("ours", _ours)):
        grad = _loss_and_grads(loss_of(target, reduction=reduction), x, weight, 65536.0)[1]
        grads[name] = grad.double().item() / 65536.0
    rel = 1e-3 if dtype == F16 else 1e-2
    assert grads["ours"] == pytest.approx(grads["plain"], rel=rel)
    assert grads["ours"] == pytest.approx(exact, rel=rel)


def test_a_float16_loss_scale_leaves_no_more_zeros_in_x_gradient_than_the_plain_path() -> None:
    """64 confident tokens (each target its largest logit), 256 classes, width 64, a loss
    scale of 65536: x's gradient has as many exact zeros as the plain path's (10 of 4,096,
    against 99 when rounded to float16 before the scale)."""
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 64, generator=generator) * 3.0).half()
    weight = (torch.randn(256, 64, generator=generator) * 0.5).half()
    target = F.linear(x.float(), weight.float()).argmax(1)
    zeros = {}
    for name, loss_of in (("plain", _plain(target)), ("ours", _ours(target))):
        grad = _loss_and_grads(loss_of, x, weight, 65536.0)[1]
        assert grad.dtype == F16
        zeros[name] = int((grad == 0).sum())
    assert zeros["ours"] <= zeros["plain"]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("extra", [{}, {"z_loss": 0.1, "softcap": 1.5}])
def test_create_graph_gives_the_second_order_gradients_of_the_plain_path(
    reduction: str, extra: dict[str, Any]
) -> None:
    x, weight, target = _inputs(7, 5, 3)
    options: dict[str, Any] = {"reduction": reduction, "label_smoothing": 0.2, **extra}
    upstream = torch.linspace(-1.0, 2.0, 7, dtype=F64)

    def second_order(loss_of: Loss) -> list[Tensor]:
        leaves = _leaves(x, weight)
        loss = loss_of(*leaves)
        outer = upstream if reduction == "none" else torch.ones((), dtype=loss.dtype)
        grads = torch.autograd.grad(loss, leaves, outer, create_graph=True)
        assert all(g.grad_fn is not None for g in grads)
        return list(torch.autograd.grad(grads[0].sin().sum() + grads[1].square().sum(), leaves))

    torch.testing.assert_close(
        second_order(_ours(target, chunk_size=3, **options)),
        second_order(_plain(target, **options)),
    )


def test_torch_func_grad_jacrev_and_vmap_match_the_plain_path() -> None:
    """Under vmap each entry is its own loss, with its own count: the third has none (nan)."""
    x, weight = torch.randn(3, 6, 4, dtype=F64), torch.randn(5, 4, dtype=F64)
    target = torch.randint(0, 5, (3, 6))
    target[1, :4] = -100
    target[2] = -100

    def transformed(make: Callable[..., Loss]) -> list[Tensor]:
        def loss(x: Tensor, w: Tensor, target: Tensor) -> Tensor:
            return make(target, chunk_size=4)(x, w)

        one = (x[0], weight, target[0])
        return [
            torch.func.grad(loss)(*one),
            torch.func.grad(loss, argnums=1)(*one),
            torch.func.jacrev(torch.func.jacrev(loss))(*one),
            torch.func.vmap(loss, (0, None, 0))(x, weight, target),
            torch.func.vmap(torch.func.grad(loss), (0, None, 0))(x, weight, target),
        ]

    torch.testing.assert_close(transformed(_ours), transformed(_plain), equal_nan=True)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize(("tokens", "batched"), [(6, "x"), (0, "x"), (6, "weight")])
def test_vmap_then_a_plain_backward_gives_the_plain_paths_gradients(
    reduction: str, tokens: int, batched: str
) -> None:
    """x or the weight batched, both needing gradients: each entry's loss, then one backward
    through them all, outside any transform."""
    x, weight = torch.randn(2, tokens, 4, dtype=F64), torch.randn(5, 4, dtype=F64)
    if batched == "weight":
        weight = torch.randn(2, 5, 4, dtype=F64)
    target = torch.randint(0, 5, (2, tokens))

    def grads(make: Callable[..., Loss]) -> list[Tensor]:
        leaves = _leaves(x, weight)
        if batched == "x":
            losses = torch.func.vmap(lambda x, t: make(t, reduction=reduction)(x, leaves[1]))(
                leaves[0], target
            )
        else:
            losses = torch.func.vmap(lambda w, t: make(t, reduction=reduction)(leaves[0][0], w))(
                leaves[1], target
            )
        losses.sum().backward()
        return [losses.detach(), leaves[0].grad, leaves[1].grad]  # type: ignore[list-item]

    torch.testing.assert_close(grads(_ours), grads(_plain), equal_nan=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_gradients_returned_are_not_part_of_a_graph(reduction: str) -> None:
    """Without create_graph the gradients are plain tensors, as the plain path's are."""
    x, weight, target = _inputs(7, 5, 3)
    leaves = _leaves(x, weight)
    loss = _ours(target, reduction=reduction, chunk_size=3)(*leaves)
    grads = torch.autograd.grad(loss.sum(), leaves)
    assert [g.requires_grad for g in grads] == [False, False]
    assert [g.grad_fn for g in grads] == [None, None]


def _dual(f: Callable[[Tensor], Tensor], primal: Tensor) -> object:
    with forward_ad.dual_level():
        return f(forward_ad.make_dual(primal, torch.ones_like(primal)))


# Forward-mode AD loads torch's decompositions, some through the deprecated torch.jit.script.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize(
    "transform",
    [
        lambda f, x: torch.func.jvp(f, (x,), (torch.ones_like(x),)),
        lambda f, x: torch.func.jacfwd(f)(x),
        lambda f, x: torch.func.hessian(f)(x),
        _dual,
    ],
    ids=["jvp", "jacfwd", "hessian", "dual-tensors"],
)
def test_forward_mode_ad_is_refused_with_the_fix(
    transform: Callable[[Callable[[Tensor], Tensor], Tensor], object],
) -> None:
    x, weight, target = _inputs(6, 5, 3)
    ours = _ours(target, chunk_size=4)
    for f, primal in ((lambda x: ours(x, weight), x), (lambda w: ours(x, w), weight)):
        with pytest.raises(RuntimeError) as info:
            transform(f, primal)
        message = str(info.value)
        assert message.startswith("TiedLinear.cross_entropy does not support forward-mode AD")
        assert "(torch.func.jvp, jacfwd, hessian, torch.autograd.forward_ad)" in message
        assert message.endswith("with head(x) and take F.cross_entropy of them")
    with forward_ad.dual_level():  # plain tensors inside a dual level are not dual
        torch.testing.assert_close(ours(x, weight), _plain(target)(x, weight))


@pytest.mark.parametrize(("dtype", "x_dtype"), [(F32, F32), (F32, torch.bfloat16), (F64, F64)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_under_bfloat16_autocast_the_loss_is_that_of_head_x(
    dtype: torch.dtype, x_dtype: torch.dtype, reduction: str
) -> None:
    """The products run in bfloat16 as head(x)'s do, for an input of float32 or of bfloat16
    (as autocast's layers give it); float64 stays float64."""
    x, weight, target = _inputs(9, 7, 16, dtype)
    embedding = nn.Embedding(7, 16, _weight=weight)
    head = TiedLinear(embedding)
    x_ours, x_plain = _leaves(x.to(x_dtype), x.to(x_dtype))
    with torch.autocast("cpu", torch.bfloat16):
        loss = head.cross_entropy(x_ours, target, reduction=reduction, chunk_size=4)
        logits = head(x_plain).to(torch.promote_types(dtype, F32))
        expected = F.cross_entropy(logits, target, reduction=reduction)
    assert loss.dtype == dtype
    torch.testing.assert_close(loss, expected)
    ours = torch.autograd.grad(loss.sum(), (x_ours, embedding.weight))
    plain = torch.autograd.grad(expected.sum(), (x_plain, embedding.weight))
    for actual, wanted in zip(ours, plain, strict=True):
        assert actual.dtype == wanted.dtype
        torch.testing.assert_close(actual, wanted, rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("create_graph", [False, True])
def test_a_backward_called_under_autocast_recomputes_at_the_forward_precision(
    create_graph: bool,
) -> None:
    x, weight, target = _inputs(9, 7, 16, F32)
    leaves, plain = _leaves(x, weight), _leaves(x, weight)
    loss = _ours(target, reduction="none", chunk_size=4)(*leaves)
    expected = _plain(target, reduction="none")(*plain)
    upstream = torch.linspace(-1.0, 1.0, 9)
    with torch.autocast("cpu", torch.bfloat16):
        grads = torch.autograd.grad(loss, leaves, upstream, create_graph=create_graph)
    torch.testing.assert_close(list(grads), list(torch.autograd.grad(expected, plain, upstream)))


# Dynamo builds the autograd context of a custom Function through a deprecated path, and warns.
DYNAMO_CONTEXT_WARNING = pytest.mark.filterwarnings(
    "ignore:.*should not be instantiated:DeprecationWarning"
)


@DYNAMO_CONTEXT_WARNING
@pytest.mark.parametrize(
    ("backend", "options", "dtype"),
    [
        ("eager", {"z_loss": 1e-2, "chunk_size": 3}, F32),
        ("eager", {"reduction": "none", "z_loss": 1e-2, "chunk_size": 3}, F32),
        ("eager", {"chunk_size": 3}, BF16),  # logits' gradients in float32, products in bf16
        ("inductor", {"chunk_size": 3}, F32),  # the in-place kernel, functionalized
    ],
)
def test_compiles_in_one_graph_with_the_loss_and_gradients_of_the_plain_path(
    backend: str, options: dict[str, Any], dtype: torch.dtype
) -> None:
    """And a target outside the vocabulary, read when the graph runs, still raises."""
    x, weight, target = _inputs(7, 5, 3, dtype)
    head = TiedLinear(nn.Embedding(5, 3, _weight=weight))  # built outside, as in a model
    compiled = torch.compile(
        lambda x: head.cross_entropy(x, target, **options).sum(), fullgraph=True, backend=backend
    )
    plain = _loss_and_grads(lambda x, w: _plain(target, **options)(x, w).sum(), x, head.weight)
    leaf = x.clone().requires_grad_()
    loss = compiled(leaf)
    ours = [loss.detach(), *torch.autograd.grad(loss, (leaf, head.weight))]
    torch.testing.assert_close(ours, plain)
    if backend == "eager":
        target[4] = -2 if "reduction" in options else 5
        with pytest.raises(RuntimeError, match=r"out of bounds for a vocabulary of 5") as info:
            compiled(leaf)
        assert "ignore_index=-100" in str(info.value)


@pytest.mark.parametrize("upstream", [1.0, math.nan, math.inf])
@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"reduction": "sum", "label_smoothing": 0.1},
        {"z_loss": 0.1, "softcap": 3.0},
        {"reduction": "none", "z_loss": 0.1},
    ],
)
@pytest.mark.parametrize("every", [True, False], ids=["every-ignored", "some-ignored"])
@pytest.mark.parametrize("dtype", [F64, BF16])
def test_ignored_tokens_get_zero_gradients_whatever_comes_in(
    upstream: float, create_graph: bool, options: dict[str, Any], every: bool, dtype: torch.dtype
) -> None:
    """As F.cross_entropy, exactly and in the same dtypes: an ignored token's row of x's
    gradient is 0, and with every token ignored the mean is nan (0 / 0), the sum 0, each
    token's loss 0 and the weight's gradient 0, for a nan or an inf incoming gradient too (the
    plain path multiplies nothing by it)."""
    x, weight, target = _inputs(7, 5, 3, dtype)
    if every:
        target = torch.full((7,), -100)
    ignored = target == -100
    plain = _loss_and_grads(_plain(target, **options), x, weight, upstream, create_graph)
    ours_of = _ours(target, chunk_size=3, **options)
    ours = _loss_and_grads(ours_of, x, weight, upstream, create_graph)
    assert [t.dtype for t in ours] == [t.dtype for t in plain]
    assert ours[1].dtype == ours[2].dtype == dtype
    for _, grad_x, _ in (ours, plain):
        assert torch.equal(grad_x[ignored], torch.zeros_like(x[ignored]))
    if every:
        if "reduction" in options:
            assert torch.equal(ours[0], plain[0])  # 0, or each token's 0
        else:
            assert ours[0].isnan()  # the mean of no token: 0 / 0
            assert plain[0].isnan()
        for _, _, grad_w in (ours, plain):
            assert torch.equal(grad_w, torch.zeros_like(weight))


def test_per_token_losses_take_any_incoming_gradient_twice_through_one_graph() -> None:
    x, weight, target = _inputs(12, 5, 3)
    options = {"reduction": "none", "label_smoothing": 0.3, "z_loss": 0.05, "softcap": 2.0}
    leaves = _leaves(x, weight)
    loss = _ours(target, chunk_size=5, **options)(*leaves)
    for upstream in (torch.randn(12, dtype=F64), torch.zeros(12, dtype=F64)):
        expected = _loss_and_grads(_plain(target, **options), x, weight, upstream)
        grads = torch.autograd.grad(loss, leaves, upstream, retain_graph=True)
        torch.testing.assert_close([loss.detach(), *grads], expected)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_under_activation_checkpointing_the_gradients_are_the_plain_paths(reduction: str) -> None:
    """The loss in a non-reentrant checkpoint, whose forward runs again in backward."""
    x, weight, target = _inputs(10, 11, 4)
    ours = _ours(target, reduction=reduction, chunk_size=3)
    leaves, reference = _leaves(x, weight), _leaves(x, weight)
    loss = torch.utils.checkpoint.checkpoint(
        lambda x, w: ours(torch.tanh(x), w).sum(), *leaves, use_reentrant=False
    )
    expected = _plain(target, reduction=reduction)(torch.tanh(reference[0]), reference[1]).sum()
    torch.testing.assert_close(
        list(torch.autograd.grad(loss, leaves)), list(torch.autograd.grad(expected, reference))
    )


# The memory law -------------------------------------------------------------------------------


class _Allocations(TorchDispatchMode):
    """The shapes that operations allocate (not a view, an ``out=`` or an in-place result), and
    the most tensors of ``numel`` elements or more alive at once."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.peak = numel, 0
        self.shapes: list[tuple[int, ...]] = []
        self.alive: list[weakref.ref[Tensor]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        given = pytree.tree_leaves((args, kwargs))
        storages = {t.untyped_storage().data_ptr() for t in given if isinstance(t, Tensor)}
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, Tensor) and tensor.untyped_storage().data_ptr() not in storages:
                self.shapes.append(tuple(tensor.shape))
                if tensor.numel() >= self.numel:
                    self.alive = [ref for ref in self.alive if ref() is not None]
                    self.alive.append(weakref.ref(tensor))
                    self.peak = max(self.peak, len(self.alive))
        return out


def _small() -> tuple[TiedLinear, Tensor, Tensor]:
    x, weight, target = _inputs(10, 11, 4, F32, seed=1)
    return TiedLinear(nn.Embedding(11, 4, _weight=weight)), x, target


@pytest.mark.parametrize(
    ("options", "peak"),
    [
        ({}, 1),  # the logits' buffer, which the softmax and the gradient replace
        ({"reduction": "none"}, 1),  # the same in backward, which recomputes the chunks
        ({"label_smoothing": 0.1, "z_loss": 0.01}, 1),
        ({"softcap": 5.0}, 2),  # and the soft-cap's slope
    ],
)
@pytest.mark.parametrize("needs", ["both", "x", "weight", "neither", "no-grad-mode"])
def test_a_chunk_holds_one_logits_sized_tensor_and_only_the_gradients_needed(
    options: dict[str, Any], peak: int, needs: str
) -> None:
    """12 tokens, 8 counted, in chunks of 4, vocabulary 50: only the logits and their like have
    4 * 50 elements. A mean or a sum computes the gradients needed in forward, each into one
    buffer (x's (12, 2), into whose counted rows each chunk's (4, 2) is copied, with no buffer
    of the counted rows alone; the weight's (50, 2)), and backward scales them; none needed, no
    slope. The counted tokens' hidden states are gathered a chunk at a time, (4, 2) twice."""
    x, weight, target = _inputs(12, 50, 2, F32)
    x.requires_grad_(needs in ("both", "x", "no-grad-mode"))
    weight.requires_grad_(needs in ("both", "weight", "no-grad-mode"))
    wanted = {"both": {"x", "weight"}, "x": {"x"}, "weight": {"weight"}}.get(needs, set())
    with _Allocations(4 * 50) as mode, torch.set_grad_enabled(needs != "no-grad-mode"):
        loss = linear_cross_entropy(x, weight, target, chunk_size=4, **options)
    saved = wanted if "reduction" not in options else set()
    assert ((12, 2) in mode.shapes, (50, 2) in mode.shapes) == ("x" in saved, "weight" in saved)
    assert (8, 2) not in mode.shapes
    assert mode.shapes.count((4, 2)) == 2 + 2 * ("x" in saved)
    assert mode.peak == (peak if saved else 1)
    assert (loss.grad_fn is None) == (not wanted)
    if wanted:
        with _Allocations(4 * 50) as mode:
            loss.sum().backward()
        assert mode.peak == (0 if saved else peak)
        if saved:  # the gradients are scaled in place: no zero-filled stand-ins for them
            assert not {(12, 2), (50, 2)} & set(mode.shapes)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_backward_keeps_the_inputs_and_the_gradients_of_a_mean_or_sum_only(
    reduction: str,
) -> None:
    """What the loss keeps for backward, besides 0-d stand-ins: x, the weight and the targets,
    and for a mean or a sum the gradients computed in forward. No per-token statistics: only a
    vocabulary shard keeps them (``tests/nn/test_cross_entropy_ranks.py``)."""
    x, weight, target = _inputs(12, 50, 2, F32)
    x.requires_grad_()
    weight.requires_grad_()
    kept: list[tuple[int, ...]] = []

    def pack(saved: Tensor) -> Tensor:
        kept.append(tuple(saved.shape))
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved):
        linear_cross_entropy(x, weight, target, chunk_size=4, reduction=reduction)
    gradients = [(12, 2), (50, 2)] if reduction != "none" else []
    assert sorted(shape for shape in kept if shape) == sorted([(12, 2), (50, 2), (12,), *gradients])


class _Products(TorchDispatchMode):
    """The shapes of the matrix products whose result has ``columns`` columns (the logits)."""

    def __init__(self, columns: int) -> None:
        super().__init__()
        self.columns = columns
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if (
            func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out)
            and out.shape[-1] == self.columns
        ):
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize(
    ("ignored", "products"),
    [(0, [4, 4, 4]), (4, [4, 4]), (9, [3]), (12, [])],
    ids=["none", "4-of-12", "9-of-12", "all"],
)
@pytest.mark.parametrize("backward", ["no-grad", "mean", "none", "none-create-graph"])
def test_the_logits_are_computed_for_the_counted_tokens_only(
    ignored: int, products: list[int], backward: str
) -> None:
    """12 tokens in chunks of 4, vocabulary 50: the logits of the counted tokens only, in
    forward and where backward recomputes them: with 9 ignored, one product of 3 rows; with
    every token ignored, none. A backward that builds a graph computes every token's
    (torch.func.vmap could not batch the selection), as torch.compile does."""
    x, weight, _ = _inputs(12, 50, 2, F32)
    target = torch.arange(12) * 4
    target[torch.randperm(12, generator=torch.Generator().manual_seed(0))[:ignored]] = -100
    x.requires_grad_(backward != "no-grad")
    reduction = "mean" if backward == "mean" else "none"
    with _Products(50) as forward, torch.set_grad_enabled(backward != "no-grad"):
        loss = linear_cross_entropy(x, weight, target, chunk_size=4, reduction=reduction)
    assert forward.shapes == [(rows, 50) for rows in products]
    if backward.startswith("none"):
        create_graph = backward.endswith("create-graph")
        with _Products(50) as recomputed:
            torch.autograd.grad(loss.sum(), x, create_graph=create_graph)
        rows = [4, 4, 4] if create_graph else products
        assert recomputed.shapes == [(r, 50) for r in rows]


class _Dtypes(TorchDispatchMode):
    """The (shape, dtype) of every tensor that operations return."""

    def __init__(self) -> None:
        super().__init__()
        self.made: set[tuple[tuple[int, ...], torch.dtype]] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, Tensor):
                self.made.add((tuple(tensor.shape), tensor.dtype))
        return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_inputs_gradient_is_kept_in_float32_for_float16_only(dtype: torch.dtype) -> None:
    """float16 would flush a confident token's gradient before the loss scale; bfloat16 has
    float32's range, so x's (12, 2) gradient buffer stays in bfloat16, at half the memory."""
    x, weight, target = _inputs(12, 50, 2, dtype)
    x.requires_grad_()
    with _Dtypes() as mode:
        linear_cross_entropy(x, weight, target, chunk_size=4)
    assert (((12, 2), F32) in mode.made) == (dtype == torch.float16)


@pytest.mark.parametrize(
    ("tokens", "vocab", "dtype", "chunk"),
    [
        (10_000, 32_000, F32, 524),  # 64 MiB // (32000 * 4 B)
        (600, 32_000, torch.bfloat16, 524),  # widened to float32: as many as float32's
        (300, 32_000, F64, 262),  # 64 MiB // (32000 * 8 B)
        (100, 32_000, F32, 100),  # never more than the tokens
        (1, 32_000, F32, 1),
        (0, 32_000, F32, 1),  # no tokens: still a valid step
        (1000, 10**7, F32, 16),  # 1.6 would fit: at least 16
        (2**26, 0, F32, 2**26),  # no bytes a token: every token in one chunk
    ],
)
def test_the_default_chunk_bounds_the_logits_buffer_to_64_mib(
    tokens: int, vocab: int, dtype: torch.dtype, chunk: int
) -> None:
    """The rule, and the buffer itself where it is small enough to allocate here."""
    assert default_chunk_size(tokens, vocab, torch.promote_types(dtype, F32)) == chunk
    if 0 < tokens * vocab <= 2 * 10**7:
        head = TiedLinear(nn.Embedding(vocab, 1, dtype=dtype))
        x, target = torch.ones(tokens, 1, dtype=dtype), torch.zeros(tokens, dtype=torch.long)
        with _Allocations(vocab) as mode, torch.no_grad():
            head.cross_entropy(x, target)
        assert max(mode.shapes, key=math.prod) == (chunk, vocab)


# Errors ---------------------------------------------------------------------------------------


def _refused(error: type[Exception], **call: Any) -> str:
    """The message of ``error`` from a call of ``_small()``'s head changed by ``call``; the
    call names cross_entropy and leaves no gradient behind."""
    head, x, target = _small()
    with pytest.raises(error) as info:
        head.cross_entropy(**{"x": x.requires_grad_(), "target": target, **call})
    assert (x.grad, head.weight.grad) == (None, None)
    assert str(info.value).startswith("cross_entropy ")
    return str(info.value)


@pytest.mark.parametrize(
    ("name", "value", "rule"),
    [
        ("reduction", "max", "'mean', 'sum' or 'none'"),
        *[("z_loss", v, "finite number >= 0.0") for v in (-0.1, math.inf, math.nan)],
        *[("softcap", v, "finite number > 0.0, or None") for v in (0.0, -2.0, math.inf, math.nan)],
        *[("label_smoothing", v, "in [0.0, 1.0]") for v in (-0.1, 1.5, math.nan)],
        *[("chunk_size", v, "positive int (tokens per chunk) or None") for v in (0, -3, 2.0, True)],
    ],
)
def test_a_bad_option_raises_naming_it_the_rule_and_the_value(
    name: str, value: object, rule: str
) -> None:
    message = _refused(ValueError, **{name: value})
    assert f"{name} must be" in message
    assert rule in message
    assert message.endswith(f"got {value!r}")


@pytest.mark.parametrize(
    ("call", "error", "facts"),
    [
        *[
            (
                {"target": torch.zeros(10, dtype=d)},
                TypeError,
                [str(d), "call F.cross_entropy on them"],
            )
            for d in (F32, torch.bool)
        ],
        (
            {"target": torch.zeros(2, 5).long()},
            ValueError,
            ["(2, 5)", "(10, 4)", "shape (10,), one class index per row"],
        ),
        (
            {"x": torch.zeros(2, 4, 4), "target": torch.zeros(4, 2).long()},
            ValueError,
            ["(4, 2)", "(2, 4, 4)", "shape (2, 4), one class index per row"],
        ),
        (
            {"x": torch.zeros(10, 4, dtype=F64)},
            TypeError,
            ["float64", "float32", "x.to(weight.dtype)"],
        ),
        ({"x": torch.zeros(10, 3)}, ValueError, ["(10, 3)", "(11, 4)", "in_features=4"]),
        *[
            (
                {"target": torch.tensor([0] * 9 + [v])},
                IndexError,
                [f"target {v}", "of 11", "[0, 11)", "ignore_index=-100"],
            )
            for v in (11, -1)
        ],
    ],
)
def test_a_bad_tensor_raises_naming_the_shapes_or_dtypes_and_the_fix(
    call: dict[str, Tensor], error: type[Exception], facts: list[str]
) -> None:
    """The last fact ends the message."""
    message = _refused(error, **call)
    assert all(fact in message for fact in facts), message
    assert message.endswith(facts[-1])


def test_a_second_backward_through_the_same_loss_raises() -> None:
    head, x, target = _small()
    loss = head.cross_entropy(x.requires_grad_(), target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError) as info:
        loss.backward()
    message = str(info.value)
    assert message.startswith("TiedLinear.cross_entropy does not support a second backward")
    assert "through the same loss (retain_graph=True)" in message
    assert "scaled in place by backward" in message
    assert message.endswith("Compute the loss again for another backward.")
