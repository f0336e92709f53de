"""What several modules of the package share.

The DTensor test, a module's one-line description, and the module that computes a TiedLinear
head's ``x @ weight.T``.

This is the one module whose private names other modules of the package import.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn


def _is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor, without importing ``torch.distributed.tensor``.

    No DTensor exists before that module is imported, so a plain tensor is told apart
    without paying for the import (seconds on a busy machine).
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _describe(module: nn.Module) -> str:
    """A one-line description of ``module``, such as ``Embedding(17, 8)``."""
    return f"{type(module).__name__}({module.extra_repr()})"


class _Linear(nn.Module):
    """The module that performs ``F.linear(x, weight)``, so that hooks can observe it."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)
