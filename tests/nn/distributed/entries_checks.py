"""What each rank runs for sync_entries and create_entries; ``test_entries_ranks.py`` compares.

Every rank seeds its own generator differently, so an entry that several ranks create has
different values on each until sync_entries makes them equal to the lowest such rank's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from tests.nn.distributed.tiny_lm import ReferenceTaskLM, TaskLM, initial_state
from tests.nn.distributed.workers import FULL, train
from toolkit.nn import ModuleDefaultDict, create_entries, sync_entries

WORLD_SIZES = (2, 3)

# The heads each rank creates before the sync: overlapping ("s", "a") and disjoint ("b", "c").
HEADS_BY_RANK = (["a", "s"], ["s", "b"], ["c", "a"])


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)
        self.register_buffer("count", torch.tensor([0]))
        self.inner = ModuleDefaultDict(functools.partial(nn.Linear, 2, 2))


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(2, 2)
        self.heads = ModuleDefaultDict(functools.partial(nn.Linear, 2, 2))
        self.outer = ModuleDefaultDict(Inner)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def sync() -> dict[str, Any]:
    """Rank-specific heads and a nested entry, synchronised; the states before and after."""
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    model = Heads()
    for key in HEADS_BY_RANK[rank]:
        model.heads[key]
    model.outer["x"].count += rank + 1
    if rank == 1:
        model.outer["x"].inner["y"]  # inside an entry that rank 0 owns
    before = _state(model)
    created = sync_entries(model)
    return {
        "created": created,
        "before": before,
        "after": _state(model),
        "heads": list(model.heads),
        "inner": list(model.outer["x"].inner),
    }


def _refused(model: nn.Module) -> tuple[str, str]:
    try:
        sync_entries(model)
    except (RuntimeError, ValueError) as error:
        return type(error).__name__, str(error)
    raise AssertionError("sync_entries did not refuse")


def failed_create() -> dict[str, Any]:
    """Rank 1's dict is closed, so it cannot create rank 0's "a": every rank raises."""
    rank = dist.get_rank()
    model = Heads()
    model.heads["a" if rank == 0 else "b"]
    if rank == 1:
        model.heads.default_factory = None
    error = _refused(model)
    return {"error": error, "heads": list(model.heads)}


def meta_on_some_ranks() -> dict[str, Any]:
    """Rank 0's model is on the meta device, rank 1's is not: every rank raises."""
    model = Heads()
    model.heads["a"]
    if dist.get_rank() == 0:
        model.to("meta")
    model.heads["b" if dist.get_rank() == 0 else "c"]
    error = _refused(model)
    return {"error": error, "heads": list(model.heads)}


def meta_on_every_rank() -> dict[str, Any]:
    """Every model is on the meta device: the names are synchronised, there are no values."""
    model = Heads().to("meta")
    model.heads["a" if dist.get_rank() == 0 else "b"]
    created = sync_entries(model)
    return {
        "created": created,
        "heads": list(model.heads),
        "devices": [str(p.device) for p in model.parameters()],
    }


def _task_model(rank: int) -> TaskLM:
    """TaskLM with this rank's adapters only; those of the reference on ranks 0 and 1."""
    state = initial_state(ReferenceTaskLM)
    torch.manual_seed(200 + rank)
    model = TaskLM()
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith("adapters.")})
    own = {0: ["a"], 1: ["b"]}.get(rank, ["b", "a"])  # rank 2 holds both, with its own values
    for task in own:
        model.adapters[task]
    if rank < 2:
        task = own[0]
        prefix = f"adapters.{task}."
        model.adapters[task].load_state_dict(
            {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
        )
    return model


def train_after_sync(kind: str, world_size: int) -> dict[str, Any]:
    """Sync the adapters, close the dict, wrap, train; and check a miss is refused after."""
    model = _task_model(dist.get_rank())
    sync_entries(model)
    model.adapters.default_factory = None
    wrapped: nn.Module = DistributedDataParallel(model) if kind == "ddp" else model
    if kind == "fsdp2":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    losses, states = train(wrapped, world_size)
    refused: tuple[object, ...] | None = None
    try:
        model.adapters["late"]
    except KeyError as error:
        refused = error.args
    return {"keys": list(model.adapters), "losses": losses, "states": states, "refused": refused}


def dcp_resume(checkpoint_dir: Path) -> dict[str, Any]:
    """Train under FSDP2, save with DCP; resume into a fresh model through create_entries."""
    path = checkpoint_dir / "entries-resume"
    state = initial_state(ReferenceTaskLM)
    model = TaskLM()
    model.load_state_dict(state)  # creates both adapters
    fully_shard(model)
    train(model, dist.get_world_size())
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)

    torch.manual_seed(300)
    fresh = TaskLM()
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    created = create_entries(fresh, keys, prefix="model.")
    fully_shard(fresh)
    loaded = {"model": get_model_state_dict(fresh)}
    dcp.load(loaded, checkpoint_id=path)
    set_model_state_dict(fresh, loaded["model"])
    return {
        "created": created,
        "trained": get_model_state_dict(model, options=FULL),
        "resumed": get_model_state_dict(fresh, options=FULL),
    }


def checks(world_size: int, checkpoint_dir: Path) -> dict[str, Callable[[], Any]]:
    """The checks this module runs at ``world_size``."""
    out: dict[str, Callable[[], Any]] = {
        "entries/sync": sync,
        "entries/train/ddp": lambda: train_after_sync("ddp", world_size),
        "entries/train/fsdp2": lambda: train_after_sync("fsdp2", world_size),
    }
    if world_size == 2:
        out["entries/dcp_resume"] = lambda: dcp_resume(checkpoint_dir)
        out["entries/failed_create"] = failed_create
        out["entries/meta_on_some_ranks"] = meta_on_some_ranks
        out["entries/meta_on_every_rank"] = meta_on_every_rank
    return out
