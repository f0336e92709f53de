"""TiedLinear.cross_entropy in the regimes training uses, against the plain path.

A float16 loss scale, second-order gradients (``create_graph=True``), ``torch.func`` (grad,
jacrev, vmap), bfloat16 autocast, ``torch.compile(fullgraph=True)``, a batch with every token
ignored, and per-token losses (``reduction="none"``) under any incoming gradient. The plain
path, the reference everywhere, is ``F.cross_entropy`` of ``F.linear`` (``head(x)``) written
here, never the code under test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad

from toolkit.nn import TiedLinear

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _inputs(
    tokens: int, vocab: int, width: int, dtype: torch.dtype = torch.float64, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=generator, dtype=torch.float64).to(dtype)
    weight = torch.randn(vocab, width, generator=generator, dtype=torch.float64).to(dtype)
    target = torch.randint(0, vocab, (tokens,), generator=generator)
    target[1::3] = -100
    return x, weight, target


def _ours(target: torch.Tensor, **options: Any) -> Loss:
    def loss(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        owner = nn.Module()
        owner.weight = weight  # a plain tensor (a transform's wrapper, say), read live
        return TiedLinear(owner).cross_entropy(x, target, **options)

    return loss


def _plain(
    target: torch.Tensor, *, z_loss: float = 0.0, softcap: float | None = None, **options: Any
) -> Loss:
    """F.cross_entropy of the logits, widened from bfloat16 and float16 as documented and
    soft-capped, plus the z-loss of each counted token, reduced as the loss is."""

    def loss(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, weight)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        ce = F.cross_entropy(logits, target, **options)
        counted = target != options.get("ignore_index", -100)
        extra = torch.where(counted, z_loss * torch.logsumexp(logits, -1).square(), 0.0)
        reduction = options.get("reduction", "mean")
        if reduction == "none":
            return ce + extra
        return ce + (extra.sum() / counted.sum() if reduction == "mean" else extra.sum())

    return loss


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


# The float16 loss scale


def test_a_float16_loss_scale_gives_gradients_as_exact_as_the_plain_path() -> None:
    """4096 tokens over 4096 classes: one token's share of a mean's gradient, p / 4096 with p
    near 1 / 4096, is below float16's smallest subnormal unless the loss scale is applied
    first. The error of x's gradient, scaled by 65536 and unscaled, against float64, is at
    most twice the plain path's, with no more exact zeros."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=generator).half()
    weight = (torch.randn(4096, 16, generator=generator) * 0.02).half()
    target = torch.randint(0, 4096, (4096,), generator=generator)
    scale = 65536.0

    def unscaled_grad_x(loss_of: Loss, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x, weight = _leaves(x, weight)
        (loss_of(x, weight) * scale).backward()
        assert x.grad is not None
        return x.grad.double() / scale

    exact = unscaled_grad_x(_plain(target), x.double(), weight.double())
    errors = {}
    for name, loss_of in (("plain", _plain(target)), ("ours", _ours(target))):
        grad = unscaled_grad_x(loss_of, x, weight)
        errors[name] = ((grad - exact).norm() / exact.norm()).item(), int((grad == 0).sum())
    assert errors["ours"][0] <= 2 * errors["plain"][0]
    assert errors["ours"][1] <= errors["plain"][1]


# Second order and torch.func


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("extra", [{}, {"z_loss": 0.1, "softcap": 1.5}])
def test_create_graph_gives_the_second_order_gradients_of_the_plain_path(
    reduction: str, extra: dict[str, Any]
) -> None:
    x, weight, target = _inputs(7, 5, 3)
    options: dict[str, Any] = {"reduction": reduction, "label_smoothing": 0.2, **extra}
    upstream = torch.linspace(-1.0, 2.0, 7, dtype=torch.float64)

    def second_order(loss_of: Loss) -> list[torch.Tensor]:
        leaves = _leaves(x, weight)
        loss = loss_of(*leaves)
        outer = upstream if reduction == "none" else torch.ones((), dtype=loss.dtype)
        grads = torch.autograd.grad(loss, leaves, outer, create_graph=True)
        assert all(g.grad_fn is not None for g in grads)
        return list(torch.autograd.grad(grads[0].sin().sum() + grads[1].square().sum(), leaves))

    ours = second_order(_ours(target, chunk_size=3, **options))
    plain = second_order(_plain(target, **options))
    for actual, expected in zip(ours, plain, strict=True):
        torch.testing.assert_close(actual, expected)


def test_create_graph_in_bfloat16_widens_the_recomputed_logits_as_forward_does() -> None:
    """The recomputed chunks' logits are widened to float32, as the plain path's are."""
    x, weight, target = _inputs(7, 5, 3, torch.bfloat16)

    def first_order(loss_of: Loss) -> list[torch.Tensor]:
        leaves = _leaves(x, weight)
        grads = torch.autograd.grad(loss_of(*leaves), leaves, create_graph=True)
        assert all(g.grad_fn is not None and g.dtype == torch.bfloat16 for g in grads)
        return list(grads)

    ours = first_order(_ours(target, chunk_size=3, label_smoothing=0.1))
    plain = first_order(_plain(target, label_smoothing=0.1))
    for actual, expected in zip(ours, plain, strict=True):
        torch.testing.assert_close(actual, expected)


def test_torch_func_grad_and_jacrev_of_jacrev_match_the_plain_path() -> None:
    x, weight, target = _inputs(6, 5, 3)
    ours, plain = _ours(target, chunk_size=4), _plain(target)
    for transform in (torch.func.grad, lambda f: torch.func.jacrev(torch.func.jacrev(f))):
        torch.testing.assert_close(
            transform(lambda x: ours(x, weight))(x), transform(lambda x: plain(x, weight))(x)
        )
    grad_w = torch.func.grad(lambda w: ours(x, w))(weight)
    torch.testing.assert_close(grad_w, torch.func.grad(lambda w: plain(x, w))(weight))


def test_torch_func_vmap_takes_one_loss_per_entry() -> None:
    """Each entry has its own count of tokens: the third has none, so its mean is nan."""
    x = torch.randn(3, 6, 4, dtype=torch.float64)
    weight = torch.randn(5, 4, dtype=torch.float64)
    target = torch.randint(0, 5, (3, 6))
    target[1, :4] = -100
    target[2] = -100

    def ours(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return _ours(target, chunk_size=4)(x, weight)

    def plain(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return _plain(target)(x, weight)

    for transform in (torch.func.vmap, lambda f: torch.func.vmap(torch.func.grad(f))):
        torch.testing.assert_close(
            transform(ours)(x, target), transform(plain)(x, target), equal_nan=True
        )


# Forward-mode AD loads torch's decompositions for it, some of them through the deprecated
# torch.jit.script, which warns on first use; the warning is torch's, not the package's.
JIT_SCRIPT_WARNING = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)


def _assert_names_forward_mode_ad_and_the_fix(message: str) -> None:
    assert message.startswith("TiedLinear.cross_entropy does not support forward-mode AD")
    assert message.endswith("compute the logits with head(x) and take F.cross_entropy of them")


@JIT_SCRIPT_WARNING
@pytest.mark.parametrize(
    "transform",
    [
        lambda f, x: torch.func.jvp(f, (x,), (torch.ones_like(x),)),
        lambda f, x: torch.func.jacfwd(f)(x),
        lambda f, x: torch.func.hessian(f)(x),
    ],
    ids=["jvp", "jacfwd", "hessian"],
)
def test_forward_mode_ad_is_refused_with_the_fix(
    transform: Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], object],
) -> None:
    x, weight, target = _inputs(6, 5, 3)
    ours = _ours(target, chunk_size=4)
    for f, primal in ((lambda x: ours(x, weight), x), (lambda w: ours(x, w), weight)):
        with pytest.raises(RuntimeError) as info:
            transform(f, primal)
        _assert_names_forward_mode_ad_and_the_fix(str(info.value))


