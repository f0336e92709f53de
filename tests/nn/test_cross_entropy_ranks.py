"""TiedLinear.cross_entropy on threaded ranks: a vocabulary-sharded weight, and FSDP2.

Each rank's results are compared with ``F.cross_entropy`` in one process on the whole weight.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from tests.nn.models import TiedLM
from tests.nn.ranks import run_threads
from tests.nn.sharded_loss_cases import DIFFERENCES, NAMES, call_with_one_difference
from tests.strategies import ignored_targets
from toolkit.nn import TiedLinear

DIM = 8


def _case(
    vocab: int, world: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> list[Tensor]:
    """The weight, input (2, 5, DIM), targets and incoming gradient of each token."""
    generator = torch.Generator().manual_seed(vocab + seed)
    weight = torch.randn(vocab, DIM, generator=generator).to(dtype)
    x = torch.randn(2, 5, DIM, generator=generator).to(dtype)
    target = torch.randint(0, vocab, (2, 5), generator=generator)
    rows = -(-vocab // world)  # as torch.chunk splits: the last ranks may have fewer, or none
    ends = sorted({i for r in range(0, vocab, rows) for i in (r, min(r + rows, vocab) - 1)})
    target[0, : len(ends)] = torch.tensor(ends)
    target[1, 1] = -100
    return [weight, x, target, torch.randn(2, 5, generator=generator)]


def _reference(*case: Tensor, **options: Any) -> list[Tensor]:
    """The loss and gradients in one process, from the logits of the whole weight."""
    weight, x, target, upstream = case
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = F.linear(x, weight).float().flatten(0, -2)
    options.pop("chunk_size", None)
    if (softcap := options.pop("softcap", None)) is not None:
        logits = softcap * torch.tanh(logits / softcap)
    counted = target.flatten() != -100
    lse = torch.logsumexp(logits, -1)
    extra = torch.where(counted, options.pop("z_loss", 0.0) * lse.square(), 0.0)
    loss = F.cross_entropy(logits, target.flatten(), **options)
    reduction = options.get("reduction", "mean")
    if reduction == "none":
        loss = (loss + extra).reshape(target.shape)
    else:
        loss = loss + (extra.sum() / counted.sum() if reduction == "mean" else extra.sum())
    loss.backward(upstream if loss.dim() else None)
    return [loss.detach(), x.grad, weight.grad]  # type: ignore[list-item]


@pytest.fixture(params=[False, True], ids=["default", "detail"])
def detail(request: pytest.FixtureRequest) -> Iterator[bool]:
    """By default, and under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` as torch reads it."""
    before = torch.distributed.get_debug_level()
    debug = torch.distributed.DebugLevel
    torch.distributed.set_debug_level(debug.DETAIL if request.param else debug.OFF)
    yield request.param
    torch.distributed.set_debug_level(before)


def _sharded_embedding(weight: Tensor, mesh: Any) -> nn.Embedding:
    emb = nn.Embedding(*weight.shape, _weight=weight.clone())
    return parallelize_module(emb, mesh, RowwiseParallel(input_layouts=Replicate()))  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("vocab", "world", "dtype", "options"),
    [
        (17, 2, torch.float32, {}),
        (17, 2, torch.float32, {"reduction": "sum", "label_smoothing": 0.2, "chunk_size": 3}),
        (17, 2, torch.float32, {"reduction": "none", "z_loss": 0.05, "softcap": 4.0}),
        (17, 2, torch.float32, {"label_smoothing": 0.1, "z_loss": 0.01, "softcap": 2.0}),
        (17, 2, torch.bfloat16, {"label_smoothing": 0.1, "z_loss": 0.01}),
        (4, 3, torch.float32, {"label_smoothing": 0.1, "z_loss": 0.01, "chunk_size": 2}),  # 2, 2, 0
        (5, 3, torch.float32, {"label_smoothing": 0.1, "z_loss": 0.01, "chunk_size": 2}),  # 2, 2, 1
        (4, 3, torch.float32, {"reduction": "none", "label_smoothing": 0.1, "chunk_size": 2}),
        (17, 2, torch.float32, {"reduction": "sum", "sequence_parallel": True}),
    ],
)
def test_the_loss_and_gradients_on_a_vocabulary_shard_are_those_of_one_process(
    vocab: int,
    world: int,
    dtype: torch.dtype,
    options: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forward and backward reduce per-token statistics and x's gradient with all_reduce, and
    issue no DTensor collective: no gather of the weight or of the logits. Under sequence
    parallelism the input, a DTensor sharded on the sequence, is gathered first, and each
    rank gets the gradient of its part."""
    weight, x, target, upstream = _case(vocab, world, dtype)
    options = dict(options)
    sequence_parallel = options.pop("sequence_parallel", False)
    all_reduce, reduced = torch.distributed.all_reduce, []
    monkeypatch.setattr(
        torch.distributed,
        "all_reduce",
        lambda t, **kw: reduced.append(t.shape) or all_reduce(t, **kw),
    )

    def rank_main(rank: int) -> tuple[list[Tensor], dict[Any, int]]:
        mesh = init_device_mesh("cpu", (world,))
        emb, leaf = _sharded_embedding(weight, mesh), x.clone().requires_grad_()
        given = leaf
        if sequence_parallel:
            part = leaf.chunk(world, dim=1)[rank]
            given = DTensor.from_local(part, mesh, [Shard(1)], shape=x.shape, stride=x.stride())
        with CommDebugMode() as comm:
            loss = TiedLinear(emb).cross_entropy(given, target, **options)
            loss.backward(upstream if loss.dim() else None)
        assert isinstance(emb.weight.grad, DTensor)
        assert emb.weight.grad.placements == (Shard(0),)
        grad_x = leaf.grad.chunk(world, dim=1)[rank] if sequence_parallel else leaf.grad
        return [loss.detach(), grad_x, emb.weight.grad.full_tensor()], comm.get_comm_counts()

    expected = _reference(weight, x, target, upstream, **options)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    for rank, (result, collectives) in enumerate(run_threads(world, rank_main)):
        part = expected[1].chunk(world, dim=1)[rank] if sequence_parallel else expected[1]
        torch.testing.assert_close(result, [expected[0], part, expected[2]], **tolerance)
        assert sequence_parallel or not collectives
    assert reduced


@settings(deadline=None, max_examples=25)
@given(
    ignored=ignored_targets(10),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    extra=st.sampled_from([{}, {"label_smoothing": 0.1, "z_loss": 0.01, "softcap": 2.0}]),
    chunk_size=st.sampled_from([None, 1, 3]),
)
def test_a_vocabulary_shard_gives_one_process_results_whatever_share_is_ignored(
    ignored: list[bool], reduction: str, extra: dict[str, Any], chunk_size: int | None
) -> None:
    """Every rank leaves out the same ignored tokens: none, some or all of them."""
    weight, x, target, upstream = _case(17, 2)
    target = target.flatten().clone()
    target[torch.tensor(ignored)] = -100
    target = target.reshape(2, 5)
    options = {"reduction": reduction, "chunk_size": chunk_size, **extra}
    expected = _reference(weight, x, target, upstream, **options)

    def rank_main(rank: int) -> list[Tensor]:
        emb, leaf = _sharded_embedding(weight, init_device_mesh("cpu", (2,))), x.clone()
        loss = TiedLinear(emb).cross_entropy(leaf.requires_grad_(), target, **options)
        loss.backward(upstream if loss.dim() else None)
        return [loss.detach(), leaf.grad, emb.weight.grad.full_tensor()]  # type: ignore[list-item,union-attr]

    for result in run_threads(2, rank_main):
        torch.testing.assert_close(result, expected, equal_nan=True)


@pytest.mark.parametrize("mistake", ["target-outside-the-vocabulary", "create-graph"])
def test_a_mistake_is_refused_on_every_rank_with_the_fix(mistake: str) -> None:
    weight, x, target, _ = _case(17, 2)
    if mistake == "target-outside-the-vocabulary":
        target[0, 0] = 17  # on no rank's rows

    def rank_main(rank: int) -> tuple[type[BaseException], str]:
        leaf = x.clone().requires_grad_()
        head = TiedLinear(_sharded_embedding(weight, init_device_mesh("cpu", (2,))))
        with pytest.raises((IndexError, RuntimeError)) as info:
            torch.autograd.grad(head.cross_entropy(leaf, target), leaf, create_graph=True)
        return info.type, str(info.value)

    for error, message in run_threads(2, rank_main):
        if mistake.startswith("target"):
            assert error is IndexError
            assert "target 17 is out of bounds for a vocabulary of 17" in message
            continue
        assert error is RuntimeError
        assert message.startswith("TiedLinear.cross_entropy on a vocabulary-sharded weight")
        assert "support a backward that builds a graph (create_graph=True, torch.func)" in message
        assert "compute the logits with head(x) and take F.cross_entropy of them inside" in message
        assert message.endswith("inside torch.distributed.tensor.parallel.loss_parallel()")


def test_on_a_dp_by_tp_mesh_only_the_tensor_parallel_group_is_reduced() -> None:
    """2 data-parallel replicas x 2 tensor-parallel ranks, each its own batch, logits in the
    hundreds (only the largest keeps exponentials finite): reduced over 4 ranks, it fails."""
    weight = _case(17, 2)[0] * 30.0
    batches = [_case(17, 2, seed=seed)[1:3] for seed in (1, 2)]
    expected = [_reference(weight, x, t, torch.ones(()), label_smoothing=0.1) for x, t in batches]

    def rank_main(rank: int) -> list[Tensor]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        emb = _sharded_embedding(weight, mesh["tp"])
        x, target = batches[mesh.get_local_rank("dp")]
        leaf = x.clone().requires_grad_()
        TiedLinear(emb).cross_entropy(leaf, target, label_smoothing=0.1).backward()
        assert isinstance(emb.weight.grad, DTensor)
        return [leaf.grad, emb.weight.grad.full_tensor()]  # type: ignore[list-item]

    for rank, result in enumerate(run_threads(4, rank_main)):
        torch.testing.assert_close(result, expected[rank // 2][1:], rtol=1e-4, atol=1e-4)


class _LossLM(TiedLM):
    """The loss taken by ``head.cross_entropy`` in the root's forward, or in a method."""

    def forward(self, idx: Tensor, target: Tensor) -> Tensor:  # type: ignore[override]
        return self.head.cross_entropy(self.trunk(idx), target)

    loss = forward


def _sgd(loss_of: Callable[[int], Tensor], model: nn.Module) -> list[Tensor]:
    """The losses of two steps of SGD on ``loss_of(step)``."""
    opt, losses = torch.optim.SGD(model.parameters(), lr=0.5), []
    for step in range(2):
        opt.zero_grad()
        losses.append(loss_of(step))
        losses[-1].backward()
        opt.step()
    return [loss.detach() for loss in losses]


@pytest.mark.parametrize("where", ["forward", "registered-method"])
def test_under_fsdp2_it_trains_as_one_process_inside_a_forward(where: str) -> None:
    """2 ranks, each its own batch: the losses and the weights are those of one process on the
    whole batch. Outside any forward the weight is sharded, and refused with the fix."""
    model = _LossLM()
    idx, target = torch.randint(0, 17, (2, 2, 2, 3)), torch.randint(0, 17, (2, 2, 2, 3))
    ref = copy.deepcopy(model)

    def plain(step: int, rank: int) -> Tensor:
        logits = F.linear(ref.trunk(idx[step, rank]), ref.trunk[0].weight)
        return F.cross_entropy(logits.flatten(0, 1), target[step, rank].flatten())

    expected = _sgd(lambda step: (plain(step, 0) + plain(step, 1)) / 2, ref)

    def rank_main(rank: int) -> tuple[str, list[Tensor], dict[str, Tensor]]:
        sharded: Any = fully_shard(copy.deepcopy(model), mesh=init_device_mesh("cpu", (2,)))
        with pytest.raises(RuntimeError) as info:  # before any forward: sharded
            sharded.head.cross_entropy(torch.randn(3, DIM), target[0, rank, 0])
        if where == "registered-method":
            register_fsdp_forward_method(sharded, "loss")
        call = sharded.loss if where == "registered-method" else sharded
        losses = _sgd(lambda step: call(idx[step, rank], target[step, rank]), sharded)
        return (
            str(info.value),
            losses,
            {k: v.full_tensor() for k, v in sharded.state_dict().items()},
        )

    results = run_threads(2, rank_main)
    for message, _, state in results:
        assert message.startswith("TiedLinear.cross_entropy cannot use the weight of")
        for fact in ("Embedding(17, 8)", "(Shard(dim=0),)", "register_fsdp_forward_method"):
            assert fact in message
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(state[key], value, msg=key)
    means = [(a + b) / 2 for a, b in zip(results[0][1], results[1][1], strict=True)]
    torch.testing.assert_close(means, expected)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_a_replicated_weight_gives_the_loss_and_gradients_of_one_process(
    mesh_shape: tuple[int, ...],
) -> None:
    """A weight replicated on every mesh dimension is whole on every rank: the loss is that of
    its local tensor, and the weight's gradient a DTensor with the same placements. Replicated
    on one dimension and sharded on another, it is refused on every rank with the fix."""
    weight, x, target, _ = _case(17, 2)
    expected = _reference(weight, x, target, torch.ones(()), label_smoothing=0.1)
    world = len(mesh_shape) * 2

    def rank_main(rank: int) -> tuple[list[Tensor], tuple[Any, ...], str]:
        mesh = init_device_mesh("cpu", mesh_shape)
        emb = nn.Embedding(17, DIM, _weight=weight.clone())
        emb.weight = nn.Parameter(distribute_tensor(weight, mesh, [Replicate()] * len(mesh_shape)))
        leaf = x.clone().requires_grad_()
        TiedLinear(emb).cross_entropy(leaf, target, label_smoothing=0.1).backward()
        grad = emb.weight.grad
        assert isinstance(grad, DTensor)
        message = ""
        if len(mesh_shape) == 2:
            emb.weight = nn.Parameter(distribute_tensor(weight, mesh, [Replicate(), Shard(0)]))
            with pytest.raises(RuntimeError) as info:
                TiedLinear(emb).cross_entropy(leaf, target)
            message = str(info.value)
        return [leaf.grad, grad.to_local()], tuple(grad.placements), message  # type: ignore[list-item]

    for grads, placements, message in run_threads(world, rank_main):
        torch.testing.assert_close(grads, expected[1:])
        assert placements == (Replicate(),) * len(mesh_shape)
        if len(mesh_shape) == 2:
            assert "(Replicate(), Shard(dim=0))" in message
            assert "Replicate()), or the vocabulary sharded" in message


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_shard_reduces_twice_a_chunk_and_x_gradient_once(
    reduction: str, detail: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """10 tokens, 9 counted, in chunks of 3: two all-reduces a chunk in forward and one of x's
    gradient (under DETAIL, two of the check's before them). By default the call's check rides
    the first alone, padded to 1,024 tokens. A mean computes x's gradient in forward;
    ``reduction="none"`` keeps each token's 3 statistics for backward, which takes the softmax
    from them, and reduces only x's gradient. The loss and gradients are one process's."""
    weight, x, target, upstream = _case(17, 2)
    all_reduce, calls = torch.distributed.all_reduce, []
    monkeypatch.setattr(
        torch.distributed,
        "all_reduce",
        lambda t, **kw: calls.append((threading.get_ident(), t.numel())) or all_reduce(t, **kw),
    )

    def rank_main(rank: int) -> tuple[list[Tensor], list[int], list[int], list[tuple[int, ...]]]:
        head = TiedLinear(_sharded_embedding(weight, init_device_mesh("cpu", (2,))))
        leaf, me, kept = x.clone().requires_grad_(), threading.get_ident(), []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda saved: kept.append(tuple(saved.shape)) or saved, lambda saved: saved
        ):
            loss = head.cross_entropy(leaf, target, reduction=reduction, chunk_size=3)
        sizes = [numel for ident, numel in calls if ident == me]
        loss.backward(upstream if loss.dim() else None)
        counts = [len(sizes), sum(ident == me for ident, _ in calls) - len(sizes)]
        grad_w = head.weight.grad.full_tensor()  # type: ignore[union-attr]
        return [loss.detach(), leaf.grad, grad_w], counts, sizes, kept  # type: ignore[list-item]

    expected = _reference(weight, x, target, upstream, reduction=reduction)
    forward, backward = (7, 0) if reduction == "mean" else (6, 1)
    for result, counts, sizes, kept in run_threads(2, rank_main):
        torch.testing.assert_close(result, expected)
        assert counts == [forward + 2 * detail, backward]
        assert [size > 1024 for size in sizes] == [not detail] + [False] * (len(sizes) - 1)
        assert ((3, 10) in kept) == (reduction == "none")


def test_the_default_chunk_is_the_same_on_ranks_with_uneven_rows() -> None:
    """33,555 rows split 16,778 + 16,777: the 64 MiB logits budget gives 999 and 1,000 tokens a
    chunk if taken from each rank's rows. Taken from the whole vocabulary, every rank issues
    the same all-reduces, and the loss is one process's."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(33_555, 1, generator=generator)
    x = torch.randn(1001, 1, generator=generator)
    target = torch.randint(0, 33_555, (1001,), generator=generator)
    expected = F.cross_entropy(F.linear(x, weight), target)

    def rank_main(rank: int) -> Tensor:
        head = TiedLinear(_sharded_embedding(weight, init_device_mesh("cpu", (2,))))
        with torch.no_grad():
            return head.cross_entropy(x, target)

    for loss in run_threads(2, rank_main):
        torch.testing.assert_close(loss, expected)


def test_rank_local_tokens_on_a_vocabulary_shard_are_refused_on_every_rank(
    detail: bool,
) -> None:
    """Under sequence parallelism each rank's slice of the hidden states with its slice of the
    targets would mix different tokens' statistics: refused on every rank, naming the fix,
    before any gradient is computed, whether the chunk differs too or not, by default (in the
    first all-reduce) and under DETAIL (before it). Ranks with the same tokens are taken."""
    weight, x, target, _ = _case(17, 2)

    def rank_main(rank: int) -> tuple[list[str], Any]:
        head = TiedLinear(_sharded_embedding(weight, init_device_mesh("cpu", (2,))))
        messages = []
        values, counts = slice(rank * 2, rank * 2 + 2), slice(0, 2 + rank)
        for tokens, chunk in ((values, None), (counts, None), (counts, 2)):
            leaf = x[:, tokens].clone().requires_grad_()
            with pytest.raises(ValueError, match="every rank") as info:
                head.cross_entropy(leaf, target[:, tokens], chunk_size=chunk)
            assert leaf.grad is None
            messages.append(str(info.value))
        head.cross_entropy(x, target).backward()  # the same tokens: taken
        return messages, head.tied_module.weight.grad

    for messages, grad in run_threads(2, rank_main):
        assert grad is not None
        by_values = messages[0]
        for message in messages:
            assert message.startswith("TiedLinear.cross_entropy on a vocabulary-sharded weight")
            assert message.endswith("and the whole targets on every rank.")
            assert "same tokens and targets on every rank" in message
            assert "DTensor sharded on the sequence (Shard(1)" in message
        assert by_values == (  # the one whole-message check of this error
            "TiedLinear.cross_entropy on a vocabulary-sharded weight needs the same tokens and "
            "targets on every rank of the tensor-parallel group, but the ranks' targets differ "
            "(this rank has 4 tokens): each rank's rows of the vocabulary give a part of every "
            "token's statistics, which are summed across ranks. Under sequence parallelism "
            "pass the hidden states as a DTensor sharded on the sequence (Shard(1), as "
            "TiedLinearParallel's input) and the whole targets on every rank."
        )


def _refused_targets(
    weight: Tensor, x: Tensor, targets: Callable[[int], Tensor]
) -> list[tuple[str, Tensor | None]]:
    """Each rank's message and weight gradient after its call with ``targets(rank)`` is refused."""

    def rank_main(rank: int) -> tuple[str, Tensor | None]:
        head = TiedLinear(_sharded_embedding(weight, init_device_mesh("cpu", (2,))))
        with pytest.raises(ValueError, match="every rank") as info:
            head.cross_entropy(x.clone().requires_grad_(), targets(rank))
        return str(info.value), head.tied_module.weight.grad

    return run_threads(2, rank_main)


@pytest.mark.parametrize("position", [0, 9])
def test_targets_that_differ_in_one_position_are_refused_on_every_rank(
    position: int, detail: bool
) -> None:
    """The same number of tokens and of counted tokens, one target different on rank 1: the
    checksum of the first all-reduce tells them apart (under DETAIL, the exact comparison)."""
    weight, x, target, _ = _case(17, 2)

    def targets(rank: int) -> Tensor:
        mine = target.clone()
        mine.view(-1)[position] = (mine.view(-1)[position] + rank) % 17
        return mine

    for message, grad in _refused_targets(weight, x, targets):
        assert "same tokens and targets on every rank" in message
        assert grad is None


# Rank 0's and rank 1's first two targets (-100: ignored), the same number of them counted.
TWO_POSITIONS = {
    "two-targets": ([0, 8], [4, 7]),
    "two-other-targets": ([0, 8], [2, 7]),
    "ignored-and-1-swapped": ([-100, 1], [1, -100]),
    "ignored-moved": ([-100, 0], [4, -100]),
}


@pytest.mark.parametrize("case", TWO_POSITIONS)
def test_targets_that_differ_in_two_positions_are_refused_on_every_rank(
    case: str, detail: bool
) -> None:
    """Two targets differ, or a target and an ignored token, with the same number of tokens
    and of counted tokens: refused on every rank, by default by the checksum of the first
    all-reduce (under DETAIL, the exact comparison)."""
    weight, x, target, _ = _case(17, 2)

    def targets(rank: int) -> Tensor:
        mine = target.clone()
        mine.view(-1)[:2] = torch.tensor(TWO_POSITIONS[case][rank])
        return mine

    for message, grad in _refused_targets(weight, x, targets):
        assert "same tokens and targets on every rank" in message
        assert grad is None


def test_an_ignore_index_that_differs_in_any_one_bit_is_refused_on_every_rank(
    detail: bool,
) -> None:
    """Rank 1's ignore_index is rank 0's -100 with one of its 64 bits flipped, no target
    ignored on either: refused on every rank, naming ignore_index, for each bit."""
    weight, x, target, _ = _case(17, 2)
    target[1, 1] = 5  # no target is ignored
    flipped = [((-100 % 2**64) ^ (1 << bit)) for bit in range(64)]
    values = [value - 2**64 if value >= 2**63 else value for value in flipped]

    def rank_main(rank: int) -> list[str]:
        head = TiedLinear(_sharded_embedding(weight, init_device_mesh("cpu", (2,))))
        messages = []
        for value in values:
            with torch.no_grad(), pytest.raises(ValueError) as info:  # noqa: PT011 - checked below
                head.cross_entropy(x, target, ignore_index=value if rank else -100)
            messages.append(str(info.value))
        return messages

    for rank, messages in enumerate(run_threads(2, rank_main)):
        for value, message in zip(values, messages, strict=True):
            shown = value if rank else -100
            assert [name for name in NAMES if f"{name} (" in message] == ["ignore_index"]
            assert f"the ranks' ignore_index ({shown} here) differ" in message


@pytest.mark.parametrize("detail", [True], ids=["detail"], indirect=True)
def test_targets_of_the_same_checksum_are_refused_on_every_rank_under_detail(
    detail: bool,
) -> None:
    """Rank 1's first two targets, 0 and 8, are 3 and 7: the same number of tokens, of counted
    tokens and the same checksum (3 more at weight 1, 1 less at weight 3). Under DETAIL the
    targets are also compared exactly: refused on every rank, with this rank's tokens."""
    weight, x, target, _ = _case(17, 2)
    assert target.view(-1)[:2].tolist() == [0, 8]

    def targets(rank: int) -> Tensor:
        mine = target.clone()
        mine.view(-1)[:2] += torch.tensor([3, -1]) * rank
        return mine

    for message, grad in _refused_targets(weight, x, targets):
        assert "same tokens and targets on every rank" in message
        assert "but the ranks' targets differ (this rank has 10 tokens):" in message
        assert grad is None


def test_targets_swapped_between_two_far_positions_are_refused_on_every_rank() -> None:
    """Two targets swapped between positions 2**20 apart on one rank: the same count, counted
    count and sum of targets. The checksum's weights of the positions differ, so it tells the
    ranks apart by default, where a mix of the two tokens' statistics would be silent."""
    weight, far = _case(17, 2)[0], 2**20
    x = torch.randn(1, DIM).expand(far + 1, DIM)  # one row, seen at every position

    def rank_main(rank: int) -> str:
        head = TiedLinear(_sharded_embedding(weight, init_device_mesh("cpu", (2,))))
        target = torch.full((far + 1,), -100)
        target[0], target[far] = (3, 5) if rank == 0 else (5, 3)
        with torch.no_grad(), pytest.raises(ValueError, match="every rank") as info:
            head.cross_entropy(x, target)
        return str(info.value)

    for message in run_threads(2, rank_main):
        assert "same tokens and targets on every rank" in message


@pytest.mark.parametrize("case", DIFFERENCES)
def test_an_option_that_differs_on_a_vocabulary_shard_is_refused_on_every_rank(
    case: str, detail: bool
) -> None:
    """Ranks that differ in an option would hang (another chunk, or a gradient of x reduced on
    one rank only) or silently mix their statistics (another softcap, dtype, label_smoothing,
    z_loss or reduction): refused with a ValueError on every rank, before any gradient, naming
    what differs and nothing else; the targets differ too, and the options are said."""
    weight, x, target, _ = _case(17, 2)

    def rank_main(rank: int) -> tuple[type[BaseException], str, Tensor | None]:
        head = TiedLinear(_sharded_embedding(weight, init_device_mesh("cpu", (2,))))
        with pytest.raises(ValueError) as info:  # noqa: PT011 - the message is checked below
            call_with_one_difference(head, x, target.roll(rank), case)
        return info.type, str(info.value), head.tied_module.weight.grad

    named = DIFFERENCES[case]
    results = run_threads(2, rank_main)
    for error, message, grad in results:
        assert error is ValueError
        assert grad is None
        assert [name for name in NAMES if f"{name} (" in message] == list(named)
    if case == "grad-mode":
        assert results[1][1] == (  # the one whole-message check of this error
            "TiedLinear.cross_entropy on a vocabulary-sharded weight needs the same options, "
            "dtype and requires_grad on every rank of the tensor-parallel group, but the ranks' "
            "x.requires_grad (False here) and weight.requires_grad (False here) differ: pass "
            "the same ones on every rank (requires_grad counts under grad mode only)."
        )


# An argument one rank's own check refuses: its keyword arguments, or a change of x or target.
REFUSED: dict[str, tuple[type[Exception], Any]] = {
    "label_smoothing-nan": (ValueError, {"label_smoothing": float("nan")}),
    "softcap-nan": (ValueError, {"softcap": float("nan")}),
    "chunk_size-0": (ValueError, {"chunk_size": 0}),
    "reduction-unknown": (ValueError, {"reduction": "max"}),
    "x-float64": (TypeError, "x"),
    "target-float": (TypeError, "target"),
}


@pytest.mark.parametrize("on_both", [False, True], ids=["one-rank", "both-ranks"])
@pytest.mark.parametrize("case", REFUSED)
def test_an_argument_refused_on_one_rank_is_refused_on_every_rank(
    case: str, on_both: bool, detail: bool
) -> None:
    """The rank whose argument is invalid raises its own error; the others, which would wait
    for it in the all-reduce that compares the calls, raise a ValueError instead of hanging."""
    weight, x, target, _ = _case(17, 2)
    error, change = REFUSED[case]

    def rank_main(rank: int) -> tuple[type[BaseException], str]:
        head = TiedLinear(_sharded_embedding(weight, init_device_mesh("cpu", (2,))))
        wrong = on_both or rank == 1
        args, options = (x, target), {}
        if wrong and change == "x":
            args = (x.double(), target)
        elif wrong and change == "target":
            args = (x, target.float())
        elif wrong:
            options = change
        with pytest.raises((TypeError, ValueError)) as info:
            head.cross_entropy(*args, **options)
        return info.type, str(info.value)

    results = run_threads(2, rank_main)
    assert [kind for kind, _ in results] == ([error, error] if on_both else [ValueError, error])
    if case == "chunk_size-0" and not on_both:
        assert results[0][1] == (  # the one whole-message check of this error
            "TiedLinear.cross_entropy on a vocabulary-sharded weight: another rank of the "
            "tensor-parallel group refused its arguments (an invalid option, target or input "
            "there), and raised its own error; pass valid arguments, the same, on every rank"
        )


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_an_argument_refused_on_one_rank_is_refused_on_every_rank_in_any_dtype(
    dtype: torch.dtype, detail: bool
) -> None:
    """The refused rank joins the all-reduce of the others' calls with their dtype, that of
    the products' accumulation (float64, or float32 for bfloat16): gloo and NCCL need one."""
    weight, x, target, _ = _case(17, 2, dtype)

    def rank_main(rank: int) -> tuple[type[BaseException], str]:
        head = TiedLinear(_sharded_embedding(weight, init_device_mesh("cpu", (2,))))
        with pytest.raises(ValueError) as info:  # noqa: PT011 - the message is checked below
            head.cross_entropy(x.clone().requires_grad_(), target, chunk_size=0 if rank else None)
        return info.type, str(info.value)

    (first, other), (refused, own) = run_threads(2, rank_main)
    assert (first, refused) == (ValueError, ValueError)
    assert other.startswith("TiedLinear.cross_entropy on a vocabulary-sharded weight: another rank")
    assert own.startswith("cross_entropy chunk_size must be a positive int")


def test_a_default_device_leaves_a_vocabulary_shard_on_its_tensors_device(detail: bool) -> None:
    """Under a default-device context (``with torch.device("meta")``, as for deferred init)
    the loss is computed where its tensors are: one process's loss and gradients; an
    argument refused on one rank is refused on every rank, in all-reduces of the weight's
    device (a meta tensor has no data to send; on a GPU, NCCL needs the GPU's); and targets
    swapped between two positions on one rank are refused on every rank."""
    weight, x, target, _ = _case(17, 2)
    expected = _reference(weight, x, target, torch.ones(()))

    def rank_main(rank: int) -> tuple[list[Tensor], str]:
        head = TiedLinear(_sharded_embedding(weight, init_device_mesh("cpu", (2,))))
        leaf = x.clone().requires_grad_()
        with torch.device("meta"):
            loss = head.cross_entropy(leaf, target)
            loss.backward()
            with pytest.raises(ValueError) as info:  # noqa: PT011 - the message is checked below
                head.cross_entropy(leaf, target, chunk_size=0 if rank else None)
            swapped = target.clone()  # on rank 1, its first two targets swapped
            swapped.view(-1)[:2] = target.view(-1)[:2].flip(0) if rank else target.view(-1)[:2]
            with pytest.raises(ValueError, match="same tokens and targets on every rank"):
                head.cross_entropy(leaf, swapped)
        grads = [leaf.grad, head.tied_module.weight.grad.full_tensor()]
        return [loss.detach(), *grads], str(info.value)

    (result0, other), (result1, own) = run_threads(2, rank_main)
    for got in (result0, result1):
        torch.testing.assert_close(got, expected)
    assert other.startswith("TiedLinear.cross_entropy on a vocabulary-sharded weight: another rank")
    assert own.startswith("cross_entropy chunk_size must be a positive int")


def test_the_same_options_however_written_are_taken_on_a_vocabulary_shard() -> None:
    """``-0.0`` is ``0.0``, and no chunk_size the default chunk: the loss is one process's."""
    weight, x, target, _ = _case(17, 2)
    expected = _reference(weight, x, target, torch.ones(()))
    written = ({"label_smoothing": 0.0, "z_loss": -0.0}, {"label_smoothing": -0.0, "z_loss": 0.0})

    def rank_main(rank: int) -> list[Tensor]:
        head = TiedLinear(_sharded_embedding(weight, init_device_mesh("cpu", (2,))))
        leaf = x.clone().requires_grad_()
        chunk = {"chunk_size": 10} if rank else {}  # 10 tokens: the default is one chunk
        loss = head.cross_entropy(leaf, target, **written[rank], **chunk)
        loss.backward()
        return [loss.detach(), leaf.grad, head.tied_module.weight.grad.full_tensor()]

    for result in run_threads(2, rank_main):
        torch.testing.assert_close(result, expected)


@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
def test_on_a_vocabulary_shard_it_compiles_in_one_graph() -> None:
    """Under torch.compile(fullgraph=True) the same-targets check is not made: the loss and
    gradients are still those of one process."""
    weight, x, target, _ = _case(17, 2)
    expected = _reference(weight, x, target, torch.ones(()))

    def rank_main(rank: int) -> list[Tensor]:
        head = TiedLinear(_sharded_embedding(weight, init_device_mesh("cpu", (2,))))
        compiled = torch.compile(
            lambda x: head.cross_entropy(x, target, chunk_size=3), fullgraph=True, backend="eager"
        )
        leaf = x.clone().requires_grad_()
        loss = compiled(leaf)
        loss.backward()
        return [loss.detach(), leaf.grad, head.tied_module.weight.grad.full_tensor()]

    for result in run_threads(2, rank_main):
        torch.testing.assert_close(result, expected)
