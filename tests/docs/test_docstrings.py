"""Every docstring example of toolkit.nn runs and prints what it shows (doctest)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import toolkit.nn
from toolkit.nn import ModuleDefaultDict, TiedLinear

MODULES = sorted(
    {
        "toolkit.nn",
        *(info.name for info in pkgutil.walk_packages(toolkit.nn.__path__, "toolkit.nn.")),
    }
)


# The public classes say they are toolkit.nn's, so a module's finder skips them, and the
# package's skips their methods (defined elsewhere): they are searched on their own.
CLASSES = [name for name in toolkit.nn.__all__ if isinstance(getattr(toolkit.nn, name), type)]


def _run(tests: list[doctest.DocTest], name: str) -> None:
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed; see stdout"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_pass(name: str) -> None:
    _run(doctest.DocTestFinder().find(importlib.import_module(name)), name)


@pytest.mark.parametrize("name", CLASSES)
def test_class_docstring_examples_pass(name: str) -> None:
    # Each example imports what it uses: it starts from empty globals.
    cls = getattr(toolkit.nn, name)
    _run(doctest.DocTestFinder().find(cls, name, module=False, globs={}), name)


@pytest.mark.parametrize("cls", [ModuleDefaultDict, TiedLinear])
def test_every_public_class_has_an_example(cls: type) -> None:
    examples = sum(len(test.examples) for test in doctest.DocTestFinder().find(cls))
    assert examples > 0
