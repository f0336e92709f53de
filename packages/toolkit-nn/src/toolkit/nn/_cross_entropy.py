"""Cross-entropy of a bias-free linear layer, computed chunk by chunk without the full logits.

For ``N`` tokens and a vocabulary of ``V``, ``F.cross_entropy(F.linear(x, w), target)`` holds
the ``(N, V)`` logits and, for backward, their softmax: at language-model scale that is the
largest allocation of a training step. Here the tokens are taken a chunk at a time: the
chunk's logits are computed into one reused ``(chunk, V)`` buffer, where torch's fused
softmax replaces them, in place, and is turned in place into the gradient of the logits and
multiplied straight into the gradients of ``x`` and ``w``.

For ``reduction="mean"`` and ``"sum"`` the gradients are computed in forward, for a unit
weight per counted token; backward only scales them by the incoming gradient (and
``1 / count`` for a mean), in the accumulation dtype. The weight's gradient is accumulated in
that dtype; x's is taken with the products' dtype, but for float16, where the logits'
gradients and the weight are taken in float32 and x's gradient is kept in float32: a
confident token's gradient (below 6e-8) would be flushed to 0 by float16 before a loss scale
could bring it into range. So a float16 loss scale is applied before anything is rounded to
float16. bfloat16 has float32's range and stays in bfloat16. For
``reduction="none"`` each token's incoming gradient is known only in backward, which
recomputes the chunks with it. So does a backward that builds a graph (``create_graph=True``,
``torch.func.grad``): it recomputes them with differentiable operations, which gives the
second-order gradients of the plain path. When no gradient is needed, only the loss is
computed.

Only the counted tokens are computed: those whose target is ``ignore_index`` are left out
before the first product, and get a loss of 0 and a gradient of 0. Under ``torch.compile``,
where the number of counted tokens would be a dynamic shape, and in a backward that builds a
graph, every token is computed and the ignored ones are masked.
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
import zlib
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from torch.autograd.function import FunctionCtx

from toolkit.nn._common import _detail

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["VocabShard", "linear_cross_entropy"]

# ``chunk_size=None`` bounds the chunk's logits buffer to this many bytes (and takes at least
# ``_MIN_CHUNK`` tokens, so that the matrix products stay efficient).
# At a vocabulary of 32,000 in float32 that is 524 tokens a chunk; see the benchmark for the
# measured cost.
_CHUNK_BYTES = 64 * 2**20
_MIN_CHUNK = 16
_REDUCTIONS = ("mean", "sum", "none")
# The ranks of a vocabulary shard compare their calls in the first all-reduce each makes, of
# the first chunk's row maxima: it holds this many rows (the first chunk has at most as many,
# padded), so that it has one size on every rank whatever its tokens and chunks.
_FIRST_ROWS = 1024
# What they compare: the tokens, as their number, the number counted and a checksum of the
# targets, then the options, named as the error names them.
_TOKENS = ("tokens", "counted", "targets")
_CHECKED = (
    "chunk_size",
    "ignore_index",
    "reduction",
    "label_smoothing",
    "z_loss",
    "softcap",
    "dtype",
    "x.requires_grad",
    "weight.requires_grad",
)
# The entries of a call (_SameCall): whether a rank refused it, then each value of _TOKENS and
# _CHECKED as four 16-bit pieces, then the pieces negated.
_CALL_ENTRIES = 1 + 2 * 4 * (len(_TOKENS) + len(_CHECKED))
_REDUCED = (torch.bfloat16, torch.float16)


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
    """Reduced-precision products accumulate in float32; float32 and float64 in themselves."""
    return torch.float32 if dtype in _REDUCED else dtype


class _Options(NamedTuple):
    """The loss's options, checked, and the dtype of its matrix products."""

    ignore_index: int
    reduction: str
    label_smoothing: float
    z_loss: float
    softcap: float | None
    chunk_size: int
    mm_dtype: torch.dtype
    shard: VocabShard | None = None
    # Whether forward compares the shard's ranks' calls in its first all-reduce (not under
    # TORCH_DISTRIBUTED_DEBUG=DETAIL, which compares them before, nor under torch.compile).
    check: bool = False


class VocabShard(NamedTuple):
    """This rank's rows of a weight sharded on the vocabulary, and the group that has them all.

    The rows are ``[offset, offset + rows)`` of a vocabulary of ``vocab``; the ranks of
    ``group`` hold the others, and every rank has the whole input and targets.
    """

    group: ProcessGroup
    offset: int
    vocab: int


def _all_reduce(
    tensor: torch.Tensor, shard: VocabShard, op: torch.distributed.ReduceOp.RedOpType
) -> torch.Tensor:
    """``tensor`` reduced in place over the shard's group by ``op``, a ``ReduceOp``."""
    torch.distributed.all_reduce(tensor, op=op, group=shard.group)
    return tensor


class _Statistics(NamedTuple):
    """Per row: the logsumexp, target logit and sum of the logits, over the whole vocabulary.

    With this rank's part of the softmax, and the target's column among this rank's columns
    (0 where another rank has it) with whether this rank has it.
    """

    lse: torch.Tensor
    target_logit: torch.Tensor
    total: torch.Tensor
    probs: torch.Tensor
    column: torch.Tensor
    here: torch.Tensor


