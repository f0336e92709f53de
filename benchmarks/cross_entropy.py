"""Benchmark: the tied head's cross-entropy, plain, through torch's fused op, and chunked.

Each variant computes the mean cross-entropy of ``F.linear(h, w)`` against random targets,
forward and backward, in float32, where ``w`` is a tied embedding's weight:

- ``plain``: ``F.cross_entropy(head(h), t)``, the full logits;
- ``torch_reference``: ``F.linear_cross_entropy(h, w, t)`` (``options=None``);
- ``torch_chunked``: ``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())``;
- ``toolkit``: ``head.cross_entropy(h, t)`` with the default chunk size (and, for the
  chunk-size rule, ``toolkit_chunk_N`` with ``chunk_size=N``).

Every variant runs in its own process, so that its peak memory is its own: the process warms
up the same kernels on a small shape, allocates the inputs, resets the kernel's peak-RSS mark
(``/proc/self/clear_refs``) and takes the resident set as the baseline; the peak is the
high-water mark over that baseline during the timed steps, so it counts what the loss
allocates (logits, softmax, the gradients of ``h`` and ``w``) and not the inputs or library
start-up. The variants alternate, round after round, and the report gives medians over
rounds and each variant's ratio to the plain path. On a shared machine absolute times are
noisy; the medians of alternated runs keep the ratios meaningful.

Run it with ``python benchmarks/cross_entropy.py`` (``--quick`` for one small shape).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.nn import TiedLinear

VARIANTS = ("plain", "torch_reference", "torch_chunked", "toolkit")
# Fixed chunks around the default rule (524 tokens at a 32,000 vocabulary in float32).
CHUNK_VARIANTS = ("toolkit_chunk_256", "toolkit_chunk_512", "toolkit_chunk_1024")
# (tokens, hidden, vocabulary): the shape and one whose float32 logits exceed 2 GB.
SHAPES = ((4096, 512, 32000), (8192, 512, 65536))
QUICK_SHAPES = ((1024, 256, 8000),)
WARMUP_SHAPE = (256, 64, 1000)
MB = 2**20


def _rss_bytes(field: str) -> int:
    """A field of ``/proc/self/status`` (``VmRSS`` or ``VmHWM``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _step(variant: str, head: TiedLinear, h: torch.Tensor, t: torch.Tensor) -> None:
    """One forward and backward of ``variant``; the gradients stay in ``.grad``."""
    loss: torch.Tensor
    if variant == "plain":
        loss = F.cross_entropy(head(h), t)
    elif variant == "torch_reference":
        loss = F.linear_cross_entropy(h, head.weight, t)
    elif variant == "torch_chunked":
        loss = F.linear_cross_entropy(h, head.weight, t, options=nn.LinearCrossEntropyOptions())
    elif variant == "toolkit":
        loss = head.cross_entropy(h, t)
    elif variant.startswith("toolkit_chunk_"):
        loss = head.cross_entropy(h, t, chunk_size=int(variant.removeprefix("toolkit_chunk_")))
    else:
        raise ValueError(f"unknown variant {variant!r}")
    loss.backward()  # type: ignore[no-untyped-call]


def _inputs(
    tokens: int, hidden: int, vocab: int
) -> tuple[nn.Embedding, TiedLinear, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    embedding = nn.Embedding(vocab, hidden)
    h = torch.randn(tokens, hidden, generator=generator).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=generator)
    return embedding, TiedLinear(embedding), h, t


def measure(variant: str, shape: tuple[int, int, int], steps: int) -> dict[str, float]:
    """In this process: warm up, then time ``steps`` steps and take the peak over baseline."""
    _, head, h, t = _inputs(*WARMUP_SHAPE)
    for _ in range(2):
        _step(variant, head, h, t)
    embedding, head, h, t = _inputs(*shape)
    del _
    gc.collect()
    clear_refs = Path("/proc/self/clear_refs")
    clear_refs.write_text("5")  # reset VmHWM to the current resident set
    baseline = _rss_bytes("VmRSS")
    times = []
    for _ in range(steps):
        embedding.weight.grad = None
        h.grad = None
        start = time.perf_counter()
        _step(variant, head, h, t)
        times.append(time.perf_counter() - start)
    return {
        "seconds": statistics.median(times),
        "peak_mb": (_rss_bytes("VmHWM") - baseline) / MB,
    }


def _in_subprocess(variant: str, shape: tuple[int, int, int], steps: int) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", variant, ",".join(map(str, shape))]
    command += ["--steps", str(steps)]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=os.environ)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def run(
    quick: bool,
    shapes: tuple[tuple[int, int, int], ...] | None = None,
    rounds: int | None = None,
    variants: tuple[str, ...] | None = None,
    steps: int | None = None,
) -> dict[str, object]:
    """Alternate the variants in fresh processes, round after round; report medians and ratios.

    Returns:
        Per shape, per variant: median seconds and peak MB over rounds, and the ratios to
        the plain path; and the three targets of the toolkit variant, met or not.
    """
    shapes = shapes or (QUICK_SHAPES if quick else SHAPES)
    rounds = rounds or (1 if quick else 3)
    steps = steps or (1 if quick else 2)
    if variants:
        variants = tuple(dict.fromkeys(("plain", "torch_chunked", "toolkit", *variants)))
    else:
        variants = VARIANTS if quick else (*VARIANTS, *CHUNK_VARIANTS)
    results: dict[str, object] = {}
    for shape in shapes:
        runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
        for round_ in range(rounds):
            order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
            for variant in order:
                runs[variant].append(_in_subprocess(variant, shape, steps))
        table = {
            v: {
                "seconds": statistics.median(r["seconds"] for r in rs),
                "peak_mb": statistics.median(r["peak_mb"] for r in rs),
            }
            for v, rs in runs.items()
        }
        plain, chunked, ours = table["plain"], table["torch_chunked"], table["toolkit"]
        for row in table.values():
            row["time_ratio"] = row["seconds"] / plain["seconds"]
            row["memory_ratio"] = row["peak_mb"] / plain["peak_mb"]
        targets = {
            "memory <= 1/6 of plain": ours["memory_ratio"] <= 1 / 6,
            "time <= 1.10x plain": ours["time_ratio"] <= 1.10,
            "faster than torch chunked": ours["seconds"] < chunked["seconds"],
            "memory <= 1.5x torch chunked": ours["peak_mb"] <= 1.5 * chunked["peak_mb"],
        }
        key = "x".join(map(str, shape))
        results[key] = {"variants": table, "targets": targets}
        _print_shape(key, table, targets, rounds)
    return results


