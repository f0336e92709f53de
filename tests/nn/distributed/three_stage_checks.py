"""One tie read on three pipeline stages: the embedding, an auxiliary head, the main head.

Three ranks run three stages of ``AuxLM`` under ``ScheduleGPipe``: stage 0 looks the tokens
up and runs block 0; stage 1 runs block 1 and an auxiliary head, a TiedLinear on its own
copy of the embedding whose logits feed back into the hidden state; stage 2 holds the
final norm and the main head, on a third copy. ``PipelineTie`` over the three ranks sums the
three copies' gradients. The expected values come from ``reference_training``, the whole
model in one process with both heads written out as ``F.linear``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from tests.nn.distributed.tiny_lm import DIM, LR, VOCAB, Block, batches, loss_fn
from toolkit.nn import PipelineTie, TiedLinear, pipeline_clip_grad_norm_

WORLD_SIZES = (3,)
STAGES = 3
STEPS = 3
MICROBATCHES = 2
MAX_NORM = 0.5


class AuxLM(nn.Module):
    """A tied LM whose embedding is read by an auxiliary head after block 1 and the main head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm: nn.LayerNorm | None = nn.LayerNorm(DIM)
        self.aux = TiedLinear(self.emb)
        self.head = TiedLinear(self.emb)
        self.parts: tuple[int, ...] = (0, 1, 2)  # the stages this copy runs

    def logits(self, h: torch.Tensor, head: TiedLinear) -> torch.Tensor:
        return head(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        if 0 in self.parts:
            h = self.blocks[0](self.emb(h))
        if 1 in self.parts:
            h = self.blocks[1](h)
            h = h + torch.tanh(self.logits(h, self.aux)).mean(-1, keepdim=True)
        if 2 in self.parts:
            assert self.norm is not None
            return self.logits(self.norm(h), self.head)
        return h


class ReferenceAuxLM(AuxLM):
    """The expected behaviour: both heads are ``F.linear`` on the embedding's weight."""

    def logits(self, h: torch.Tensor, head: TiedLinear) -> torch.Tensor:
        return F.linear(h, self.emb.weight)


def initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in ReferenceAuxLM().state_dict().items()}


def split(stage_index: int) -> AuxLM:
    """Stage ``stage_index`` of the whole model; every stage keeps its copy of the embedding."""
    model = AuxLM()
    model.load_state_dict(initial_state())
    stage = copy.deepcopy(model)
    stage.parts = (stage_index,)
    for i in range(len(stage.blocks)):
        if i != stage_index:
            stage.blocks[i] = nn.Identity()
    if stage_index != STAGES - 1:
        stage.norm = None
    return stage


def reference_training() -> dict[str, Any]:
    """The whole model trained in one process as the pipeline should, with clipping."""
    model = ReferenceAuxLM()
    model.load_state_dict(initial_state())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for idx, targets in batches(2, STEPS):
        per_mb = [
            loss_fn(model(i), t)
            for i, t in zip(idx.chunk(MICROBATCHES), targets.chunk(MICROBATCHES), strict=True)
        ]
        opt.zero_grad()
        torch.stack(per_mb).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        losses.append([loss.item() for loss in per_mb])
    return {"losses": losses, "norms": norms, "state": model.state_dict()}


def train(*, sum_grads: bool = True, count_tie: bool = True) -> dict[str, Any]:
    """Train the three stages; what the test compares with ``reference_training``."""
    rank = dist.get_rank()
    stage = split(rank)
    tie = PipelineTie(stage)  # the default group: the whole pipeline
    schedule = ScheduleGPipe(
        PipelineStage(stage, rank, STAGES, torch.device("cpu")),
        n_microbatches=MICROBATCHES,
        loss_fn=loss_fn,
    )
    opt = torch.optim.SGD(stage.parameters(), lr=LR)
    steps = []
    for idx, targets in batches(2, STEPS):
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        schedule.step(idx, target=targets, losses=losses)
        if sum_grads:
            tie.reduce_grads()
        norm = pipeline_clip_grad_norm_(
            stage.parameters(), MAX_NORM, tie=tie if count_tie else None, group=dist.group.WORLD
        )
        opt.step()
        steps.append({"losses": [loss.item() for loss in losses], "norm": norm.item()})
    return {
        "copies": repr(tie),
        "steps": steps,
        "state": {k: v.detach().clone() for k, v in stage.state_dict().items()},
    }


def checks(world_size: int, checkpoint_dir: Path) -> dict[str, Callable[[], Any]]:
    """The checks of this module at ``world_size``: none but at ``WORLD_SIZES``."""
    del checkpoint_dir
    if world_size not in WORLD_SIZES:
        return {}
    return {
        "three_stages/tied": train,
        "three_stages/without_sum": lambda: train(sum_grads=False),
        "three_stages/tie_counted_thrice": lambda: train(count_tie=False),
    }
