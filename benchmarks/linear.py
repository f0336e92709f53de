"""TiedLinear against the other ways to apply a shared weight, at the overhead-bound shape.

At 1 token, 8 to 16 features, the matrix product costs almost nothing, so the ratios show
what each way adds in Python: TiedLinear against an ``nn.Linear(bias=False)`` whose weight is
the embedding's Parameter ("nn.Linear shared"), torchtune's ``TiedLinear`` and a raw
``F.linear(x, embedding.weight)`` call, the floor. Targets: TiedLinear at most 1.00x
``nn.Linear`` shared and torchtune's TiedLinear, forward and forward+backward.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch.nn.functional as F
from timing import Candidate, Ratio, interleave, loop, ratio_table, ratios_against, statement
from torch import nn
from torchtune_reference import TIED_LINEAR_FILE, load_tied_linear

from toolkit.nn import TiedLinear

__all__ = ["measure", "run", "torchtune_tied_linear"]

MODES = ("forward", "forward+backward")


def torchtune_tied_linear() -> tuple[type | None, str]:
    """The ``TiedLinear`` class of torchtune, loaded from its own file, and a note saying how."""
    try:
        cls, version = load_tied_linear()
    except ImportError as error:
        return None, f"{error}: its TiedLinear is left out of the comparison"
    note = (
        f"torchtune {version} is installed with --no-deps and only its {TIED_LINEAR_FILE} "
        "is loaded (importlib, from the installed distribution): the torchtune package "
        "itself does not import beside current torchao"
    )
    return cls, note


def _candidates(
    embedding: nn.Embedding, torchtune_cls: type | None
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Every way to apply ``embedding.weight`` as a bias-free linear layer."""
    shared = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False)
    shared.weight = embedding.weight
    candidates: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "TiedLinear": TiedLinear(embedding),
        "nn.Linear shared": shared,
    }
    if torchtune_cls is not None:
        candidates["torchtune TiedLinear"] = torchtune_cls(embedding)
    candidates["F.linear"] = functools.partial(F.linear, weight=embedding.weight)
    return candidates


def _one_call(
    candidate: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grad: torch.Tensor | None
) -> Callable[[], None]:
    """One forward of ``candidate``, and its backward unless ``grad`` is None."""

    def call() -> None:
        out = candidate(x)
        if grad is not None:
            out.backward(grad)  # type: ignore[no-untyped-call]

    return call


def measure(
    *,
    case: str,
    shape: tuple[int, int, int],
    blocks: int,
    block_seconds: float,
    targets: dict[str, float],
    torchtune_cls: type | None,
    calls_per_block: int | None = None,
) -> list[Ratio]:
    """Forward and forward+backward of TiedLinear against the alternatives at one shape.

    Args:
        case: The shape in words, for the table.
        shape: ``(tokens, in_features, out_features)``.
        blocks: Blocks per mode.
        block_seconds: Length of a calibrated block.
        targets: Baseline name to the ratio TiedLinear must stay at or below.
        torchtune_cls: torchtune's ``TiedLinear``, or ``None`` to leave it out.
        calls_per_block: ``1`` for calls long enough to time one by one, with a plain
            Python loop; by default, ``torch.utils.benchmark`` loops calibrated to
            ``block_seconds``.
    """
    tokens, in_features, out_features = shape
    torch.manual_seed(0)
    embedding = nn.Embedding(out_features, in_features)
    weight = embedding.weight
    candidates = _candidates(embedding, torchtune_cls)
    x = torch.randn(tokens, in_features, requires_grad=True)
    grad = torch.ones(tokens, out_features)
    reference = F.linear(x, weight)
    for name, candidate in candidates.items():  # also the warm-up of every candidate
        out = candidate(x)
        if not torch.equal(out, reference):
            raise AssertionError(f"{name} does not compute F.linear(x, weight)")
        out.backward(grad)  # type: ignore[no-untyped-call]
    del reference, out
    namespace = {"x": x, "w": weight, "g": grad, "F": F}
    namespace |= {f"c{i}": c for i, c in enumerate(candidates.values())}
    ratios = []
    for mode in MODES:
        backward = mode == "forward+backward"
        timers: dict[str, Candidate] = {}
        for i, (name, candidate) in enumerate(candidates.items()):
            if calls_per_block is not None:
                timers[name] = loop(_one_call(candidate, x, grad if backward else None))
                continue
            # A statement calls F.linear itself: the partial would add its own overhead.
            call = "F.linear(x, w)" if name == "F.linear" else f"c{i}(x)"
            timers[name] = statement(call + ".backward(g)" if backward else call, namespace)
        samples = interleave(
            timers, blocks=blocks, number=calls_per_block, block_seconds=block_seconds
        )
        weight.grad = None
        x.grad = None
        ratios += ratios_against(
            samples, "TiedLinear", section="TiedLinear", case=f"{case}, {mode}", targets=targets
        )
    return ratios


def run(quick: bool) -> dict[str, object]:
    """Measure the overhead-bound shape, print the table and return the ratios."""
    torchtune_cls, note = torchtune_tied_linear()
    print(note)
    ratios = measure(
        case="1 token, 8 -> 16",
        shape=(1, 8, 16),
        blocks=41 if quick else 201,
        block_seconds=0.01 if quick else 0.02,
        targets={"nn.Linear shared": 1.00, "torchtune TiedLinear": 1.00},
        torchtune_cls=torchtune_cls,
    )
    print(ratio_table(ratios))
    return {"torchtune": note, "ratios": [asdict(r) for r in ratios]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks, for a smoke run")
    run(parser.parse_args().quick)
