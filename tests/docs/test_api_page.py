"""The rendered API page of toolkit.nn shows every part of the toolkit's reference pages.

The site is built (not strictly, so that a page still being written elsewhere cannot hide a
regression here) into a temporary folder, and the text of each class's section is checked.
"""

from __future__ import annotations

import html
import os
import re
from pathlib import Path

import mkdocs.commands.build as mkdocs_build
import mkdocs.config as mkdocs_config
import pytest

ROOT = Path(__file__).resolve().parents[2]
CLASSES = ["ModuleDefaultDict", "TiedLinear"]
SPHINX_ROLE = re.compile(r":(class|func|meth|attr|mod|obj|data|exc):")


def _text(fragment: str) -> str:
    """The words a reader sees: inline tags join their neighbours, other tags separate them."""
    fragment = re.sub(r"<(script|style)\b.*?</\1>", " ", fragment, flags=re.DOTALL)
    fragment = re.sub(r"</?(a|abbr|b|code|em|i|span|strong|autoref)\b[^>]*>", "", fragment)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def _heading(page: str, identifier: str) -> int:
    match = re.search(rf'<h[1-6] id="{re.escape(identifier)}"', page)
    assert match is not None, f"the page has no heading for {identifier}"
    return match.start()


@pytest.fixture(scope="module")
def sections(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The text of the module's section and of each class's, from the built page."""
    site = tmp_path_factory.mktemp("site")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        config = mkdocs_config.load_config(
            str(ROOT / "mkdocs.yml"), site_dir=str(site), strict=False
        )
        mkdocs_build.build(config)
    finally:
        os.chdir(cwd)
    page = (site / "api" / "nn" / "index.html").read_text(encoding="utf-8")
    starts = {name: _heading(page, f"toolkit.nn.{name}") for name in CLASSES}
    bounds = [*sorted(starts.values()), page.index("</article>")]
    result = {"toolkit.nn": _text(page[_heading(page, "toolkit.nn") : bounds[0]])}
    for name, start in starts.items():
        fragment = page[start : bounds[bounds.index(start) + 1]]
        result[name] = _text(fragment)
        result[f"{name} html"] = fragment
    return result


def test_the_module_has_its_summary_and_a_table_of_classes(sections: dict[str, str]) -> None:
    module = sections["toolkit.nn"]
    assert "Module for PyTorch neural network utilities." in module
    assert "Classes: Name Description ModuleDefaultDict Holds submodules" in module
    assert "TiedLinear A bias-free linear layer" in module


def test_module_default_dict_shows_its_bases(sections: dict[str, str]) -> None:
    assert "Bases: ModuleDict, Generic[ModuleT]" in sections["ModuleDefaultDict"]
    assert "Bases:" not in sections["TiedLinear"]


@pytest.mark.parametrize("name", CLASSES)
def test_each_class_has_every_part(name: str, sections: dict[str, str]) -> None:
    text = sections[name]
    assert "Parameters: Name Type Description Default" in text
    assert "Methods: Name Description" in text
    assert "Returns: Type Description" in text
    assert "Raises: Type Description" in text
    assert "Added in version v3.58.0." in text


def test_the_parameter_tables_give_types_from_the_signatures_and_defaults(
    sections: dict[str, str],
) -> None:
    assert (
        "default_factory Callable[[], ModuleT] | None A no argument constructor"
        in sections["ModuleDefaultDict"]
    )
    assert "**kwargs ModuleT Initial dictionary values" in sections["ModuleDefaultDict"]
    assert "key str The name of the module to retrieve. required" in sections["ModuleDefaultDict"]
    assert (
        "tied_module Module The module whose weight attribute is shared." in sections["TiedLinear"]
    )


def test_the_entry_points_are_listed_with_their_summaries(sections: dict[str, str]) -> None:
    assert (
        "__getitem__ Retrieve a module by key, creating it if missing."
        in sections["ModuleDefaultDict"]
    )
    assert "__call__ Apply the tied linear transform." in sections["TiedLinear"]
    assert (
        "AttributeError If tied_module does not have a weight attribute." in sections["TiedLinear"]
    )


@pytest.mark.parametrize("name", ["ModuleDefaultDict", "TiedLinear"])
def test_docstrings_render_as_markdown(name: str, sections: dict[str, str]) -> None:
    """Sphinx roles show up verbatim, and only an "Examples:" section renders as code."""
    assert SPHINX_ROLE.search(sections[name]) is None
    assert "<blockquote" not in sections[f"{name} html"]
    assert "Examples: >>> import" in sections[name]


def test_tied_linear_lists_cross_entropy(sections: dict[str, str]) -> None:
    assert (
        "cross_entropy The cross-entropy of self(x) against target, without the full logits."
        in sections["TiedLinear"]
    )
