"""The rendered API page of toolkit.nn shows every part of the toolkit's reference pages.

The text of each class's section is read from the built site (the ``site`` fixture).
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

CLASSES = ["ModuleDefaultDict", "TiedLinear"]
# Classes without methods of their own, whose sections have no methods or returns tables.
STYLES = ["TiedLinearParallel"]
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
def sections(site: Path) -> dict[str, str]:
    """The text of the module's section and of each class's, from the built page."""
    page = (site / "api" / "nn.html").read_text(encoding="utf-8")
    starts = {name: _heading(page, f"toolkit.nn.{name}") for name in [*CLASSES, *STYLES]}
    bounds = [*sorted(starts.values()), page.index("</article>")]
    result = {"toolkit.nn": _text(page[_heading(page, "toolkit.nn") : bounds[0]])}
    for name, start in starts.items():
        fragment = page[start : bounds[bounds.index(start) + 1]]
        result[name] = _text(fragment)
        result[f"{name} html"] = fragment
    return result


def test_the_module_has_its_summary_and_a_table_of_classes(sections: dict[str, str]) -> None:
    module = sections["toolkit.nn"]
    assert "PyTorch neural-network utilities" in module
    assert "Classes: Name Description ModuleDefaultDict An nn.ModuleDict that builds" in module
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
        "default_factory Callable[[], ModuleT] | None A callable without arguments"
        in sections["ModuleDefaultDict"]
    )
    assert "**kwargs ModuleT Initial entries" in sections["ModuleDefaultDict"]
    assert "key str The name of the module to retrieve. required" in sections["ModuleDefaultDict"]
    assert "tied_module Module The module whose weight is shared" in sections["TiedLinear"]


def test_the_entry_points_are_listed_with_their_summaries(sections: dict[str, str]) -> None:
    assert (
        "__getitem__ Retrieve a module by key, creating it if missing."
        in sections["ModuleDefaultDict"]
    )
    assert "__call__ Apply the tied linear transform." in sections["TiedLinear"]
    assert "AttributeError If tied_module has no weight" in sections["TiedLinear"]


def test_the_tensor_parallel_style_shows_its_base_parameters_and_errors(
    sections: dict[str, str],
) -> None:
    text = sections["TiedLinearParallel"]
    assert "Bases: ParallelStyle" in text
    assert "Parameters: Name Type Description Default" in text
    assert "input_layouts Placement | None The layout of a plain-tensor input" in text
    assert "use_local_output bool Return this rank's local tensor" in text
    assert "Raises: Type Description TypeError If applied to anything but" in text
    assert "Added in version v3.58.0." in text
    assert SPHINX_ROLE.search(text) is None
    assert "<blockquote" not in sections["TiedLinearParallel html"]


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


def test_only_public_signatures_are_shown(sections: dict[str, str]) -> None:
    """The typing overloads are the signatures; the implementation's, with its catch-all
    types, is not shown."""
    text = sections["ModuleDefaultDict"]
    assert (
        "ModuleDefaultDict( default_factory: Callable[[], ModuleT] | None, modules: "
        "Mapping[str, ModuleT] | Iterable[tuple[str, ModuleT]] | None, /, **kwargs: ModuleT, )"
    ) in text
    assert "get(key: str, default: T) -> ModuleT | T" in text
    for implementation in ["_MISSING", "default: object", "-> object", "*args", "*modules:"]:
        assert implementation not in text


def test_the_guides_are_links(sections: dict[str, str]) -> None:
    for name, guide in [
        ("ModuleDefaultDict", "per-task-heads.html"),
        ("TiedLinear", "tied-lm-heads.html"),
        ("TiedLinearParallel", "tensor-parallel.html"),
    ]:
        assert re.search(rf'<a [^>]*href="\.\./{guide}#[^"]*"', sections[f"{name} html"]), name


def test_the_tensor_parallel_example_renders_as_code(sections: dict[str, str]) -> None:
    fragment = sections["TiedLinearParallel html"]
    assert "::" not in sections["TiedLinearParallel"].split("Examples:")[1]
    code = fragment[fragment.index("Examples:") :]
    assert "<code" in code
    assert "parallelize_module(model.head.linear, tp_mesh, TiedLinearParallel())" in _text(code)
