"""TiedLinear.cross_entropy on several ranks (threads): a vocabulary-sharded weight, and FSDP2.

``RowwiseParallel`` shards the tied embedding on the vocabulary, unevenly (17 rows: 9 and 8).
Each rank's loss and gradients are compared with ``F.cross_entropy`` in one process on the
whole weight, with targets at both ends of every rank's rows, and some ignored.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from tests.nn.models import TiedLM
from tests.nn.ranks import run_threads
from toolkit.nn import TiedLinear

DIM = 8


def _case(vocab: int, world: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """The weight, input (2, 5, DIM), targets and incoming gradient of each token."""
    generator = torch.Generator().manual_seed(vocab)
    weight = torch.randn(vocab, DIM, generator=generator).to(dtype)
    x = torch.randn(2, 5, DIM, generator=generator).to(dtype)
    target = torch.randint(0, vocab, (2, 5), generator=generator)
    rows = -(-vocab // world)  # as torch.chunk splits: the last ranks may have fewer, or none
    ends = sorted({i for r in range(0, vocab, rows) for i in (r, min(r + rows, vocab) - 1)})
    target[0, : len(ends)] = torch.tensor(ends)
    target[1, 1] = -100
    return [weight, x, target, torch.randn(2, 5, generator=generator)]


def _reference(
    weight: torch.Tensor,
    x: torch.Tensor,
    target: torch.Tensor,
    upstream: torch.Tensor,
    *,
    z_loss: float = 0.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    **options: Any,
) -> list[torch.Tensor]:
    """The loss and gradients in one process, from the logits of the whole weight."""
    del chunk_size
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = F.linear(x, weight).float().flatten(0, -2)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    counted = target.flatten() != -100
    loss = F.cross_entropy(logits, target.flatten(), **options)
    extra = torch.where(counted, z_loss * torch.logsumexp(logits, -1).square(), 0.0)
    reduction = options.get("reduction", "mean")
    if reduction == "none":
        loss = (loss + extra).reshape(target.shape)
    else:
        loss = loss + (extra.sum() / counted.sum() if reduction == "mean" else extra.sum())
    loss.backward(upstream if loss.dim() else None)
    return [loss.detach(), x.grad, weight.grad]  # type: ignore[list-item]


def _sharded_embedding(weight: torch.Tensor, mesh: Any) -> nn.Embedding:
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
    issue no DTensor collective: no gather of the weight or of the logits."""
    weight, x, target, upstream = _case(vocab, world, dtype)
    all_reduce, reduced = torch.distributed.all_reduce, []
    monkeypatch.setattr(
        torch.distributed,
        "all_reduce",
        lambda t, **kw: reduced.append(t.shape) or all_reduce(t, **kw),
    )

    def rank_main(rank: int) -> tuple[list[torch.Tensor], dict[Any, int]]:
        emb = _sharded_embedding(weight, init_device_mesh("cpu", (world,)))
        leaf = x.clone().requires_grad_()
        with CommDebugMode() as comm:
            loss = TiedLinear(emb).cross_entropy(leaf, target, **options)
            loss.backward(upstream if loss.dim() else None)
        assert isinstance(emb.weight.grad, DTensor)
        assert emb.weight.grad.placements == (Shard(0),)
        return [loss.detach(), leaf.grad, emb.weight.grad.full_tensor()], comm.get_comm_counts()

    expected = _reference(weight, x, target, upstream, **options)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    for result, collectives in run_threads(world, rank_main):
        for actual, wanted in zip(result, expected, strict=True):
            torch.testing.assert_close(actual, wanted.to(actual.dtype), **tolerance)
        assert not collectives
    assert reduced


def test_an_input_sharded_on_the_sequence_is_gathered_first() -> None:
    """Under sequence parallelism the head's input is a DTensor sharded on the sequence; its
    gradient comes back as the DTensor's, to this rank's part of the input."""
    weight, x, target, _ = _case(17, 2)

    def rank_main(rank: int) -> list[torch.Tensor]:
        mesh = init_device_mesh("cpu", (2,))
        leaf = x.clone().requires_grad_()
        local = leaf.chunk(2, dim=1)[rank]
        given = DTensor.from_local(local, mesh, [Shard(1)], shape=x.shape, stride=x.stride())
        emb = _sharded_embedding(weight, mesh)
        TiedLinear(emb).cross_entropy(given, target, reduction="sum").backward()
        assert isinstance(emb.weight.grad, DTensor)
        return [leaf.grad, emb.weight.grad.full_tensor()]  # type: ignore[list-item]

    expected = _reference(weight, x, target, torch.ones(()), reduction="sum")
    for rank, (grad_x, grad_w) in enumerate(run_threads(2, rank_main)):
        part = slice(0, 3) if rank == 0 else slice(3, 5)
        torch.testing.assert_close(grad_x[:, part], expected[1][:, part])
        torch.testing.assert_close(grad_w, expected[2])