@JIT_SCRIPT_WARNING
def test_forward_mode_ad_of_dual_tensors_is_refused_and_plain_tensors_work_in_a_dual_level() -> (
    None
):
    x, weight, target = _inputs(6, 5, 3)
    ours = _ours(target, chunk_size=4)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(x, torch.ones_like(x))
        with pytest.raises(RuntimeError) as info:
            ours(dual, weight)
        _assert_names_forward_mode_ad_and_the_fix(str(info.value))
        torch.testing.assert_close(ours(x, weight), _plain(target)(x, weight))


# Autocast


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_under_bfloat16_autocast_the_loss_is_that_of_the_autocast_logits(
    x_dtype: torch.dtype, reduction: str
) -> None:
    """The products run in bfloat16, as head(x)'s do: a float32 weight and an input of
    float32, or of bfloat16 as autocast's own layers give it."""
    x, weight, target = _inputs(9, 7, 16, torch.float32)
    x = x.to(x_dtype)
    embedding = nn.Embedding(7, 16)
    with torch.no_grad():
        embedding.weight.copy_(weight)
    head = TiedLinear(embedding)
    x_ours, x_plain = _leaves(x, x)
    with torch.autocast("cpu", torch.bfloat16):
        loss = head.cross_entropy(x_ours, target, reduction=reduction, chunk_size=4)
        expected = F.cross_entropy(head(x_plain).float(), target, reduction=reduction)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected)
    ours_w = torch.autograd.grad(loss.sum(), (x_ours, embedding.weight))
    plain_w = torch.autograd.grad(expected.sum(), (x_plain, embedding.weight))
    for actual, wanted in zip(ours_w, plain_w, strict=True):
        assert actual.dtype == wanted.dtype
        torch.testing.assert_close(actual, wanted, rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("create_graph", [False, True])
def test_a_backward_called_under_autocast_recomputes_at_the_forward_precision(
    create_graph: bool,
) -> None:
    """Per-token losses of float32 products, their backward called inside an autocast region:
    the recomputed products stay float32, as the forward's were."""
    x, weight, target = _inputs(9, 7, 16, torch.float32)
    leaves, plain = _leaves(x, weight), _leaves(x, weight)
    loss = _ours(target, reduction="none", chunk_size=4)(*leaves)
    expected = _plain(target, reduction="none")(*plain)
    upstream = torch.linspace(-1.0, 1.0, 9)
    with torch.autocast("cpu", torch.bfloat16):
        grads = torch.autograd.grad(loss, leaves, upstream, create_graph=create_graph)
    for actual, wanted in zip(grads, torch.autograd.grad(expected, plain, upstream), strict=True):
        torch.testing.assert_close(actual, wanted)


def test_under_autocast_the_products_run_in_bfloat16() -> None:
    """Weights that round differently in bfloat16: the loss is the rounded logits'."""
    x = torch.ones(1, 1)
    weight = torch.tensor([[1.0 + 2.0**-10], [0.0]])
    target = torch.tensor([0])
    with torch.autocast("cpu", torch.bfloat16), torch.no_grad():
        loss = _ours(target)(x, weight)
    torch.testing.assert_close(loss, F.cross_entropy(torch.tensor([[1.0, 0.0]]), target))


# torch.compile

# Dynamo itself builds the autograd context of a custom Function through the deprecated
# instantiation path, and warns; the warning is torch's, not the package's.
DYNAMO_CONTEXT_WARNING = pytest.mark.filterwarnings(
    "ignore:.*should not be instantiated:DeprecationWarning"
)


def _compiled_case(
    backend: str, **options: Any
) -> tuple[Callable[[torch.Tensor], torch.Tensor], TiedLinear, torch.Tensor, torch.Tensor]:
    """A head built outside the compiled region, as in a model, and its compiled loss."""
    x, weight, target = _inputs(7, 5, 3, torch.float32)
    head = TiedLinear(nn.Embedding(5, 3))
    with torch.no_grad():
        head.weight.copy_(weight)
    compiled = torch.compile(
        lambda x: head.cross_entropy(x, target, **options).sum(), fullgraph=True, backend=backend
    )
    return compiled, head, x, target


def _loss_and_grads(
    loss_of: Callable[[torch.Tensor], torch.Tensor], head: TiedLinear, x: torch.Tensor
) -> list[torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    loss = loss_of(x)
    return [loss.detach(), *torch.autograd.grad(loss, (x, head.weight))]


@DYNAMO_CONTEXT_WARNING
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiles_in_one_graph_with_the_loss_and_gradients_of_eager(reduction: str) -> None:
    options: dict[str, Any] = {"reduction": reduction, "z_loss": 1e-2, "chunk_size": 3}
    compiled, head, x, target = _compiled_case("eager", **options)
    expected = _loss_and_grads(lambda x: head.cross_entropy(x, target, **options).sum(), head, x)
    for actual, wanted in zip(_loss_and_grads(compiled, head, x), expected, strict=True):
        torch.testing.assert_close(actual, wanted)


@DYNAMO_CONTEXT_WARNING
def test_compile_with_inductor_matches_the_plain_path() -> None:
    compiled, head, x, target = _compiled_case("inductor", chunk_size=3)
    expected = _loss_and_grads(lambda x: F.cross_entropy(head(x), target), head, x)
    for actual, wanted in zip(_loss_and_grads(compiled, head, x), expected, strict=True):
        torch.testing.assert_close(actual, wanted)


@DYNAMO_CONTEXT_WARNING
@pytest.mark.parametrize("value", [5, -2])
def test_compiled_a_target_outside_the_vocabulary_still_raises(value: int) -> None:
    compiled, _, x, target = _compiled_case("eager")
    target[4] = value  # read by the compiled function when it runs
    with pytest.raises(RuntimeError, match=r"out of bounds for a vocabulary of 5") as info:
        compiled(x.requires_grad_())
    assert "ignore_index=-100" in str(info.value)


# Every token ignored


@pytest.mark.parametrize("upstream", [1.0, float("nan"), float("inf")])
@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("options", [{}, {"z_loss": 0.1, "softcap": 3.0}])
def test_every_token_ignored_gives_a_nan_mean_and_zero_gradients(
    upstream: float, create_graph: bool, options: dict[str, Any]
) -> None:
    """As F.cross_entropy: the mean is 0 / 0, and every gradient is zero whatever comes in,
    a nan or an inf included (the plain path multiplies nothing by it)."""
    x, weight, _ = _inputs(4, 5, 3)
    target = torch.full((4,), -100)
    for loss_of in (_ours(target, chunk_size=3, **options), _plain(target)):
        leaves = _leaves(x, weight)
        loss = loss_of(*leaves)
        assert loss.isnan()
        grads = torch.autograd.grad(
            loss, leaves, torch.tensor(upstream, dtype=loss.dtype), create_graph=create_graph
        )
        for grad, leaf in zip(grads, leaves, strict=True):
            assert torch.equal(grad, torch.zeros_like(leaf))


@pytest.mark.parametrize("upstream", [float("nan"), float("inf")])
@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("every", [True, False], ids=["every", "some"])
def test_ignored_tokens_get_zero_gradients_whatever_comes_in(
    upstream: float, create_graph: bool, reduction: str, every: bool
) -> None:
    """As F.cross_entropy: an ignored token's row of x's gradient is exactly 0, and with
    every token ignored so is the weight's, for a nan or an inf incoming gradient."""
    x, weight, target = _inputs(7, 5, 3)
    if every:
        target = torch.full((7,), -100)
    ignored = target == -100
    plain = _plain(target, reduction=reduction)
    for loss_of in (_ours(target, reduction=reduction, chunk_size=3), plain):
        leaves = _leaves(x, weight)
        loss = loss_of(*leaves)
        grads = torch.autograd.grad(
            loss, leaves, torch.tensor(upstream, dtype=loss.dtype), create_graph=create_graph
        )
        assert torch.equal(grads[0][ignored], torch.zeros_like(x[ignored]))
        if every:
            assert torch.equal(grads[1], torch.zeros_like(weight))


# Per-token losses


@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.3, "z_loss": 0.05, "softcap": 2.0}])
def test_reduction_none_gives_each_token_its_loss_and_exact_gradients(
    options: dict[str, Any],
) -> None:
    """Losses in the target's shape, 0 at ignored tokens, and the gradients of any incoming
    gradient: a different weight per token, zeros, and the same loss backpropagated twice."""
    x, weight, target = _inputs(12, 5, 3)
    x, target = x.reshape(3, 4, 3), target.reshape(3, 4)
    flat_plain = _plain(target.flatten(), reduction="none", **options)

    def plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return flat_plain(x.flatten(0, 1), w).reshape(3, 4)

    ours = _ours(target, reduction="none", chunk_size=5, **options)
    leaves, reference = _leaves(x, weight), _leaves(x, weight)
    loss, expected = ours(*leaves), plain(*reference)
    assert loss.shape == (3, 4)
    assert torch.equal(
        loss[target == -100], torch.zeros(int((target == -100).sum()), dtype=loss.dtype)
    )
    torch.testing.assert_close(loss, expected)
    for upstream in (
        torch.randn(3, 4, dtype=torch.float64),
        torch.zeros(3, 4, dtype=torch.float64),
    ):
        grads = torch.autograd.grad(loss, leaves, upstream, retain_graph=True)
        wanted = torch.autograd.grad(expected, reference, upstream, retain_graph=True)
        for actual, want in zip(grads, wanted, strict=True):
            torch.testing.assert_close(actual, want)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_under_activation_checkpointing_the_gradients_are_the_plain_paths(reduction: str) -> None:
    """The loss in a non-reentrant checkpoint, whose forward runs again in backward."""
    x, weight, target = _inputs(10, 11, 4)
    ours, plain = (
        _ours(target, reduction=reduction, chunk_size=3),
        _plain(target, reduction=reduction),
    )
    leaves, reference = _leaves(x, weight), _leaves(x, weight)
    loss = torch.utils.checkpoint.checkpoint(
        lambda x, w: ours(torch.tanh(x), w).sum(), *leaves, use_reentrant=False
    )
    expected = plain(torch.tanh(reference[0]), reference[1]).sum()
    for actual, wanted in zip(
        torch.autograd.grad(loss, leaves), torch.autograd.grad(expected, reference), strict=True
    ):
        torch.testing.assert_close(actual, wanted)
