"""Benchmarks for toolkit.nn against what users would otherwise write.

Every timing comparison runs in this one process. The candidates are interleaved: each block
times every candidate once, in an order rotated from block to block, and the reported number
is the median over blocks of the per-block ratio, with a 95% confidence interval of that
median and the interquartile range of the ratios. A shared, noisy machine slows all
candidates of a block alike, so the ratios stay meaningful where absolute times do not. A
target is met when the whole confidence interval lies at or below it.

Run it with ``nox -s bench`` (``nox -s bench -- --quick`` for a shorter run), or directly
with ``python benchmarks/bench_nn.py`` where toolkit-nn, safetensors and (optionally)
torchtune are installed.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import timeit
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn
from torchtune_reference import TIED_LINEAR_FILE, load_tied_linear

import toolkit.nn
from toolkit.nn import ModuleDefaultDict, TiedLinear

DEFAULT_JSON = Path("build") / "benchmarks" / "nn.json"
SECTIONS = ("linear", "lm-head", "compile", "memory", "dict")


# Settings ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """How long each section measures; ``--quick`` picks the smaller numbers."""

    small_blocks: int
    block_seconds: float
    lm_head_blocks: int
    compile_blocks: int
    dict_blocks: int

    @classmethod
    def choose(cls, *, quick: bool) -> Settings:
        """The full settings, or the quick ones."""
        if quick:
            return cls(
                small_blocks=41,
                block_seconds=0.01,
                lm_head_blocks=3,
                compile_blocks=21,
                dict_blocks=41,
            )
        return cls(
            small_blocks=201,
            block_seconds=0.02,
            lm_head_blocks=5,
            compile_blocks=41,
            dict_blocks=201,
        )


# Results -----------------------------------------------------------------------------------


@dataclass
class Ratio:
    """One row of the table: ``subject`` time over ``baseline`` time, per block."""

    section: str
    case: str
    subject: str
    baseline: str
    median: float
    q1: float
    q3: float
    ci_low: float
    ci_high: float
    blocks: int
    subject_seconds: float
    baseline_seconds: float
    target: float | None = None
    verdict: str = ""
    per_block: list[float] = field(default_factory=list)

    def judge(self) -> Ratio:
        """Set ``verdict`` by where the 95% confidence interval of the median lies.

        ``met`` when it lies at or below the target, ``MISSED`` when above, and ``noise``
        when it contains the target: the blocks cannot tell either way.
        """
        if self.target is None:
            self.verdict = ""
        elif self.ci_high <= self.target:
            self.verdict = "met"
        elif self.ci_low > self.target:
            self.verdict = "MISSED"
        else:
            self.verdict = "noise: CI contains the target"
        return self


@dataclass
class Report:
    """Everything the run measured, as written to JSON."""

    environment: dict[str, Any]
    ratios: list[Ratio] = field(default_factory=list)
    compile: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# Timing ------------------------------------------------------------------------------------


def _quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def _median_ci(values: Sequence[float]) -> tuple[float, float]:
    """A distribution-free 95% confidence interval of the median, from order statistics.

    With ``n`` values, the median lies between the ``(n - 1.96 sqrt(n)) / 2``-th and the
    ``(n + 1.96 sqrt(n)) / 2``-th smallest with about 95% confidence (normal approximation of
    the binomial). With few blocks it is the whole range.
    """
    ordered = sorted(values)
    n = len(ordered)
    half_width = 1.96 * math.sqrt(n) / 2
    low = max(0, math.floor(n / 2 - half_width) - 1)
    high = min(n - 1, math.ceil(n / 2 + half_width))
    return ordered[low], ordered[high]


def interleave(
    candidates: dict[str, Callable[[int], float]],
    *,
    blocks: int,
    number: int | None = None,
    block_seconds: float = 0.02,
) -> dict[str, list[float]]:
    """Time every candidate once per block, rotating the order; return seconds per call.

    Args:
        candidates: Name to a function that runs the candidate ``n`` times and returns the
            elapsed seconds.
        blocks: How many blocks to time.
        number: Calls per candidate per block. By default it is calibrated so that a block
            of the fastest candidate lasts about ``block_seconds``, which also warms every
            candidate up; when given, the caller has warmed them up.
        block_seconds: The length of a calibrated block.

    Returns:
        For each name, its seconds per call in each block, in block order.
    """
    names = list(candidates)
    if number is None:
        number = min(_calibrate(run, block_seconds) for run in candidates.values())
    samples: dict[str, list[float]] = {name: [] for name in names}
    for block in range(blocks):
        shift = block % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(candidates[name](number) / number)
    return samples


def _calibrate(run: Callable[[int], float], block_seconds: float) -> int:
    """The number of calls that take about ``block_seconds``, after a warm-up."""
    run(1)
    number = 1
    while True:
        elapsed = run(number)
        if elapsed >= block_seconds / 4 or number >= 1 << 20:
            return max(1, round(number * block_seconds / max(elapsed, 1e-9)))
        number *= 4


def stmt_timer(stmt: str, namespace: dict[str, Any]) -> Callable[[int], float]:
    """A candidate that runs ``stmt`` in a ``timeit`` loop (no per-call function overhead)."""
    timer = timeit.Timer(stmt, globals=namespace)
    return timer.timeit


def ratios_against(
    samples: dict[str, list[float]],
    subject: str,
    *,
    section: str,
    case: str,
    targets: dict[str, float] | None = None,
) -> list[Ratio]:
    """One :class:`Ratio` per other candidate: ``subject`` over it, block by block."""
    rows = []
    for baseline, times in samples.items():
        if baseline == subject:
            continue
        per_block = [s / b for s, b in zip(samples[subject], times, strict=True)]
        q1, median, q3 = _quartiles(per_block)
        ci_low, ci_high = _median_ci(per_block)
        rows.append(
            Ratio(
                section=section,
                case=case,
                subject=subject,
                baseline=baseline,
                median=median,
                q1=q1,
                q3=q3,
                ci_low=ci_low,
                ci_high=ci_high,
                blocks=len(per_block),
                subject_seconds=statistics.median(samples[subject]),
                baseline_seconds=statistics.median(times),
                target=(targets or {}).get(baseline),
                per_block=per_block,
            ).judge()
        )
    return rows


# torchtune ---------------------------------------------------------------------------------


def load_torchtune_tied_linear() -> tuple[type | None, str]:
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


# TiedLinear against the alternatives -----------------------------------------------------


def linear_candidates(
    embedding: nn.Embedding, torchtune_cls: type | None
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Every way to apply ``embedding.weight`` as a bias-free linear layer."""
    shared = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False)
    shared.weight = embedding.weight
    weight = embedding.weight
    candidates: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "TiedLinear": TiedLinear(embedding),
        "nn.Linear shared": shared,
    }
    if torchtune_cls is not None:
        candidates["torchtune TiedLinear"] = torchtune_cls(embedding)
    candidates["F.linear"] = functools.partial(F.linear, weight=weight)
    return candidates


