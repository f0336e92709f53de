"""ModuleDefaultDict under DDP and FSDP2 on two threaded ranks, against one process.

Entries created before wrapping, by reading their keys or by loading a checkpoint, train as a
plain ``nn.ModuleDict`` of the same adapters does in one process; an entry created after
wrapping is not the wrapper's: DDP does not average it, and FSDP2 does not shard it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from tests.nn.distributed.tiny_lm import (
    TASKS,
    ReferenceTaskLM,
    TaskLM,
    initial_state,
    reference_training,
    train,
)
from tests.nn.ranks import run_threads


def _wrap(kind: str, model: TaskLM) -> nn.Module:
    if kind == "ddp":
        return DistributedDataParallel(model)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


@pytest.mark.parametrize("recipe", ["read_keys", "load_checkpoint"])
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_entries_created_before_wrapping_train_as_a_module_dict_in_one_process(
    kind: str, recipe: str
) -> None:
    state = initial_state(ReferenceTaskLM)
    expected = reference_training(2, ReferenceTaskLM)
    models = [TaskLM(), TaskLM()]  # built here: the ranks share the random generator

    def rank_main(rank: int) -> tuple[list[str], list[float], dict[str, torch.Tensor]]:
        model = models[rank]
        if recipe == "read_keys":
            for task in TASKS:
                model.adapters[task]
        model.load_state_dict(state)  # creates the entries it names, if need be
        keys = list(model.adapters)
        losses, states = train(_wrap(kind, model), 2)
        return keys, losses, states[-1]

    for rank, (keys, losses, last) in enumerate(run_threads(2, rank_main)):
        assert keys == list(TASKS)
        close = {"rtol": 1e-5, "atol": 1e-5}
        torch.testing.assert_close(losses, [step[rank] for step in expected["losses"]], **close)
        assert list(last) == list(expected["states"][-1])
        torch.testing.assert_close(last, expected["states"][-1], **close)


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_an_entry_created_after_wrapping_is_not_the_wrappers(kind: str) -> None:
    state = initial_state(ReferenceTaskLM)
    models = [TaskLM(), TaskLM()]
    for model in models:
        model.adapters["a"]

    def rank_main(rank: int) -> dict[str, torch.Tensor]:
        model = models[rank]
        wrapped = _wrap(kind, model)
        if kind == "fsdp2":
            model.adapters["b"]
            return {t: isinstance(model.adapters[t].weight, DTensor) for t in TASKS}
        model.load_state_dict(state)  # creates "b", the same on both ranks
        return train(wrapped, 2)[1][-1]

    first, second = run_threads(2, rank_main)
    if kind == "fsdp2":
        assert first == second == {"a": True, "b": False}
        return
    for key in first:
        # Entries that existed at wrapping are averaged; the late one trains on local data only.
        assert torch.equal(first[key], second[key]) == (not key.startswith("adapters.b.")), key