def _statistics(
    z: torch.Tensor,
    index: torch.Tensor,
    o: _Options,
    inplace: bool,
    check: _SameCall | None,
    known: torch.Tensor | None,
) -> _Statistics:
    """The per-row statistics of the (soft-capped) logits ``z``, over the whole vocabulary.

    In place, the softmax replaces ``z``: what else is needed of ``z`` is taken first. With
    ``check``, the ranks' calls are compared in the first all-reduce, which raises on every
    rank if they differ. On a shard, ``known`` is forward's ``(3, rows)`` logsumexp, target
    logit and sum of the logits of these rows: backward's recompute takes them from it, and
    the softmax, ``exp(z - lse)``, locally, with no all-reduce.
    """
    if o.shard is None:
        top = z.argmax(1, keepdim=True)
        top_logit = z.gather(1, top)
        target_logit = z.gather(1, index).squeeze(1)
        total = z.sum(1)  # read with label smoothing only; one pass over the chunk
        if inplace:
            # torch's fused row-wise kernel takes each row while it is in cache.
            torch.softmax(z, 1, out=z)
        else:
            z = torch.softmax(z, 1)
        # logsumexp(z) = z[top] - log p[top]: the largest probability is at least 1 / V, so
        # its logarithm neither underflows nor loses precision.
        lse = (top_logit - z.gather(1, top).log()).squeeze(1)
        here = index >= 0  # every target's column is here
        return _Statistics(lse, target_logit, total, z, index, here)
    # This rank has columns [offset, offset + rows) of the logits: only per-row statistics
    # cross the group, a max, then the sum of exponentials, the target logit and the sum.
    # Only in place: a sharded weight refuses a backward that differentiates this again.
    tokens, rows = z.shape
    local = index - o.shard.offset
    here = (local >= 0) & (local < rows)
    column = torch.where(here, local, 0)
    if known is not None:  # backward: the softmax from forward's logsumexp, here alone
        lse, target_logit, total = known
        return _Statistics(lse, target_logit, total, z.sub_(lse.unsqueeze(1)).exp_(), column, here)
    peak = z.amax(1) if rows else z.new_full((tokens,), -math.inf)
    if check is not None:  # the call's entries, then the maxima padded to one size (unread)
        peak = torch.cat([check.entries, peak, peak.new_zeros(_FIRST_ROWS - tokens)])
    peak = _all_reduce(peak, o.shard, torch.distributed.ReduceOp.MAX)
    if check is not None:
        _raise_unless_same(check, peak[: len(check.entries)])
        peak = peak[len(check.entries) :][:tokens]
    peak = peak.unsqueeze(1)
    target_logit = z.gather(1, column) if rows else z.new_zeros(index.shape)
    total = z.sum(1)
    p = z.sub_(peak).exp_()
    sums = torch.stack([p.sum(1), torch.where(here, target_logit, 0.0).squeeze(1), total])
    sums = _all_reduce(sums, o.shard, torch.distributed.ReduceOp.SUM)
    p = p.div_(sums[0].unsqueeze(1))
    lse = peak.squeeze(1) + sums[0].log()
    return _Statistics(lse, sums[1], sums[2], p, column, here)


