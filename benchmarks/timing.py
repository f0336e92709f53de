"""How every timing comparison of the benchmarks is measured: interleaved blocks, median ratios.

The candidates of one comparison run in one process and are interleaved: each block times
every candidate once, in an order rotated from block to block, and a comparison reports the
median over blocks of the per-block ratio, with a distribution-free 95% confidence interval of
that median and the interquartile range of the ratios. A shared, noisy machine slows all
candidates of a block alike, so the ratios stay meaningful where absolute times do not. A
target is met when the whole confidence interval lies at or below it.

A candidate is a function of ``number`` that runs the candidate ``number`` times and returns
the seconds per call. :func:`statement` builds one from a statement with
``torch.utils.benchmark.Timer``; :func:`loop` from a function, for calls long enough that
the timer's warm-up calls would cost more than they teach.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import benchmark

__all__ = [
    "Candidate",
    "Ratio",
    "format_seconds",
    "interleave",
    "loop",
    "ratio_table",
    "ratios_against",
    "statement",
]

Candidate = Callable[[int], float]
"""Runs a candidate ``number`` times and returns its seconds per call."""


def statement(stmt: str, namespace: dict[str, Any], *, threads: int | None = None) -> Candidate:
    """A candidate that runs ``stmt`` in ``torch.utils.benchmark``'s ``timeit`` loop.

    The loop has no per-call function overhead, synchronizes an accelerator before reading
    the clock, and runs at ``threads`` torch threads (the current number by default). Each
    measurement first runs 1% of its calls (at least two) as a warm-up, untimed.
    """
    timer = benchmark.Timer(
        stmt,
        globals=namespace,
        num_threads=torch.get_num_threads() if threads is None else threads,
    )
    return lambda number: timer.timeit(number).mean


def loop(function: Callable[[], object]) -> Candidate:
    """A candidate that calls ``function`` in a Python loop, with no warm-up calls."""

    def run(number: int) -> float:
        start = time.perf_counter()
        for _ in range(number):
            function()
        return (time.perf_counter() - start) / number

    return run


def interleave(
    candidates: dict[str, Candidate],
    *,
    blocks: int,
    number: int | None = None,
    block_seconds: float = 0.02,
) -> dict[str, list[float]]:
    """Time every candidate once per block, rotating the order; return seconds per call.

    Args:
        candidates: Name to candidate.
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
            samples[name].append(candidates[name](number))
    return samples


def _calibrate(run: Candidate, block_seconds: float) -> int:
    """The number of calls that take about ``block_seconds``, after a warm-up."""
    run(1)
    number = 1
    while True:
        elapsed = run(number) * number
        if elapsed >= block_seconds / 4 or number >= 1 << 20:
            return max(1, round(number * block_seconds / max(elapsed, 1e-9)))
        number *= 4


@dataclass
class Ratio:
    """One row of a table: ``subject`` time over ``baseline`` time, per block."""

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


def format_seconds(value: float) -> str:
    """``value`` seconds with three significant digits in s, ms, us or ns."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


def ratio_table(ratios: Sequence[Ratio]) -> str:
    """The ratios as a Markdown table, with a line for each missed target under it."""
    lines = [
        "| comparison | case | ratio (median) | 95% CI | IQR | median times | target | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ratios:
        target = f"<= {r.target:.2f}x" if r.target is not None else ""
        lines.append(
            f"| {r.subject} / {r.baseline} | {r.case} | {r.median:.3f}x | "
            f"{r.ci_low:.3f}-{r.ci_high:.3f} | {r.q1:.3f}-{r.q3:.3f} | "
            f"{format_seconds(r.subject_seconds)} vs "
            f"{format_seconds(r.baseline_seconds)} ({r.blocks} blocks) | {target} | "
            f"{r.verdict} |"
        )
    for r in ratios:
        if r.verdict == "MISSED":
            lines.append(
                f"MISSED: {r.subject} / {r.baseline}, {r.case}: {r.median:.3f}x > {r.target}x"
            )
    return "\n".join(lines)