@pytest.mark.parametrize("mistake", ["target-outside-the-vocabulary", "create-graph"])
def test_a_mistake_is_refused_on_every_rank_with_the_fix(mistake: str) -> None:
    weight, x, target, _ = _case(17, 2)
    if mistake == "target-outside-the-vocabulary":
        target[0, 0] = 17  # on no rank's rows

    def rank_main(rank: int) -> str:
        leaf = x.clone().requires_grad_()
        head = TiedLinear(_sharded_embedding(weight, init_device_mesh("cpu", (2,))))
        if mistake.startswith("target"):
            with pytest.raises(IndexError) as info:
                head.cross_entropy(leaf, target)
            return str(info.value)
        loss = head.cross_entropy(leaf, target)
        with pytest.raises(RuntimeError) as info:
            torch.autograd.grad(loss, leaf, create_graph=True)
        return str(info.value)

    for message in run_threads(2, rank_main):
        if mistake.startswith("target"):
            assert "target 17 is out of bounds for a vocabulary of 17" in message
            continue
        assert message.startswith("TiedLinear.cross_entropy on a vocabulary-sharded weight")
        assert "support a backward that builds a graph (create_graph=True, torch.func)" in message
        assert "compute the logits with head(x) and take F.cross_entropy of them inside" in message
        assert message.endswith("inside torch.distributed.tensor.parallel.loss_parallel()")


def test_on_a_dp_by_tp_mesh_only_the_tensor_parallel_group_is_reduced() -> None:
    """2 data-parallel replicas x 2 tensor-parallel ranks, each replica its own batch: a
    statistic reduced over all 4 ranks would be wrong. The logits are in the hundreds, where
    only the largest logit keeps the exponentials finite."""
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(17, DIM, generator=generator) * 30.0
    xs = torch.randn(2, 6, DIM, generator=generator)
    targets = torch.randint(0, 17, (2, 6), generator=generator)
    one = torch.ones(())
    expected = [
        _reference(weight, x, t, one, label_smoothing=0.1) for x, t in zip(xs, targets, strict=True)
    ]

    def rank_main(rank: int) -> list[torch.Tensor]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        replica = mesh.get_local_rank("dp")
        emb = _sharded_embedding(weight, mesh["tp"])
        x = xs[replica].clone().requires_grad_()
        loss = TiedLinear(emb).cross_entropy(x, targets[replica], label_smoothing=0.1)
        loss.backward()
        assert isinstance(emb.weight.grad, DTensor)
        return [loss.detach(), x.grad, emb.weight.grad.full_tensor()]  # type: ignore[list-item]

    for rank, result in enumerate(run_threads(4, rank_main)):
        for actual, wanted in zip(result, expected[rank // 2], strict=True):
            torch.testing.assert_close(actual, wanted, rtol=1e-4, atol=1e-4)


class _LossLM(TiedLM):
    """The loss taken by ``head.cross_entropy`` in the root's forward, or in a method."""

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.head.cross_entropy(self.trunk(idx), target)

    def loss(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.head.cross_entropy(self.trunk(idx), target)


@pytest.mark.parametrize("where", ["forward", "registered-method"])
def test_under_fsdp2_it_trains_as_one_process_inside_a_forward(where: str) -> None:
    """2 ranks, each its own batch, 2 steps of SGD: the losses and the weights are those of one
    process on the whole batch. Outside any forward the weight is sharded, and refused."""
    model = _LossLM()
    idx, target = torch.randint(0, 17, (2, 2, 2, 3)), torch.randint(0, 17, (2, 2, 2, 3))
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    expected = []
    for step in range(2):
        opt.zero_grad()
        emb = reference.trunk[0]
        losses = [
            F.cross_entropy(F.linear(reference.trunk(i), emb.weight).flatten(0, 1), t.flatten())
            for i, t in zip(idx[step], target[step], strict=True)
        ]
        (sum(losses) / 2).backward()
        opt.step()
        expected.append(torch.stack(losses).detach())

    def rank_main(rank: int) -> tuple[str, list[torch.Tensor], dict[str, torch.Tensor]]:
        sharded = fully_shard(copy.deepcopy(model), mesh=init_device_mesh("cpu", (2,)))
        with pytest.raises(RuntimeError) as info:  # before any forward: sharded
            sharded.head.cross_entropy(torch.randn(3, DIM), target[0, rank, 0])
        if where == "registered-method":
            register_fsdp_forward_method(sharded, "loss")
        call = sharded.loss if where == "registered-method" else sharded
        opt = torch.optim.SGD(sharded.parameters(), lr=0.5)
        losses = []
        for step in range(2):
            opt.zero_grad()
            loss = call(idx[step, rank], target[step, rank])
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        state = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
        return str(info.value), losses, state

    for rank, (message, losses, state) in enumerate(run_threads(2, rank_main)):
        assert message.startswith("TiedLinear.cross_entropy cannot use the weight of")
        for fact in ("Embedding(17, 8)", "(Shard(dim=0),)", "register_fsdp_forward_method"):
            assert fact in message
        torch.testing.assert_close(torch.stack(losses), torch.stack(expected)[:, rank])
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, msg=key)
