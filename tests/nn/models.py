"""The tiny models the tests share, importable so that pickle can find their classes."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from toolkit.nn import TiedLinear


class TiedPair(nn.Module):
    """An embedding and a TiedLinear head reading its weight: the smallest tied LM."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(num_embeddings, embedding_dim, dtype=dtype, device=device)
        self.head = TiedLinear(self.emb)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx))


class TiedLM(nn.Module):
    """A tied LM whose embedding sits in a trunk with a norm: a unit that does not call the head."""

    def __init__(self, vocab: int = 17, dim: int = 8) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Embedding(vocab, dim), nn.LayerNorm(dim))
        self.head = TiedLinear(self.trunk[0])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(idx))  # type: ignore[no-any-return]


class Counter(nn.Module):
    """A module with one parameter holding the index it was built with."""

    _made = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Parameter(torch.tensor([float(next(Counter._made))]))


class CountingFactory:
    """A picklable factory that counts its calls and builds a fresh Counter each time."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> Counter:
        self.calls += 1
        return Counter()

    def __repr__(self) -> str:
        return "CountingFactory()"
