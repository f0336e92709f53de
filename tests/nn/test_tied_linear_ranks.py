"""TiedLinear on threaded ranks: sharded training as one process, and sharded-weight errors.

The tiny tied LM of ``tests.nn.distributed.tiny_lm`` (vocabulary 17, so every split is uneven)
trains under each FSDP2 placement that keeps the embedding's weight whole when the head reads
it, and under DDP, against ``ReferenceLM`` trained in this process. A placement that reshards it
first, or tensor parallelism without a prepared input, raises an error that names the cause.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from tests.nn.distributed.tiny_lm import (
    DIM,
    FSDP2_UNITS,
    VOCAB,
    TinyLM,
    check_setup,
    initial_state,
    run_setup,
)
from tests.nn.models import TiedLM
from tests.nn.ranks import run_threads
from toolkit.nn import TiedLinear

# Three ranks split the vocabulary 6, 6, 5: the setups whose sharding differs most run there too.
CASES = [(2, setup) for setup in [*FSDP2_UNITS, "ddp"]]
CASES += [(3, "fsdp2_blocks"), (3, "fsdp2_grouped")]


@pytest.mark.parametrize(("world_size", "setup"), CASES, ids=[f"{w}-{s}" for w, s in CASES])
def test_sharded_training_saves_and_loads_as_one_process(
    world_size: int, setup: str, tmp_path: Path
) -> None:
    starts = (initial_state(), initial_state(seed=1))
    results = run_threads(world_size, lambda _: run_setup(setup, world_size, tmp_path, starts))
    check_setup(results, world_size, setup)


# Errors: which cause and fix they name -------------------------------------------------------

FSDP_FIXES = ["fully_shard([tied_module, caller])", "reshard_after_forward=False"]
TP_FIXES = ["TiedLinearParallel", "parallelize_module(head.linear", "PrepareModuleInput"]


def test_a_weight_fsdp2_resharded_with_a_plain_input_names_the_placement_and_fixes(
    one_rank: DeviceMesh,
) -> None:
    emb = nn.Embedding(7, 3)
    fully_shard(emb, mesh=one_rank)  # the weight stays sharded until a forward unshards it
    with pytest.raises(RuntimeError) as info:
        TiedLinear(emb)(torch.randn(2, 3))
    assert str(info.value) == (  # the one golden message
        "TiedLinear cannot use the weight of the tied module FSDPEmbedding(7, 3): that weight "
        "is sharded (a DTensor with placements (Shard(dim=0),)) when TiedLinear reads it, and "
        "the input is a plain tensor. This happens when the FSDP2 unit (fully_shard) holding "
        "the tied module reshards its parameters after a forward that ends before TiedLinear "
        "runs: the tied module is its own unit, or is grouped only with modules that do not "
        "call TiedLinear. Keep the tied module in the unit whose forward calls TiedLinear, "
        "group it with the module that calls TiedLinear in one unit "
        "(fully_shard([tied_module, caller])), or keep its weight unsharded after forward "
        "with fully_shard(tied_module, reshard_after_forward=False)."
    )
    assert "mixed torch.Tensor and DTensor" in str(info.value.__cause__)


def test_a_weight_sharded_by_tensor_parallelism_with_a_plain_input_names_the_fixes(
    one_rank: DeviceMesh,
) -> None:
    emb = nn.Embedding(7, 3)
    emb.weight = nn.Parameter(distribute_tensor(emb.weight.detach(), one_rank, [Shard(0)]))
    with pytest.raises(RuntimeError) as info:
        TiedLinear(emb)(torch.randn(2, 3))
    assert str(info.value) == (  # the one golden message
        "TiedLinear got a plain-tensor input, but the weight of the tied module "
        "Embedding(7, 3) is sharded by tensor parallelism (a DTensor with placements "
        "(Shard(dim=0),)): the head's input must be a DTensor on the same device mesh. "
        "Prepare the head's input by applying toolkit.nn.TiedLinearParallel to the head's "
        "linear module, parallelize_module(head.linear, tp_mesh, TiedLinearParallel()), with "
        "input_layouts=Shard(1) under sequence parallelism; or apply torch's "
        "PrepareModuleInput(input_layouts=(Replicate(), None), "
        "desired_input_layouts=(Replicate(), None)) to head.linear."
    )


def _shard(model: nn.Module, setup: str) -> None:
    """Leave the embedding's weight a DTensor when the head reads it, as ``setup`` says."""
    if setup == "enclosing_unit":  # a unit around the embedding, not the unit's own module
        fully_shard(model.trunk)
        fully_shard(model)
        return
    if setup in ("own_unit", "grouped_resharding"):  # a unit that reshards before the head
        fully_shard(model.emb if setup == "own_unit" else [model.emb, model.out.norm])
        fully_shard(model)
        return
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model.emb, mesh["tp"], RowwiseParallel(input_layouts=Replicate()))
    if setup == "tp_fsdp_trunk_unit":  # the embedding in a unit that reshards it on the 2-D mesh
        fully_shard([model.emb, *model.blocks], mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


@pytest.mark.parametrize(
    ("setup", "facts"),
    [
        ("enclosing_unit", ["module Embedding(17, 8)", "(Shard(dim=0),)", *FSDP_FIXES]),
        ("own_unit", ["FSDPEmbedding(17, 8)", "(Shard(dim=0),)", *FSDP_FIXES]),
        ("grouped_resharding", ["FSDPEmbedding(17, 8)", "(Shard(dim=0),)", *FSDP_FIXES]),
        ("tp_fsdp", ["Embedding(17, 8)", "(Shard(dim=0),)", *TP_FIXES]),
        ("tp_fsdp_trunk_unit", ["(_StridedShard(dim=0, sf=2), Shard(dim=0))", *FSDP_FIXES]),
    ],
)
def test_on_every_rank_the_error_names_what_left_the_weight_a_dtensor(
    setup: str, facts: list[str]
) -> None:
    """FSDP2 units that reshard the embedding before the head; tensor parallelism (split 9
    and 8) with the embedding unsharded by the unit that calls the head, or resharded."""
    model = TiedLM() if setup == "enclosing_unit" else TinyLM()
    idx = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))

    def rank_main(rank: int) -> str:
        rank_model = copy.deepcopy(model)
        _shard(rank_model, setup)
        with pytest.raises(RuntimeError) as info:
            rank_model(idx)
        assert "mixed torch.Tensor and DTensor" in str(info.value.__cause__)  # torch's own
        return str(info.value)

    for message in run_threads(2, rank_main):
        assert all(fact in message for fact in facts), message


def test_a_dtensor_input_gives_the_full_product_or_at_the_wrong_width_the_shape_error() -> None:
    """The sharded-weight diagnosis is for plain inputs only: with both DTensors, the widths."""
    weight = torch.randn(VOCAB, DIM)
    x = torch.randn(2, DIM)

    def rank_main(rank: int) -> torch.Tensor:
        mesh = init_device_mesh("cpu", (2,))
        emb = nn.Embedding(VOCAB, DIM)
        emb.weight = nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))  # 9 and 8 rows
        head = TiedLinear(emb)
        with pytest.raises(RuntimeError) as info:
            head(distribute_tensor(torch.ones(2, DIM + 1), mesh, [Replicate()]))
        assert str(info.value) == (
            f"TiedLinear input has shape (2, {DIM + 1}), but Embedding.weight has shape "
            f"({VOCAB}, {DIM}): the input's last dimension must equal in_features={DIM}; "
            "reshape the input or tie to the right module"
        )
        out = head(distribute_tensor(x, mesh, [Replicate()]))
        assert isinstance(out, DTensor)
        return out.full_tensor()

    for out in run_threads(2, rank_main):
        torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-6, atol=1e-6)
