"""The hit path of ModuleDefaultDict: ``d[key]`` on an existing key, against ``nn.ModuleDict``.

Placement of new entries and the other miss-path work must cost a hit nothing. Both lookups
are timed in one process, interleaved round by round so that drift affects both alike, and
the report is the ratio of the fastest rounds (1.0 means as fast as ``nn.ModuleDict``): as
``timeit`` advises, the minimum is the best estimate on a machine with other load.
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
    # Many short rounds: on a loaded machine the fastest of them is rarely interrupted.
    rounds, number = (100, 5_000) if quick else (300, 5_000)
    times: dict[str, list[float]] = {"nn.ModuleDict": [], "ModuleDefaultDict": []}
    for _ in range(rounds):
        for name, d in (("nn.ModuleDict", plain), ("ModuleDefaultDict", ours)):
            seconds = timeit.Timer('d["b"]', globals={"d": d}).timeit(number)
            times[name].append(seconds / number * 1e9)
    fastest = {name: min(values) for name, values in times.items()}
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratio = fastest["ModuleDefaultDict"] / fastest["nn.ModuleDict"]
    median_ratio = medians["ModuleDefaultDict"] / medians["nn.ModuleDict"]
    print("d[key] on an existing key, ns per lookup over", rounds, "rounds (fastest, median)")
    for name in times:
        print(f"  {name:18} {fastest[name]:7.1f} {medians[name]:7.1f}")
    print(f"  ratio ModuleDefaultDict / nn.ModuleDict: {ratio:.3f} (medians: {median_ratio:.3f})")
    return {"hit_ns": fastest, "hit_ratio": ratio, "hit_ratio_of_medians": median_ratio}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    print(json.dumps(run(parser.parse_args().quick)))
