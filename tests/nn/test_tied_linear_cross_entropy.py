"""TiedLinear.cross_entropy: equal to F.cross_entropy of the logits, without the logits.

Every expected value is written here with ``F.linear`` and ``F.cross_entropy`` (and a float64
oracle for the reduced-precision dtypes), never with the code under test. The kernel's
operations are observed with a dispatch mode, so that "no gradient work" and the chunk rule are
checked by what actually runs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.strategies import LinearCase, linear_cases, make_tensor
from toolkit.nn import TiedLinear

REDUCED = (torch.bfloat16, torch.float16)
# (rtol, atol) against F.cross_entropy of the same logits, and against the float64 oracle.
TOLERANCE = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}
ORACLE_TOLERANCE = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (1e-1, 1e-1),
    torch.float16: (2e-2, 2e-2),
}


ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_zeros", "zeros"}


class OpCounter(TorchDispatchMode):
    """Counts the aten operations that run, by their overload packet's name, and records the
    shapes that allocating operations return."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.allocated: list[tuple[int, ...]] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = func.overloadpacket.__name__
        self.counts[name] += 1
        out = func(*args, **(kwargs or {}))
        if name in ALLOCATIONS:
            self.allocated.append(tuple(out.shape))
        return out


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in REDUCED else dtype


def reference_loss(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    z_loss: float = 0.0,
    softcap: float | None = None,
    **options: Any,
) -> torch.Tensor:
    """The plain path: the full logits, widened as the documentation says, soft-capped, then
    F.cross_entropy, plus the z-loss of each counted token reduced as the loss is."""
    logits = F.linear(x, weight).to(acc_dtype(x.dtype)).reshape(-1, weight.shape[0])
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    flat = target.reshape(-1)
    loss = F.cross_entropy(logits, flat, **options)
    counted = flat != options.get("ignore_index", -100)
    extra = torch.where(counted, z_loss * torch.logsumexp(logits, 1).square(), 0.0)
    reduction = options.get("reduction", "mean")
    if reduction == "none":
        return (loss + extra).reshape(target.shape)
    return loss + (extra.sum() / counted.sum() if reduction == "mean" else extra.sum())


@st.composite
def ce_cases(draw: st.DrawFn) -> dict[str, Any]:
    """A linear case with a vocabulary of at least one, and the loss's options and targets."""
    case = draw(
        linear_cases(
            max_lead_dims=3, min_out=1, devices=("cpu",), float_only=True, max_side=6
        ).filter(lambda c: c.dtype.is_floating_point)
    )
    tokens = math.prod(case.lead)
    vocab = case.out_features
    ignore_index = draw(st.sampled_from([-100, -1, 0, vocab - 1]))
    pattern = draw(st.sampled_from(["none", "some", "all"]))
    generator = torch.Generator().manual_seed(case.seed)
    target = torch.randint(0, vocab, case.lead, generator=generator)
    if pattern == "all":
        target.fill_(ignore_index)
    elif pattern == "some":
        ignored = draw(st.lists(st.booleans(), min_size=tokens, max_size=tokens))
        target.view(-1)[torch.tensor(ignored, dtype=torch.bool)] = ignore_index
    reduction = draw(st.sampled_from(["mean", "sum", "none"]))
    if reduction == "none":  # a different incoming gradient per token, zeros among them
        upstream = torch.randn(case.lead, generator=generator, dtype=torch.float64)
        upstream.view(-1)[:: draw(st.integers(1, 3))] = 0.0
    else:
        upstream = torch.tensor(draw(st.sampled_from([1.0, -0.5, 3.0])), dtype=torch.float64)
    return {
        "case": case,
        "target": target,
        "ignore_index": ignore_index,
        "reduction": reduction,
        "label_smoothing": draw(st.sampled_from([0.0, 1.0]) | st.floats(0.0, 1.0)),
        "z_loss": draw(st.sampled_from([0.0, 1e-4, 0.5])),
        "softcap": draw(st.sampled_from([None, 1.0, 30.0])),
        "chunk_size": draw(st.none() | st.integers(1, 8)),
        "upstream": upstream,
    }


