"""What a newcomer reads first is true: what each page needs, the version, every public name."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

import toolkit.nn

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
GUIDES = sorted(
    p.name for p in DOCS.glob("*.md") if p.name not in {"index.md", "changelog.md", "benchmarks.md"}
)
PUBLIC = [name for name in toolkit.nn.__all__ if name != "__version__"]
CODE = re.compile(r"^ *```(?:python|py)\n(?P<code>.*?)^ *```", re.DOTALL | re.MULTILINE)
# What a module imports that the page must name too: safetensors.torch imports numpy, and so
# does torch's CommDebugMode, though torch does not depend on numpy.
ALSO_NEEDS = {"safetensors": {"numpy"}, "torch.distributed.tensor.debug": {"numpy"}}


def _needs(page: str) -> set[str]:
    """The distributions beyond the standard library, torch and toolkit a page's code imports."""
    modules = set()
    for match in CODE.finditer(page):
        for node in ast.walk(ast.parse(match["code"])):
            if isinstance(node, ast.Import):
                modules |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules.add(node.module)
    tops = {module.split(".")[0] for module in modules}
    needs = tops - set(sys.stdlib_module_names) - {"torch", "toolkit"}
    return needs.union(*(ALSO_NEEDS.get(name, set()) for name in needs | modules))


@pytest.mark.parametrize("guide", GUIDES)
def test_every_guide_names_what_it_needs_beyond_torch_before_its_code(guide: str) -> None:
    page = (DOCS / guide).read_text(encoding="utf-8")
    first_code = CODE.search(page)
    before_code = page[: first_code.start()] if first_code else page
    for distribution in _needs(page):
        assert f"`{distribution}`" in before_code, f"{guide} does not name {distribution}"


@pytest.mark.parametrize("guide", sorted(set(GUIDES) - {"parallelism.md", "torchtitan.md"}))
def test_every_guide_says_how_its_examples_run(guide: str) -> None:
    # One script, run in order: alone, a later block fails on a name an earlier one defined.
    # (The 3-D parallelism and torchtitan pages show sections of an example, which they name.)
    page = (DOCS / guide).read_text(encoding="utf-8")
    first_code = CODE.search(page)
    assert first_code is not None
    assert "one script" in page[: first_code.start()]


def test_the_front_page_has_the_version_the_install_line_and_every_public_name() -> None:
    page = (DOCS / "index.md").read_text(encoding="utf-8")
    release = (ROOT / "VERSION").read_text().strip()
    assert f"release **{release}**" in page
    assert "pip install ./packages/toolkit-nn" in page
    assert "depends on `torch` alone" not in page
    for name in PUBLIC:
        assert f"(api/nn.md#toolkit.nn.{name})" in page, name


def test_the_package_readme_and_description_name_every_public_name() -> None:
    readme = (ROOT / "packages" / "toolkit-nn" / "README.md").read_text(encoding="utf-8")
    pyproject = tomllib.loads((ROOT / "packages" / "toolkit-nn" / "pyproject.toml").read_text())
    for name in PUBLIC:
        assert f"`{name}`" in readme, name
        assert name in pyproject["project"]["description"], name
    # Absolute links: the README is also the package's page on the index.
    assert "(https://github.com/toolkit-dev/toolkit/tree/main/docs)" in readme
    assert "docs/migrating-from-torchtune.md)" in readme
