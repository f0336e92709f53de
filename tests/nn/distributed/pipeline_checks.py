"""What each rank runs for PipelineTie: the tiny tied LM trained over pipeline stages.

Two ranks run two stages (``ScheduleGPipe``, ``Schedule1F1B``); four ranks run two stages
times two data-parallel replicas on a ``("dp", "pp")`` mesh, under DDP and under FSDP2.
Rank ``dp * 2 + pp`` holds stage ``pp`` of replica ``dp``. The expected values are computed
in the test process by ``pipeline_lm.reference_pipeline_training``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel

from tests.nn.distributed.pipeline_lm import (
    MAX_NORM,
    MICROBATCHES,
    STEPS,
    StageLM,
    split,
    whole_model,
)
from tests.nn.distributed.tiny_lm import LR, batches, initial_state, loss_fn
from toolkit.nn import PipelineTie, TiedLinear, pipeline_clip_grad_norm_

WORLD_SIZES = (2, 4)
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
FULL = StateDictOptions(full_state_dict=True)


def _counts(mode: CommDebugMode) -> dict[str, int]:
    """The collectives ``mode`` saw, by name."""
    return {str(op): n for op, n in mode.get_comm_counts().items()}


class Pipeline:
    """One rank's stage of the tiny LM, its schedule, tie and optimizer."""

    def __init__(self, schedule: str, dp: str | None, *, seed: int = 0) -> None:
        world = dist.get_world_size()
        if world == 2:
            self.pp_group: dist.ProcessGroup | DeviceMesh = dist.group.WORLD  # type: ignore[assignment]
            self.pp_rank, self.dp_rank, replicas = dist.get_rank(), 0, 1
        else:
            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "pp"))
            self.pp_group = mesh["pp"]
            self.pp_rank = mesh["pp"].get_local_rank()
            self.dp_rank, replicas = mesh["dp"].get_local_rank(), world // 2
        self.replicas = replicas
        self.stage = split(whole_model(initial_state(seed=seed)), self.pp_rank, 2)
        if self.pp_rank == 1:  # set-up must replace this copy by the first stage's
            self.stage.emb.weight.data.add_(1.0)
        module: nn.Module = self.stage
        if dp == "ddp":
            # With several microbatches, DDP's first-iteration bucket rebuild counts every
            # parameter once per microbatch and fails an internal assert at the second step;
            # find_unused_parameters=True turns the rebuild off.
            module = DistributedDataParallel(
                self.stage, process_group=mesh["dp"].get_group(), find_unused_parameters=True
            )
        elif dp == "fsdp2":
            fully_shard(self.stage, mesh=mesh["dp"])
        # Set up on the module the stage runs, wrapped or not.
        with CommDebugMode() as setup:
            self.tie = PipelineTie(module, self.pp_group)
        self.setup_collectives = _counts(setup)
        group = (
            self.pp_group.get_group() if isinstance(self.pp_group, DeviceMesh) else self.pp_group
        )
        pipeline_stage = PipelineStage(module, self.pp_rank, 2, torch.device("cpu"), group=group)
        self.schedule = SCHEDULES[schedule](
            pipeline_stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn
        )
        self.opt = torch.optim.SGD(self.stage.parameters(), lr=LR)

    def train_step(
        self, idx: torch.Tensor, targets: torch.Tensor, *, sum_grads: bool = True
    ) -> dict[str, Any]:
        """One step on this replica's rows; the losses of its microbatches on the last stage."""
        size = len(idx) // self.replicas
        rows = slice(self.dp_rank * size, (self.dp_rank + 1) * size)
        self.opt.zero_grad()
        losses: list[torch.Tensor] = []
        if self.pp_rank == 0:
            self.schedule.step(idx[rows])
        else:
            self.schedule.step(target=targets[rows], losses=losses)
        with CommDebugMode() as tie_comm:
            if sum_grads:
                self.tie.reduce_grads()
        with CommDebugMode() as clip_comm:
            norm = pipeline_clip_grad_norm_(
                self.stage.parameters(), MAX_NORM, group=self.pp_group, tie=self.tie
            )
        self.opt.step()
        return {
            "losses": [loss.item() for loss in losses],
            "norm": norm.item(),
            "tie_collectives": _counts(tie_comm),
            "clip_collectives": _counts(clip_comm),
        }

    def full_state(self) -> dict[str, torch.Tensor]:
        state = get_model_state_dict(self.stage, options=FULL)
        return {key: value.detach().clone() for key, value in state.items()}


