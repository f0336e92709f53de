"""The chunked cross-entropy kernel behind TiedLinear.cross_entropy, at its edges.

``linear_cross_entropy`` is called directly: its own defaults, its buffers' device under a
different default device, float64 at float64's precision, ``reduction="sum"`` gradients, no
tokens at all, a float16 loss scale beyond float16's range, the dtypes its backward returns,
the default chunk rule at its bounds, the tensors of a chunk's size it holds, a single class
with ignored tokens, a 3-D input and its shape error. Every expected value is written here
with ``F.linear`` and ``F.cross_entropy`` or by hand, never with the code under test.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from toolkit.nn._cross_entropy import default_chunk_size, linear_cross_entropy


def _inputs(
    tokens: int, vocab: int, width: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(tokens * 100 + vocab)
    x = torch.randn(tokens, width, generator=generator).to(dtype)
    weight = torch.randn(vocab, width, generator=generator).to(dtype)
    target = torch.randint(0, max(vocab, 1), (tokens,), generator=generator)
    return x, weight, target


def _grads(
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss and the gradients of ``scale * loss`` for fresh leaves holding x and weight."""
    x = x.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    loss = loss_of(x, weight)
    grad_x, grad_w = torch.autograd.grad(loss * scale, (x, weight))
    return loss.detach(), grad_x, grad_w


def test_the_defaults_are_those_of_f_cross_entropy() -> None:
    """No reduction, smoothing or ignore_index given: a mean, unsmoothed, -100 ignored."""
    x, weight, target = _inputs(6, 5, 3)
    target[2] = -100
    ours = _grads(lambda x, w: linear_cross_entropy(x, w, target), x, weight)
    plain = _grads(lambda x, w: F.cross_entropy(F.linear(x, w), target), x, weight)
    for actual, expected in zip(ours, plain, strict=True):
        torch.testing.assert_close(actual, expected)


def test_buffers_follow_the_input_not_the_default_device() -> None:
    """Under another default device (meta here), CPU inputs give CPU results, equal to the
    plain path's: every buffer is allocated on the input's device."""
    x, weight, target = _inputs(7, 5, 3)
    plain = _grads(lambda x, w: F.cross_entropy(F.linear(x, w), target), x, weight)
    with torch.device("meta"):
        ours = _grads(lambda x, w: linear_cross_entropy(x, w, target, chunk_size=3), x, weight)
        with torch.no_grad():
            loss_only = linear_cross_entropy(x, weight, target, chunk_size=3)
    for actual, expected in zip((*ours, loss_only), (*plain, plain[0]), strict=True):
        assert actual.device == torch.device("cpu")
        torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_float64_matches_f_cross_entropy_to_float64_precision(reduction: str) -> None:
    """Three counted tokens: a mean's 1 / 3 is kept in float64, not rounded to float32."""
    x, weight, target = _inputs(5, 4, 3, torch.float64)
    target[1] = target[3] = -100
    ours = _grads(
        lambda x, w: linear_cross_entropy(x, w, target, reduction=reduction, chunk_size=2),
        x,
        weight,
        scale=0.7,
    )
    plain = _grads(
        lambda x, w: F.cross_entropy(F.linear(x, w), target, reduction=reduction),
        x,
        weight,
        scale=0.7,
    )
    for actual, expected in zip(ours, plain, strict=True):
        assert actual.dtype == torch.float64
        torch.testing.assert_close(actual, expected, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.25])
def test_the_gradients_of_a_sum_are_not_divided_by_the_count(label_smoothing: float) -> None:
    x, weight, target = _inputs(6, 5, 3)
    target[0] = -100
    options: dict[str, Any] = {"reduction": "sum", "label_smoothing": label_smoothing}
    ours = _grads(
        lambda x, w: linear_cross_entropy(x, w, target, chunk_size=4, **options), x, weight
    )
    plain = _grads(lambda x, w: F.cross_entropy(F.linear(x, w), target, **options), x, weight)
    for actual, expected in zip(ours, plain, strict=True):
        torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("vocab", [0, 4])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_no_tokens_give_what_f_cross_entropy_gives(vocab: int, reduction: str) -> None:
    """No tokens, even with an empty vocabulary: nan for a mean (0 / 0), 0 for a sum, and
    empty gradients."""
    x, weight, target = _inputs(0, vocab, 3)
    ours = _grads(lambda x, w: linear_cross_entropy(x, w, target, reduction=reduction), x, weight)
    plain = _grads(
        lambda x, w: F.cross_entropy(F.linear(x, w), target, reduction=reduction), x, weight
    )
    assert ours[1].shape == (0, 3)
    assert ours[2].shape == (vocab, 3)
    for actual, expected in zip(ours, plain, strict=True):
        torch.testing.assert_close(actual, expected, equal_nan=True)
    assert ours[0].isnan().item() == (reduction == "mean")