def bench_linear(
    report: Report,
    *,
    case: str,
    tokens: int,
    in_features: int,
    out_features: int,
    blocks: int,
    number: int | None,
    block_seconds: float,
    targets: dict[str, float],
    torchtune_cls: type | None,
) -> None:
    """Forward and forward+backward of TiedLinear against the alternatives at one shape."""
    torch.manual_seed(0)
    embedding = nn.Embedding(out_features, in_features)
    weight = embedding.weight
    candidates = linear_candidates(embedding, torchtune_cls)
    x = torch.randn(tokens, in_features, requires_grad=True)
    grad = torch.ones(tokens, out_features)
    reference = F.linear(x, weight)
    for name, candidate in candidates.items():  # also the warm-up of every candidate
        out = candidate(x)
        if not torch.equal(out, reference):
            raise AssertionError(f"{name} does not compute F.linear(x, weight)")
        out.backward(grad)  # type: ignore[no-untyped-call]
    del reference, out
    namespace = {
        "x": x,
        "w": weight,
        "g": grad,
        "F": F,
        **{f"c{i}": c for i, c in enumerate(candidates.values())},
    }
    for mode, template in (("forward", "{}(x)"), ("forward+backward", "{}(x).backward(g)")):
        timers = {}
        for i, name in enumerate(candidates):
            call = "F.linear(x, w)" if name == "F.linear" else template.format(f"c{i}")
            if name == "F.linear" and mode == "forward+backward":
                call += ".backward(g)"
            timers[name] = stmt_timer(call, namespace)
        samples = interleave(timers, blocks=blocks, number=number, block_seconds=block_seconds)
        weight.grad = None
        x.grad = None
        report.ratios += ratios_against(
            samples,
            "TiedLinear",
            section="TiedLinear",
            case=f"{case}, {mode}",
            targets=targets,
        )


