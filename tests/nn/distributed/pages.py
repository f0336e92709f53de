"""Documentation pages whose examples run on several gloo ranks, as one ``torchrun`` script.

The generic docs test runs only blocks fenced exactly ```python, in a single process. A page
whose code needs a process group fences it ```py instead, and its test runs them with
:func:`run_page`: in order, in one namespace, on gloo ranks, as ``torchrun`` would.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.nn.distributed import workers
from tests.nn.ranks import run_processes

DOCS = Path(__file__).resolve().parents[3] / "docs"
FENCE = re.compile(r"^```(\S*)\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def fences(page: Path) -> list[str]:
    """The info string of every fenced block of ``page``, in order."""
    return [m.group(1) for m in FENCE.finditer(page.read_text(encoding="utf-8"))]


def blocks(page: Path, kind: str) -> list[tuple[int, str]]:
    """The blocks of ``page`` fenced exactly ```kind: their first code line's number, and code."""
    text = page.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, m.start(2)) + 1, m.group(2))
        for m in FENCE.finditer(text)
        if m.group(1) == kind
    ]


def run_page(page: Path, world_size: int = 2, timeout: float = 120.0) -> list[dict[str, object]]:
    """Run the ```py blocks of ``page`` as one script on ``world_size`` ranks.

    Returns:
        Each rank's namespace afterwards, its picklable values only, by rank.
    """
    return run_processes(
        world_size, workers.run_script, blocks(page, "py"), str(page), timeout=timeout
    )
