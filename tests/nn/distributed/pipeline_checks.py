"""What each rank runs for the real pipeline schedules: the tiny tied LM trained over two stages.

These need processes: ``PipelineStage`` sends activations point to point, which the threaded
backend of ``run_threads`` does not implement. Two ranks run two stages; four ranks run two
stages times two replicas on a ``("dp", "pp")`` mesh, rank ``dp * 2 + pp`` holding stage ``pp``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel

from tests.nn.distributed.pipeline_lm import MAX_NORM, MICROBATCHES, STEPS, split, whole_model
from tests.nn.distributed.tiny_lm import LR, batches, initial_state, loss_fn
from toolkit.nn import PipelineTie, pipeline_clip_grad_norm_

WORLD_SIZES = (2, 4)
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# The schedule and the data parallelism of each run, by world size.
SETUPS = {2: [("gpipe", None), ("1f1b", None)], 4: [("gpipe", "ddp"), ("1f1b", "fsdp2")]}


def _counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op): n for op, n in mode.get_comm_counts().items()}


def train(schedule_name: str, dp: str | None, world_size: int) -> dict[str, Any]:
    """Train ``STEPS`` steps with the tie and the clip; what the test compares with one process."""
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "pp"))
    pp, replica, replicas = (
        mesh["pp"].get_local_rank(),
        mesh["dp"].get_local_rank(),
        world_size // 2,
    )
    stage = split(whole_model(initial_state()), pp, 2)
    if pp == 1:  # set-up must replace this copy by the first stage's
        stage.emb.weight.data.add_(1.0)
    module: nn.Module = stage
    if dp == "ddp":
        # find_unused_parameters=True turns off DDP's first-iteration bucket rebuild, which
        # counts every parameter once per microbatch and fails an assert at the second step.
        dp_group = mesh["dp"].get_group()
        module = DistributedDataParallel(stage, process_group=dp_group, find_unused_parameters=True)
    elif dp == "fsdp2":
        fully_shard(stage, mesh=mesh["dp"])
    tie = PipelineTie(module, mesh["pp"])  # on the module the stage runs, wrapped or not
    pipeline_stage = PipelineStage(module, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = SCHEDULES[schedule_name](pipeline_stage, MICROBATCHES, loss_fn=loss_fn)
    opt = torch.optim.SGD(stage.parameters(), lr=LR)
    steps = []
    for idx, targets in batches(2, STEPS):
        rows = slice(replica * len(idx) // replicas, (replica + 1) * len(idx) // replicas)
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        if pp == 0:
            schedule.step(idx[rows])
        else:
            schedule.step(target=targets[rows], losses=losses)
        with CommDebugMode() as tie_comm:
            tie.reduce_grads()
        with CommDebugMode() as clip_comm:
            norm = pipeline_clip_grad_norm_(stage.parameters(), MAX_NORM, tie=tie)
        opt.step()
        counts = (_counts(tie_comm), _counts(clip_comm))
        steps.append({"losses": [x.item() for x in losses], "norm": norm.item(), "counts": counts})
    tie.check()
    state = get_model_state_dict(stage, options=StateDictOptions(full_state_dict=True))
    return {"steps": steps, "state": {k: v.detach().clone() for k, v in state.items()}}


def checks(world_size: int, checkpoint_dir: Path) -> dict[str, Callable[[], Any]]:
    """The pipeline checks at ``world_size``."""
    return {
        f"pipeline/{name}/{dp}": (lambda name=name, dp=dp: train(name, dp, world_size))
        for name, dp in SETUPS.get(world_size, [])
    }