def train(schedule: str, dp: str | None, *, sum_grads: bool = True) -> dict[str, Any]:
    """Train for ``STEPS`` steps; what the tests compare with the single-process reference."""
    start = time.perf_counter()
    pipeline = Pipeline(schedule, dp)
    steps = [
        pipeline.train_step(idx, targets, sum_grads=sum_grads) for idx, targets in batches(2, STEPS)
    ]
    with CommDebugMode() as check_comm:
        try:
            pipeline.tie.check()
            check = None
        except RuntimeError as error:
            check = str(error)
    return {
        "pp_rank": pipeline.pp_rank,
        "dp_rank": pipeline.dp_rank,
        "steps": steps,
        "state": pipeline.full_state(),
        "check": check,
        "setup_collectives": pipeline.setup_collectives,
        "check_collectives": _counts(check_comm),
        "seconds": time.perf_counter() - start,
    }


def train_looped(kind: str) -> dict[str, Any]:
    """Four stages on two ranks: interleaved (stages r, r + 2) or V-shaped (r, 3 - r).

    Under the V schedule rank 0 holds both copies and rank 1 none: the tie, built on every
    rank with the default group, sums them on rank 0 without communication, and does
    nothing on rank 1. Under the interleaved one each rank holds one copy.
    """
    start = time.perf_counter()
    rank = dist.get_rank()
    indices = [rank, rank + 2] if kind == "interleaved" else [rank, 3 - rank]
    model = whole_model(initial_state())
    stages = [split(model, i, 4) for i in indices]
    tie = PipelineTie(stages)  # the same loop on every rank
    schedule_type = ScheduleInterleaved1F1B if kind == "interleaved" else ScheduleZBVZeroBubble
    schedule = schedule_type(
        [PipelineStage(s, i, 4, torch.device("cpu")) for s, i in zip(stages, indices, strict=True)],
        n_microbatches=MICROBATCHES,
        loss_fn=loss_fn,
    )
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    steps = []
    for idx, targets in batches(2, STEPS):
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        schedule.step(idx, target=targets, losses=losses)
        with CommDebugMode() as tie_comm:
            tie.reduce_grads()
        norm = pipeline_clip_grad_norm_(params, MAX_NORM, tie=tie)
        opt.step()
        steps.append(
            {
                "losses": [loss.item() for loss in losses],
                "norm": norm.item(),
                "tie_collectives": _counts(tie_comm),
            }
        )
    tie.check()
    state: dict[str, torch.Tensor] = {}
    for stage in stages:
        for key, value in stage.state_dict().items():
            state.setdefault(key, value.detach().clone())
    return {
        "copies": [s.emb is not None for s in stages],
        "steps": steps,
        "state": state,
        "seconds": time.perf_counter() - start,
    }


def refused() -> str:
    """The last stage drops its embedding, whose copy its head still reads: every rank's error."""
    stage = split(whole_model(initial_state()), dist.get_rank(), 2)
    if dist.get_rank() == 1:
        stage.emb = None  # type: ignore[assignment]
    try:
        PipelineTie(stage)
    except ValueError as error:
        return str(error)
    raise AssertionError("PipelineTie accepted a head reading an unregistered embedding")


def accepted_without_a_copy() -> dict[str, Any]:
    """Rank 0's stage holds no module at the name rank 1's head reads: a tie held by rank 1
    alone, which needs no communication after set-up."""
    stage = split(whole_model(initial_state()), dist.get_rank(), 2)
    if dist.get_rank() == 0:
        stage.emb = None  # type: ignore[assignment]
    tie = PipelineTie(stage)
    if stage.emb is not None:
        stage.emb.weight.grad = torch.ones_like(stage.emb.weight)
    with CommDebugMode() as comm:
        tie.reduce_grads()
        tie.broadcast()
    grad = None if stage.emb is None else stage.emb.weight.grad
    return {"repr": repr(tie), "collectives": _counts(comm), "grad": grad}


