"""docs/parallelism.md shows the code of examples/parallel_3d.py, included, not copied.

Its Python blocks are snippet includes of sections of the example, which
``test_distributed_example.py`` launches on eight processes, as the page says.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "parallelism.md"
EXAMPLE = ROOT / "examples" / "parallel_3d.py"
INCLUDE = re.compile(r'--8<-- "examples/parallel_3d\.py:(\w+)"')


def included_sections() -> list[str]:
    text = PAGE.read_text(encoding="utf-8")
    fences = re.findall(r"^```(.*)$", text, re.M)
    # Includes, fenced so that neither the docs tests run them nor ruff formats them; the
    # one other block is the command that runs the example.
    assert fences == ["bash", "", *["{ .python }", ""] * 4]
    blocks = re.findall(r"^```\{ \.python \}\n(.*?)^```$", text, re.M | re.S)
    sections = []
    for block in blocks:
        match = INCLUDE.fullmatch(block.strip())
        assert match is not None, f"a Python block of the page is not an include: {block!r}"
        sections.append(match.group(1))
    return sections


def section(name: str) -> str:
    text = EXAMPLE.read_text(encoding="utf-8")
    start, end = f"# --8<-- [start:{name}]\n", f"# --8<-- [end:{name}]"
    assert text.count(start) == text.count(end) == 1, name
    return text.split(start)[1].split(end)[0]


def test_every_code_block_of_the_page_is_a_section_of_the_example() -> None:
    sections = included_sections()
    assert sections == ["model", "plans", "build", "step"]
    for name in sections:
        assert section(name).strip()


def test_the_built_page_shows_the_example_code(site: Path) -> None:
    html = (site / "parallelism.html").read_text(encoding="utf-8")
    text = re.sub(r"<[^>]+>", "", html).replace("&quot;", '"').replace("&gt;", ">")
    for name in included_sections():
        for line in section(name).splitlines():
            if line.strip() and "&" not in line and "<" not in line:
                assert line.strip() in text, line
