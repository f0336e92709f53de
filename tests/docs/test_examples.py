"""Every example of the docs runs: each ```python block, page by page, in order.

The blocks of a page share one namespace, as a reader following the page would. Blocks fenced
```py are skipped here: other tests own them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.examples import python_blocks, run_page

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    path
    for pattern in ("docs/**/*.md", "README.md", "packages/*/README.md")
    for path in ROOT.glob(pattern)
)
RUNNABLE = [path for path in PAGES if python_blocks(path.read_text(encoding="utf-8"))]
GUIDES = [
    "quickstart.md",
    "per-task-heads.md",
    "tied-lm-heads.md",
    "migrating-from-torchtune.md",
    "transformers.md",
]


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda path: str(path.relative_to(ROOT)))
def test_page_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # an example that writes files writes them here
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    run_page(page, blocks)


@pytest.mark.parametrize("guide", GUIDES)
def test_every_guide_has_runnable_examples(guide: str) -> None:
    assert ROOT / "docs" / guide in RUNNABLE


def test_only_blocks_fenced_exactly_python_are_found() -> None:
    text = "\n".join(
        [
            "# Page",
            "```python",
            "a = 1",
            "```",
            "```py",
            "raise AssertionError('owned by another test')",
            "```",
            "```bash",
            "exit 1",
            "```",
            '```python title="x.py"',
            "b = 2",
            "```",
            "- item",
            "",
            "    ```python",
            "    if a:",
            "        c = 3",
            "    ```",
        ]
    )
    blocks = python_blocks(text)
    assert [block.code for block in blocks] == ["a = 1", "if a:\n    c = 3"]
    assert [block.line for block in blocks] == [3, 17]


def test_an_unclosed_block_is_an_error() -> None:
    with pytest.raises(ValueError, match="line 2 is not closed"):
        python_blocks("text\n```python\nx = 1\n")


def test_blocks_share_a_namespace_in_order_and_failures_point_at_the_page(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    text = "```python\nx = 2\n```\n\nProse.\n\n```python\ny = x * 3\nassert y == 7\n```\n"
    page.write_text(text)
    with pytest.raises(AssertionError) as failure:
        run_page(page, python_blocks(text))
    frame = failure.traceback[-1]
    assert Path(str(frame.path)) == page
    assert frame.lineno + 1 == 9
