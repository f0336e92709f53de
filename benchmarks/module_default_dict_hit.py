"""The hit path of ModuleDefaultDict: ``d[key]`` on an existing key, against ``nn.ModuleDict``.

Placement of new entries and the other miss-path work must cost a hit nothing. Both lookups
are timed in one process, interleaved round by round so that drift affects both alike, and
the report is the ratio of the medians (1.0 means as fast as ``nn.ModuleDict``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import timeit

import torch
from torch import nn

from toolkit.nn import ModuleDefaultDict


def run(quick: bool) -> dict[str, object]:
    """Time ``d["b"]`` for both dicts after the ours was moved, cast and put in eval mode."""
    entries = {name: nn.Linear(2, 2) for name in ("a", "b", "c")}
    plain = nn.ModuleDict(entries)
    ours = ModuleDefaultDict(lambda: nn.Linear(2, 2), entries).to(torch.float64).eval()
    rounds, number = (15, 20_000) if quick else (41, 100_000)
    times: dict[str, list[float]] = {"nn.ModuleDict": [], "ModuleDefaultDict": []}
    for _ in range(rounds):
        for name, d in (("nn.ModuleDict", plain), ("ModuleDefaultDict", ours)):
            seconds = timeit.Timer('d["b"]', globals={"d": d}).timeit(number)
            times[name].append(seconds / number * 1e9)
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratio = medians["ModuleDefaultDict"] / medians["nn.ModuleDict"]
    print("d[key] on an existing key, median ns per lookup over", rounds, "rounds")
    for name, value in medians.items():
        print(f"  {name:18} {value:7.1f} ns")
    print(f"  ratio ModuleDefaultDict / nn.ModuleDict: {ratio:.3f}")
    return {"hit_ns": medians, "hit_ratio": ratio}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    print(json.dumps(run(parser.parse_args().quick)))
