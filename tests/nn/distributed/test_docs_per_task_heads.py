"""The multi-rank examples of docs/per-task-heads.md run on two gloo ranks.

Its ```py blocks form one ``torchrun`` script, run here in order, in one namespace, on two
ranks; its ```python blocks run in a single process in the generic docs test.
"""

from __future__ import annotations

import pytest

from tests.nn.distributed.pages import DOCS, fences, run_page

PAGE = DOCS / "per-task-heads.md"


@pytest.fixture(scope="module")
def namespaces() -> list[dict[str, object]]:
    return run_page(PAGE)


def test_the_page_has_multi_rank_blocks_and_single_process_blocks() -> None:
    kinds = fences(PAGE)
    assert kinds.count("py") == 4
    assert set(kinds) == {"py", "python"}


def test_the_lifecycle_runs_on_two_ranks_and_the_ranks_agree(
    namespaces: list[dict[str, object]],
) -> None:
    rank0, rank1 = namespaces
    assert rank0["created"] == ["heads.language"]
    assert rank1["created"] == ["heads.topic"]
    for namespace in namespaces:
        assert str(namespace["without_prefix"]).endswith("pass prefix='model.'")
        assert namespace["heads"] == ["sentiment", "spam", "topic", "language"]
        assert namespace["saved_heads"] == ["language", "sentiment", "spam", "topic"]
        assert namespace["closed"] is True
    assert rank0["topic_sum"] == rank1["topic_sum"]
