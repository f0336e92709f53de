"""TiedLinear.cross_entropy on a vocabulary-sharded weight, on two ranks of one process.

The tied embedding is sharded on the vocabulary by ``RowwiseParallel`` (``Shard(0)``) on a 1-D
tensor-parallel mesh; a vocabulary of 17 splits unevenly, 9 rows and 8. Each rank computes the
loss from its own rows, and every result (loss, the input's gradient, the whole weight's
gradient) is compared with the same loss in one process on the whole weight. The targets fall
in both ranks' rows, and some are ignored.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from tests.nn.ranks import RanksFailedError, run_threads
from toolkit.nn import TiedLinear

VOCAB, DIM, WORLD = 17, 8, 2
OPTIONS: list[dict[str, Any]] = [
    {"reduction": "mean"},
    {"reduction": "sum", "label_smoothing": 0.2, "chunk_size": 3},
    {"reduction": "none", "z_loss": 0.05, "softcap": 4.0, "chunk_size": 4},
    {"reduction": "mean", "label_smoothing": 0.1, "z_loss": 0.01, "softcap": 2.0},
]


class _Case:
    """The embedding, input, targets and incoming gradient, drawn in the calling thread."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        generator = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM, dtype=dtype)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(VOCAB, DIM, generator=generator))
        self.x = torch.randn(2, 5, DIM, generator=generator).to(dtype)
        self.target = torch.randint(0, VOCAB, (2, 5), generator=generator)
        self.target[0, :4] = torch.tensor([0, 8, 9, 16])  # both ends of both ranks' rows
        self.target[1, 1] = -100
        self.upstream = torch.randn(2, 5, generator=generator)

    def grad_of(self, loss: torch.Tensor) -> torch.Tensor:
        return self.upstream if loss.dim() else torch.tensor(1.0)

    def reference(self, **options: Any) -> list[torch.Tensor]:
        """The loss and gradients in one process, from the logits of the whole weight."""
        weight = self.emb.weight.detach().clone().requires_grad_()
        x = self.x.clone().requires_grad_()
        logits = F.linear(x, weight).float()
        if (cap := options.get("softcap")) is not None:
            logits = cap * torch.tanh(logits / cap)
        reduction = options.get("reduction", "mean")
        loss = F.cross_entropy(
            logits.transpose(1, 2),
            self.target,
            reduction=reduction,
            label_smoothing=options.get("label_smoothing", 0.0),
        )
        counted = self.target != -100
        extra = torch.where(counted, torch.logsumexp(logits, -1).square(), 0.0)
        extra = extra * options.get("z_loss", 0.0)
        if reduction == "none":
            loss = loss + extra
        else:
            loss = loss + (extra.sum() / counted.sum() if reduction == "mean" else extra.sum())
        loss.backward(self.grad_of(loss))
        assert x.grad is not None
        assert weight.grad is not None
        return [loss.detach(), x.grad, weight.grad]

    def sharded_head(self) -> TiedLinear:
        """This rank's head, its embedding sharded on the vocabulary."""
        mesh = init_device_mesh("cpu", (WORLD,))
        emb = copy.deepcopy(self.emb)
        parallelize_module(emb, mesh, RowwiseParallel(input_layouts=Replicate()))
        return TiedLinear(emb)

    def on_rank(self, x_placement: Shard | None = None, **options: Any) -> list[torch.Tensor]:
        """This rank's loss and gradients, the input whole or a DTensor ``x_placement``."""
        head = self.sharded_head()
        x = self.x.clone().requires_grad_()
        given: torch.Tensor = x
        if x_placement is not None:
            given = DTensor.from_local(
                x.chunk(WORLD, dim=x_placement.dim)[torch.distributed.get_rank()],
                head.weight.device_mesh,  # type: ignore[attr-defined]
                [x_placement],
                shape=x.shape,
                stride=x.stride(),
            )
        loss = head.cross_entropy(given, self.target, **options)
        loss.backward(self.grad_of(loss))
        assert x.grad is not None
        assert isinstance(head.weight.grad, DTensor)
        assert head.weight.grad.placements == (Shard(0),)
        return [loss.detach(), x.grad, head.weight.grad.full_tensor()]


@pytest.mark.parametrize("options", OPTIONS)
def test_the_loss_and_gradients_on_a_vocabulary_shard_are_those_of_one_process(
    options: dict[str, Any],
) -> None:
    case = _Case()
    expected = case.reference(**options)
    for result in run_threads(WORLD, lambda rank: case.on_rank(**options)):
        for actual, wanted in zip(result, expected, strict=True):
            torch.testing.assert_close(actual, wanted)


def test_an_input_sharded_on_the_sequence_is_gathered_first() -> None:
    """Under sequence parallelism the head's input is a DTensor sharded on the sequence; its
    gradient comes back as the DTensor's, to this rank's part of the input."""
    case = _Case()
    expected = case.reference(reduction="sum")
    for rank, result in enumerate(
        run_threads(WORLD, lambda rank: case.on_rank(Shard(1), reduction="sum"))
    ):
        torch.testing.assert_close(result[0], expected[0])
        part = slice(0, 3) if rank == 0 else slice(3, 5)
        torch.testing.assert_close(result[1][:, part], expected[1][:, part])
        torch.testing.assert_close(result[2], expected[2])