# torch.compile -----------------------------------------------------------------------------


class TinyLM(nn.Module):
    """A tiny language model with per-task adapters and an output head tied to the embedding.

    Args:
        vocab: Vocabulary size.
        dim: Embedding width.
        head: ``"tied"`` for a TiedLinear head, ``"shared"`` for an ``nn.Linear`` whose weight
            is the embedding's Parameter, ``"untied"`` for an independent ``nn.Linear``.
        tasks: Adapters created before compiling; ``forward`` reads ``tasks[0]``.
    """

    def __init__(
        self, vocab: int, dim: int, head: str, tasks: Sequence[str] = ("en", "de")
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.adapters: ModuleDefaultDict[nn.Linear] = ModuleDefaultDict(
            functools.partial(nn.Linear, dim, dim)
        )
        for task in tasks:
            self.adapters[task]
        self.task = tasks[0]
        self.head: TiedLinear | nn.Linear
        if head == "tied":
            self.head = TiedLinear(self.embedding)
        else:
            self.head = nn.Linear(dim, vocab, bias=False)
            if head == "shared":
                self.head.weight = self.embedding.weight
            elif head != "untied":
                raise ValueError(f"head must be 'tied', 'shared' or 'untied', got {head!r}")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for every position of ``idx``."""
        hidden = self.embedding(idx)
        hidden = hidden + torch.tanh(self.adapters[self.task](hidden))
        return self.head(hidden)


def _copy_weights(source: nn.Module, target: nn.Module) -> None:
    target.load_state_dict(source.state_dict(), strict=False)


def bench_compile(report: Report, *, blocks: int, block_seconds: float, backend: str) -> None:
    """Graphs and breaks of the tied LM, and its compiled step against the shared one."""
    torch.manual_seed(0)
    vocab, dim, batch, seq = 512, 64, 8, 32
    tied = TinyLM(vocab, dim, "tied")
    shared = TinyLM(vocab, dim, "shared")
    _copy_weights(tied, shared)
    idx = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch * seq,))

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(tied)(idx)
    breaks = [str(reason.reason) for reason in explanation.break_reasons]
    report.compile = {
        "model": f"TinyLM(vocab={vocab}, dim={dim}), input {batch}x{seq}, backend {backend}",
        "graph_count": explanation.graph_count,
        "graph_break_count": explanation.graph_break_count,
        "break_reasons": breaks,
        "target": "1 graph, 0 breaks",
        "verdict": (
            "met"
            if explanation.graph_count == 1 and explanation.graph_break_count == 0
            else "MISSED"
        ),
    }

    torch._dynamo.reset()
    steps: dict[str, Callable[[int], float]] = {}
    logits: list[torch.Tensor] = []
    started = time.perf_counter()
    for name, model in (("tied (TiedLinear)", tied), ("shared Parameter", shared)):
        compiled = torch.compile(model, fullgraph=True, backend=backend)

        def step(compiled: Callable[..., torch.Tensor] = compiled) -> None:
            loss = F.cross_entropy(compiled(idx).flatten(0, 1), targets)
            loss.backward()  # type: ignore[no-untyped-call]

        step()  # compile forward and backward now, outside the timing
        logits.append(compiled(idx).detach())

        def run(number: int, step: Callable[[], None] = step) -> float:
            start = time.perf_counter()
            for _ in range(number):
                step()
            return time.perf_counter() - start

        steps[name] = run
    report.compile["compile_seconds_both"] = round(time.perf_counter() - started, 1)
    report.compile["same_logits"] = bool(torch.allclose(logits[0], logits[1]))
    samples = interleave(steps, blocks=blocks, block_seconds=block_seconds)
    report.ratios += ratios_against(
        samples,
        "tied (TiedLinear)",
        section="torch.compile",
        case="compiled training step (forward, loss, backward)",
    )


# Memory ------------------------------------------------------------------------------------


def _state_dict_bytes(state_dict: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Bytes summed over the entries, and bytes of the distinct storages they use."""
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state_dict.values()
    }
    return total, sum(storages.values())


