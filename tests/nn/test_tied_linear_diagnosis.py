"""Which error a failed TiedLinear call gives under FSDP2, with and without tensor parallelism.

FSDP2 and tensor parallelism both leave the tied module's weight a DTensor, and a plain input
then fails the same way in torch; the message must name the right cause. Each case runs on two
ranks of one process (``tests/nn/threads.py``) with a real ``fully_shard`` and, where named,
``RowwiseParallel`` on the embedding (a vocabulary of 17, split 9 and 8):

* the embedding inside an enclosing unit that reshards it before the head reads it: the
  FSDP2 message;
* tensor parallelism under FSDP2, the embedding unsharded by the unit that calls the head
  (its weight the tensor-parallel DTensor, on the 1-D ``tp`` mesh): the tensor-parallel
  message, since only the head's input is missing;
* tensor parallelism under FSDP2, the embedding in a trunk unit that reshards it, on the 2-D
  mesh, before the head reads it: the FSDP2 message.

The multi-process runs of the same cases are in ``tests/nn/distributed/tp_checks.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from tests.nn.test_tied_linear_messages import sharded_weight_message
from tests.nn.threads import run_ranks
from toolkit.nn import TiedLinear

VOCAB, DIM = 17, 8
WORLD = 2


class _TiedLM(nn.Module):
    """An embedding inside a trunk, and a head tied to it."""

    def __init__(self) -> None:
        super().__init__()
        # The norm keeps the trunk's output from being a view, which FSDP2 warns about.
        self.trunk = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.LayerNorm(DIM))
        self.head = TiedLinear(self.trunk[0])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(idx))  # type: ignore[no-any-return]


_UNPREPARED_INPUT = (
    "TiedLinear got a plain-tensor input, but the weight of the tied module Embedding(17, 8) "
    "is sharded by tensor parallelism (a DTensor with placements (Shard(dim=0),)): the "
    "head's input must be a DTensor on the same device mesh. Prepare the head's input by "
    "applying toolkit.nn.TiedLinearParallel to the head's linear module, "
    "parallelize_module(head.linear, tp_mesh, TiedLinearParallel()), with "
    "input_layouts=Shard(1) under sequence parallelism; or apply torch's "
    "PrepareModuleInput(input_layouts=(Replicate(), None), "
    "desired_input_layouts=(Replicate(), None)) to head.linear."
)


def _errors(setup: str) -> list[str]:
    """The error of each rank's forward, its type, message and the type of its cause."""
    model = _TiedLM()
    idx = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))

    def rank_main(rank: int) -> str:
        rank_model = copy.deepcopy(model)
        emb = rank_model.trunk[0]
        if setup == "fsdp":
            mesh = init_device_mesh("cpu", (WORLD,))
            fully_shard(rank_model.trunk, mesh=mesh)
            fully_shard(rank_model, mesh=mesh)
        else:
            mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
            parallelize_module(emb, mesh["tp"], RowwiseParallel(input_layouts=Replicate()))
            if setup == "tp_fsdp_trunk_unit":
                fully_shard(rank_model.trunk, mesh=mesh["dp"])
            fully_shard(rank_model, mesh=mesh["dp"])
        try:
            rank_model(idx)
        except RuntimeError as error:
            return f"{type(error).__name__}: {error} (from {type(error.__cause__).__name__})"
        return "no error"

    return run_ranks(WORLD, rank_main)


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("fsdp", sharded_weight_message("Embedding(17, 8)", "(Shard(dim=0),)")),
        ("tp_fsdp", _UNPREPARED_INPUT),
        (
            "tp_fsdp_trunk_unit",
            sharded_weight_message(
                "Embedding(17, 8)", "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
            ),
        ),
    ],
    ids=["fsdp_enclosing_unit", "tp_under_fsdp_unsharded", "tp_under_fsdp_resharded"],
)
def test_a_plain_input_names_the_sharding_that_left_the_weight_a_dtensor(
    setup: str, message: str
) -> None:
    assert _errors(setup) == [f"RuntimeError: {message} (from RuntimeError)"] * WORLD
