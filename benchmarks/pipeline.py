"""What PipelineTie adds to a pipeline step: the collectives, counted, and their bytes.

A tied model of two stages is trained for a few steps on two gloo ranks, started by torch's
elastic launcher as ``torchrun`` starts them (its rendezvous store on a port the system picks),
and in this process with both stages on one rank (a looped schedule). Each rank counts,
with ``CommDebugMode``, the collectives that ``PipelineTie.reduce_grads``,
``pipeline_clip_grad_norm_`` and ``PipelineTie.broadcast`` issue per step, by default and
with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, and compares the bytes of the tie's all-reduce with
those the schedule sends between the stages. Counts do not depend on the machine, so they
are exact, not timed.

Run it with ``python benchmarks/pipeline.py`` (``--quick`` for fewer steps) where toolkit-nn
is installed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleLoopedBFS
from torch.distributed.tensor.debug import CommDebugMode

from toolkit.nn import PipelineTie, TiedLinear, pipeline_clip_grad_norm_

VOCAB, DIM, MICROBATCHES, BATCH, SEQ = 1024, 64, 4, 8, 16


class StagedLM(nn.Module):
    """A tied LM whose forward runs the parts a stage holds."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): nn.Linear(DIM, DIM) for i in range(2)})
        self.norm: nn.Module | None = nn.LayerNorm(DIM)
        self.head = TiedLinear(self.emb)
        self.looks_up = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Look up on the first stage, run the layers held, and the head on the last."""
        h = self.emb(x) if self.looks_up else x
        for layer in self.layers.values():
            h = h + torch.tanh(layer(h))
        return h if self.norm is None else self.head(self.norm(h))


def split(model: StagedLM, index: int) -> StagedLM:
    """Stage ``index`` of two: a deep copy without the other stage's modules."""
    stage = copy.deepcopy(model)
    del stage.layers[str(1 - index)]
    if index == 0:
        stage.norm = None
    else:
        stage.looks_up = False
    return stage


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over every position."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def _comm() -> CommDebugMode:
    return CommDebugMode()  # type: ignore[no-untyped-call]


def _counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).removeprefix("c10d."): n for op, n in mode.get_comm_counts().items()}


def _train(
    stages: list[StagedLM],
    step: Callable[[torch.Tensor, torch.Tensor], object],
    tie: PipelineTie,
    steps: int,
) -> list[dict[str, Any]]:
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    gen = torch.Generator().manual_seed(0)
    out: list[dict[str, Any]] = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        targets = torch.randint(0, VOCAB, tokens.shape, generator=gen)
        opt.zero_grad()
        step(tokens, targets)
        with _comm() as tie_comm:
            tie.reduce_grads()
        with _comm() as clip:
            pipeline_clip_grad_norm_(params, 1.0, tie=tie)
        opt.step()
        with _comm() as broadcast:
            tie.broadcast()
        out.append(
            {"tie": _counts(tie_comm), "clip": _counts(clip), "broadcast": _counts(broadcast)}
        )
    tie.check()
    return out


def _rank(steps: int) -> list[dict[str, Any]]:
    """One rank of the two-stage pipeline, in the environment the launcher gives it."""
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        torch.manual_seed(0)
        stage = split(StagedLM(), rank)
        tie = PipelineTie(stage)
        schedule = ScheduleGPipe(
            PipelineStage(stage, rank, 2, torch.device("cpu")),
            n_microbatches=MICROBATCHES,
            loss_fn=loss_fn,
        )

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> object:
            if rank == 0:
                return schedule.step(tokens)
            return schedule.step(target=targets)

        return _train([stage], step, tie, steps)
    finally:
        dist.destroy_process_group()


def two_ranks(steps: int) -> dict[int, list[dict[str, Any]]]:
    """Two stages on two ranks: what each rank counted per step."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        run_id=f"pipeline-{uuid.uuid4().hex}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # port 0: the system picks a free one
        max_restarts=0,
        local_addr="127.0.0.1",
    )
    results = elastic_launch(config, _rank)(steps)
    return {rank: results[rank] for rank in sorted(results)}


def one_rank(steps: int) -> list[dict[str, Any]]:
    """Both stages on this rank, under a looped schedule."""
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = StagedLM()
        stages = [split(model, i) for i in range(2)]
        tie = PipelineTie(stages)
        schedule = ScheduleLoopedBFS(
            [PipelineStage(s, i, 2, torch.device("cpu")) for i, s in enumerate(stages)],
            n_microbatches=MICROBATCHES,
            loss_fn=loss_fn,
        )
        return _train(stages, lambda x, y: schedule.step(x, target=y), tie, steps)
    finally:
        dist.destroy_process_group()


def run(quick: bool) -> dict[str, object]:
    """Count the collectives per step; print a report and return the counts."""
    steps = 2 if quick else 4
    looped = one_rank(steps)
    ranks = two_ranks(steps)
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # for the ranks launched next
    try:
        detail = two_ranks(steps)
    finally:
        del os.environ["TORCH_DISTRIBUTED_DEBUG"]
    tied_bytes = VOCAB * DIM * 4
    activation_bytes = 2 * BATCH * SEQ * DIM * 4  # forward and backward, every microbatch
    result: dict[str, object] = {
        "steps": steps,
        "tied_gradient_bytes": tied_bytes,
        "activation_bytes": activation_bytes,
        "two_ranks": {str(r): counts[-1] for r, counts in ranks.items()},
        "two_ranks_detail": {str(r): counts[-1] for r, counts in detail.items()},
        "one_rank_looped": looped[-1],
        "tie_counts_equal_every_step": all(
            c["tie"] == counts[0]["tie"]
            for counts in [*ranks.values(), *detail.values(), looped]
            for c in counts
        ),
    }
    print(f"PipelineTie, per training step ({steps} steps, {MICROBATCHES} microbatches):")
    for what, launch in (("", ranks), (" under DETAIL", detail)):
        for rank, counts in launch.items():
            last = counts[-1]
            print(
                f"  2 ranks{what}, stage {rank}: reduce_grads {last['tie'] or 'none'}, "
                f"clipping {last['clip'] or 'none'}, broadcast {last['broadcast'] or 'none'}"
            )
    last = looped[-1]
    print(
        f"  1 rank holding both stages: reduce_grads {last['tie'] or 'none'}, "
        f"clipping {last['clip'] or 'none'}, broadcast {last['broadcast'] or 'none'}"
    )
    print(
        f"  the tie's all_reduce carries the tied gradient, {tied_bytes} bytes; the schedule "
        f"sends {activation_bytes} bytes of activations and their gradients between the stages"
    )
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    args = parser.parse_args()
    print(json.dumps(run(args.quick), indent=2))
