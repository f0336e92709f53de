"""The examples of docs/sharded-training.md run on two gloo ranks, and its error is the real one.

The page's ```py blocks form one ``torchrun`` script. The generic docs test runs only blocks
fenced exactly ```python, in a single process; these need a process group, so this test runs
them in order, in one namespace, on two ranks, as ``torchrun --nproc-per-node 2`` would.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.nn.distributed import workers
from tests.nn.distributed.launch import run_ranks

PAGE = Path(__file__).resolve().parents[3] / "docs" / "sharded-training.md"
FENCE = re.compile(r"^```(\S*)\n(.*?)^```$", re.DOTALL | re.MULTILINE)
TIMEOUT = 120.0


def blocks(kind: str) -> list[tuple[int, str]]:
    """The page's blocks fenced exactly ```kind: the line of their first code line, and code."""
    text = PAGE.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, m.start(2)) + 1, m.group(2))
        for m in FENCE.finditer(text)
        if m.group(1) == kind
    ]


@pytest.fixture(scope="module")
def namespaces() -> list[dict[str, object]]:
    return run_ranks(workers.run_script, 2, blocks("py"), str(PAGE), timeout=TIMEOUT)


def test_every_block_of_the_page_is_run_or_checked() -> None:
    fences = [m.group(1) for m in FENCE.finditer(PAGE.read_text(encoding="utf-8"))]
    assert fences.count("py") >= 5
    assert fences.count("text") == 1
    # ```python blocks would run in a single process, without the process group they need.
    assert set(fences) == {"py", "text"}


def test_the_page_script_runs_on_two_ranks(namespaces: list[dict[str, object]]) -> None:
    assert len(namespaces) == 2
    for namespace in namespaces:
        assert namespace["tasks"] == ["sentiment", "topic"]


def test_the_error_shown_is_the_one_every_rank_raises(
    namespaces: list[dict[str, object]],
) -> None:
    ((_, shown),) = blocks("text")
    for namespace in namespaces:
        assert " ".join(str(namespace["message"]).split()) == " ".join(shown.split())
