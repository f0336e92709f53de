"""ModuleDefaultDict lookups against ``nn.ModuleDict``: hits, and misses against doing it by hand.

Target: a hit at most 1.05x ``ModuleDict.__getitem__``. A miss runs the factory and
registers the result; it is compared with calling the factory and assigning by hand, with the
cheapest factory there is (``nn.Identity``), and has no target.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import asdict

import torch
from timing import interleave, ratio_table, ratios_against, statement
from torch import nn

from toolkit.nn import ModuleDefaultDict

__all__ = ["run"]


def run(quick: bool) -> dict[str, object]:
    """Time hits and misses, print the table and return the ratios."""
    blocks, block_seconds = (41, 0.01) if quick else (201, 0.02)
    factory = nn.Identity
    entries = {f"task{i}": nn.Identity() for i in range(8)}
    # Moved, cast and in eval mode, so the hit runs beside the state that places late
    # entries: that work belongs to the miss path only.
    defaultdict: ModuleDefaultDict[nn.Module] = (
        ModuleDefaultDict(factory, entries).to(torch.float64).eval()
    )
    namespace = {"d": defaultdict, "m": nn.ModuleDict(entries)}
    samples = interleave(
        {
            "ModuleDefaultDict[key]": statement("d['task3']", namespace),
            "ModuleDict[key]": statement("m['task3']", namespace),
        },
        blocks=blocks,
        block_seconds=block_seconds,
    )
    ratios = ratios_against(
        samples,
        "ModuleDefaultDict[key]",
        section="ModuleDefaultDict",
        case="hit",
        targets={"ModuleDict[key]": 1.05},
    )

    # Both loops index inline, as user code would, with the collector paused.
    def misses(number: int) -> float:
        keys = [f"new{i}" for i in range(number)]
        fresh: ModuleDefaultDict[nn.Module] = ModuleDefaultDict(factory)
        gc.disable()
        try:
            start = time.perf_counter()
            for key in keys:
                fresh[key]
            return (time.perf_counter() - start) / number
        finally:
            gc.enable()

    def by_hand(number: int) -> float:
        keys = [f"new{i}" for i in range(number)]
        fresh = nn.ModuleDict()
        gc.disable()
        try:
            start = time.perf_counter()
            for key in keys:
                fresh[key] = factory()
            return (time.perf_counter() - start) / number
        finally:
            gc.enable()

    samples = interleave(
        {"ModuleDefaultDict miss": misses, "factory() + ModuleDict[key] = ...": by_hand},
        blocks=blocks,
        block_seconds=block_seconds,
    )
    ratios += ratios_against(
        samples,
        "ModuleDefaultDict miss",
        section="ModuleDefaultDict",
        case="miss (factory nn.Identity; a fresh dict per block)",
    )
    print(ratio_table(ratios))
    return {"ratios": [asdict(r) for r in ratios]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks, for a smoke run")
    run(parser.parse_args().quick)
