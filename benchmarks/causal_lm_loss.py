"""Benchmark: a tied causal LM's ``forward(labels=...)`` with and without ``chunked_loss``.

Both variants run a transformers ``LlamaForCausalLM`` with tied embeddings (a 32,000
vocabulary, 64 hidden, 2 layers: a small model, so that the loss dominates) on 2 rows of
1,024 tokens, forward and backward, in float32:

- ``stock``: the model as transformers builds it, ``model(ids, labels=ids).loss``: the full
  logits, then transformers' ``ForCausalLMLoss`` of them;
- ``chunked_loss``: the same model tied by ``tie_output_embeddings(model,
  chunked_loss=True)``, the same call, which takes the tied head's chunked loss.

Each variant runs in its own process, so that its peak memory is its own: the process warms
up on 2 rows of 16 tokens, builds the inputs, resets the kernel's peak-RSS mark and takes the
resident set as the baseline; the peak is the high-water mark over it during the timed step,
so it counts what the forward and backward allocate above the model, the inputs and library
start-up. The variants alternate, round after round; the report gives medians over rounds,
the chunked loss's ratios to the stock model's, and both losses, which must agree.

Run it with ``python benchmarks/causal_lm_loss.py`` (``--quick``: 2 rows of 512 tokens, one
round). It needs transformers.
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
from process_memory import MB, rss_bytes

VARIANTS = ("stock", "chunked_loss")
VOCAB, HIDDEN = 32000, 64
SHAPE, QUICK_SHAPE, WARMUP_SHAPE = (2, 1024), (2, 512), (2, 16)
TARGET = 1 / 4  # the chunked loss's peak against the stock model's


def build(variant: str) -> torch.nn.Module:
    """The tiny Llama, the same weights in every process; tied as ``variant`` says."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    from toolkit.nn import tie_output_embeddings  # noqa: PLC0415

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SHAPE[1],
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    if variant == "chunked_loss":
        tie_output_embeddings(model, chunked_loss=True)
    return model


def measure(variant: str, shape: tuple[int, int]) -> dict[str, float]:
    """In this process: warm up, then time one step and take the peak over the baseline."""
    model = build(variant)
    generator = torch.Generator().manual_seed(1)
    warmup = torch.randint(0, VOCAB, WARMUP_SHAPE, generator=generator)
    model(warmup, labels=warmup).loss.backward()
    ids = torch.randint(0, VOCAB, shape, generator=generator)
    model.zero_grad(set_to_none=True)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    baseline = rss_bytes("VmRSS")
    start = time.perf_counter()
    loss = model(ids, labels=ids).loss
    loss.backward()
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "peak_mb": (rss_bytes("VmHWM") - baseline) / MB,
        "loss": loss.item(),
    }


def _in_subprocess(variant: str, shape: tuple[int, int]) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", variant, ",".join(map(str, shape))]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=os.environ)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def run(quick: bool, rounds: int | None = None) -> dict[str, object]:
    """Alternate the variants in fresh processes; report medians, ratios and the target.

    Returns:
        Per variant: median seconds and peak MB over rounds, and the loss; the chunked
        loss's ratios to the stock model's, and whether its peak is within the target.
    """
    shape = QUICK_SHAPE if quick else SHAPE
    rounds = rounds or (1 if quick else 3)
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for round_ in range(rounds):
        order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            runs[variant].append(_in_subprocess(variant, shape))
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
            "loss": rs[0]["loss"],
        }
        for v, rs in runs.items()
    }
    stock, lean = table["stock"], table["chunked_loss"]
    ratios = {
        "time": lean["seconds"] / stock["seconds"],
        "memory": lean["peak_mb"] / stock["peak_mb"],
        "loss_difference": abs(lean["loss"] - stock["loss"]),
    }
    met = ratios["memory"] <= TARGET
    rows, length = shape
    print(f"\n{rows} x {length} tokens -> {VOCAB} vocabulary, Llama with {HIDDEN} hidden, float32")
    print(f"(median of {rounds} alternated runs, forward + backward, each in its own process)")
    print(f"{'variant':<14} {'time s':>8} {'peak MB':>9} {'loss':>10}")
    for name, row in table.items():
        print(f"{name:<14} {row['seconds']:>8.3f} {row['peak_mb']:>9.0f} {row['loss']:>10.6f}")
    print(f"chunked_loss / stock: time {ratios['time']:.2f}x, memory {ratios['memory']:.3f}x")
    print(f"  chunked_loss: memory <= 1/4 of stock: {'met' if met else 'NOT met'}")
    return {
        "shape": list(shape),
        "rounds": rounds,
        "variants": table,
        "ratios": ratios,
        "targets": {"chunked_loss: memory <= 1/4 of stock": met},
    }


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark, or, with ``--child``, measure one variant in this process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512 tokens a row, one round")
    parser.add_argument("--rounds", type=int, help="alternated runs of both variants")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "SHAPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        variant, shape = args.child
        rows, length = (int(n) for n in shape.split(","))
        print(json.dumps(measure(variant, (rows, length))))
        return
    results = run(args.quick, args.rounds)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
