"""Benchmark: the tied head's cross-entropy, plain, through torch's fused op, and chunked.

Each variant computes the mean cross-entropy of ``F.linear(h, w)`` against random targets,
forward and backward, in float32, where ``w`` is a tied embedding's weight:

- ``plain``: ``F.cross_entropy(head(h), t)``, the full logits;
- ``torch_reference``: ``F.linear_cross_entropy(h, w, t)`` (``options=None``);
- ``torch_chunked``: ``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())``;
- ``toolkit``: ``head.cross_entropy(h, t)`` with the default chunk size (and, for the
  chunk-size rule, ``toolkit_chunk_N`` with ``chunk_size=N``, on request);
- ``toolkit_none``: ``head.cross_entropy(h, t, reduction="none")``, summed for backward;
- ``plain_capped``: the plain path with a soft-cap and a z-loss,
  ``F.cross_entropy(c, t) + Z * logsumexp(c) ** 2`` (mean) with ``c = S * tanh(logits / S)``;
- ``toolkit_capped``: ``head.cross_entropy(h, t, z_loss=Z, softcap=S)``, the same loss;
- ``plain_fp16`` and ``toolkit_fp16``, on request: the plain path (logits widened to float32,
  as autocast's ``F.cross_entropy`` does) and ``head.cross_entropy(h, t)``, both on a float16
  weight and input, with the loss scaled by 65536 as ``GradScaler`` does;
- ``plain_ignored50``, ``toolkit_ignored50``, ``plain_ignored90`` and ``toolkit_ignored90``:
  ``plain`` and ``toolkit`` with 50% and 90% of the targets (at random positions) set to
  ``ignore_index``, as a prompt's tokens are in supervised fine-tuning; ``toolkit`` computes
  the logits of the counted tokens only;
  with them, ``paired_ignored`` times ``toolkit`` with none, 50% and 90% ignored in one
  process, step by step in rotating order, and gives each share's median ratio to none
  (``--child paired_ignored_compiled SHAPE --steps BLOCKS`` does so compiled);
- ``toolkit_compiled`` and ``toolkit_compiled_ignored50``, on request: ``head.cross_entropy``
  under ``torch.compile(fullgraph=True)`` (inductor), which computes every token, with none
  and half of the targets ignored; compiled in the process's warm-up, at the measured shape;
- ``tp_loss_parallel`` and ``tp_toolkit``: on 2 gloo ranks with the weight sharded on the
  vocabulary, ``loss_parallel()`` over the sharded logits and ``head.cross_entropy`` on the
  shard (``cross_entropy_parallel.py``).

Every variant runs in its own process (its own ranks for the tensor-parallel ones), so that
its peak memory is its own: the process warms up the same kernels on a small shape,
allocates the inputs, resets the kernel's peak-RSS mark (``/proc/self/clear_refs``) and
takes the resident set as the baseline; the peak is the high-water mark over that baseline
during the timed steps, so it counts what the loss allocates (logits, softmax, the
gradients of ``h`` and ``w``) and not the inputs or library start-up. The variants
alternate, round after round, and the report gives medians over rounds and each variant's
ratios to its reference: ``plain_capped`` for ``toolkit_capped``, ``tp_loss_parallel`` for
the tensor-parallel variants, the plain path with the same targets for the others. On a
shared machine absolute times are noisy; the medians of alternated runs keep the ratios
meaningful.

Run it with ``python benchmarks/cross_entropy.py`` (``--quick`` for one small shape).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cross_entropy_parallel
import torch
import torch.nn.functional as F
from process_memory import MB, rss_bytes
from torch import nn

from toolkit.nn import TiedLinear

# The share of ignored targets that a variant's suffix names; none without one.
IGNORED = {"_ignored50": 0.5, "_ignored90": 0.9}
IGNORED_VARIANTS = tuple(f"{v}{suffix}" for suffix in IGNORED for v in ("plain", "toolkit"))
VARIANTS = (
    "plain",
    "torch_reference",
    "torch_chunked",
    "toolkit",
    "toolkit_none",
    "plain_capped",
    "toolkit_capped",
    *IGNORED_VARIANTS,
    *cross_entropy_parallel.VARIANTS,
)
# Fixed chunks around the default rule (524 tokens at a 32,000 vocabulary in float32), on
# request (--variants).
CHUNK_VARIANTS = ("toolkit_chunk_256", "toolkit_chunk_512", "toolkit_chunk_1024")
# Compiled, on request (--variants): compiling takes minutes on these cores.
COMPILED_VARIANTS = ("toolkit_compiled", "toolkit_compiled_ignored50")
# float16 with a loss scale, on request (--variants): float16 products are slow on the CPU.
FP16_VARIANTS = ("plain_fp16", "toolkit_fp16")
LOSS_SCALE = 65536.0
# The z-loss weight and soft-cap of the capped variants (PaLM's 1e-4, Gemma 2's 30).
Z_LOSS, SOFTCAP = 1e-4, 30.0
# (tokens, hidden, vocabulary): the shape. A larger one, 8192,512,65536 (float32
# logits over 2 GB), runs with --shape; the plain variants then need several GB each.
SHAPES = ((4096, 512, 32000),)
QUICK_SHAPES = ((1024, 256, 8000),)
WARMUP_SHAPE = (256, 64, 1000)


def _ignored(variant: str) -> tuple[str, float]:
    """The variant without its suffix, and the share of targets ignored that it names."""
    for suffix, share in IGNORED.items():
        if variant.endswith(suffix):
            return variant.removesuffix(suffix), share
    return variant, 0.0


def _step(variant: str, head: TiedLinear, h: torch.Tensor, t: torch.Tensor) -> None:
    """One forward and backward of ``variant``; the gradients stay in ``.grad``."""
    loss: torch.Tensor
    variant = _ignored(variant)[0]
    if variant == "plain":
        loss = F.cross_entropy(head(h), t)
    elif variant == "torch_reference":
        loss = F.linear_cross_entropy(h, head.weight, t)
    elif variant == "torch_chunked":
        loss = F.linear_cross_entropy(h, head.weight, t, options=nn.LinearCrossEntropyOptions())
    elif variant == "toolkit":
        loss = head.cross_entropy(h, t)
    elif variant == "toolkit_none":
        loss = head.cross_entropy(h, t, reduction="none").sum()
    elif variant == "plain_capped":
        capped = SOFTCAP * torch.tanh(head(h) / SOFTCAP)
        z = torch.logsumexp(capped, dim=-1).square().mean()
        loss = F.cross_entropy(capped, t) + Z_LOSS * z
    elif variant == "toolkit_compiled":
        loss = _compiled(head, h, t)
    elif variant == "toolkit_capped":
        loss = head.cross_entropy(h, t, z_loss=Z_LOSS, softcap=SOFTCAP)
    elif variant == "plain_fp16":
        loss = F.cross_entropy(head(h).float(), t) * LOSS_SCALE
    elif variant == "toolkit_fp16":
        loss = head.cross_entropy(h, t) * LOSS_SCALE
    elif variant.startswith("toolkit_chunk_"):
        loss = head.cross_entropy(h, t, chunk_size=int(variant.removeprefix("toolkit_chunk_")))
    else:
        raise ValueError(f"unknown variant {variant!r}")
    loss.backward()  # type: ignore[no-untyped-call]


@functools.cache
def _compiled_loss() -> Callable[[TiedLinear, torch.Tensor, torch.Tensor], torch.Tensor]:
    return torch.compile(lambda head, h, t: head.cross_entropy(h, t), fullgraph=True)


def _compiled(head: TiedLinear, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return _compiled_loss()(head, h, t)


def _inputs(
    tokens: int, hidden: int, vocab: int, dtype: torch.dtype = torch.float32, ignored: float = 0.0
) -> tuple[nn.Embedding, TiedLinear, torch.Tensor, torch.Tensor]:
    embedding, h, t = cross_entropy_parallel.inputs(tokens, hidden, vocab)
    positions = torch.randperm(tokens, generator=torch.Generator().manual_seed(1))
    t[positions[: round(tokens * ignored)]] = -100
    embedding.to(dtype)
    h = h.detach().to(dtype).requires_grad_()
    return embedding, TiedLinear(embedding), h, t


def measure(variant: str, shape: tuple[int, int, int], steps: int) -> dict[str, float]:
    """In this process: warm up, then time ``steps`` steps and take the peak over baseline."""
    dtype = torch.float16 if variant.endswith("_fp16") else torch.float32
    ignored = _ignored(variant)[1]
    # A compiled variant warms up at the measured shape, which it compiles for.
    warmup = shape if "compiled" in variant else WARMUP_SHAPE
    _, head, h, t = _inputs(*warmup, dtype, ignored)
    for _ in range(2):
        _step(variant, head, h, t)
    embedding, head, h, t = _inputs(*shape, dtype, ignored)
    del _
    gc.collect()
    clear_refs = Path("/proc/self/clear_refs")
    clear_refs.write_text("5")  # reset VmHWM to the current resident set
    baseline = rss_bytes("VmRSS")
    times = []
    for _ in range(steps):
        embedding.weight.grad = None
        h.grad = None
        start = time.perf_counter()
        _step(variant, head, h, t)
        times.append(time.perf_counter() - start)
    return {
        "seconds": statistics.median(times),
        "peak_mb": (rss_bytes("VmHWM") - baseline) / MB,
    }


def _in_subprocess(variant: str, shape: tuple[int, int, int], steps: int) -> dict[str, float]:
    if variant in cross_entropy_parallel.VARIANTS:
        return cross_entropy_parallel.in_ranks(variant, shape, steps)
    command = [sys.executable, __file__, "--child", variant, ",".join(map(str, shape))]
    command += ["--steps", str(steps)]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=os.environ)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _reference(variant: str) -> str:
    """The variant whose time and memory ``variant``'s ratios are taken against."""
    if variant == "toolkit_capped":
        return "plain_capped"
    if variant == "toolkit_fp16":
        return "plain_fp16"
    if variant in cross_entropy_parallel.VARIANTS:
        return "tp_loss_parallel"
    base = _ignored(variant)[0]
    return "plain" if base == variant else variant.replace(base, "plain", 1)


