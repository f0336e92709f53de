"""Cross-entropy of a bias-free linear layer, computed chunk by chunk without the full logits.

For ``N`` tokens and a vocabulary of ``V``, ``F.cross_entropy(F.linear(x, w), target)`` holds
the ``(N, V)`` logits and, for backward, their softmax: at language-model scale that is the
largest allocation of a training step. Here the tokens are taken a chunk at a time: the
chunk's logits are computed into one reused ``(chunk, V)`` buffer and their softmax into
another, which is turned in place into the gradient of the logits and multiplied straight
into the gradients of ``x`` and ``w``. The gradients are therefore computed in forward,
with the same matrix products as the plain path and nothing recomputed; backward only
scales them by the incoming gradient. When no gradient is needed, only the loss is computed.
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx

__all__ = ["linear_cross_entropy"]

# ``chunk_size=None`` bounds the chunk's logits buffer, and its softmax's, to this many bytes
# (and takes at least ``_MIN_CHUNK`` tokens, so that the matrix products stay efficient).
# At a vocabulary of 32,000 in float32 that is 524 tokens a chunk; see the benchmark for the
# measured cost.
_CHUNK_BYTES = 64 * 2**20
_MIN_CHUNK = 16
_REDUCTIONS = ("mean", "sum")


def default_chunk_size(num_tokens: int, vocab: int, acc_dtype: torch.dtype) -> int:
    """The tokens per chunk when none is given: a logits buffer of at most 64 MiB.

    The buffer holds ``chunk * vocab`` values of the accumulation dtype. The chunk is at least
    16 tokens (a vocabulary so large that 16 rows exceed the budget still runs) and at most
    the number of tokens.
    """
    itemsize = torch.empty((), dtype=acc_dtype).element_size()
    chunk = max(_MIN_CHUNK, _CHUNK_BYTES // max(1, vocab * itemsize))
    return max(1, min(chunk, num_tokens))


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reduced-precision inputs accumulate in float32; float32 and float64 in themselves."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _check_arguments(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    reduction: str,
    label_smoothing: float,
    chunk_size: int | None,
) -> None:
    """Raise, before any work, for arguments that ``F.cross_entropy`` would not accept."""
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"cross_entropy reduction must be 'mean' or 'sum', got {reduction!r}; for "
            "per-token losses ('none') compute the logits with head(x) and call "
            "F.cross_entropy on them"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(
            f"cross_entropy label_smoothing must be in [0.0, 1.0], got {label_smoothing}"
        )
    if chunk_size is not None and (type(chunk_size) is not int or chunk_size < 1):
        raise ValueError(
            f"cross_entropy chunk_size must be a positive int (tokens per chunk) or None to "
            f"choose one from the shapes, got {chunk_size!r}"
        )
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(
            f"cross_entropy target must hold class indices of an integer dtype such as "
            f"torch.long, got {target.dtype}; class probabilities are not supported, "
            "compute the logits with head(x) and call F.cross_entropy on them"
        )
    if not x.dtype.is_floating_point or x.dtype != weight.dtype:
        raise TypeError(
            f"cross_entropy needs a floating-point input of the weight's dtype, got input "
            f"{x.dtype} and weight {weight.dtype}; convert the input with x.to(weight.dtype)"
        )
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"cross_entropy input has shape {tuple(x.shape)}, but the weight has shape "
            f"{tuple(weight.shape)}: the input's last dimension must equal "
            f"in_features={weight.shape[1]}"
        )
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"cross_entropy target has shape {tuple(target.shape)}, but the input has shape "
            f"{tuple(x.shape)}: the target must have the input's leading shape "
            f"{tuple(x.shape[:-1])}, one class index per row"
        )


def _check_targets(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Raise for a counted target outside the vocabulary, as ``F.cross_entropy`` does."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        value = int(target[bad][0])
        raise IndexError(
            f"cross_entropy target {value} is out of bounds for a vocabulary of {vocab} "
            f"(out_features): each target must be in [0, {vocab}) or equal "
            f"ignore_index={ignore_index}"
        )


def _chunks(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    chunk_size: int,
    grad_x: torch.Tensor | None,
    grad_w: torch.Tensor | None,
) -> torch.Tensor:
    """The loss of ``F.cross_entropy(F.linear(x, weight), target)``, chunk by chunk.

    ``x`` is ``(N, D)`` and ``target`` ``(N,)``. When given, ``grad_x`` (``(N, D)``, the
    input's dtype) is filled with, and ``grad_w`` (``(V, D)``, the accumulation dtype, zeroed)
    accumulates, the gradients of the returned loss.
    """
    num_tokens, vocab = x.shape[0], weight.shape[0]
    acc = _accumulation_dtype(x.dtype)
    reduced = acc != x.dtype
    valid = target != ignore_index
    count = valid.sum().to(acc)
    # The gradient of a mean divides by the number of counted tokens. With none counted the
    # loss is 0 / 0 = nan, as in F.cross_entropy, and every gradient is zero.
    grad_scale = 1.0 / count.clamp(min=1) if reduction == "mean" else count.new_ones(())
    total = torch.zeros((), dtype=acc, device=x.device)
    rows = min(chunk_size, num_tokens)
    logits = torch.empty((rows, vocab), dtype=acc, device=x.device)
    # The softmax goes to a second buffer: torch's fused row-wise kernel takes each row while
    # it is in cache, where an in-place softmax of our own would take five passes.
    probs = torch.empty((rows, vocab), dtype=acc, device=x.device)
    for start in range(0, num_tokens, chunk_size):
        stop = min(start + chunk_size, num_tokens)
        x_c, keep = x[start:stop], valid[start:stop]
        z, p = logits[: stop - start], probs[: stop - start]
        if reduced:
            z.copy_(torch.mm(x_c, weight.t()))  # rounded like head(x), then widened
        else:
            torch.mm(x_c, weight.t(), out=z)
        index = torch.where(keep, target[start:stop], 0).unsqueeze(1)
        top = z.argmax(1, keepdim=True)
        torch.softmax(z, 1, out=p)
        # logsumexp(z) = z[top] - log p[top]: the largest probability is at least 1 / V, so
        # its logarithm neither underflows nor loses precision.
        lse = (z.gather(1, top) - p.gather(1, top).log()).squeeze(1)
        # lse - (1 - eps) * z_target - eps * mean(z): F.cross_entropy's label smoothing.
        row_loss = lse - (1.0 - label_smoothing) * z.gather(1, index).squeeze(1)
        if label_smoothing:
            row_loss -= label_smoothing / vocab * z.sum(1)
        total += torch.where(keep, row_loss, 0).sum()
        if grad_x is None and grad_w is None:
            continue
        # In the softmax's buffer: the softmax, times the reduction's scale, minus the smoothed
        # one-hot target.
        row_scale = keep.to(acc) * grad_scale
        grad = p.mul_(row_scale.unsqueeze(1))
        if label_smoothing:
            grad.sub_((row_scale * (label_smoothing / vocab)).unsqueeze(1))
        grad.scatter_add_(1, index, (-(1.0 - label_smoothing) * row_scale).unsqueeze(1))
        if grad_x is not None:
            if reduced:
                grad_x[start:stop] = torch.mm(grad.to(x.dtype), weight)
            else:
                torch.mm(grad, weight, out=grad_x[start:stop])
        if grad_w is not None:
            grad_w.addmm_(grad.t(), x_c.to(acc))
    return total / count if reduction == "mean" else total


class _Context(FunctionCtx):
    """What the autograd context holds between forward and backward, for type checking."""

    needs_input_grad: tuple[bool, ...]
    saved_tensors: tuple[torch.Tensor | None, torch.Tensor | None]
    x_shape: torch.Size
    weight_dtype: torch.dtype
    used: bool


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and both gradients; backward scales the saved gradients."""

    @staticmethod
    def forward(
        ctx: _Context,
        x: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        ignore_index: int,
        reduction: str,
        label_smoothing: float,
        chunk_size: int,
    ) -> torch.Tensor:
        needs_x, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        flat = x.reshape(target.numel(), x.shape[-1])
        acc = _accumulation_dtype(x.dtype)
        grad_x = torch.empty_like(flat) if needs_x else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs_w else None
        loss = _chunks(
            flat,
            weight,
            target.reshape(-1),
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            chunk_size=chunk_size,
            grad_x=grad_x,
            grad_w=grad_w,
        )
        ctx.x_shape = x.shape
        ctx.weight_dtype = weight.dtype
        ctx.used = False
        ctx.save_for_backward(grad_x, grad_w)  # type: ignore[arg-type] # None is allowed
        return loss

    @staticmethod
    def backward(ctx: _Context, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # The saved gradients are scaled in place, so that backward allocates no second
        # (V, D) buffer; a second backward through the same graph would scale them again.
        if ctx.used:
            raise RuntimeError(
                "TiedLinear.cross_entropy does not support a second backward through the same "
                "loss (retain_graph=True): its gradients are computed in forward and scaled in "
                "place by backward. Compute the loss again for another backward."
            )
        ctx.used = True
        grad_x, grad_w = ctx.saved_tensors
        # grad_loss has the loss's dtype, the accumulation dtype; it is not converted to a
        # reduced input dtype first, for float16 cannot hold a loss scale such as 65536.
        if grad_x is not None:
            grad_x = grad_x.mul_(grad_loss).reshape(ctx.x_shape)
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_loss).to(ctx.weight_dtype)
        return grad_x, grad_w, None, None, None, None, None


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(x, weight).float(), target, ...)`` without the full logits.

    The loss has the accumulation dtype: float32 for bfloat16 and float16 inputs, otherwise
    the input's. Arguments are checked before any work. With no gradient needed (grad mode
    off, or neither ``x`` nor ``weight`` requiring grad) only the loss is computed.
    """
    _check_arguments(x, weight, target, reduction, label_smoothing, chunk_size)
    target = target.long()
    _check_targets(target, weight.shape[0], ignore_index)
    num_tokens = target.numel()
    chunk = chunk_size or default_chunk_size(
        num_tokens, weight.shape[0], _accumulation_dtype(x.dtype)
    )
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        loss: torch.Tensor = _LinearCrossEntropy.apply(  # type: ignore[no-untyped-call]
            x, weight, target, ignore_index, reduction, float(label_smoothing), chunk
        )
        return loss
    return _chunks(
        x.reshape(num_tokens, x.shape[-1]),
        weight,
        target.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=float(label_smoothing),
        chunk_size=chunk,
        grad_x=None,
        grad_w=None,
    )
