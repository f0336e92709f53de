"""The guides built on an example script show its code, included, not copied.

docs/parallelism.md walks through examples/parallel_3d.py, which
``test_distributed_example.py`` launches on eight processes; docs/torchtitan.md walks
through examples/torchtitan_pp.py, which ``tests/torchtitan`` launches in the torchtitan
session. Every Python block of these pages is a snippet include of a section of the example.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Each page, its example, and the example's sections the page includes, in order.
PAGES = {
    "parallelism.md": ("parallel_3d.py", ["model", "plans", "build", "step"]),
    "torchtitan.md": ("torchtitan_pp.py", ["model", "stage", "build", "step", "checkpoint"]),
}


def included_sections(page: str) -> list[str]:
    example, _ = PAGES[page]
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    # Includes, fenced so that neither the docs tests run them nor ruff formats them; the
    # only other blocks are the commands that run the example.
    fences = re.findall(r"^```(.*)$", text, re.M)
    assert set(fences[0::2]) == {"bash", "{ .python }"}
    assert set(fences[1::2]) == {""}
    blocks = re.findall(r"^```\{ \.python \}\n(.*?)^```$", text, re.M | re.S)
    include = re.compile(rf'--8<-- "examples/{re.escape(example)}:(\w+)"')
    sections = []
    for block in blocks:
        match = include.fullmatch(block.strip())
        assert match is not None, f"a Python block of {page} is not an include: {block!r}"
        sections.append(match.group(1))
    return sections


def section(page: str, name: str) -> str:
    example, _ = PAGES[page]
    text = (ROOT / "examples" / example).read_text(encoding="utf-8")
    start, end = f"# --8<-- [start:{name}]\n", f"# --8<-- [end:{name}]"
    assert text.count(start) == text.count(end) == 1, name
    return text.split(start)[1].split(end)[0]


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_code_block_of_the_page_is_a_section_of_the_example(page: str) -> None:
    sections = included_sections(page)
    assert sections == PAGES[page][1]
    for name in sections:
        assert section(page, name).strip()


@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_built_page_shows_the_example_code(page: str, site: Path) -> None:
    html = (site / page.replace(".md", ".html")).read_text(encoding="utf-8")
    text = re.sub(r"<[^>]+>", "", html).replace("&quot;", '"').replace("&gt;", ">")
    for name in included_sections(page):
        for line in section(page, name).splitlines():
            if line.strip() and "&" not in line and "<" not in line:
                assert line.strip() in text, line
