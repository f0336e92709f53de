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


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_pass(name: str) -> None:
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(module):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed; see stdout"


@pytest.mark.parametrize("cls", [ModuleDefaultDict, TiedLinear])
def test_every_public_class_has_an_example(cls: type) -> None:
    examples = sum(len(test.examples) for test in doctest.DocTestFinder().find(cls))
    assert examples > 0