def _product_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(x, weight)`` computes in: under autocast, its dtype for both.

    Autocast casts float16, bfloat16 and float32 tensors (not float64) to its dtype for
    ``F.linear``; outside autocast the input must have the weight's dtype.
    """
    device = x.device.type
    x_dtype, w_dtype = x.dtype, weight.dtype
    if torch.is_autocast_enabled(device) and x_dtype.is_floating_point:
        cast = torch.get_autocast_dtype(device)
        eligible = (torch.float16, torch.bfloat16, torch.float32)
        x_dtype = cast if x_dtype in eligible else x_dtype
        w_dtype = cast if w_dtype in eligible else w_dtype
    if not x.dtype.is_floating_point or x_dtype != w_dtype:
        raise TypeError(
            f"cross_entropy needs a floating-point input of the weight's dtype, got input "
            f"{x.dtype} and weight {weight.dtype}; convert the input with x.to(weight.dtype)"
        )
    return x_dtype


def _check_arguments(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    chunk_size: int | None,
) -> None:
    """Raise, before any work, for arguments that ``F.cross_entropy`` would not accept."""
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"cross_entropy reduction must be 'mean', 'sum' or 'none', got {reduction!r}"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(
            f"cross_entropy label_smoothing must be in [0.0, 1.0], got {label_smoothing}"
        )
    if not 0.0 <= z_loss < math.inf:
        raise ValueError(
            f"cross_entropy z_loss must be a finite number >= 0.0 (0.0 for none), got {z_loss}"
        )
    if softcap is not None and not 0.0 < softcap < math.inf:
        raise ValueError(
            f"cross_entropy softcap must be a finite number > 0.0, or None for no soft-cap, "
            f"got {softcap}"
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
    """Raise for a counted target outside the vocabulary, as ``F.cross_entropy`` does.

    On the CPU, eagerly, the error names the value. Elsewhere, and under ``torch.compile``,
    the check is an asynchronous assertion, so that it neither waits for the device nor
    breaks the graph; on CUDA it fails as ``F.cross_entropy``'s device-side assertion does.
    """
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    fix = f"each target must be in [0, {vocab}) or equal ignore_index={ignore_index}"
    if target.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool(bad.any()):
            value = int(target[bad][0])
            raise IndexError(
                f"cross_entropy target {value} is out of bounds for a vocabulary of {vocab} "
                f"(out_features): {fix}"
            )
        return
    torch._assert_async(
        ~bad.any(),
        f"cross_entropy target out of bounds for a vocabulary of {vocab} (out_features): {fix}",
    )


def _row_losses(
    z: torch.Tensor,
    index: torch.Tensor,
    keep: torch.Tensor,
    o: _Options,
    *,
    want_grad: bool,
    inplace: bool,
    check: _SameCall | None = None,
    known: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Each row's loss, the gradient of the rows' sum for the logits ``z``, and statistics.

    The statistics are the rows' ``(3, rows)`` logsumexp, target logit and sum of the logits.
    ``z`` is ``(rows, V)`` in the accumulation dtype, ``index`` ``(rows, 1)`` the target
    (0 where ignored) and ``keep`` ``(rows,)`` the counted rows; ignored rows give 0 and a
    zero gradient. In place, ``z`` becomes the gradient; otherwise ``z`` and what backward
    saves are left unchanged, so that autograd can differentiate it again. ``check`` and
    ``known``: see ``_statistics``.
    """
    vocab = z.shape[1] if o.shard is None else o.shard.vocab
    eps, cap = o.label_smoothing, o.softcap
    slope = None
    if cap is not None:  # Gemma 2's soft-cap: cap * tanh(z / cap), before the softmax
        z = z.div_(cap).tanh_().mul_(cap) if inplace else torch.tanh(z / cap) * cap
    if cap is not None and want_grad:
        # d/dz cap * tanh(z / cap) = 1 - (z_capped / cap)^2, taken before the softmax
        # replaces z: one more chunk-sized tensor, with a soft-cap only.
        slope = (z / cap).square_().neg_().add_(1.0)
    stats = _statistics(z, index, o, inplace, check, known)
    lse, p = stats.lse, stats.probs
    known = torch.stack([lse, stats.target_logit, stats.total])
    # lse - (1 - eps) * z_target - eps * mean(z): F.cross_entropy's label smoothing.
    row = lse - (1.0 - eps) * stats.target_logit
    if eps:
        row = row - eps / vocab * stats.total
    if o.z_loss:
        row = row + o.z_loss * lse.square()
    row = torch.where(keep, row, 0.0)
    if not want_grad:
        return row, None, known
    # d row / d z = p * (1 + 2 c lse) - (1 - eps) onehot - eps / V, on counted rows.
    counted = keep.to(z.dtype)
    scale = (counted * (1.0 + 2.0 * o.z_loss * lse)).unsqueeze(1)
    # Out of place, p is saved by the softmax's backward; the product is a fresh tensor that no
    # backward saves, so it is updated in place from here on in both modes.
    grad = p.mul_(scale) if inplace else p * scale
    if eps:
        grad.sub_((counted * (eps / vocab)).unsqueeze(1))
    onehot = -(1.0 - eps) * counted.unsqueeze(1) * stats.here
    if grad.shape[1]:  # a rank may hold no rows of a sharded vocabulary
        grad.scatter_add_(1, stats.column, onehot)
    if slope is not None:  # through the soft-cap
        grad.mul_(slope)
    return row, grad, known


class _Gradients:
    """The gradients of x (by chunk) and of the weight, summed over the chunks.

    In place, into one ``(N, D)`` buffer for x's, where the tokens are its ``rows`` (0 in the
    others, the ignored ones) or all of them, and one ``(V, D)`` buffer; under grad mode, out
    of place and for every row, so that autograd can differentiate them.
    """

    def __init__(
        self,
        x: torch.Tensor,
        w_mm: torch.Tensor,
        o: _Options,
        *,
        rows: torch.Tensor | None,
        want_x: bool,
        want_w: bool,
    ) -> None:
        self.inplace = not torch.is_grad_enabled()
        self.mm, self.acc = o.mm_dtype, _accumulation_dtype(o.mm_dtype)
        # float16 flushes to 0 what is below 6e-8, such as the logit gradients of a confident
        # token before the loss scale that would bring them into range: x's gradient is taken
        # and kept in float32 until backward has scaled it. bfloat16 has float32's range.
        x_dtype = self.acc if self.mm == torch.float16 else self.mm
        self.w_x = w_mm.to(x_dtype)
        self.want_x, self.rows = want_x, rows
        self.x_buffer = (
            torch.zeros(x.shape, dtype=x_dtype, device=x.device)
            if want_x and self.inplace
            else None
        )
        # No rows of x: with no tokens the gradient is this empty start, on x's device.
        self.x_parts: list[torch.Tensor] = [x.detach()[:0]]
        self.weight = torch.zeros(w_mm.shape, dtype=self.acc, device=x.device) if want_w else None

    def add(self, start: int, grad: torch.Tensor, x_c: torch.Tensor) -> None:
        """Add a chunk's share, from the gradient of its logits ``grad``."""
        stop = start + len(grad)
        if self.x_buffer is not None and self.rows is not None:  # the tokens: rows[start:stop]
            part = torch.mm(grad.to(self.w_x.dtype), self.w_x)
            self.x_buffer.index_copy_(0, self.rows[start:stop], part)
        elif self.x_buffer is not None:
            torch.mm(grad.to(self.w_x.dtype), self.w_x, out=self.x_buffer[start:stop])
        elif self.want_x:
            self.x_parts.append(torch.mm(grad.to(self.w_x.dtype), self.w_x))
        if self.weight is not None and self.inplace:
            self.weight.addmm_(grad.t(), x_c.to(self.acc))
        elif self.weight is not None:
            self.weight = self.weight + grad.t().mm(x_c.to(self.acc))

    def x(self) -> torch.Tensor | None:
        """The gradient of x, or None if not wanted; backward gives it x's dtype."""
        if self.x_buffer is not None or not self.want_x:
            return self.x_buffer
        return torch.cat(self.x_parts)