def bench_memory(report: Report, *, vocab: int, dim: int) -> None:
    """Parameter count, state_dict bytes and file sizes of tied, shared and untied models."""
    torch.manual_seed(0)
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, head in (
            ("tied (TiedLinear)", "tied"),
            ("shared Parameter", "shared"),
            ("untied", "untied"),
        ):
            model = TinyLM(vocab, dim, head)
            state_dict = model.state_dict()
            entries, distinct = _state_dict_bytes(state_dict)
            row: dict[str, Any] = {
                "parameters": sum(p.numel() for p in model.parameters()),
                "state_dict_keys": len(state_dict),
                "state_dict_bytes": entries,
                "state_dict_distinct_storage_bytes": distinct,
            }
            path = Path(folder) / f"{head}.safetensors"
            try:
                safetensors.torch.save_file(state_dict, path)
                row["safetensors_bytes"] = path.stat().st_size
                row["safetensors_how"] = "save_file(model.state_dict())"
            except RuntimeError as error:
                row["save_file_error"] = " ".join(str(error).split())
                safetensors.torch.save_model(model, str(path))
                row["safetensors_bytes"] = path.stat().st_size
                row["safetensors_how"] = (
                    "save_file(model.state_dict()) refuses the shared tensors; "
                    "save_model(model) drops the duplicate key and saves one copy"
                )
            torch_path = Path(folder) / f"{head}.pt"
            torch.save(state_dict, torch_path)
            row["torch_save_bytes"] = torch_path.stat().st_size
            rows[name] = row
    report.memory = {"model": f"TinyLM(vocab={vocab}, dim={dim}), float32", "rows": rows}


# ModuleDefaultDict -------------------------------------------------------------------------


def bench_dict(report: Report, *, blocks: int, block_seconds: float) -> None:
    """ModuleDefaultDict hits against ModuleDict, misses against factory plus registration."""
    factory = nn.Identity
    entries = {f"task{i}": nn.Identity() for i in range(8)}
    defaultdict: ModuleDefaultDict[nn.Module] = ModuleDefaultDict(factory, entries)
    plain = nn.ModuleDict(entries)
    namespace = {"d": defaultdict, "m": plain}
    samples = interleave(
        {
            "ModuleDefaultDict[key]": stmt_timer("d['task3']", namespace),
            "ModuleDict[key]": stmt_timer("m['task3']", namespace),
        },
        blocks=blocks,
        block_seconds=block_seconds,
    )
    report.ratios += ratios_against(
        samples,
        "ModuleDefaultDict[key]",
        section="ModuleDefaultDict",
        case="hit",
        targets={"ModuleDict[key]": 1.05},
    )

    def misses(number: int) -> float:
        keys = [f"new{i}" for i in range(number)]
        fresh: ModuleDefaultDict[nn.Module] = ModuleDefaultDict(factory)
        gc.disable()
        try:
            start = time.perf_counter()
            for key in keys:
                fresh[key]
            return time.perf_counter() - start
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
            return time.perf_counter() - start
        finally:
            gc.enable()

    samples = interleave(
        {"ModuleDefaultDict miss": misses, "factory() + ModuleDict[key] = ...": by_hand},
        blocks=blocks,
        block_seconds=block_seconds,
    )
    report.ratios += ratios_against(
        samples,
        "ModuleDefaultDict miss",
        section="ModuleDefaultDict",
        case="miss (factory nn.Identity; a fresh dict per block)",
    )


# Output ------------------------------------------------------------------------------------


