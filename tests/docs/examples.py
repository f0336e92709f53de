"""Find and run the examples of Markdown pages: the blocks fenced exactly ```python (or ```py)."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

FENCE = "```"


@dataclass(frozen=True)
class Block:
    """One fenced block: its code and the 1-based line of its first code line."""

    code: str
    line: int


def python_blocks(text: str, info: str = "python") -> list[Block]:
    """The blocks of ``text`` fenced exactly ```python (or `````info``), in order.

    Blocks fenced any other way (```py, ```bash, ```python title="x", ...) are left out: ```py
    marks examples that need a process group, which ``tests/nn/distributed`` runs on gloo
    ranks. A fence may be indented, as inside a list item.

    Raises:
        ValueError: If a block is not closed.
    """
    blocks: list[Block] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        if lines[index].strip() != FENCE + info:
            index += 1
            continue
        start = index + 1
        end = start
        while end < len(lines) and lines[end].strip() != FENCE:
            end += 1
        if end == len(lines):
            raise ValueError(f"the ```{info} block opened on line {index + 1} is not closed")
        blocks.append(Block(textwrap.dedent("\n".join(lines[start:end])), start + 1))
        index = end + 1
    return blocks


def run_page(path: Path, blocks: list[Block]) -> dict[str, object]:
    """Run ``blocks`` in order in one namespace; tracebacks name the page and its lines."""
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem.replace('-', '_')}"}
    for block in blocks:
        # Pad with blank lines so that the line numbers in a traceback are the page's.
        code = compile("\n" * (block.line - 1) + block.code, str(path), "exec")
        exec(code, namespace)
    return namespace
