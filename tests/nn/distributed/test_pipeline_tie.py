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
from torch.distributed.tensor import DTensor
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
        # Under FSDP2, clipping also reduces over the replicas how many DTensors they pass and
        # which have a gradient, then the sharded norm: three more all-reduces.
        clip = {"c10d.allreduce_": 4 if dp == "fsdp2" else 1}
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


# Accumulating over schedule steps under FSDP2, with the schedule's default scale_grads=True. ---

ACCUMULATION = 2  # schedule steps per optimizer step


def reference_scaled_accumulation(replicas: int) -> dict[str, Any]:
    """``ReferenceLM`` trained as a schedule with ``scale_grads=True`` accumulates: after each
    schedule step every gradient is divided by the number of microbatches, in place."""
    model = ReferenceLM()
    model.load_state_dict(initial_state())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for idx, targets in batches(4, STEPS):
        opt.zero_grad()
        per_step = replicas * MICROBATCHES
        chunks = list(
            zip(
                idx.chunk(ACCUMULATION * per_step),
                targets.chunk(ACCUMULATION * per_step),
                strict=True,
            )
        )
        for step in range(ACCUMULATION):
            for replica in range(replicas):
                for micro in range(MICROBATCHES):
                    i, t = chunks[(replica * ACCUMULATION + step) * MICROBATCHES + micro]
                    (loss_fn(model(i), t) / replicas).backward()
            for p in model.parameters():
                p.grad.div_(MICROBATCHES)  # type: ignore[union-attr]
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
    return {"norms": norms, "state": model.state_dict()}


def scaled_accumulation_in_a_process() -> dict[str, Any]:
    """pp=2 x dp=2 under FSDP2: ``reduce_grads()`` after each of two schedule steps."""
    with process_group():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        pp, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        stage = split(whole_model(initial_state()), pp, 2)
        fully_shard(stage, mesh=mesh["dp"])
        tie = PipelineTie(stage, mesh["pp"])
        pipeline_stage = PipelineStage(
            stage, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group()
        )
        schedule = ScheduleGPipe(pipeline_stage, MICROBATCHES, loss_fn=loss_fn)  # scale_grads=True
        opt = torch.optim.SGD(stage.parameters(), lr=LR)
        norms = []
        for idx, targets in batches(4, STEPS):
            opt.zero_grad()
            rows = len(idx) // 2
            for step in range(ACCUMULATION):
                part = slice(
                    replica * rows + step * rows // 2, replica * rows + (step + 1) * rows // 2
                )
                if pp == 0:
                    schedule.step(idx[part])
                else:
                    schedule.step(target=targets[part])
                tie.reduce_grads()
            norms.append(pipeline_clip_grad_norm_(stage.parameters(), MAX_NORM, tie=tie).item())
            opt.step()
        tie.check()
        state = get_model_state_dict(stage, options=StateDictOptions(full_state_dict=True))
        return {"norms": norms, "state": {k: v.detach().clone() for k, v in state.items()}}


def test_fsdp2_accumulation_with_the_schedules_scaling_counts_the_tie_once_distributed() -> None:
    expected = reference_scaled_accumulation(replicas=2)
    for result in run_processes(4, scaled_accumulation_in_a_process, timeout=240.0):
        close(result["norms"], expected["norms"])
        for key, value in result["state"].items():
            close(value, expected["state"][key], msg=key)


# Set-ups refused at construction, on every rank, before anything is changed. ------------------


def local(weight: torch.Tensor) -> torch.Tensor:
    return (weight.to_local() if isinstance(weight, DTensor) else weight).detach()


def refused_in_a_process(case: str) -> str | None:
    """This rank's error for ``case`` on a ("dp", "pp") mesh of 2 x 2, or None if accepted."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    pp = mesh["pp"].get_local_rank()
    stage = split(whole_model(initial_state()), pp, 2)
    stage.emb.weight.data.add_(pp)  # the set-up's broadcast would make the copies equal
    module: nn.Module = stage
    group: Any = mesh["pp"]
    if case == "ddp-world":  # group= forgotten: the default, the world, holds both replicas
        module = DistributedDataParallel(
            stage, process_group=mesh["dp"].get_group(), find_unused_parameters=True
        )
        group = None
    elif case == "fsdp2-world":
        fully_shard(stage, mesh=mesh["dp"])
        group = None
    elif case == "sharded-on-one-stage":  # 17 rows: shards of 9 and 8 against the whole 17
        if pp == 0:
            fully_shard(stage, mesh=mesh["dp"])
    elif pp == 1:  # the last stage's copy in another dtype
        stage.to({"float64": torch.float64, "bfloat16": torch.bfloat16}[case])
    before = local(stage.emb.weight).clone()
    try:
        PipelineTie(module, group)
    except ValueError as error:
        assert torch.equal(local(stage.emb.weight), before)  # nothing broadcast
        return " ".join(str(error).split())
    return None


REFUSED_DISTRIBUTED = {
    "ddp-world": ("group ranks 0 and 2", 'group=mesh["pp"]'),
    "fsdp2-world": ("group ranks 0 and 2", 'group=mesh["pp"]'),
    "sharded-on-one-stage": ("local shard shape", "(17, 8)", 'group=mesh["pp"]'),
    "float64": ("dtype", "torch.float32", "torch.float64", "stage.to(dtype)"),
    "bfloat16": ("dtype", "torch.float32", "torch.bfloat16", "stage.to(dtype)"),
}


def meta_default_device_in_a_process() -> bool:
    """Three stages on ranks 0 to 2, the middle one without a copy, set up, summed and checked
    under ``torch.device("meta")``: the buffers of a rank without a copy are on the model's
    device, not the default one."""
    group = dist.new_group([0, 1, 2])
    if dist.get_rank() == 3:
        return True
    stage = split(whole_model(initial_state()), dist.get_rank(), 3)
    if stage.emb is not None:
        stage.emb.weight.data.add_(dist.get_rank())
        stage.emb.weight.grad = torch.ones_like(stage.emb.weight)
    with torch.device("meta"):
        tie = PipelineTie(stage, group)
        tie.reduce_grads()
        tie.check()
    if stage.emb is not None:
        torch.testing.assert_close(stage.emb.weight, initial_state()["emb.weight"])
        torch.testing.assert_close(stage.emb.weight.grad, torch.full_like(stage.emb.weight, 2.0))
    return True


def refusals_in_a_process() -> dict[str, Any]:
    with process_group():
        results: dict[str, Any] = {case: refused_in_a_process(case) for case in REFUSED_DISTRIBUTED}
        results["meta"] = meta_default_device_in_a_process()
        return results


def test_set_ups_a_tie_cannot_keep_equal_are_refused_on_every_rank_distributed() -> None:
    ranks = run_processes(4, refusals_in_a_process, timeout=240.0)
    for case, facts in REFUSED_DISTRIBUTED.items():
        # The same error on every rank of each pipeline (ranks 0 and 1, 2 and 3), or of the world.
        assert ranks[0][case] == ranks[1][case], case
        assert ranks[2][case] == ranks[3][case], case
        for message in (ranks[0][case], ranks[2][case]):
            assert message is not None, case
            assert message.startswith("PipelineTie"), case
            for fact in facts:
                assert fact in message, (case, fact, message)
    assert all(rank["meta"] for rank in ranks)
