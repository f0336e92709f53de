"""The guides whose examples need a process group run on gloo ranks, as one ``torchrun`` script.

``test_examples.py`` runs the blocks fenced exactly ```python, in a single process. These
pages fence their code ```py instead: each page's blocks run here in order, in one namespace,
on the page's number of ranks, as ``torchrun --nproc-per-node N`` would. The blocks assert
the pages' claims themselves (losses equal to one process, layouts, collectives); these tests
check that every block ran on every rank, and that an error a page shows is the real one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs.examples import python_blocks
from tests.nn.ranks import RanksFailedError, run_processes

DOCS = Path(__file__).resolve().parents[2] / "docs"
OPENING_FENCE = re.compile(r"^\s*```(\S+)", re.MULTILINE)  # a closing fence has no info
# Each page, its number of ranks, and its ```py blocks at least: a block fenced ```python by
# mistake would run in a single process, without the process group it needs.
PAGES = {
    "per-task-heads.md": (2, 4),
    "pipeline-parallel.md": (3, 9),
    "sharded-training.md": (2, 5),
    "tensor-parallel.md": (2, 9),
}
_RUNS: dict[str, list[dict[str, object]] | RanksFailedError] = {}


def blocks(page: str, info: str) -> list[tuple[int, str]]:
    """The blocks of ``page`` fenced exactly ```info: their first code line's number, and code."""
    text = (DOCS / page).read_text(encoding="utf-8")
    return [(block.line, block.code) for block in python_blocks(text, info)]


def run_script(sources: list[tuple[int, str]], filename: str) -> dict[str, object]:
    """In each rank: run a page's blocks in order in one namespace, as one ``torchrun`` script.

    Each block is padded to its line on the page, so tracebacks point at the page. Returns the
    namespace's picklable values, for the tests to inspect.
    """
    namespace: dict[str, object] = {"__name__": "__main__"}
    for line, source in sources:
        exec(compile("\n" * (line - 1) + source, filename, "exec"), namespace)
    return {
        name: value
        for name, value in namespace.items()
        if isinstance(value, (str, int, float, list, tuple)) and not name.startswith("__")
    }


def run_page(page: str) -> list[dict[str, object]]:
    """Each rank's namespace after the page's ```py blocks ran, its picklable values only."""
    if page not in _RUNS:
        script = blocks(page, "py")
        try:
            _RUNS[page] = run_processes(
                PAGES[page][0], run_script, script, str(DOCS / page), timeout=300.0
            )
        except RanksFailedError as error:
            _RUNS[page] = error  # fail every test of the page without running it again
    result = _RUNS[page]
    if isinstance(result, RanksFailedError):
        raise result
    return result


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_block_runs_on_every_rank(page: str) -> None:
    kinds = OPENING_FENCE.findall((DOCS / page).read_text(encoding="utf-8"))
    world_size, least = PAGES[page]
    assert kinds.count("py") >= least
    assert set(kinds) <= {"py", "python", "text"}
    assert len(run_page(page)) == world_size


@pytest.mark.parametrize(
    "page", ["pipeline-parallel.md", "sharded-training.md", "tensor-parallel.md"]
)
def test_the_error_a_page_shows_is_the_one_every_rank_raises(page: str) -> None:
    ((_, shown),) = blocks(page, "text")
    for namespace in run_page(page):
        assert " ".join(str(namespace["message"]).split()) == " ".join(shown.split())


def test_per_task_heads_lifecycle_agrees_across_ranks() -> None:
    rank0, rank1 = run_page("per-task-heads.md")
    assert (rank0["created"], rank1["created"]) == (["heads.language"], ["heads.topic"])
    for namespace in (rank0, rank1):
        assert str(namespace["without_prefix"]).endswith("pass prefix='model.'")
        assert namespace["heads"] == ["sentiment", "spam", "topic", "language"]
        assert namespace["saved_heads"] == ["language", "sentiment", "spam", "topic"]
        assert namespace["closed"] is True
    assert rank0["topic_sum"] == rank1["topic_sum"]


def test_pipeline_page_matches_one_process_accumulates_and_freezes() -> None:
    first, middle, last = run_page("pipeline-parallel.md")
    assert first["losses"] == middle["losses"] == []  # only the last stage computes losses
    assert last["losses"] == pytest.approx(last["reference_losses"], rel=1e-5)
    assert len(last["losses"]) == 6  # type: ignore[arg-type]
    for namespace in (first, middle, last):
        assert min(namespace["norms"]) > 1.0  # type: ignore[type-var]  # clipping scaled
        assert namespace["norms"] == pytest.approx(last["norms"], rel=1e-6)
        assert namespace["accumulated_norm"] > 1.0  # type: ignore[operator]
        assert namespace["accumulated_norm"] == pytest.approx(namespace["reference_norm"], rel=1e-5)
        assert namespace["exported_keys"] == [  # every weight once, the tied one too
            *(f"layers.{i}.{name}" for i in range(3) for name in ("bias", "weight")),
            *("norm.bias", "norm.weight", "tok_embeddings.weight"),
        ]
    assert first["frozen_gradients"] == last["frozen_gradients"] == [None]
    assert middle["frozen_gradients"] == []


def test_sharded_training_and_tensor_parallel_pages_state_what_they_show() -> None:
    for namespace in run_page("sharded-training.md"):
        assert namespace["tasks"] == ["sentiment", "topic"]
    for namespace in run_page("tensor-parallel.md"):
        assert namespace["collectives"] == ["all_reduce"]
        assert namespace["outside_loss_parallel"] == "raises"
        assert "loss_parallel()" in str(namespace["local_slice"])
