"""Real pipeline schedules on gloo ranks train the tied LM as the whole model does in one process.

The ranks run ``pipeline_checks`` (processes, since ``PipelineStage`` sends point to point); the
reference is ``reference_pipeline_training``, ``ReferenceLM`` trained without PipelineTie.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.nn.distributed.pipeline_checks import SETUPS
from tests.nn.distributed.pipeline_lm import MAX_NORM, STEPS, reference_pipeline_training
from tests.nn.distributed.tiny_lm import ReferenceLM
from tests.nn.distributed.worlds import Worlds, per_rank

RUNS = [(size, name, dp) for size, setups in SETUPS.items() for name, dp in setups]


def close(actual: Any, expected: Any, msg: str | None = None) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=msg)


@pytest.mark.parametrize(("world_size", "name", "dp"), RUNS, ids=[f"{n}-{d}" for _, n, d in RUNS])
def test_a_schedule_trains_as_one_model_with_one_all_reduce_per_step_each_for_tie_and_clip(
    worlds: Worlds, world_size: int, name: str, dp: str | None
) -> None:
    expected = reference_pipeline_training(replicas=world_size // 2)
    assert min(expected["norms"]) > MAX_NORM  # clipping scales every step
    # Under FSDP2, clipping also reduces the sharded norm over the replicas (DTensor's own).
    clip = {"c10d.allreduce_": 1} | ({"c10d_functional.all_reduce": 1} if dp == "fsdp2" else {})
    results = per_rank(worlds, world_size, f"pipeline/{name}/{dp}")
    losses: list[list[float]] = [[] for _ in range(STEPS)]
    for result in results:  # in rank order: replica-major, as the reference's losses
        for step, values in enumerate(result["steps"]):
            close(values["norm"], expected["norms"][step])
            losses[step] += values["losses"]  # only the last stage has losses
            assert values["counts"] == ({"c10d.allreduce_": 1}, clip)
        assert "emb.weight" in result["state"]  # both stages hold the tied weight
        for key, value in result["state"].items():
            close(value, expected["state"][key], msg=key)
    close(losses, expected["losses"])
    assert {key for result in results for key in result["state"]} == set(ReferenceLM().state_dict())