def _losses_and_grads(
    compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    upstream: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss, and the gradients of x and weight for the incoming gradient ``upstream``."""
    x = x.detach().requires_grad_()
    loss = compute(x, weight)
    grad_x, grad_w = torch.autograd.grad(loss, (x, weight), upstream.to(loss.dtype))
    return loss.detach(), grad_x, grad_w


# No deadline: the first example pays for loading the kernels, which on a busy machine can
# take seconds.
@settings(deadline=None)
@given(drawn=ce_cases())
def test_loss_and_gradients_equal_f_cross_entropy_of_the_logits(drawn: dict[str, Any]) -> None:
    case: LinearCase = drawn["case"]
    target, upstream = drawn["target"], drawn["upstream"]
    names = ("ignore_index", "reduction", "label_smoothing", "z_loss", "softcap")
    options = {k: drawn[k] for k in names}
    embedding = nn.Embedding(case.out_features, case.in_features, dtype=case.dtype)
    with torch.no_grad():
        embedding.weight.copy_(make_tensor(tuple(embedding.weight.shape), case, offset=1))
    head = TiedLinear(embedding)
    x = make_tensor(case.x_shape, case)

    def ours(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return head.cross_entropy(x, target, chunk_size=drawn["chunk_size"], **options)

    def leaf(weight: torch.Tensor) -> torch.Tensor:
        return weight.detach().clone().requires_grad_()

    loss, grad_x, grad_w = _losses_and_grads(ours, x, embedding.weight, upstream)
    expected = _losses_and_grads(
        lambda x, w: reference_loss(x, w, target, **options), x, leaf(embedding.weight), upstream
    )
    assert loss.dtype == acc_dtype(case.dtype)
    assert grad_x.dtype == grad_w.dtype == case.dtype
    rtol, atol = TOLERANCE[case.dtype]
    for actual, wanted in zip((loss, grad_x, grad_w), expected, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=rtol, atol=atol, equal_nan=True)
    # The float64 oracle, from the same (rounded) inputs.
    oracle = _losses_and_grads(
        lambda x, w: reference_loss(x, w, target, **options),
        x.double(),
        leaf(embedding.weight.double()),
        upstream,
    )
    rtol, atol = ORACLE_TOLERANCE[case.dtype]
    for actual, wanted in zip((loss, grad_x, grad_w), oracle, strict=True):
        torch.testing.assert_close(actual.double(), wanted, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_every_target_ignored_gives_what_f_cross_entropy_gives(reduction: str) -> None:
    head = TiedLinear(nn.Embedding(5, 3))
    x = torch.randn(4, 3, requires_grad=True)
    target = torch.full((4,), -100)
    loss = head.cross_entropy(x, target, reduction=reduction, label_smoothing=0.1)
    loss.backward()
    if reduction == "mean":
        assert math.isnan(loss.item())  # 0 / 0, as F.cross_entropy gives
    else:
        assert loss.item() == 0.0
    assert x.grad is not None
    assert torch.equal(x.grad, torch.zeros(4, 3))
    assert torch.equal(head.weight.grad, torch.zeros(5, 3))  # type: ignore[arg-type]


def test_the_embedding_receives_the_sum_of_the_lookup_and_head_gradients() -> None:
    torch.manual_seed(0)
    embedding = nn.Embedding(7, 4)
    head = TiedLinear(embedding)
    idx = torch.randint(0, 7, (3, 5))
    target = torch.randint(0, 7, (3, 5))
    head.cross_entropy(torch.tanh(embedding(idx)), target).backward()
    ours = embedding.weight.grad
    weight = embedding.weight.detach().clone().requires_grad_()
    F.cross_entropy(
        F.linear(torch.tanh(F.embedding(idx, weight)), weight).reshape(-1, 7), target.reshape(-1)
    ).backward()
    assert ours is not None
    assert weight.grad is not None
    torch.testing.assert_close(ours, weight.grad)


def _count(run: Callable[[], object]) -> Counter[str]:
    return _observe(run).counts


def _observe(run: Callable[[], object]) -> OpCounter:
    with OpCounter() as counter:
        run()
    return counter


def _small() -> tuple[TiedLinear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return TiedLinear(nn.Embedding(11, 4)), torch.randn(10, 4), torch.randint(0, 11, (10,))


@pytest.mark.parametrize(
    ("x_grad", "w_grad", "grad_mode", "mm", "addmm"),
    [
        (True, True, True, 8, 4),  # logits and grad x per chunk; grad w accumulated
        (True, False, True, 8, 0),  # no weight gradient is computed
        (False, True, True, 4, 4),  # no input gradient is computed
        (False, False, True, 4, 0),  # only the loss
        (True, True, False, 4, 0),  # under torch.no_grad(): only the loss
    ],
)
def test_only_the_gradients_needed_are_computed(
    x_grad: bool, w_grad: bool, grad_mode: bool, mm: int, addmm: int
) -> None:
    head, x, target = _small()
    head.weight.requires_grad_(w_grad)
    x.requires_grad_(x_grad)
    with torch.set_grad_enabled(grad_mode):
        seen = _observe(lambda: head.cross_entropy(x, target, chunk_size=3))
    assert (seen.counts["mm"], seen.counts["addmm_"]) == (mm, addmm)
    # A gradient buffer is allocated only when needed: (11, 4) for w, (10, 4) for x.
    assert seen.allocated.count((11, 4)) == int(addmm > 0)
    assert seen.allocated.count((10, 4)) == int(mm == 8)
    assert (3, 11) in seen.allocated  # the one reused logits buffer
    assert seen.counts["scatter_add_"] == (4 if mm == 8 or addmm else 0)  # the logits' gradient


def test_no_grad_returns_a_loss_without_a_graph() -> None:
    head, x, target = _small()
    x.requires_grad_()
    with torch.no_grad():
        loss = head.cross_entropy(x, target)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(x, head.weight), target))


def test_backward_scales_the_saved_gradients_without_a_matrix_product() -> None:
    head, x, target = _small()
    x.requires_grad_()
    loss = head.cross_entropy(x, target, chunk_size=3)
    counts = _count((loss * 2).backward)
    assert counts["mm"] == counts["addmm_"] == counts["addmm"] == 0
    weight = head.weight.detach().requires_grad_()
    x2 = x.detach().requires_grad_()
    (F.cross_entropy(F.linear(x2, weight), target) * 2).backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(head.weight.grad, weight.grad)


def test_a_second_backward_through_the_same_loss_raises() -> None:
    head, x, target = _small()
    loss = head.cross_entropy(x.requires_grad_(), target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError) as info:
        loss.backward()
    assert str(info.value) == (
        "TiedLinear.cross_entropy does not support a second backward through the same loss "
        "(retain_graph=True): its gradients are computed in forward and scaled in place by "
        "backward. Compute the loss again for another backward."
    )


@pytest.mark.parametrize(
    ("dtype", "vocab", "tokens", "chunks"),
    [
        (torch.float32, 32000, 1200, 3),  # 64 MiB / (32000 * 4 B) = 524 tokens a chunk
        (torch.bfloat16, 32000, 1200, 3),  # accumulated in float32: the same buffer
        (torch.float64, 32000, 600, 3),  # 262 tokens a chunk
        (torch.float32, 32000, 500, 1),  # never more tokens than there are
        (torch.float32, 1_100_000, 32, 2),  # 15 tokens would fit: at least 16 a chunk
    ],
)
def test_the_default_chunk_bounds_the_logits_buffer_to_64_mib(
    dtype: torch.dtype, vocab: int, tokens: int, chunks: int
) -> None:
    head = TiedLinear(nn.Embedding(vocab, 1, dtype=dtype))
    x = torch.ones(tokens, 1, dtype=dtype)
    target = torch.zeros(tokens, dtype=torch.long)
    with torch.no_grad():
        counts = _count(lambda: head.cross_entropy(x, target))
    assert counts["mm"] == chunks


def test_hooks_on_linear_are_not_called() -> None:
    """The logits never exist, so no hook on ``linear`` could observe them."""
    head, x, target = _small()
    calls: list[str] = []
    head.linear.register_forward_pre_hook(lambda *_: calls.append("pre"))
    head.linear.register_forward_hook(lambda *_: calls.append("post"))
    head.cross_entropy(x, target)
    assert calls == []
    head(x)
    assert calls == ["pre", "post"]


def test_reads_the_weight_live() -> None:
    head, x, target = _small()
    replacement = nn.Parameter(torch.randn(11, 4))
    head.tied_module.weight = replacement
    with torch.no_grad():
        loss = head.cross_entropy(x, target)
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(x, replacement), target))


def test_integer_targets_of_any_width_are_accepted() -> None:
    head, x, target = _small()
    with torch.no_grad():
        expected = F.cross_entropy(F.linear(x, head.weight), target)
        torch.testing.assert_close(head.cross_entropy(x, target.int()), expected)


def _error(expected: type[Exception], **call: Any) -> str:
    head, x, target = _small()
    arguments: dict[str, Any] = {"x": x, "target": target, **call}
    with pytest.raises(expected) as info:
        head.cross_entropy(**arguments)
    return str(info.value)


def test_a_reduction_other_than_mean_sum_or_none_is_refused() -> None:
    message = _error(ValueError, reduction="max")
    assert "'max'" in message
    assert all(name in message for name in ("'mean'", "'sum'", "'none'"))


@pytest.mark.parametrize("value", [-0.1, math.inf, math.nan])
def test_a_z_loss_that_is_not_finite_and_nonnegative_is_refused(value: float) -> None:
    message = _error(ValueError, z_loss=value)
    assert "z_loss" in message
    assert str(value) in message
    assert ">= 0.0" in message


@pytest.mark.parametrize("value", [0.0, -2.0, math.inf, math.nan])
def test_a_softcap_that_is_not_finite_and_positive_is_refused(value: float) -> None:
    message = _error(ValueError, softcap=value)
    assert "softcap" in message
    assert str(value) in message
    assert "None" in message


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan])
def test_label_smoothing_outside_zero_one_is_refused(value: float) -> None:
    assert _error(ValueError, label_smoothing=value) == (
        f"cross_entropy label_smoothing must be in [0.0, 1.0], got {value}"
    )


@pytest.mark.parametrize("value", [0, -3, 2.0, True])
def test_a_chunk_size_that_is_not_a_positive_int_is_refused(value: object) -> None:
    assert _error(ValueError, chunk_size=value) == (
        "cross_entropy chunk_size must be a positive int (tokens per chunk) or None to choose "
        f"one from the shapes, got {value!r}"
    )


def test_a_target_of_the_wrong_shape_is_refused() -> None:
    assert _error(ValueError, target=torch.zeros(2, 5, dtype=torch.long)) == (
        "cross_entropy target has shape (2, 5), but the input has shape (10, 4): the target "
        "must have the input's leading shape (10,), one class index per row"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_a_target_that_is_not_integer_is_refused(dtype: torch.dtype) -> None:
    assert _error(TypeError, target=torch.zeros(10, dtype=dtype)) == (
        f"cross_entropy target must hold class indices of an integer dtype such as torch.long, "
        f"got {dtype}; class probabilities are not supported, compute the logits with head(x) "
        "and call F.cross_entropy on them"
    )


def test_an_input_of_another_dtype_is_refused() -> None:
    assert _error(TypeError, x=torch.zeros(10, 4, dtype=torch.float64)) == (
        "cross_entropy needs a floating-point input of the weight's dtype, got input "
        "torch.float64 and weight torch.float32; convert the input with x.to(weight.dtype)"
    )


def test_an_input_of_the_wrong_width_is_refused() -> None:
    assert _error(ValueError, x=torch.zeros(10, 3)) == (
        "cross_entropy input has shape (10, 3), but the weight has shape (11, 4): the input's "
        "last dimension must equal in_features=4"
    )


@pytest.mark.parametrize("value", [11, -1])
def test_a_target_outside_the_vocabulary_is_refused(value: int) -> None:
    target = torch.zeros(10, dtype=torch.long)
    target[3] = value
    assert _error(IndexError, target=target) == (
        f"cross_entropy target {value} is out of bounds for a vocabulary of 11 (out_features): "
        "each target must be in [0, 11) or equal ignore_index=-100"
    )


def test_a_failed_call_leaves_no_gradient() -> None:
    head, x, target = _small()
    x.requires_grad_()
    with pytest.raises(ValueError, match="reduction"):
        head.cross_entropy(x, target, reduction="max")
    assert x.grad is None
    assert head.weight.grad is None


def test_a_target_far_below_the_largest_logit_gives_the_exact_loss() -> None:
    """Its probability underflows in float32; the loss must not become inf."""
    head = TiedLinear(nn.Embedding(3, 1))
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0.0], [300.0], [-5.0]]))
    x = torch.ones(2, 1)
    target = torch.tensor([0, 2])
    with torch.no_grad():
        loss = head.cross_entropy(x, target, reduction="sum")
    torch.testing.assert_close(
        loss, F.cross_entropy(F.linear(x, head.weight), target, reduction="sum")
    )
    assert loss.item() == pytest.approx(300.0 + 305.0)


def test_a_build_without_torch_distributed_computes_the_loss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch built without distributed has no DTensor: no weight is taken for one."""
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    generator = torch.Generator().manual_seed(5)
    head = TiedLinear(nn.Embedding(11, 4))
    x = torch.randn(6, 4, generator=generator)
    target = torch.randint(0, 11, (6,), generator=generator)
    expected = F.cross_entropy(F.linear(x, head.tied_module.weight), target)
    torch.testing.assert_close(head.cross_entropy(x, target), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_no_tokens_give_empty_per_token_losses_and_gradients_of_their_dtype(
    dtype: torch.dtype,
) -> None:
    head = TiedLinear(nn.Embedding(5, 3, dtype=dtype))
    x = torch.randn(0, 3, dtype=dtype, requires_grad=True)
    target = torch.empty(0, dtype=torch.long)
    losses = head.cross_entropy(x, target, reduction="none")
    expected = F.cross_entropy(head(x).float(), target, reduction="none")
    # The losses are float32 for bfloat16 and float16, as documented; else the input's dtype.
    assert (losses.shape, losses.dtype) == (
        expected.shape,
        torch.promote_types(dtype, torch.float32),
    )
    # A backward that builds a graph recomputes the (zero) chunks.
    (grad,) = torch.autograd.grad(
        head.cross_entropy(x, target, reduction="sum"), x, create_graph=True
    )
    assert (grad.shape, grad.dtype) == (x.shape, dtype)
    assert not grad.any()


def test_float64_under_autocast_computes_in_float64_as_head_does() -> None:
    torch.manual_seed(0)
    head = TiedLinear(nn.Embedding(7, 4, dtype=torch.float64))
    x = torch.randn(5, 4, dtype=torch.float64)
    target = torch.randint(0, 7, (5,))
    with torch.autocast("cpu", torch.bfloat16):
        loss = head.cross_entropy(x, target)
        expected = F.cross_entropy(head(x), target)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_input_gradient_does_not_depend_on_a_frozen_weight(reduction: str) -> None:
    torch.manual_seed(0)
    embedding = nn.Embedding(11, 6)
    head = TiedLinear(embedding)
    x = torch.randn(7, 6)
    target = torch.randint(0, 11, (7,))
    grads = []
    for frozen in (False, True):
        embedding.weight.requires_grad_(not frozen)
        x_ = x.clone().requires_grad_(True)
        (head.cross_entropy(x_, target, reduction=reduction) * 3.0).backward()
        grads.append(x_.grad)
    assert torch.equal(grads[0], grads[1])
