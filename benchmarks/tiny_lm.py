"""The tiny language model that the compile and memory benchmarks build three ways."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn

from toolkit.nn import ModuleDefaultDict, TiedLinear

__all__ = ["HEADS", "TinyLM"]

HEADS = ("tied", "shared", "untied")


class TinyLM(nn.Module):
    """A tiny language model with per-task adapters and an output head tied to the embedding.

    Args:
        vocab: Vocabulary size.
        dim: Embedding width.
        head: ``"tied"`` for a TiedLinear head, ``"shared"`` for an ``nn.Linear`` whose weight
            is the embedding's Parameter, ``"untied"`` for an independent ``nn.Linear``.
        tasks: Adapters created before compiling; ``forward`` reads ``tasks[0]``.
    """

    def __init__(
        self, vocab: int, dim: int, head: str, tasks: Sequence[str] = ("en", "de")
    ) -> None:
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"head must be 'tied', 'shared' or 'untied', got {head!r}")
        self.embedding = nn.Embedding(vocab, dim)
        self.adapters: ModuleDefaultDict[nn.Linear] = ModuleDefaultDict(
            functools.partial(nn.Linear, dim, dim)
        )
        for task in tasks:
            self.adapters[task]
        self.task = tasks[0]
        self.head: TiedLinear | nn.Linear
        if head == "tied":
            self.head = TiedLinear(self.embedding)
        else:
            self.head = nn.Linear(dim, vocab, bias=False)
            if head == "shared":
                self.head.weight = self.embedding.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for every position of ``idx``."""
        hidden = self.embedding(idx)
        hidden = hidden + torch.tanh(self.adapters[self.task](hidden))
        return self.head(hidden)