def test_a_float16_loss_scale_beyond_float16_range_gives_finite_gradients() -> None:
    """A loss scaled by 65536 (a common initial loss scale; float16 tops out at 65504): the
    gradients are those of the plain path, which scales the float32 logits' gradient."""
    x, weight, target = _inputs(6, 5, 3, torch.float16)
    scale = 65536.0
    ours = _grads(lambda x, w: linear_cross_entropy(x, w, target), x, weight, scale)
    plain = _grads(lambda x, w: F.cross_entropy(F.linear(x, w).float(), target), x, weight, scale)
    for actual, expected in zip(ours[1:], plain[1:], strict=True):
        assert actual.dtype == torch.float16
        assert bool(actual.isfinite().all())
        torch.testing.assert_close(actual, expected, rtol=5e-3, atol=16.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.float32])
@pytest.mark.parametrize("grad_mode", [False, True])
def test_backward_itself_returns_each_gradient_in_its_input_dtype(
    dtype: torch.dtype, grad_mode: bool
) -> None:
    """The loss is float32 for reduced inputs; backward (called here on the graph's node, with
    no engine to convert what it returns) gives the gradients of x and weight their dtype, in
    the engine's usual grad mode (off) and in create_graph's (on). float32 runs under bfloat16
    autocast, where the products and their gradients are bfloat16."""
    x, weight, target = _inputs(6, 5, 3, dtype)
    with torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.float32):
        loss = linear_cross_entropy(x.requires_grad_(), weight.requires_grad_(), target)
    # The node of a custom Function: its apply runs the Function's backward and nothing else.
    # It takes one gradient per output: the loss's, and none for the internal ones.
    node: Any = loss.grad_fn
    with torch.set_grad_enabled(grad_mode):
        grad_x, grad_w, *rest = node.apply(torch.ones((), dtype=loss.dtype), None, None)
    assert (grad_x.dtype, grad_w.dtype) == (dtype, dtype)
    assert (grad_x.shape, grad_w.shape) == ((6, 3), (5, 3))
    assert all(grad is None for grad in rest)
    plain = _grads(lambda x, w: F.cross_entropy(F.linear(x, w).float(), target), x, weight)
    if dtype != torch.float32:  # autocast's products are compared in the regimes tests
        torch.testing.assert_close(grad_x, plain[1], rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(grad_w, plain[2], rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("grad_mode", [False, True])
@pytest.mark.parametrize("which", ["x", "weight"])
def test_backward_gives_no_gradient_to_an_input_that_needs_none(
    grad_mode: bool, which: str
) -> None:
    x, weight, target = _inputs(6, 5, 3)
    (x if which == "x" else weight).requires_grad_()
    loss = linear_cross_entropy(x, weight, target, chunk_size=4)
    node: Any = loss.grad_fn
    with torch.set_grad_enabled(grad_mode):
        grad_x, grad_w, *_ = node.apply(torch.ones(()), None, None)
    assert (grad_x is None, grad_w is None) == (which != "x", which == "x")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_float16_loss_scale_reaches_every_chunk_of_x_gradient(reduction: str) -> None:
    """10 tokens of width 3 in chunks of 4, scaled by 65536 (beyond float16's range, as a sum's
    factor is): every row of x's gradient is that of the plain path."""
    x, weight, target = _inputs(10, 5, 3, torch.float16)
    weight = weight * 0.01  # probabilities near 1 / 5: the plain path's gradient fits float16
    scale = 65536.0
    ours = _grads(
        lambda x, w: linear_cross_entropy(x, w, target, reduction=reduction, chunk_size=4),
        x,
        weight,
        scale,
    )
    plain = _grads(
        lambda x, w: F.cross_entropy(F.linear(x, w).float(), target, reduction=reduction),
        x,
        weight,
        scale,
    )
    assert bool(ours[1].isfinite().all())
    torch.testing.assert_close(ours[1], plain[1], rtol=5e-3, atol=1.0)


@pytest.mark.parametrize(
    ("tokens", "vocab", "dtype", "chunk"),
    [
        (10_000, 32_000, torch.float32, 524),  # 64 MiB // (32000 * 4 B)
        (10_000, 32_000, torch.float64, 262),  # 64 MiB // (32000 * 8 B)
        (100, 32_000, torch.float32, 100),  # never more than the tokens
        (1, 32_000, torch.float32, 1),  # one token: one row
        (0, 32_000, torch.float32, 1),  # no tokens: still a valid step
        (1000, 10**7, torch.float32, 16),  # 1.6 would fit: at least 16
        (2**26, 0, torch.float32, 2**26),  # no bytes a token: every token in one chunk
    ],
)
def test_the_default_chunk_rule_at_its_bounds(
    tokens: int, vocab: int, dtype: torch.dtype, chunk: int
) -> None:
    assert default_chunk_size(tokens, vocab, dtype) == chunk


def test_the_shape_error_of_a_3d_input_names_its_leading_shape() -> None:
    x, weight = torch.zeros(2, 4, 3), torch.zeros(5, 3)
    target = torch.zeros(4, 2, dtype=torch.long)
    expected = (
        "cross_entropy target has shape (4, 2), but the input has shape (2, 4, 3): the target "
        "must have the input's leading shape (2, 4), one class index per row"
    )
    with pytest.raises(ValueError, match="^" + re.escape(expected) + "$"):
        linear_cross_entropy(x, weight, target)


def test_a_3d_input_is_flattened_over_its_leading_dimensions() -> None:
    """Batch 2, sequence 3, width 5: one row per token, the width last, with and without
    gradients."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, generator=generator)
    weight = torch.randn(7, 5, generator=generator)
    target = torch.randint(0, 7, (2, 3), generator=generator)
    ours = _grads(lambda x, w: linear_cross_entropy(x, w, target), x, weight)
    plain = _grads(
        lambda x, w: F.cross_entropy(F.linear(x, w).flatten(0, 1), target.flatten()), x, weight
    )
    for actual, expected in zip(ours, plain, strict=True):
        torch.testing.assert_close(actual, expected)
    with torch.no_grad():  # the loss alone, without the autograd Function
        torch.testing.assert_close(linear_cross_entropy(x, weight, target), plain[0])


def test_a_single_class_with_ignored_tokens_gives_what_f_cross_entropy_gives() -> None:
    """With one class, index 0 is the only valid one: ignored rows must look there too."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(3, 2, generator=generator)
    weight = torch.randn(1, 2, generator=generator)
    target = torch.tensor([0, -100, 0])
    ours = _grads(lambda x, w: linear_cross_entropy(x, w, target), x, weight)
    plain = _grads(lambda x, w: F.cross_entropy(F.linear(x, w), target), x, weight)
    for actual, expected in zip(ours, plain, strict=True):
        torch.testing.assert_close(actual, expected)


class _ChunkSizedTensors(TorchDispatchMode):
    """The most tensors of at least ``numel`` elements alive at once, among those that ops
    allocate (an output sharing an input's storage, a view or an ``out=``, is not one)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.peak = numel, 0
        self.alive: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        given = pytree.tree_leaves((args, kwargs))
        storages = {t.untyped_storage().data_ptr() for t in given if isinstance(t, torch.Tensor)}
        for tensor in pytree.tree_leaves(out):
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.numel() >= self.numel
                and tensor.untyped_storage().data_ptr() not in storages
            ):
                self.alive = [ref for ref in self.alive if ref() is not None]
                self.alive.append(weakref.ref(tensor))
                self.peak = max(self.peak, len(self.alive))
        return out


@pytest.mark.parametrize(
    ("options", "peak"),
    [
        ({}, 1),  # the logits' buffer, which the softmax and the gradient replace
        ({"reduction": "none"}, 1),  # the same in backward, which recomputes the chunks
        ({"label_smoothing": 0.1, "z_loss": 0.01}, 1),
        ({"softcap": 5.0}, 2),  # and the soft-cap's slope
    ],
)
def test_a_chunk_holds_one_logits_sized_tensor_and_a_soft_cap_one_more(
    options: dict[str, Any], peak: int
) -> None:
    """12 tokens in chunks of 4, a vocabulary of 50 and 2 features: only the chunk's logits
    (and their like) have 4 * 50 elements or more, the weight's gradient has 100."""
    x, weight, target = _inputs(12, 50, 2)
    x.requires_grad_()
    weight.requires_grad_()
    for grad in (False, True):
        with _ChunkSizedTensors(4 * 50) as mode, torch.set_grad_enabled(grad):
            loss = linear_cross_entropy(x, weight, target, chunk_size=4, **options)
            if grad:
                loss.sum().backward()
        assert mode.peak == (peak if grad else 1)