def _chunk_logits(
    x_c: torch.Tensor, w_mm: torch.Tensor, acc: torch.dtype, buffer: torch.Tensor | None
) -> torch.Tensor:
    """A chunk's logits in the accumulation dtype, rounded like ``head(x)``'s.

    Into the first rows of ``buffer``, or out of place where it is None.
    """
    if buffer is None:
        return torch.mm(x_c, w_mm.t()).to(acc)
    z = buffer[: len(x_c)]
    if x_c.dtype == acc:
        torch.mm(x_c, w_mm.t(), out=z)
    else:
        z.copy_(torch.mm(x_c, w_mm.t()))  # rounded like head(x), then widened
    return z


def _chunks(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    o: _Options,
    *,
    row_weight: torch.Tensor | None,
    want_x: bool,
    want_w: bool,
    check: _SameCall | None = None,
    known: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Each token's loss and statistics, and the gradients of ``sum(row_weight * loss)``.

    ``x`` is ``(N, D)``, ``target`` ``(N,)``; ``row_weight`` ``(N,)`` is the incoming gradient
    of each token's loss, or None for one per token. The statistics are ``(3, N)``, as
    ``_row_losses`` gives them; the gradients are x's, in the products' dtype (float32 for
    float16; or x's, if wider, out of place), and the weight's, in the accumulation dtype.
    Only the counted tokens are computed: the ignored ones get a loss, statistics and gradient
    of 0. Every rank of a shard has the same targets, so takes the same tokens. Under
    ``torch.compile`` their number would be a dynamic shape, and under grad mode (a backward
    that builds a graph) ``torch.func.vmap`` could not batch it: there every token is taken,
    and ``_row_losses`` masks the ignored ones. Under grad mode every operation is out of
    place and differentiable, but for updates of fresh results; otherwise the chunk's buffers
    are reused in place. With ``check``, the first chunk has at most ``_FIRST_ROWS`` tokens,
    and is taken even with no token, so that the ranks' calls are compared in its all-reduce.
    ``known``: the tokens' statistics from forward, on a shard (see ``_statistics``).
    """
    tokens = len(target)
    rows = None  # the counted tokens' positions in x, where they are taken apart
    if not (torch.compiler.is_compiling() or torch.is_grad_enabled()):
        rows = (target != o.ignore_index).nonzero().squeeze(1)
    if rows is not None:
        target = target[rows]
        row_weight = None if row_weight is None else row_weight[rows]
        known = None if known is None else known[:, rows]
    num_tokens, vocab = len(target), weight.shape[0]
    acc = _accumulation_dtype(o.mm_dtype)
    w_mm = weight.to(o.mm_dtype)
    keep = target != o.ignore_index
    index = torch.where(keep, target, 0).unsqueeze(1)
    grads = _Gradients(x, w_mm, o, rows=rows, want_x=want_x, want_w=want_w)
    buffer = None
    if grads.inplace:  # one chunk's logits, reused: their softmax and gradient replace them
        shape = (min(o.chunk_size, num_tokens), vocab)
        buffer = torch.empty(shape, dtype=acc, device=x.device)
    starts = list(range(0, num_tokens, o.chunk_size))
    if check is not None:
        starts = [0, *range(min(o.chunk_size, _FIRST_ROWS), num_tokens, o.chunk_size)]
    losses, statistics = [], []
    for start, stop in itertools.pairwise([*starts, num_tokens]):
        x_c = (x[start:stop] if rows is None else x[rows[start:stop]]).to(o.mm_dtype)
        z = _chunk_logits(x_c, w_mm, acc, buffer)
        row, grad, stats = _row_losses(
            z,
            index[start:stop],
            keep[start:stop],
            o,
            want_grad=want_x or want_w,
            inplace=grads.inplace,
            check=check if start == 0 else None,
            known=None if known is None else known[:, start:stop],
        )
        losses.append(row)
        statistics.append(stats)
        if grad is None:
            continue
        if row_weight is not None:
            factor = row_weight[start:stop].unsqueeze(1)
            grad = grad.mul_(factor) if grads.inplace else grad * factor
        grads.add(start, grad, x_c)
    loss = torch.cat(losses) if losses else x.new_zeros((0,), dtype=acc)
    stats = torch.cat(statistics, 1) if statistics else loss.new_zeros((3, 0))
    if rows is not None:  # back in every token's place, 0 in the ignored ones'
        loss = loss.new_zeros(tokens).index_copy_(0, rows, loss)
        stats = stats.new_zeros((3, tokens)).index_copy_(1, rows, stats)
    grad_x = grads.x()
    if o.shard is not None and grad_x is not None:
        # Each rank's columns give a part of x's gradient: the whole is their sum.
        grad_x = _all_reduce(grad_x, o.shard, torch.distributed.ReduceOp.SUM)
    return loss, stats, grad_x, grads.weight


def _reduce(rows: torch.Tensor, target: torch.Tensor, o: _Options) -> torch.Tensor:
    """The loss of the reduction, from each token's (0 where ignored)."""
    if o.reduction == "none":
        return rows.reshape(target.shape)
    if o.reduction == "sum":
        return rows.sum()
    # A mean of no counted token is 0 / 0 = nan, as in F.cross_entropy.
    return rows.sum() / (target != o.ignore_index).sum()


def _select(b: int, arg: object, dim: object) -> object:
    """Entry ``b`` of a batched argument (one with an int batch dimension ``dim``)."""
    if isinstance(arg, torch.Tensor) and isinstance(dim, int):
        return arg.select(dim, b)
    return arg


class _BatchInfo(Protocol):
    """What ``torch.func.vmap`` tells a Function's vmap rule: the size of the batch."""

    batch_size: int


class _Context(FunctionCtx):
    """What the autograd context holds between forward and backward, for type checking."""

    needs_input_grad: tuple[bool, ...]
    saved_tensors: tuple[torch.Tensor, ...]
    options: _Options
    x_shape: torch.Size
    x_dtype: torch.dtype
    weight_dtype: torch.dtype
    saved: tuple[bool, bool]
    used: bool  # set by the first backward that scales the saved gradients


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, for a mean or a sum, the unit-weight gradients.

    Backward scales those, or recomputes the chunks: on a shard, with forward's per-token
    statistics, which it outputs for ``reduction="none"``.
    """

    @staticmethod
    def forward(
        x: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        o: _Options,
        want_x: bool,
        want_w: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        flat_target = target.reshape(-1)
        vocab = weight.shape[0] if o.shard is None else o.shard.vocab
        check = _same_call(flat_target, vocab, o, want_x=want_x, want_w=want_w) if o.check else None
        # Checked here, where under torch.func.vmap each entry's targets are a plain tensor;
        # on a shard, once the ranks have compared them: a rank that raised alone would leave
        # the others waiting for it.
        if check is None:
            _check_targets(target, vocab, o.ignore_index)
        save = o.reduction != "none"
        rows, stats, grad_x, grad_w = _chunks(
            x.reshape(flat_target.numel(), x.shape[-1]),
            weight,
            flat_target,
            o,
            row_weight=None,
            want_x=want_x and save,
            want_w=want_w and save,
            check=check,
        )
        if check is not None:
            _check_targets(target, vocab, o.ignore_index)
        # Outputs must be tensors, and distinct ones: a 0-d one stands for a gradient not
        # computed, or statistics not kept, which backward never reads.
        return (
            _reduce(rows, target, o),
            x.new_empty(()) if grad_x is None else grad_x,
            x.new_empty(()) if grad_w is None else grad_w,
            stats if _recompute_from_statistics(o) else x.new_empty(()),
        )

    @staticmethod
    def setup_context(
        ctx: _Context,
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, _Options, bool, bool],
        output: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> None:
        x, weight, target, o, want_x, want_w = inputs
        _, grad_x, grad_w, stats = output
        ctx.mark_non_differentiable(grad_x, grad_w, stats)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight, target, grad_x, grad_w, stats)
        ctx.options = o
        ctx.x_shape, ctx.x_dtype, ctx.weight_dtype = x.shape, x.dtype, weight.dtype
        save = o.reduction != "none"
        # What forward computed: under torch.func.vmap an input can need a gradient that the
        # batched tensor did not say it needs.
        ctx.saved = (save and want_x, save and want_w)

    @staticmethod
    def backward(
        ctx: _Context, grad_loss: torch.Tensor, *_internal: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        o = ctx.options
        needs_x, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        saved_x, saved_w = ctx.saved
        every_one_saved = (saved_x or not needs_x) and (saved_w or not needs_w)
        if every_one_saved and not torch.is_grad_enabled():
            return _scale_saved(ctx, grad_loss, needs_x, needs_w)
        # Recompute: each token's incoming gradient is known only now (reduction "none"),
        # the gradients must themselves be differentiable (create_graph, torch.func), or
        # forward did not compute one that is needed (under torch.func.vmap).
        if o.shard is not None and torch.is_grad_enabled():
            raise RuntimeError(
                "TiedLinear.cross_entropy on a vocabulary-sharded weight does not support a "
                "backward that builds a graph (create_graph=True, torch.func); compute the "
                "logits with head(x) and take F.cross_entropy of them inside "
                "torch.distributed.tensor.parallel.loss_parallel()"
            )
        x, weight, target, _, _, stats = ctx.saved_tensors
        flat_target = target.reshape(-1)
        keep = flat_target != o.ignore_index
        # grad_loss has the loss's dtype, the accumulation dtype.
        if o.reduction == "none":
            row_weight = grad_loss.reshape(-1)
        else:
            row_weight = _loss_factor(grad_loss, keep, o).expand(keep.shape)
        with torch.autocast(x.device.type, enabled=False):
            _, _, grad_x, grad_w = _chunks(
                x.reshape(flat_target.numel(), x.shape[-1]),
                weight,
                flat_target,
                o,
                row_weight=torch.where(keep, row_weight, 0.0),
                want_x=needs_x,
                want_w=needs_w,
                known=stats if _recompute_from_statistics(o) else None,
            )
        return (
            None if grad_x is None else grad_x.reshape(ctx.x_shape).to(ctx.x_dtype),
            None if grad_w is None else grad_w.to(ctx.weight_dtype),
            None,
            None,
            None,
            None,
        )

    @staticmethod
    def vmap(
        info: _BatchInfo, in_dims: tuple[object, ...], *args: object
    ) -> tuple[tuple[torch.Tensor, ...], tuple[int, int, int, int]]:
        # One call per batch entry: each is its own loss, with its own count of tokens.
        outputs = []
        for b in range(info.batch_size):
            entry = map(functools.partial(_select, b), args, in_dims)
            outputs.append(_LinearCrossEntropy.apply(*entry))  # type: ignore[no-untyped-call]
        stacked = tuple(torch.stack([out[i] for out in outputs]) for i in range(4))
        return stacked, (0,) * 4


def _recompute_from_statistics(o: _Options) -> bool:
    """Whether backward recomputes a shard's chunks from forward's per-token statistics.

    On a shard, for ``reduction="none"``: backward then needs no all-reduce but x's gradient's.
    """
    return o.shard is not None and o.reduction == "none"


def _loss_factor(grad_loss: torch.Tensor, keep: torch.Tensor, o: _Options) -> torch.Tensor:
    """What the gradient of one counted token's loss is multiplied by.

    The incoming gradient, divided by the count for a mean: 0 when none is counted, as in
    ``F.cross_entropy``, whatever comes in (a nan or an inf times the zero gradients would be
    nan).
    """
    count = keep.sum()
    per_token = grad_loss if o.reduction == "sum" else grad_loss / count.clamp(min=1)
    return torch.where(count > 0, per_token, 0.0)


def _scale_saved(
    ctx: _Context, grad_loss: torch.Tensor, needs_x: bool, needs_w: bool
) -> tuple[torch.Tensor | None, ...]:
    """Backward of a mean or sum: the saved unit-weight gradients, scaled in place."""
    # The saved gradients are scaled in place, so that backward allocates no second (V, D)
    # buffer; a second backward through the same graph would scale them again. The first
    # sets ``used``, which the context lacks before it.
    if getattr(ctx, "used", None):
        raise RuntimeError(
            "TiedLinear.cross_entropy does not support a second backward through the same "
            "loss (retain_graph=True): its gradients are computed in forward and scaled in "
            "place by backward. Compute the loss again for another backward."
        )
    ctx.used = True
    _, _, target, grad_x, grad_w, _ = ctx.saved_tensors
    o = ctx.options
    # The factor has the loss's dtype, the accumulation dtype: float16 cannot hold a loss
    # scale such as 65536, nor the gradient of one token of a mean over thousands.
    keep = target.reshape(-1) != o.ignore_index
    factor = _loss_factor(grad_loss, keep, o)
    if needs_x:  # scaled a chunk at a time, in place
        for start in range(0, grad_x.shape[0], o.chunk_size):
            # A factor per row: an ignored token's row stays exactly 0, as in F.cross_entropy,
            # whatever comes in. The rows, in the accumulation dtype and not 0-d, take part in
            # type promotion, so each product is taken in that dtype and rounded once.
            rows = torch.where(keep[start : start + o.chunk_size], factor, 0.0).unsqueeze(1)
            grad_x[start : start + o.chunk_size].mul_(rows)
    return (
        grad_x.reshape(ctx.x_shape).to(ctx.x_dtype) if needs_x else None,
        grad_w.mul_(factor).to(ctx.weight_dtype) if needs_w else None,
        None,
        None,
        None,
        None,
    )


def _agree(mine: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Per entry of the int64 ``mine``, whether every rank of the shard's group has the same value.

    The maximum of ``v`` is the minimum only if every rank has the same ``v``, and the minimum is
    ``~max(~v)``: ``~v = -v - 1`` maps every int64 to another (``-v`` would map the smallest to
    itself), so one all-reduce of ``v`` and ``~v`` takes both, exactly.
    """
    spread = _all_reduce(torch.cat([mine, ~mine]), shard, torch.distributed.ReduceOp.MAX)
    return spread[: len(mine)] == ~spread[len(mine) :]


def _float_code(value: float) -> int:
    """A float option ``value`` (never negative) as an int64, equal for equal values.

    Its float64 bits, read as an integer: exact, where a float's value could round. ``abs``
    takes ``-0.0``, which the options' checks let through, as ``0.0``.
    """
    return int.from_bytes(struct.pack("<d", abs(value)), "little")


class _SameCall(NamedTuple):
    """This rank's call, as the ranks of a shard compare it, in an all-reduce by maximum.

    ``entries``: 0 (1 on a rank whose arguments were refused), then each value that
    ``_TOKENS`` and ``_CHECKED`` name, as four 16-bit pieces of its int64 code, then the
    pieces negated. The maximum of the pieces is the negated maximum of their negations only
    where every rank has the same, exactly, in any floating dtype. ``tokens`` is this rank's
    number of tokens, and ``shown`` each option's name and this rank's value.
    """

    entries: torch.Tensor
    tokens: int
    shown: tuple[tuple[str, object], ...]


def _same_call(
    target: torch.Tensor, vocab: int, o: _Options, *, want_x: bool, want_w: bool
) -> _SameCall:
    """This rank's call on the flattened ``target``, of a vocabulary of ``vocab``.

    The per-token statistics of the ranks are summed: a rank with other tokens (under sequence
    parallelism, its own slice) would mix them silently, and so would another softcap, dtype,
    label_smoothing or z_loss; another chunk, reduction or ``requires_grad`` would make
    all-reduces of other sizes or make one rank reduce x's gradient alone (a hang), and another
    ``ignore_index`` or reduction would give another loss and weight gradient. The targets are
    compared by a checksum: the sum, modulo 2**64, of each target (``vocab``, which no target
    is, where ignored) times ``2 * position + 1``, so that targets that differ in one position
    always differ in it, and so do targets of the vocabulary swapped between two positions.
    """
    counted = target != o.ignore_index
    weights = torch.arange(len(target), device=target.device).mul_(2).add_(1)
    checksum = torch.where(counted, target, vocab).mul_(weights).sum()
    options = (
        (o.chunk_size, o.chunk_size),
        (o.ignore_index, o.ignore_index),
        (o.reduction, _REDUCTIONS.index(o.reduction)),
        (o.label_smoothing, _float_code(o.label_smoothing)),
        (o.z_loss, _float_code(o.z_loss)),
        (o.softcap, _float_code(o.softcap or 0.0)),  # 0.0, which no softcap can be, for None
        (o.mm_dtype, zlib.crc32(str(o.mm_dtype).encode())),
        (want_x, int(want_x)),
        (want_w, int(want_w)),
    )
    tokens = torch.stack([target.new_tensor(len(target)), counted.sum(), checksum])
    codes = torch.cat([tokens, target.new_tensor([code for _, code in options])])
    shifts = target.new_tensor([0, 16, 32, 48])
    pieces = ((codes.unsqueeze(1) >> shifts) & 0xFFFF).flatten()
    pieces = pieces.to(_accumulation_dtype(o.mm_dtype))
    shown = tuple((name, options[i][0]) for i, name in enumerate(_CHECKED))
    return _SameCall(torch.cat([pieces.new_zeros(1), pieces, -pieces]), len(target), shown)


def _raise_unless_same(call: _SameCall, reduced: torch.Tensor) -> None:
    """Raise, on every rank, unless every rank made ``call``.

    ``reduced`` is the maximum of the ranks' entries, the same on every rank.
    """
    if reduced[0]:
        raise _refused_elsewhere()
    half = len(reduced) // 2
    same = (reduced[1 : half + 1] == -reduced[half + 1 :]).view(-1, 4).all(1).tolist()
    tokens, options = same[: len(_TOKENS)], same[len(_TOKENS) :]
    if tokens[0] and not all(options):  # a different count is said below, as other tokens
        differing = itertools.compress(call.shown, [not agreed for agreed in options])
        differ = " and ".join(f"{name} ({shown!r} here)" for name, shown in differing)
        raise ValueError(
            f"TiedLinear.cross_entropy on a vocabulary-sharded weight needs the same options, "
            f"dtype and requires_grad on every rank of the tensor-parallel group, but the "
            f"ranks' {differ} differ: pass the same ones on every rank (requires_grad counts "
            f"under grad mode only)."
        )
    if not all(tokens):
        raise _other_tokens(call.tokens)


def _other_tokens(tokens: object) -> ValueError:
    return ValueError(
        f"TiedLinear.cross_entropy on a vocabulary-sharded weight needs the same tokens "
        f"and targets on every rank of the tensor-parallel group, but the ranks' "
        f"targets differ (this rank has {tokens} tokens): each rank's rows of "
        "the vocabulary give a part of every token's statistics, which are summed "
        "across ranks. Under sequence parallelism pass the hidden states as a DTensor "
        "sharded on the sequence (Shard(1), as TiedLinearParallel's input) and the "
        "whole targets on every rank."
    )


def _check_same_call(
    target: torch.Tensor, o: _Options, shard: VocabShard, *, want_x: bool, want_w: bool
) -> None:
    """Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: compare the ranks' calls before any chunk.

    In two all-reduces of their own: the call (a fixed size, so that the second has one size
    on every rank), then the targets, exactly, where forward compares them by a checksum.
    """
    call = _same_call(target.reshape(-1), shard.vocab, o, want_x=want_x, want_w=want_w)
    _raise_unless_same(call, _all_reduce(call.entries, shard, torch.distributed.ReduceOp.MAX))
    if not _agree(target.reshape(-1), shard).all():
        raise _other_tokens(target.numel())


def _join_refused(weight: torch.Tensor, shard: VocabShard | None) -> None:
    """Take part, refused, in the all-reduce in which the other ranks compare their calls.

    A rank whose arguments were refused raises its own error; the ranks whose arguments were
    not wait for it in that all-reduce (the first chunk's, or under DETAIL the check's),
    whose first entry (1 here, 0 there) tells them to raise too.
    """
    if shard is None or torch.compiler.is_compiling():
        return
    size = _CALL_ENTRIES + (0 if _detail() else _FIRST_ROWS)
    refused = torch.zeros(size, dtype=_accumulation_dtype(weight.dtype), device=weight.device)
    refused[0] = True
    _all_reduce(refused, shard, torch.distributed.ReduceOp.MAX)


def _refused_elsewhere() -> ValueError:
    return ValueError(
        "TiedLinear.cross_entropy on a vocabulary-sharded weight: another rank of the "
        "tensor-parallel group refused its arguments (an invalid option, target or input "
        "there), and raised its own error; pass valid arguments, the same, on every rank"
    )


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    shard: VocabShard | None = None,
) -> torch.Tensor:
    """``F.cross_entropy`` of ``F.linear(x, weight)``, plus the z-loss, without the logits.

    With ``shard``, ``weight`` is this rank's rows of the vocabulary and the loss and x's
    gradient are those of the whole vocabulary, reduced over the shard's group; every rank
    must have the same targets and options (``ignore_index``, ``reduction``,
    ``label_smoothing``, ``z_loss``, ``softcap``, the chunk), the same products' dtype and,
    under grad mode, the same ``requires_grad`` of ``x`` and of ``weight``. They are compared
    in the first all-reduce of forward, the targets by a checksum (and, under
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, before it in two all-reduces, the targets exactly): a
    ``ValueError`` on every rank names what differs (not under ``torch.compile``, where the
    check would break the graph). The default chunk comes from the whole vocabulary.

    The logits are widened to float32 from bfloat16 and float16, and soft-capped. The loss
    has the accumulation dtype: float32 when the products run in bfloat16 or float16,
    otherwise their dtype. Arguments are checked before any work. With no gradient
    needed (grad mode off, or neither ``x`` nor ``weight`` requiring grad) only the loss is
    computed.
    """
    try:
        _check_arguments(x, weight, target, reduction, label_smoothing, z_loss, softcap, chunk_size)
        mm = _product_dtype(x, weight)
    except (TypeError, ValueError):
        # The other ranks of a shard wait in the check's first all-reduce: join it, refused.
        _join_refused(weight, shard)
        raise
    target = target.long()
    # From the whole vocabulary, so that every rank of a shard takes the same chunks and its
    # all-reduces have the same sizes, whatever rows it has.
    chunk = chunk_size or default_chunk_size(
        target.numel(), weight.shape[0] if shard is None else shard.vocab, _accumulation_dtype(mm)
    )
    o = _Options(
        ignore_index,
        reduction,
        float(label_smoothing),
        float(z_loss),
        None if softcap is None else float(softcap),
        chunk,
        mm,
        shard,
    )
    grad = torch.is_grad_enabled()
    want_x, want_w = grad and x.requires_grad, grad and weight.requires_grad
    if shard is not None and not torch.compiler.is_compiling():
        # The ranks' calls are compared in forward's first all-reduce, or before it under DETAIL.
        if _detail():
            _check_same_call(target, o, shard, want_x=want_x, want_w=want_w)
        else:
            o = o._replace(check=True)
    args = (x, weight, target, o, want_x, want_w)
    with torch.autocast(x.device.type, enabled=False):
        if torch.compiler.is_compiling():
            return _LinearCrossEntropy.apply(*args)[0]  # type: ignore[no-untyped-call,no-any-return]
        try:
            loss: torch.Tensor = _LinearCrossEntropy.apply(*args)[0]  # type: ignore[no-untyped-call]
        except NotImplementedError as error:
            # Forward-mode AD calls the Function's jvp, which it has not: one of its own would
            # make torch.compile break the graph, so the error is made clear here, eagerly.
            if "jvp" not in str(error):
                raise
            raise RuntimeError(
                "TiedLinear.cross_entropy does not support forward-mode AD (torch.func.jvp, "
                "jacfwd, hessian, torch.autograd.forward_ad); compute the logits with head(x) "
                "and take F.cross_entropy of them"
            ) from error
    return loss
