"""The tiny tied LM of ``tiny_lm`` cut into pipeline stages, and its training in one process.

Each stage is a deep copy of the whole model with the other stages' modules replaced by
``nn.Identity`` or ``None``, so every module keeps its qualified name in the whole model (unless
``split`` renumbers the blocks); the last stage keeps its copy of the embedding registered, read
by its head.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from tests.nn.distributed.tiny_lm import LR, ReferenceLM, TinyLM, batches, initial_state, loss_fn

STEPS = 3
MICROBATCHES = 2
MAX_NORM = 0.5  # below every step's gradient norm, so clipping always scales the gradients


class StageLM(TinyLM):
    """TinyLM whose forward runs only the parts this stage holds."""

    lookup = True  # whether this stage looks the tokens up in the embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.lookup else x
        for block in self.blocks:
            h = block(h)
        return h if self.out is None else self.out(h)


def whole_model(state: dict[str, Any], n_blocks: int = 2) -> StageLM:
    model = StageLM(n_blocks=n_blocks)
    model.load_state_dict(state)
    return model


def stage_blocks(stage_index: int, num_stages: int, n_blocks: int) -> list[int]:
    """The blocks of stage ``stage_index``: block ``i`` is on stage ``i * stages // blocks``."""
    return [i for i in range(n_blocks) if i * num_stages // n_blocks == stage_index]


def split(model: StageLM, stage_index: int, num_stages: int, *, renumber: bool = False) -> StageLM:
    """Stage ``stage_index`` of ``num_stages``, holding the blocks of ``stage_blocks``.

    The other stages' blocks are ``nn.Identity`` placeholders, so every block keeps its index
    in the whole model; with ``renumber`` the stage holds only its own blocks, numbered from 0,
    so that stages without the embedding have the same parameter names (``whole_name`` maps
    them back).
    """
    stage = copy.deepcopy(model)
    n_blocks = len(stage.blocks)
    own = stage_blocks(stage_index, num_stages, n_blocks)
    if renumber:
        stage.blocks = nn.ModuleList(stage.blocks[i] for i in own)
    else:
        for i in range(n_blocks):
            if i not in own:
                stage.blocks[i] = nn.Identity()
    if stage_index != num_stages - 1:
        stage.out = None  # type: ignore[assignment]
    if stage_index != 0:
        stage.lookup = False
        if stage_index != num_stages - 1:
            stage.emb = None  # type: ignore[assignment]
    return stage


def whole_name(
    name: str, stage_index: int, num_stages: int, n_blocks: int, *, renumber: bool
) -> str:
    """The whole model's name of parameter ``name`` of a stage that ``split`` made."""
    if not renumber or not name.startswith("blocks."):
        return name
    _, index, rest = name.split(".", 2)
    first = stage_blocks(stage_index, num_stages, n_blocks)[0]
    return f"blocks.{int(index) + first}.{rest}"


def stages_of(seed: int, num_stages: int) -> list[StageLM]:
    model = whole_model(initial_state(seed=seed))
    return [split(model, i, num_stages) for i in range(num_stages)]


def random_grads(stages: list[StageLM], seed: int) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    return [{n: torch.randn_like(p) for n, p in stage.named_parameters()} for stage in stages]


def whole_clip(
    stages: list[StageLM], grads: list[dict[str, torch.Tensor]], norm_type: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """torch's clip to 0.5 of the whole model: each name once, a tied weight the copies' sum."""
    twins: dict[str, nn.Parameter] = {}
    for stage, stage_grads in zip(stages, grads, strict=True):
        for name, param in stage.named_parameters():
            if name not in twins:
                twins[name] = nn.Parameter(torch.zeros_like(param))
                twins[name].grad = torch.zeros_like(param)
            twins[name].grad += stage_grads[name]  # type: ignore[operator]
    norm = torch.nn.utils.clip_grad_norm_(twins.values(), 0.5, norm_type)
    assert norm > 0.5  # clipping scales
    return norm, {name: twin.grad for name, twin in twins.items()}  # type: ignore[misc]


def reference_pipeline_training(replicas: int = 1) -> dict[str, Any]:
    """``ReferenceLM`` trained with clipping as the pipeline should, without PipelineTie.

    Each step's batch is split among ``replicas`` and each replica's rows into
    ``MICROBATCHES``; ``losses[step]`` holds the microbatches' losses, replica-major.
    """
    model = ReferenceLM()
    model.load_state_dict(initial_state())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for idx, targets in batches(2, STEPS):
        chunks = replicas * MICROBATCHES
        per_mb = [
            loss_fn(model(i), t)
            for i, t in zip(idx.chunk(chunks), targets.chunk(chunks), strict=True)
        ]
        opt.zero_grad()
        torch.stack(per_mb).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        losses.append([loss.item() for loss in per_mb])
    return {"losses": losses, "norms": norms, "state": model.state_dict()}
