"""The package's layout: what its modules may import from each other, and what they import lazily.

The suite's own layout too: a test module imports helpers (the harness, the tiny models, the
strategies), never another test module and never the benchmarks.

Each private module ``_x.py`` keeps its ``_``-prefixed names to itself; the names several
modules share live in ``_common.py``, the one module whose private names others import. A
name another module needs is imported without the ``_`` (``linear_cross_entropy``), which
says that it is part of the package's inside, not of one file's.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from torch import nn

import toolkit.nn

PACKAGE = Path(toolkit.nn.__file__).parent
TESTS = Path(__file__).resolve().parents[1]
SHARED = "toolkit.nn._common"


def _modules() -> dict[str, ast.Module]:
    return {
        f"toolkit.nn.{path.stem}" if path.stem != "__init__" else "toolkit.nn": ast.parse(
            path.read_text(), str(path)
        )
        for path in sorted(PACKAGE.glob("*.py"))
    }


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.Module) -> set[str]:
    """The private names a module defines: functions, classes and methods, at any depth."""
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and _is_private(node.name)
    }


def _package_imports(tree: ast.Module) -> list[ast.ImportFrom]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("toolkit.nn.")
    ]


def test_private_names_cross_files_only_from_the_common_module() -> None:
    modules = _modules()
    defined = {name: _defined(tree) for name, tree in modules.items()}
    crossings = []
    for name, tree in modules.items():
        for node in _package_imports(tree):
            if node.module != SHARED:
                crossings += [
                    f"{name} imports {alias.name} from {node.module}"
                    for alias in node.names
                    if _is_private(alias.name)
                ]
        # A private method or function of another module, reached as an attribute; torch's
        # own (Module._apply, overridden somewhere here) are torch's protocol.
        elsewhere = set().union(
            *(names for other, names in defined.items() if other not in (name, SHARED))
        ) - set(dir(nn.Module))
        crossings += [
            f"{name} uses {node.attr}, which another module defines"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and node.attr in elsewhere - defined[name] - defined[SHARED]
        ]
    assert crossings == []


def test_the_modules_import_each_other_without_a_loop() -> None:
    # Imports made only for type checking count too: a loop there is a loop in the design.
    graph = {
        name: {node.module for node in _package_imports(tree)} for name, tree in _modules().items()
    }
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import loop: {' -> '.join((*path, name))}"
        if name not in done:
            for imported in graph.get(name, ()):
                visit(imported, (*path, name))
            done.add(name)

    for name in graph:
        visit(name, ())


def test_plain_tensors_never_import_torch_distributed_tensor_nor_transformers() -> None:
    """torch.distributed.tensor takes seconds to import: the package imports it only when
    TiedLinearParallel is first used, or when a DTensor already exists. transformers is a
    test dependency only: the package never imports it."""
    code = """
import sys
import torch
from torch import nn
import toolkit.nn
from toolkit.nn import ModuleDefaultDict, TiedLinear, clip_grad_norm_
assert "transformers" not in sys.modules, "imported by the package"

head = TiedLinear(nn.Embedding(17, 8))
x = torch.randn(3, 8, requires_grad=True)
head(x).sum().backward()
head.cross_entropy(x, torch.tensor([0, 5, 16])).backward()
clip_grad_norm_([head.weight], 1.0)
ModuleDefaultDict(nn.Identity)["a"]
assert "torch.distributed.tensor" not in sys.modules, "imported by a plain call"
toolkit.nn.TiedLinearParallel
assert "torch.distributed.tensor" in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_docstrings_are_short_and_date_each_public_name_once() -> None:
    """A docstring says what, the arguments, what is raised and one example; the narrative
    lives in the guides under docs/. Each public name's own docstring dates it; a method or
    an argument added later dates itself too (``nox -s lockstep`` checks them all against
    the CHANGELOG)."""
    long = []
    added = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                docstring = ast.get_docstring(node, clean=False) or ""
                if len(docstring.splitlines()) > 40:
                    long.append(f"{name}.{getattr(node, 'name', '')}")
        defined = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
        for node in defined:  # the module's own names, not their methods
            if "Added in version" in (ast.get_docstring(node, clean=False) or ""):
                added.append(node.name)
    assert long == []
    assert sorted(added) == sorted(n for n in toolkit.nn.__all__ if n != "__version__")


def test_tests_import_helpers_never_another_test_module_nor_the_benchmarks() -> None:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found += [
                f"{path.relative_to(TESTS.parent)} imports {name}"
                for name in names
                if name.split(".")[0] == "benchmarks"
                or (name.split(".")[0] == "tests" and name.split(".")[-1].startswith("test_"))
            ]
    assert found == []
