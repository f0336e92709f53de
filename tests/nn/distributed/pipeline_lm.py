"""The tiny tied LM of ``tiny_lm`` cut into pipeline stages, the usual way.

Each stage is a deep copy of the whole model with the modules of the other stages replaced by
``nn.Identity`` or ``None``, so every module keeps its qualified name in the whole model and a
checkpoint of the stages lines up with one of the whole model. The last stage keeps its copy
of the embedding registered, and the deep copy re-ties its TiedLinear to that copy.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from tests.nn.distributed.tiny_lm import LR, ReferenceLM, TinyLM, batches, initial_state, loss_fn


class StageLM(TinyLM):
    """TinyLM whose forward runs only the parts this stage holds."""

    lookup = True  # whether this stage looks the tokens up in the embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.lookup else x
        for block in self.blocks:
            h = block(h)
        return h if self.out is None else self.out(h)


def whole_model(state: dict[str, Any]) -> StageLM:
    """The whole model, holding ``state``."""
    model = StageLM()
    model.load_state_dict(state)
    return model


def split(model: StageLM, stage_index: int, num_stages: int) -> StageLM:
    """Stage ``stage_index`` of ``num_stages``: block ``i`` runs on stage ``i * stages // blocks``.

    The first stage drops the output; the others do not look tokens up, and the last keeps
    the embedding registered for its head.
    """
    stage = copy.deepcopy(model)
    n_blocks = len(stage.blocks)
    for i in range(n_blocks):
        if i * num_stages // n_blocks != stage_index:
            stage.blocks[i] = nn.Identity()
    if stage_index != num_stages - 1:
        stage.out = None  # type: ignore[assignment]
    if stage_index != 0:
        stage.lookup = False
        if stage_index != num_stages - 1:
            stage.emb = None  # type: ignore[assignment]
    return stage


# Training: the expected values, written out without the code under test. -----------------

STEPS = 3
MICROBATCHES = 2
MAX_NORM = 0.5  # below every step's gradient norm, so clipping always scales the gradients


def reference_pipeline_training(
    replicas: int = 1, steps: int = STEPS, max_norm: float = MAX_NORM
) -> dict[str, Any]:
    """Train ``ReferenceLM`` in one process as the pipeline should, with clipping.

    Each step's global batch (``batches(2)``, four rows) is split among ``replicas``
    data-parallel replicas and each replica's rows into ``MICROBATCHES`` microbatches; the loss
    is the mean of the microbatch losses, which all have the same size.

    Returns:
        ``losses[step]``, the loss of each microbatch in replica-major order; ``norms[step]``,
        the total gradient norm before clipping; and ``state``, the final state.
    """
    model = ReferenceLM()
    model.load_state_dict(initial_state())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for idx, targets in batches(2, steps):
        chunks = replicas * MICROBATCHES
        per_mb = [
            loss_fn(model(i), t)
            for i, t in zip(idx.chunk(chunks), targets.chunk(chunks), strict=True)
        ]
        opt.zero_grad()
        torch.stack(per_mb).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        losses.append([loss.item() for loss in per_mb])
    return {"losses": losses, "norms": norms, "state": model.state_dict()}