# (name, variant, reference, "seconds" or "peak_mb", bound on variant / reference).
TARGETS = (
    ("toolkit: time <= 1.00x plain", "toolkit", "plain", "seconds", 1.0),
    ("toolkit: memory <= 1/8 of plain", "toolkit", "plain", "peak_mb", 1 / 8),
    ("toolkit: faster than torch chunked", "toolkit", "torch_chunked", "seconds", 1.0),
    ("toolkit: memory <= 1.25x torch chunked", "toolkit", "torch_chunked", "peak_mb", 1.25),
    ("toolkit_none: time <= 1.40x plain", "toolkit_none", "plain", "seconds", 1.4),
    ("toolkit_none: memory <= 1/5 of plain", "toolkit_none", "plain", "peak_mb", 1 / 5),
    (
        "toolkit_capped: time <= 1.15x plain_capped",
        "toolkit_capped",
        "plain_capped",
        "seconds",
        1.15,
    ),
    # Ignored targets cost nothing: memory no more than with none (time: PAIRED_TARGETS).
    ("toolkit_ignored50: memory <= toolkit", "toolkit_ignored50", "toolkit", "peak_mb", 1.0),
    ("toolkit_ignored90: memory <= toolkit", "toolkit_ignored90", "toolkit", "peak_mb", 1.0),
    (
        "tp_toolkit: memory <= 1/4 of tp_loss_parallel",
        "tp_toolkit",
        "tp_loss_parallel",
        "peak_mb",
        1 / 4,
    ),
)