def overhead_notes(ratios: Sequence[Ratio]) -> list[str]:
    """What TiedLinear's Python overhead over F.linear is worth at the LM-head shape.

    The work TiedLinear adds to ``F.linear`` does not depend on the shape, so its cost at the
    small shape, divided by the time of one LM-head call, bounds the LM-head ratio far more
    tightly than a few blocks of second-long calls on a shared machine can measure it.
    """
    notes = []
    for mode in ("forward", "forward+backward"):
        small = _find(ratios, f"1 token, 8 -> 16, {mode}", "F.linear")
        large = _find(ratios, f"4096 tokens, 512 -> 32000, {mode}", "F.linear")
        if small is None or large is None:
            continue
        extra = small.subject_seconds - small.baseline_seconds
        notes.append(
            f"LM-head {mode}: TiedLinear's overhead over F.linear, measured at the small shape "
            f"({_seconds(extra)}), is {100 * extra / large.baseline_seconds:.5f}% of one "
            f"LM-head F.linear call ({_seconds(large.baseline_seconds)}); the measured "
            f"LM-head ratio ({large.median:.3f}x, IQR {large.q1:.3f}-{large.q3:.3f}) is limited "
            "by the noise of the machine, not by TiedLinear"
        )
    return notes


def _find(ratios: Sequence[Ratio], case: str, baseline: str) -> Ratio | None:
    for r in ratios:
        if r.case == case and r.baseline == baseline:
            return r
    return None