def _print_shape(
    key: str, table: dict[str, dict[str, float]], targets: dict[str, bool], rounds: int
) -> None:
    tokens, hidden, vocab = map(int, key.split("x"))
    logits_gb = tokens * vocab * 4 / 1e9
    print(f"\n{tokens} tokens x {hidden} hidden -> {vocab} vocabulary, float32")
    print(f"(logits {logits_gb:.2f} GB; median of {rounds} alternated runs, forward + backward)")
    print(f"{'variant':<20} {'time s':>8} {'x plain':>8} {'peak MB':>9} {'x plain':>8}")
    for name, row in table.items():
        print(
            f"{name:<20} {row['seconds']:>8.3f} {row['time_ratio']:>8.2f} "
            f"{row['peak_mb']:>9.0f} {row['memory_ratio']:>8.3f}"
        )
    for target, met in targets.items():
        print(f"  toolkit: {target}: {'met' if met else 'NOT met'}")


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark, or, with ``--child``, measure one variant in this process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small shape, one round")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--shape", action="append", help="TOKENS,HIDDEN,VOCAB instead of the default shapes"
    )
    parser.add_argument("--rounds", type=int, help="alternated runs of every variant")
    parser.add_argument(
        "--variants", help="comma-separated variants (plain, torch_chunked, toolkit always run)"
    )
    parser.add_argument("--steps-per-run", type=int, help="timed steps in each process")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "SHAPE"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        variant, shape = args.child
        tokens, hidden, vocab = (int(n) for n in shape.split(","))
        print(json.dumps(measure(variant, (tokens, hidden, vocab), args.steps)))
        return
    shapes = tuple(tuple(int(n) for n in s.split(",")) for s in args.shape or ())
    variants = tuple(args.variants.split(",")) if args.variants else None
    results: dict[str, Any] = run(
        args.quick,
        shapes or None,  # type: ignore[arg-type]
        args.rounds,
        variants,
        args.steps_per_run,
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