# (name, key of the paired result, bound): the time with a share of the targets ignored over
# the same call's with none, step by step in one process (``paired_ignored``).
PAIRED_TARGETS = (
    ("toolkit_ignored50: time <= 0.55x toolkit, paired", "ignored50", 0.55),
    ("toolkit_ignored90: time <= 0.15x toolkit, paired", "ignored90", 0.15),
)


def paired_ignored(
    shape: tuple[int, int, int], blocks: int, variant: str = "toolkit"
) -> dict[str, float]:
    """In this process: ``variant`` with none, 50% and 90% of the targets ignored, alternated.

    Each block times one step of each, in an order that rotates from block to block; the
    result is the median over blocks of each share's time over the time with none ignored in
    the same block, so that a load that changes between blocks slows all three alike, and the
    median time with none. The first block, not counted, warms up (and compiles).
    """
    shares = {"none": 0.0, "ignored50": 0.5, "ignored90": 0.9}
    runs = {name: _inputs(*shape, ignored=share) for name, share in shares.items()}
    ratios: dict[str, list[float]] = {"ignored50": [], "ignored90": [], "none_seconds": []}
    names = list(shares)
    for block in range(blocks + 1):  # the first block warms up
        seconds = {}
        for name in names[block % 3 :] + names[: block % 3]:
            embedding, head, h, t = runs[name]
            embedding.weight.grad = h.grad = None
            start = time.perf_counter()
            _step(variant, head, h, t)
            seconds[name] = time.perf_counter() - start
        if block:
            ratios["ignored50"].append(seconds["ignored50"] / seconds["none"])
            ratios["ignored90"].append(seconds["ignored90"] / seconds["none"])
            ratios["none_seconds"].append(seconds["none"])
    return {name: statistics.median(values) for name, values in ratios.items()}