def environment(
    threads: int, small_threads: int, quick: bool, torchtune_note: str
) -> dict[str, Any]:
    """The machine, versions and settings the numbers belong to."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "toolkit_nn": toolkit.nn.__version__,
        "safetensors": importlib.metadata.version("safetensors"),
        "torchtune": torchtune_note,
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "cpus_available": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "torch_threads_lm_head": threads,
        "torch_threads_elsewhere": small_threads,
        "torch_interop_threads": torch.get_num_interop_threads(),
        "quick": quick,
        "command": " ".join(["python", "benchmarks/bench_nn.py", *sys.argv[1:]]),
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _seconds(value: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


def format_table(report: Report) -> str:
    """The report as Markdown tables."""
    lines = [
        "| comparison | case | ratio (median) | 95% CI | IQR | median times | target | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report.ratios:
        target = f"<= {r.target:.2f}x" if r.target is not None else ""
        lines.append(
            f"| {r.subject} / {r.baseline} | {r.case} | {r.median:.3f}x | "
            f"{r.ci_low:.3f}-{r.ci_high:.3f} | {r.q1:.3f}-{r.q3:.3f} | "
            f"{_seconds(r.subject_seconds)} vs "
            f"{_seconds(r.baseline_seconds)} ({r.blocks} blocks) | {target} | {r.verdict} |"
        )
    if report.notes:
        lines += ["", *(f"- {note}" for note in report.notes)]
    if report.compile:
        c = report.compile
        lines += [
            "",
            f"torch.compile, {c['model']}: {c['graph_count']} graph(s), "
            f"{c['graph_break_count']} break(s) (target {c['target']}: {c['verdict']}); "
            f"compiling both models took {c.get('compile_seconds_both', '?')} s; "
            f"both compiled models give the same logits: {c.get('same_logits')}.",
        ]
        for reason in c["break_reasons"]:
            lines.append(f"  break: {reason}")
    if report.memory:
        lines += [
            "",
            f"Memory, {report.memory['model']}:",
            "",
            "| model | parameters | state_dict keys | state_dict bytes (entries) "
            "| distinct storage bytes | safetensors file | torch.save file |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, row in report.memory["rows"].items():
            lines.append(
                f"| {name} | {row['parameters']:,} | {row['state_dict_keys']} | "
                f"{row['state_dict_bytes']:,} | {row['state_dict_distinct_storage_bytes']:,} | "
                f"{row['safetensors_bytes']:,} | {row['torch_save_bytes']:,} |"
            )
        for name, row in report.memory["rows"].items():
            if "save_file_error" in row:
                lines += [
                    "",
                    f"{name}: {row['safetensors_how']} (save_file said: {row['save_file_error']})",
                ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmarks, print the tables and write the JSON.

    Returns:
        1 if the tied LM does not compile to one graph without breaks, else 0. Timing
        targets are reported, not enforced: on a shared machine their spread can straddle
        them.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks, for a smoke run")
    parser.add_argument(
        "--json",
        type=Path,
        default=DEFAULT_JSON,
        help=f"where to write the results (default: {DEFAULT_JSON})",
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
        help="torch intra-op threads for the small shapes, the compiled step and the dict "
        "(default: 1: they are too small to split, and a second thread only waits on a "
        "busy core)",
    )
    parser.add_argument(
        "--only",
        choices=SECTIONS,
        action="append",
        help="run only this section (repeatable; default: all)",
    )
    parser.add_argument(
        "--backend", default="inductor", help="torch.compile backend (default: inductor)"
    )
    args = parser.parse_args(argv)
    sections = set(args.only or SECTIONS)
    settings = Settings.choose(quick=args.quick)

    torchtune_cls, torchtune_note = load_torchtune_tied_linear()
    report = Report(environment(args.threads, args.small_threads, args.quick, torchtune_note))
    env = report.environment
    print(
        f"toolkit-nn {env['toolkit_nn']}, torch {torch.__version__}, "
        f"{env['cpus_available']} CPUs ({env['processor']}); torch threads: "
        f"{args.threads} at the LM-head shape, {args.small_threads} elsewhere"
    )
    print(torchtune_note, flush=True)

    overhead_targets = {"nn.Linear shared": 1.00, "torchtune TiedLinear": 1.00}
    runs: dict[str, tuple[str, int, Callable[[], None]]] = {
        "linear": (
            "TiedLinear, overhead-bound shape",
            args.small_threads,
            lambda: bench_linear(
                report,
                case="1 token, 8 -> 16",
                tokens=1,
                in_features=8,
                out_features=16,
                blocks=settings.small_blocks,
                number=None,
                block_seconds=settings.block_seconds,
                targets=overhead_targets,
                torchtune_cls=torchtune_cls,
            ),
        ),
        "lm-head": (
            "TiedLinear, LM-head shape (about 67 GFLOP per forward)",
            args.threads,
            lambda: bench_linear(
                report,
                case="4096 tokens, 512 -> 32000",
                tokens=4096,
                in_features=512,
                out_features=32000,
                blocks=settings.lm_head_blocks,
                number=1,
                block_seconds=0.0,
                targets={"F.linear": 1.02},
                torchtune_cls=torchtune_cls,
            ),
        ),
        "compile": (
            f"torch.compile ({args.backend})",
            args.small_threads,
            lambda: bench_compile(
                report,
                blocks=settings.compile_blocks,
                block_seconds=10 * settings.block_seconds,
                backend=args.backend,
            ),
        ),
        "memory": (
            "memory",
            args.small_threads,
            lambda: bench_memory(report, vocab=32000, dim=512),
        ),
        "dict": (
            "ModuleDefaultDict",
            args.small_threads,
            lambda: bench_dict(
                report, blocks=settings.dict_blocks, block_seconds=settings.block_seconds
            ),
        ),
    }
    started = time.perf_counter()
    section_seconds = {}
    for section, (title, threads, run) in runs.items():
        if section not in sections:
            continue
        print(f"{title} ...", end=" ", flush=True)
        torch.set_num_threads(threads)
        section_start = time.perf_counter()
        run()
        section_seconds[section] = round(time.perf_counter() - section_start, 1)
        print(f"{section_seconds[section]} s", flush=True)
    report.environment["section_seconds"] = section_seconds
    report.environment["seconds"] = round(time.perf_counter() - started, 1)
    report.notes += overhead_notes(report.ratios)

    print()
    print(format_table(report))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    print(f"\nwrote {args.json} ({report.environment['seconds']} s)")
    missed = [r for r in report.ratios if r.verdict.startswith("MISSED")]
    if report.compile.get("verdict") == "MISSED":
        print("MISSED: the tied LM does not compile to one graph without breaks")
        return 1
    for r in missed:
        print(f"MISSED: {r.subject} / {r.baseline}, {r.case}: {r.median:.3f}x > {r.target}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
