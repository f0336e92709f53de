"""Benchmarks for toolkit.nn against what users would otherwise write.

Each subject is a module of this folder with ``run(quick: bool) -> dict[str, object]``,
which measures, prints its own report and returns JSON-able results; ``SUBJECTS`` maps each
section name to its module, imported only when the section runs. How timings are compared
is in ``timing.py``.

Run it with ``nox -s bench`` (``nox -s bench -- --quick`` for a shorter run), or directly
with ``python benchmarks/bench_nn.py`` where toolkit-nn, safetensors and (optionally)
torchtune are installed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import toolkit.nn

DEFAULT_JSON = Path("build") / "benchmarks" / "nn.json"

# Section name (for --only) to module name. A new subject is one line here.
SUBJECTS: dict[str, str] = {
    "linear": "linear",
    "lm-head": "lm_head",
    "compile": "torch_compile",
    "memory": "memory",
    "dict": "module_dict",
    "tensor-parallel": "tensor_parallel",
    "pipeline": "pipeline",
    "clip": "clip",
    "cross-entropy": "cross_entropy",
    "causal-lm-loss": "causal_lm_loss",
}
# Sections run at --threads torch threads; every other one starts at --small-threads.
MANY_THREADS = frozenset({"lm-head"})


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen subjects and write their results as JSON.

    Returns:
        1 if a subject reports ``failures`` (the tied LM does not compile to one graph
        without breaks), else 0. Timing targets are reported, not enforced: on a shared
        machine their spread can straddle them.
    """
    args = _parser().parse_args(argv)
    sections = [name for name in SUBJECTS if name in (args.only or SUBJECTS)]
    env = environment(args)
    print(
        f"toolkit-nn {env['toolkit_nn']}, torch {torch.__version__}, "
        f"{env['cpus_available']} CPUs ({env['processor']}); torch threads: "
        f"{args.threads} at the LM-head shape, {args.small_threads} elsewhere",
        flush=True,
    )
    started = time.perf_counter()
    results: dict[str, dict[str, object]] = {}
    section_seconds = {}
    for section in sections:
        print(f"\n## {section}\n", flush=True)
        torch.set_num_threads(args.threads if section in MANY_THREADS else args.small_threads)
        section_start = time.perf_counter()
        module: Any = importlib.import_module(SUBJECTS[section])
        options = {"backend": args.backend} if section == "compile" else {}
        results[section] = module.run(args.quick, **options)
        section_seconds[section] = round(time.perf_counter() - section_start, 1)
        print(f"\n({section}: {section_seconds[section]} s)", flush=True)
    env["section_seconds"] = section_seconds
    env["seconds"] = round(time.perf_counter() - started, 1)

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"environment": env, "results": results}, indent=2) + "\n")
    print(f"\nwrote {args.json} ({env['seconds']} s)")
    failures = [
        f"{section}: {failure}"
        for section, result in results.items()
        for failure in _as_list(result.get("failures"))
    ]
    for failure in failures:
        print(f"MISSED: {failure}")
    return 1 if failures else 0


def _as_list(value: object) -> list[object]:
    """A subject's ``failures``: a list of messages, or nothing."""
    return list(value) if isinstance(value, list) else []


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks, for a smoke run")
    parser.add_argument(
        "--json",
        type=Path,
        default=DEFAULT_JSON,
        help=f"where to write the results (default: {DEFAULT_JSON})",
    )
    parser.add_argument(
        "--only",
        choices=list(SUBJECTS),
        action="append",
        help="run only this section (repeatable; default: all)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch intra-op threads for the LM-head shape (default: 2)",
    )
    parser.add_argument(
        "--small-threads",
        type=int,
        default=1,
        help="torch intra-op threads for every other section (default: 1: their work is "
        "too small to split, and a second thread only waits on a busy core)",
    )
    parser.add_argument(
        "--backend", default="inductor", help="torch.compile backend (default: inductor)"
    )
    return parser


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """The machine, versions and settings the numbers belong to."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "toolkit_nn": toolkit.nn.__version__,
        "safetensors": _version("safetensors"),
        "torchtune": _version("torchtune"),
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "cpus_available": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "torch_threads_lm_head": args.threads,
        "torch_threads_elsewhere": args.small_threads,
        "torch_interop_threads": torch.get_num_interop_threads(),
        "quick": args.quick,
        "command": " ".join(["python", "benchmarks/bench_nn.py", *sys.argv[1:]]),
    }


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
