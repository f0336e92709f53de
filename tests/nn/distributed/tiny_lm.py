"""A tiny tied language model, its untied reference, data, and how it trains on any ranks.

``TinyLM`` ends in a :class:`~toolkit.nn.TiedLinear` head. ``ReferenceLM`` has the same
parameters under the same names but computes its logits with ``F.linear(h, emb.weight)`` itself,
so the expected values never come from the code under test. The vocabulary, 17, is divisible by
no world size the tests use, so every sharding is uneven. ``run_setup`` is what each rank runs,
on threads or on processes; ``check_setup`` compares its results with the reference.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import FlatParameter, FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel import DistributedDataParallel

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


# Sharded training: the setups, what each rank runs, and the checks ---------------------------

FULL = StateDictOptions(full_state_dict=True)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict, gathered from the ranks' shards where it is sharded."""
    return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=FULL).items()}


def train(model: nn.Module, world_size: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Train on this rank's rows of the global batches; return its losses and the full states."""
    rank = dist.get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, states = [], [full_state(model)]
    for idx, targets in batches(world_size):
        loss = loss_fn(model(idx[rank_rows(rank)]), targets[rank_rows(rank)])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        states.append(full_state(model))
    return losses, states


# The FSDP2 units of each setup before the root unit, as (modules, reshard_after_forward).
Units = list[tuple[nn.Module | list[nn.Module], bool]]
FSDP2_UNITS: dict[str, Callable[[TinyLM], Units]] = {
    "fsdp2_root": lambda m: [],  # the embedding stays in the root, which calls the head
    "fsdp2_grouped": lambda m: [([m.emb, m.out.norm], False)],  # kept unsharded after forward
    "fsdp2_grouped_with_caller": lambda m: [([m.emb, m.out], True)],  # with the head's caller
    "fsdp2_caller_own_unit": lambda m: [(m.out, True)],  # the caller alone
    "fsdp2_emb_unsharded": lambda m: [(m.emb, False)],  # its own unit, unsharded after forward
    "fsdp2_blocks": lambda m: [(block, True) for block in m.blocks],
    "fsdp2_meta": lambda m: [(block, True) for block in m.blocks],  # built on meta, then loaded
}
SETUPS = [*FSDP2_UNITS, "ddp", "fsdp1_orig_params", "fsdp1_flat_params"]


def build(setup: str, state: dict[str, Any]) -> nn.Module:
    """This rank's model of ``setup``, wrapped, holding the full ``state``."""
    meta = setup == "fsdp2_meta"
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = TinyLM()
    if not meta:
        model.load_state_dict(state)
    if setup == "ddp":
        return DistributedDataParallel(model)
    if setup.startswith("fsdp1"):  # on the CPU, FSDP1 must be told the device
        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=setup == "fsdp1_orig_params",
            device_id=torch.device("cpu"),
        )
    for units, reshard in FSDP2_UNITS[setup](model):
        fully_shard(units, reshard_after_forward=reshard)
    fully_shard(model)
    if meta:
        model.to_empty(device="cpu")
        set_model_state_dict(model, dict(state), options=FULL)  # which it fills with shards
    return model


def run_setup(
    setup: str, world_size: int, checkpoint_dir: Path, starts: tuple[Any, Any] | None = None
) -> dict[str, Any]:
    """Build, train, save with DCP and load into a copy that started elsewhere, on this rank.

    ``starts`` are the initial states of both copies; threaded ranks, which share torch's
    random generator, must make them in the calling thread.
    """
    start, other = starts or (initial_state(), initial_state(seed=1))
    model = build(setup, start)
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    losses, states = train(model, world_size)
    flat = any(isinstance(p, FlatParameter) for p in model.parameters())
    names = [n.removeprefix("module.") for n, _ in model.named_parameters()]
    path = checkpoint_dir / setup
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    fresh = build(setup, other)
    before = full_state(fresh)
    loaded = get_model_state_dict(fresh)
    dcp.load(loaded, checkpoint_id=path)
    set_model_state_dict(fresh, loaded)
    idx, _ = batches(world_size)[0]
    with torch.no_grad():
        logits = (fresh(idx), model(idx))
    return {
        "losses": losses,
        "states": states,
        "names": None if flat else [n.replace("_fsdp_wrapped_module.", "") for n in names],
        "tied": inner.out.head.tied_module is inner.emb,
        "checkpoint": (before, full_state(fresh), logits),
    }


def assert_close(actual: Any, expected: Any, msg: str | None = None) -> None:
    """Equal up to float32 rounding in a different order of operations."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=msg)


def assert_states_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """The same keys in the same order, and close values."""
    assert list(actual) == list(expected)
    assert_close(actual, expected)


def check_setup(results: list[dict[str, Any]], world_size: int, setup: str) -> None:
    """Each rank trained as the reference in one process, added no parameter, and round-tripped.

    The reference's update of every embedding row sums the lookup's and the head's: every token
    is in every step's inputs, and the head's gradient reaches every row.
    """
    expected = reference_training(world_size)
    names = [n for n, _ in ReferenceLM().named_parameters()]
    assert [n for n, _ in TinyLM().named_parameters()] == names  # the head adds none
    assert len(results) == world_size
    for rank, result in enumerate(results):
        assert_close(result["losses"], [step[rank] for step in expected["losses"]])
        for actual, wanted in zip(result["states"], expected["states"], strict=True):
            assert_states_close(actual, wanted)  # with no state-dict key for the head
        assert result["names"] == (None if setup == "fsdp1_flat_params" else names)
        assert result["tied"]
        before, after, (logits, trained_logits) = result["checkpoint"]
        # The fresh copy started elsewhere, so the load is what made it equal.
        assert not torch.allclose(before["emb.weight"], result["states"][-1]["emb.weight"])
        assert_states_close(after, result["states"][-1])
        assert_close(logits, trained_logits)