def _targets(table: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """The targets whose variants ran, met or not ("faster than" is strict)."""
    met = {}
    for name, variant, reference, key, bound in TARGETS:
        if variant in table and reference in table:
            ratio = table[variant][key] / table[reference][key]
            met[name] = (
                ratio < bound if name.endswith("faster than torch chunked") else ratio <= bound
            )
    return met


def run(
    quick: bool,
    shapes: tuple[tuple[int, int, int], ...] | None = None,
    rounds: int | None = None,
    variants: tuple[str, ...] | None = None,
    steps: int | None = None,
) -> dict[str, object]:
    """Alternate the variants in fresh processes, round after round; report medians and ratios.

    Returns:
        Per shape, per variant: median seconds and peak MB over rounds, the reference
        variant and the ratios to it; and the targets whose variants ran, met or not.
    """
    shapes = shapes or (QUICK_SHAPES if quick else SHAPES)
    rounds = rounds or (1 if quick else 3)
    steps = steps or 1
    if variants:
        variants = tuple(dict.fromkeys(("plain", "torch_chunked", "toolkit", *variants)))
        variants += tuple(r for r in map(_reference, variants) if r not in variants)
    else:
        variants = VARIANTS
    results: dict[str, object] = {}
    for shape in shapes:
        runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
        for round_ in range(rounds):
            order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
            for variant in order:
                runs[variant].append(_in_subprocess(variant, shape, steps))
                last = runs[variant][-1]
                print(
                    f"  round {round_ + 1}: {variant} {last['seconds']:.3f} s, "
                    f"{last['peak_mb']:.0f} MB",
                    file=sys.stderr,
                    flush=True,
                )
        table: dict[str, dict[str, Any]] = {
            v: {
                "seconds": statistics.median(r["seconds"] for r in rs),
                "peak_mb": statistics.median(r["peak_mb"] for r in rs),
            }
            for v, rs in runs.items()
        }
        for variant, row in table.items():
            reference = table[_reference(variant)]
            row["reference"] = _reference(variant)
            row["time_ratio"] = row["seconds"] / reference["seconds"]
            row["memory_ratio"] = row["peak_mb"] / reference["peak_mb"]
        targets = _targets(table)
        key = "x".join(map(str, shape))
        results[key] = {"variants": table, "targets": targets, "rounds": rounds, "steps": steps}
        if "toolkit_ignored50" in variants:
            paired = _in_subprocess("paired_ignored", shape, 3 if quick else 7)
            results[key]["paired_ignored"] = paired
            for name, ratio, bound in PAIRED_TARGETS:
                targets[name] = paired[ratio] <= bound
            print(f"  paired, toolkit's time over none ignored: {paired}", file=sys.stderr)
        _print_shape(key, table, targets, rounds)
    return results


def _print_shape(
    key: str, table: dict[str, dict[str, Any]], targets: dict[str, bool], rounds: int
) -> None:
    tokens, hidden, vocab = map(int, key.split("x"))
    logits_gb = tokens * vocab * 4 / 1e9
    print(f"\n{tokens} tokens x {hidden} hidden -> {vocab} vocabulary, float32")
    print(f"(logits {logits_gb:.2f} GB; median of {rounds} alternated runs, forward + backward;")
    print(f" tp_* on {cross_entropy_parallel.WORLD_SIZE} gloo ranks: slowest rank, largest peak)")
    header = f"{'variant':<18} {'time s':>8} {'peak MB':>9}  {'reference':<17}"
    print(f"{header} {'x time':>7} {'x mem':>7}")
    for name, row in table.items():
        print(
            f"{name:<18} {row['seconds']:>8.3f} {row['peak_mb']:>9.0f}  {row['reference']:<17} "
            f"{row['time_ratio']:>7.2f} {row['memory_ratio']:>7.3f}"
        )
    for target, met in targets.items():
        print(f"  {target}: {'met' if met else 'NOT met'}")


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
        "--variants",
        help="comma-separated variants (plain, torch_chunked, toolkit and the references "
        "of those named always run)",
    )
    parser.add_argument("--steps-per-run", type=int, help="timed steps in each process (1)")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "SHAPE"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        variant, shape = args.child
        tokens, hidden, vocab = (int(n) for n in shape.split(","))
        if variant.startswith("paired_ignored"):  # --steps is the number of blocks
            measured = "toolkit" + variant.removeprefix("paired_ignored")  # _compiled, say
            print(json.dumps(paired_ignored((tokens, hidden, vocab), args.steps, measured)))
        else:
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