def refused_shapes() -> str:
    """Rank 1's copy has another vocabulary: every rank's error."""
    stage = split(whole_model(initial_state()), dist.get_rank(), 2)
    if dist.get_rank() == 1:
        stage.emb = nn.Embedding(5, 8)
        stage.out.head = TiedLinear(stage.emb)
    try:
        PipelineTie(stage)
    except ValueError as error:
        return str(error)
    raise AssertionError("PipelineTie accepted copies of different shapes")


def checkpoint(checkpoint_dir: Path) -> dict[str, Any]:
    """Train one step, save with DCP, resume in fresh stages; export the whole model."""
    path = checkpoint_dir / "pipeline"
    data = batches(2, STEPS)
    pipeline = Pipeline("gpipe", None)
    first = pipeline.train_step(*data[0])
    saved = pipeline.full_state()
    dcp.save(get_model_state_dict(pipeline.stage), checkpoint_id=path)
    uninterrupted = [pipeline.train_step(*batch) for batch in data[1:]]

    fresh = Pipeline("gpipe", None, seed=1)
    before = fresh.full_state()
    state = get_model_state_dict(fresh.stage)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fresh.stage, state)
    loaded = fresh.full_state()
    fresh.tie.check()
    resumed = [fresh.train_step(*batch) for batch in data[1:]]

    metadata = dcp.FileSystemReader(path).read_metadata()
    entries = [
        (index.fqn, tuple(index.offset), info.relative_path, info.length)
        for index, info in metadata.storage_data.items()
    ]
    return {
        "first": first,
        "saved": saved,
        "before": before,
        "loaded": loaded,
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "chunks": {
            fqn: [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]  # type: ignore[union-attr]
            for fqn, md in metadata.state_dict_metadata.items()
        },
        "entries": entries,
        "file_bytes": sum(f.stat().st_size for f in path.glob("*.distcp")),
        "export": export(pipeline, checkpoint_dir / "model.safetensors"),
    }


def export(pipeline: Pipeline, path: Path) -> dict[str, torch.Tensor] | None:
    """Gather every stage's full state to rank 0, keep one copy of the tie, save safetensors.

    Returns, on rank 0, the state of a whole TiedLinear model loaded from the file.
    """
    states: list[dict[str, torch.Tensor]] | None = (
        [{}] * dist.get_world_size() if dist.get_rank() == 0 else None
    )
    dist.gather_object(pipeline.full_state(), states, dst=0)
    if states is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for state in states:
        for key, value in state.items():
            if key in merged and not torch.equal(merged[key], value):
                raise AssertionError(f"the stages' copies of {key} differ")
            merged.setdefault(key, value)
    safetensors.torch.save_file(merged, str(path))
    model = StageLM()
    model.load_state_dict(safetensors.torch.load_file(str(path)))  # strict: every key, once
    return dict(model.state_dict())


def checks(world_size: int, checkpoint_dir: Path) -> dict[str, Callable[[], Any]]:
    """The pipeline checks at ``world_size``."""
    if world_size == 2:
        return {
            "pipeline/gpipe": lambda: train("gpipe", None),
            "pipeline/1f1b": lambda: train("1f1b", None),
            "pipeline/gpipe_without_sum": lambda: train("gpipe", None, sum_grads=False),
            "pipeline/interleaved": lambda: train_looped("interleaved"),
            "pipeline/zbv": lambda: train_looped("zbv"),
            "pipeline/refused": refused,
            "pipeline/accepted_without_a_copy": accepted_without_a_copy,
            "pipeline/refused_shapes": refused_shapes,
            "pipeline/checkpoint": lambda: checkpoint(checkpoint_dir),
        }
    if world_size == 4:
        return {
            "pipeline/ddp": lambda: train("gpipe", "ddp"),
            "pipeline/fsdp2": lambda: train("1f1b", "fsdp2"),
        }
    return {}
