"""A tiny tied language model, its untied single-process reference, data and reference training.

``TinyLM`` ends in a :class:`~toolkit.nn.TiedLinear` head. ``ReferenceLM`` has the same
parameters under the same names but computes its logits with ``F.linear(h, emb.weight)`` itself,
so the expected values never come from the code under test. The vocabulary, 17, is divisible by
no world size the tests use, so every sharding is uneven.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.nn import ModuleDefaultDict, TiedLinear

VOCAB = 17
DIM = 8
ROWS_PER_RANK = 2
SEQ = 6
STEPS = 4
LR = 0.2
TASKS = ("a", "b")


class Block(nn.Module):
    """A residual MLP block, the unit FSDP wraps on its own in the per-block setups."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(self.norm(h))))


class Trunk(nn.Module):
    """Everything before the output: the embedding and the blocks."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, n_blocks: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))

    def features(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return h


class Output(nn.Module):
    """The final norm and the TiedLinear head: the module whose forward calls TiedLinear."""

    def __init__(self, emb: nn.Embedding, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.head = TiedLinear(emb)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h))


class TinyLM(Trunk):
    """The model under test: ``out.head`` is a TiedLinear reading ``emb.weight``."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, n_blocks: int = 2) -> None:
        super().__init__(vocab, dim, n_blocks)
        self.out = Output(self.emb, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.features(idx))


class ReferenceLM(Trunk):
    """The expected behaviour, written out by hand: logits are ``F.linear(h, emb.weight)``."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, n_blocks: int = 2) -> None:
        super().__init__(vocab, dim, n_blocks)
        self.out = nn.Module()
        self.out.norm = nn.LayerNorm(dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.linear(self.out.norm(self.features(idx)), self.emb.weight)


class TaskLM(Trunk):
    """A tied LM with one ModuleDefaultDict adapter per task, created on first use."""

    def __init__(self) -> None:
        super().__init__()
        self.adapters: ModuleDefaultDict[nn.Linear] = ModuleDefaultDict(
            functools.partial(nn.Linear, DIM, DIM)
        )
        self.head = TiedLinear(self.emb)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.features(idx)
        for task in TASKS:
            h = h + self.adapters[task](h)
        return self.head(h)


class ReferenceTaskLM(Trunk):
    """TaskLM written out by hand, with a plain ModuleDict of the same adapters."""

    def __init__(self) -> None:
        super().__init__()
        self.adapters = nn.ModuleDict({task: nn.Linear(DIM, DIM) for task in TASKS})

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.features(idx)
        for task in TASKS:
            h = h + self.adapters[task](h)
        return F.linear(h, self.emb.weight)


def initial_state(reference: type[nn.Module] = ReferenceLM, seed: int = 0) -> dict[str, Any]:
    """The starting weights that every rank and the reference load."""
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in reference().state_dict().items()}


def batches(world_size: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global ``(inputs, targets)`` per step; rank ``r`` trains on rows ``rank_rows(r)``.

    Every token appears in the inputs of every step, so every embedding row is looked up.
    """
    gen = torch.Generator().manual_seed(1234 + world_size)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (world_size * ROWS_PER_RANK, SEQ), generator=gen)
        idx.view(-1)[:VOCAB] = torch.randperm(VOCAB, generator=gen)
        targets = torch.randint(0, VOCAB, idx.shape, generator=gen)
        out.append((idx, targets))
    return out


def rank_rows(rank: int) -> slice:
    """The rows of a global batch that ``rank`` trains on."""
    return slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def reference_training(world_size: int, reference: type[nn.Module] = ReferenceLM) -> dict[str, Any]:
    """Train the reference in one process on the global batches, as data parallelism should.

    Returns:
        ``losses[step][rank]``, the loss each rank should see, and ``states[step]``, the full
        state after each optimizer step (``states[0]`` is the initial state).
    """
    model = reference()
    model.load_state_dict(initial_state(reference))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, states = [], [initial_state(reference)]
    for idx, targets in batches(world_size):
        per_rank = [
            loss_fn(model(idx[rank_rows(r)]), targets[rank_rows(r)]) for r in range(world_size)
        ]
        opt.zero_grad()
        torch.stack(per_rank).mean().backward()
        opt.step()
        losses.append([loss.item() for loss in per_rank])
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return {"losses": losses, "states": states}


def reference_path_updates(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first step's update of ``emb.weight`` from the lookup path alone and the head alone."""
    updates = []
    for path in ("lookup", "head"):
        model = ReferenceLM()
        model.load_state_dict(initial_state())
        idx, targets = batches(world_size)[0]
        h = model.out.norm(model.features(idx))
        weight = model.emb.weight
        # Cut one path: the lookup path alone, or the head alone.
        logits = F.linear(h, weight.detach()) if path == "lookup" else F.linear(h.detach(), weight)
        per_rank = [loss_fn(logits[rank_rows(r)], targets[rank_rows(r)]) for r in range(world_size)]
        (grad,) = torch.autograd.grad(torch.stack(per_rank).mean(), weight)
        updates.append(-LR * grad)
    return updates[0], updates[1]
