"""Real pipeline schedules on gloo ranks train the tied LM as the whole model does in one process.

They need processes: ``PipelineStage`` sends activations point to point, which the threaded
backend of ``run_threads`` does not implement. Two ranks run two stages; four ranks run two
stages times two replicas on a ``("dp", "pp")`` mesh, rank ``dp * 2 + pp`` holding stage ``pp``.
The reference is ``reference_pipeline_training``, ``ReferenceLM`` trained without PipelineTie.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel

from tests.nn.distributed.pipeline_lm import (
    MAX_NORM,
    MICROBATCHES,
    STEPS,
    reference_pipeline_training,
    split,
    whole_model,
)
from tests.nn.distributed.tiny_lm import LR, ReferenceLM, batches, initial_state, loss_fn
from tests.nn.ranks import process_group, run_processes
from toolkit.nn import PipelineTie, pipeline_clip_grad_norm_

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# The schedule and the data parallelism of each run, by world size; one launch per world size.
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


def setups_in_a_process() -> dict[str, dict[str, Any]]:
    """In each rank: every run of this world size, one after the other."""
    results = {}
    with process_group():
        world_size = dist.get_world_size()
        for name, dp in SETUPS[world_size]:
            results[f"{name}-{dp}"] = train(name, dp, world_size)
            dist.barrier()
    return results


def close(actual: Any, expected: Any, msg: str | None = None) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=msg)


@pytest.mark.parametrize("world_size", sorted(SETUPS))
def test_a_schedule_trains_as_one_model_with_one_all_reduce_per_step_each_for_tie_and_clip(
    world_size: int,
) -> None:
    expected = reference_pipeline_training(replicas=world_size // 2)
    assert min(expected["norms"]) > MAX_NORM  # clipping scales every step
    ranks = run_processes(world_size, setups_in_a_process, timeout=240.0)
    for name, dp in SETUPS[world_size]:
        # Under FSDP2, clipping also reduces over the replicas which shards have a gradient,
        # then the sharded norm: two more all-reduces.
        clip = {"c10d.allreduce_": 3 if dp == "fsdp2" else 1}
        results = [rank[f"{name}-{dp}"] for rank in ranks]
        losses: list[list[float]] = [[] for _ in range(STEPS)]
        for result in results:  # in rank order: replica-major, as the reference's losses
            for step, values in enumerate(result["steps"]):
                close(values["norm"], expected["norms"][step], msg=f"{name}-{dp}")
                losses[step] += values["losses"]  # only the last stage has losses
                assert values["counts"] == ({"c10d.allreduce_": 1}, clip), f"{name}-{dp}"
            assert "emb.weight" in result["state"]  # both stages hold the tied weight
            for key, value in result["state"].items():
                close(value, expected["state"][key], msg=f"{name}-{dp}: {key}")
        close(losses, expected["losses"], msg=f"{name}-{dp}")
        assert {key for result in results for key in result["state"]} == set(
            ReferenceLM().state_dict()
        )