def test_bfloat16_on_a_vocabulary_shard_matches_one_process() -> None:
    case = _Case(torch.bfloat16)
    options = {"label_smoothing": 0.1, "z_loss": 0.01}
    expected = case.reference(**options)
    for result in run_threads(WORLD, lambda rank: case.on_rank(**options)):
        for actual, wanted in zip(result, expected, strict=True):
            torch.testing.assert_close(actual, wanted, rtol=2e-2, atol=2e-2)


def test_a_target_outside_the_whole_vocabulary_is_refused_on_every_rank() -> None:
    case = _Case()
    case.target[0, 0] = VOCAB

    def rank_main(rank: int) -> None:
        case.sharded_head().cross_entropy(case.x, case.target)

    with pytest.raises(RanksFailedError) as info:
        run_threads(WORLD, rank_main)
    assert type(info.value.__cause__) is IndexError
    assert f"vocabulary of {VOCAB}" in str(info.value.__cause__)


def test_a_backward_that_builds_a_graph_is_refused_on_every_rank() -> None:
    case = _Case()

    def rank_main(rank: int) -> str:
        x = case.x.clone().requires_grad_()
        loss = case.sharded_head().cross_entropy(x, case.target)
        with pytest.raises(RuntimeError) as info:
            torch.autograd.grad(loss, x, create_graph=True)
        return str(info.value)

    for message in run_threads(WORLD, rank_main):
        for fact in (
            "TiedLinear.cross_entropy on a vocabulary-sharded weight does not support a "
            "backward that builds a graph (create_graph=True, torch.func)",
            "compute the logits with head(x) and take F.cross_entropy of them inside "
            "torch.distributed.tensor.parallel.loss_parallel()",
        ):
            assert fact in message


@pytest.mark.parametrize("vocab", [4, 5])
def test_a_rank_with_one_row_or_none_of_the_vocabulary_takes_part(vocab: int) -> None:
    """A vocabulary of 4 on 3 ranks: 2 rows, 2 rows and none; of 5: 2, 2 and 1."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(vocab, DIM, generator=generator)
    x = torch.randn(5, DIM, generator=generator)
    target = torch.tensor([0, 3, -100, 1, 2])
    options: dict[str, Any] = {"label_smoothing": 0.1, "z_loss": 0.01, "chunk_size": 2}
    x_ref, w_ref = x.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = F.linear(x_ref, w_ref)
    expected = F.cross_entropy(logits, target, label_smoothing=0.1) + 0.01 * (
        torch.logsumexp(logits, 1)[target != -100].square().mean()
    )
    expected.backward()

    def rank_main(rank: int) -> list[torch.Tensor]:
        mesh = init_device_mesh("cpu", (3,))
        emb = nn.Embedding(vocab, DIM)
        with torch.no_grad():
            emb.weight.copy_(weight)
        parallelize_module(emb, mesh, RowwiseParallel(input_layouts=Replicate()))
        assert emb.weight.to_local().shape[0] == (2, 2, vocab - 4)[rank]
        x_rank = x.clone().requires_grad_()
        loss = TiedLinear(emb).cross_entropy(x_rank, target, **options)
        loss.backward()
        assert x_rank.grad is not None
        assert isinstance(emb.weight.grad, DTensor)
        return [loss.detach(), x_rank.grad, emb.weight.grad.full_tensor()]

    for result in run_threads(3, rank_main):
        for actual, wanted in zip(result, [expected.detach(), x_ref.grad, w_ref.grad], strict=True):
            torch.testing.assert_close(actual, wanted)


def test_on_a_dp_by_tp_mesh_only_the_tensor_parallel_group_is_reduced() -> None:
    """4 ranks as 2 data-parallel replicas x 2 tensor-parallel ranks: each replica has its own
    batch, so a statistic reduced over all 4 ranks instead of its 2 would be wrong. The
    logits are in the hundreds, where only the largest logit keeps the exponentials finite."""
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(VOCAB, DIM, generator=generator) * 30.0
    xs = torch.randn(2, 6, DIM, generator=generator)
    targets = torch.randint(0, VOCAB, (2, 6), generator=generator)
    expected = []
    for batch, target in zip(xs, targets, strict=True):
        x, w = batch.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = F.cross_entropy(F.linear(x, w), target, label_smoothing=0.1)
        loss.backward()
        expected.append([loss.detach(), x.grad, w.grad])

    def rank_main(rank: int) -> list[torch.Tensor]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        replica = mesh.get_local_rank("dp")
        emb = nn.Embedding(VOCAB, DIM)
        with torch.no_grad():
            emb.weight.copy_(weight)
        parallelize_module(emb, mesh["tp"], RowwiseParallel(input_layouts=Replicate()))
        x = xs[replica].clone().requires_grad_()
        loss = TiedLinear(emb).cross_entropy(x, targets[replica], label_smoothing=0.1)
        loss.backward()
        assert x.grad is not None
        assert isinstance(emb.weight.grad, DTensor)
        return [loss.detach(), x.grad, emb.weight.grad.full_tensor()]

    for rank, result in enumerate(run_threads(4, rank_main)):
        assert bool(result[0].isfinite())
        for actual, wanted in zip(result, expected[rank // 2], strict=True):
            torch.testing.assert_close(actual, wanted, rtol=1e-4, atol=1e-4)
