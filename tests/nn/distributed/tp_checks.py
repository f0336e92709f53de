"""What each rank runs for TiedLinear under tensor parallelism, alone and under FSDP2.

The tiny tied LM of ``tiny_lm`` is parallelised the way torch's tensor-parallel recipes do it:
the embedding is ``RowwiseParallel`` (its weight sharded on the vocabulary of 17, unevenly),
each block is ``ColwiseParallel`` then ``RowwiseParallel``, and with sequence parallelism the
norms are ``SequenceParallel``. The head reads the sharded weight through TiedLinear, with
:class:`toolkit.nn.TiedLinearParallel` (or torch's ``PrepareModuleInput``) on ``head.linear``.
Every check returns plain tensors and strings for the tests to compare with a reference
trained in one process.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from tests.nn.distributed.tiny_lm import (
    DIM,
    LR,
    VOCAB,
    TinyLM,
    batches,
    initial_state,
    loss_fn,
    rank_rows,
)
from toolkit.nn import TiedLinear, TiedLinearParallel

WORLD_SIZES = (2, 4)
STEPS = 3
# The global batches are those of two data-parallel ranks: on a 1-D tensor-parallel mesh
# every rank takes all their rows, on the 2 x 2 mesh each ``dp`` rank takes its own.
DATA_RANKS = 2
ALL_ROWS = slice(None)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state with every DTensor gathered into a full tensor."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def parallelise(
    model: TinyLM,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    gathered: bool = False,
    head: str = "style",
    embedding: str = "rowwise",
) -> TinyLM:
    """Apply torch's tensor-parallel styles to the trunk and one of the head recipes."""
    sp = sequence_parallel
    trunk_out = Shard(1) if sp else Replicate()
    plan: dict[str, Any] = {
        "emb": (
            RowwiseParallel(input_layouts=Replicate(), output_layouts=trunk_out)
            if embedding == "rowwise"
            else ColwiseParallel(output_layouts=trunk_out)
        ),
        "blocks.*.up": ColwiseParallel(input_layouts=trunk_out),
        "blocks.*.down": RowwiseParallel(output_layouts=trunk_out),
    }
    if sp:
        plan["blocks.*.norm"] = SequenceParallel()
        plan["out.norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, plan)
    if head == "style":
        style = TiedLinearParallel(
            input_layouts=trunk_out,
            output_layouts=Replicate() if gathered else Shard(-1),
            use_local_output=gathered,
        )
        parallelize_module(model.out.head.linear, tp_mesh, style)
    elif head == "prepare_module_input":
        prepare = PrepareModuleInput(
            input_layouts=(trunk_out, None), desired_input_layouts=(Replicate(), None)
        )
        parallelize_module(model.out.head.linear, tp_mesh, prepare)
    return model


def build(mesh: DeviceMesh, *, seed: int = 0, fsdp: bool = False, **options: Any) -> TinyLM:
    """The tied LM holding the initial state, parallelised on ``mesh`` (1-D, or 2-D: dp by tp)."""
    model = TinyLM()
    model.load_state_dict(initial_state(seed=seed))
    tp_mesh = mesh["tp"] if mesh.ndim == 2 else mesh
    parallelise(model, tp_mesh, **options)
    if fsdp:
        fully_shard(model, mesh=mesh["dp"])
    return model


def compute_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return loss_fn(logits, targets)


def train(model: nn.Module, rows: slice, *, sharded_logits: bool) -> dict[str, Any]:
    """Train on ``rows`` of the global batches for STEPS steps."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, states, layouts = [], [full_state(model)], set()
    for idx, targets in batches(DATA_RANKS, STEPS):
        context = loss_parallel() if sharded_logits else torch.enable_grad()
        with context:
            logits = model(idx[rows])
            loss = loss_fn(logits, targets[rows])
            opt.zero_grad()
            loss.backward()
        opt.step()
        layouts.add(str(logits.placements) if isinstance(logits, DTensor) else "plain")
        losses.append(full(loss).item())
        states.append(full_state(model))
    return {"losses": losses, "states": states, "logits": sorted(layouts)}


def tp_training(**options: Any) -> dict[str, Any]:
    """Train on a 1-D tensor-parallel mesh: every rank sees the same rows."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build(mesh, **options)
    return train(model, ALL_ROWS, sharded_logits=not options.get("gathered", False))


def mesh_2d() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def fsdp_tp_training(**options: Any) -> dict[str, Any]:
    """Train with FSDP2 over ``dp`` and tensor parallelism over ``tp`` on a 2 x 2 mesh."""
    mesh = mesh_2d()
    model = build(mesh, fsdp=True, **options)
    data_rank = mesh.get_local_rank("dp")
    result = train(model, rank_rows(data_rank), sharded_logits=not options.get("gathered", False))
    result["data_rank"] = data_rank
    return result


def checkpoint_round_trip(checkpoint_dir: Path, *, fsdp: bool = False) -> dict[str, Any]:
    """Train, save with DCP, load into a freshly parallelised model started elsewhere."""
    mesh = mesh_2d() if fsdp else init_device_mesh("cpu", (dist.get_world_size(),))
    model = build(mesh, fsdp=fsdp)
    rows = rank_rows(mesh.get_local_rank("dp")) if fsdp else ALL_ROWS
    train(model, rows, sharded_logits=True)
    path = checkpoint_dir / f"tp-{'fsdp' if fsdp else 'tp'}"
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    fresh = build(mesh, seed=1, fsdp=fsdp)
    before = full_state(fresh)
    loaded = get_model_state_dict(fresh)
    dcp.load(loaded, checkpoint_id=path)
    set_model_state_dict(fresh, loaded)
    idx, _ = batches(DATA_RANKS, 1)[0]
    with torch.no_grad():
        return {
            "before": before,
            "after": full_state(fresh),
            "trained": full_state(model),
            "tied": fresh.out.head.tied_module is fresh.emb,
            "same_weight": fresh.out.head.weight is fresh.emb.weight,
            "logits": full(fresh(idx)),
            "trained_logits": full(model(idx)),
        }


def compiled_loss() -> dict[str, float]:
    """The first step's loss, eager and through ``torch.compile``, on the same TP model."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build(mesh, sequence_parallel=True)
    idx, targets = batches(DATA_RANKS, 1)[0]
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad(), loss_parallel():
        eager = full(loss_fn(model(idx), targets)).item()
        traced = full(loss_fn(compiled(idx), targets)).item()
    return {"eager": eager, "compiled": traced}


def counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items() if n}


def communication() -> dict[str, dict[str, int]]:
    """The collectives of the head's forward, the loss's forward, and their backward."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict[str, dict[str, int]] = {}
    idx, targets = batches(DATA_RANKS, 1)[0]
    configs = {
        "loss_parallel": {},
        "gathered": {"gathered": True},
        "sequence_parallel": {"sequence_parallel": True},
        "colwise_embedding": {"embedding": "colwise"},
    }
    for name, options in configs.items():
        model = build(mesh, **options)
        h = model.out.norm(model.features(idx)).detach().requires_grad_()
        with loss_parallel() if not options.get("gathered") else torch.enable_grad():
            with CommDebugMode() as head:
                logits = model.out.head(h)
            with CommDebugMode() as loss:
                value = loss_fn(logits, targets)
            with CommDebugMode() as backward:
                value.backward()
        out[f"{name}/head"] = counts(head)
        out[f"{name}/loss"] = counts(loss)
        out[f"{name}/backward"] = counts(backward)
    return out


def error_of(call: Callable[[], object]) -> str:
    try:
        call()
    except RuntimeError as error:
        return f"{type(error).__name__}: {error}\nCAUSE {type(error.__cause__).__name__}"
    raise AssertionError("the call did not raise")


def unprepared_input(*, fsdp: bool = False) -> str:
    """The error when the head's input is left a plain tensor and the weight is TP-sharded."""
    mesh = mesh_2d() if fsdp else init_device_mesh("cpu", (dist.get_world_size(),))
    model = build(mesh, fsdp=fsdp, head="none")
    idx, _ = batches(DATA_RANKS, 1)[0]
    return error_of(partial(model, idx))


def fsdp_resharded_under_tp() -> str:
    """The error when FSDP2 reshards the TP-sharded embedding before the head reads it."""
    mesh = mesh_2d()
    model = TinyLM()
    model.load_state_dict(initial_state())
    parallelise(model, mesh["tp"])
    fully_shard(model.emb, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    idx, _ = batches(DATA_RANKS, 1)[0]
    return error_of(partial(model, idx))


class _Trunked(nn.Module):
    """An embedding inside a trunk: FSDP2 manages it, but it is not a unit itself."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Embedding(VOCAB, DIM))
        self.head = TiedLinear(self.trunk[0])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(idx))  # type: ignore[no-any-return]


def fsdp_resharded_by_an_enclosing_unit() -> str:
    """The error when a unit enclosing the embedding reshards it before the head, without TP."""
    model = _Trunked()
    fully_shard(model.trunk)
    fully_shard(model)
    idx, _ = batches(DATA_RANKS, 1)[0]
    return error_of(partial(model, idx))


def unsharded_weight() -> str:
    """The error when the head's input is prepared but the tied module was not parallelised."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = TinyLM()
    parallelize_module(model.out.head.linear, mesh, TiedLinearParallel())
    idx, _ = batches(DATA_RANKS, 1)[0]
    return error_of(partial(model, idx))


def style_on_another_module() -> str:
    """The error when the style is applied to a module other than a TiedLinear's linear."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    try:
        parallelize_module(nn.Linear(DIM, VOCAB), mesh, TiedLinearParallel())
    except TypeError as error:
        return str(error)
    raise AssertionError("the style was applied to an nn.Linear")


def plan_by_name() -> list[str]:
    """What ``parallelize_module`` says of a plan that names the head's linear module by path."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = TinyLM()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallelize_module(model, mesh, {"out.head.linear": TiedLinearParallel()})
    hooked = bool(model.out.head.linear._forward_pre_hooks)
    return [*(str(w.message) for w in caught), f"hooked={hooked}"]


def checks(world_size: int, checkpoint_dir: Path) -> dict[str, Callable[[], Any]]:
    """The tensor-parallel checks run at ``world_size``."""
    if world_size == 2:
        return {
            "tp/train/loss_parallel": partial(tp_training),
            "tp/train/gathered": partial(tp_training, gathered=True),
            "tp/train/sequence_parallel": partial(tp_training, sequence_parallel=True),
            "tp/train/sequence_parallel_gathered": partial(
                tp_training, sequence_parallel=True, gathered=True
            ),
            "tp/train/prepare_module_input": partial(tp_training, head="prepare_module_input"),
            "tp/train/colwise_embedding": partial(tp_training, embedding="colwise"),
            "tp/checkpoint": partial(checkpoint_round_trip, checkpoint_dir),
            "tp/compile": compiled_loss,
            "tp/communication": communication,
            "tp/unprepared": unprepared_input,
            "tp/unsharded_weight": unsharded_weight,
            "tp/style_on_another_module": style_on_another_module,
            "tp/plan_by_name": plan_by_name,
            "tp/fsdp_enclosing_unit": fsdp_resharded_by_an_enclosing_unit,
        }
    if world_size == 4:
        return {
            "tp/fsdp/loss_parallel": partial(fsdp_tp_training),
            "tp/fsdp/gathered": partial(fsdp_tp_training, gathered=True),
            "tp/fsdp/checkpoint": partial(checkpoint_round_trip, checkpoint_dir, fsdp=True),
            "tp/fsdp/unprepared": partial(unprepared_input, fsdp=True),
            "tp/fsdp/resharded": fsdp_resharded_under_tp,
        }
    return {}
