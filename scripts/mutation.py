"""Mutation testing of every package: mutmut's pass, the slow tests, the equivalent list.

``nox -s mutation`` runs this script. It works in three steps:

1. **Lay out the workspace.** mutmut expects the src layout of its documentation: one ``src/``
   beside ``tests/`` and ``pyproject.toml``, with module names read from the paths under
   ``src/``. The monorepo keeps each package's sources in ``packages/<name>/src``, so the script
   copies every one of them into ``.mutation/src`` (the ``toolkit`` namespace is PEP 420, so
   the portions merge into one tree), beside copies of ``tests/`` and the root
   ``pyproject.toml``, whose ``[tool.mutmut]`` table configures mutmut. A new package or source
   file joins the run with no change here.
2. **The fast pass.** ``mutmut run`` mutates every function and runs the single-process tests
   that reach it, each mutant switched on in a forked worker.
3. **The slow pass.** Some tests cannot run under mutmut: the compile tests assert that a
   model compiles in one graph, which mutmut's trampolines break, and the multi-rank tests run
   the code in other processes, out of mutmut's sight. Each mutant still alive after the fast
   pass is written into a plain copy of the sources, and the slow tests run against it, in
   order from the cheapest, stopping at the first failure.

A mutant that survives both passes must be listed in ``tests/mutation/equivalent.toml`` with
the reason it cannot change behaviour; otherwise the run fails. Entries are keyed by function,
original line and mutated line, not by mutmut's numbering, which shifts as code changes. A
listed entry that matches no surviving mutant is stale and also fails the run, so that the
list stays reviewed.

``--incremental`` reuses the outcomes recorded in the ledger, ``tests/mutation/ledger.toml``,
where they still hold, and runs every other mutant; ``--record`` rewrites the ledger after a
run that passed. A recorded outcome is reused only when what decided it is unchanged:

* the function's own code (as ``ast`` parses it, without its docstring);
* what it depends on (``dependencies``): the code of every function of the package it may
  call, transitively, and the context (constants, class attributes, imports, signatures) of
  every module those live in or import;
* every test file that covers the function, each with the helper modules it imports from
  ``tests/``, ``benchmarks/`` or ``examples/`` and the ``conftest.py`` files above it, and the
  test files that cover it now, by mutmut's stats of this run, the same as recorded; a
  mutant killed by the slow tests also needs the whole slow selection (its test files, their
  helpers, ``docs/`` and ``examples/``) unchanged;
* the settings (``setup_digest``): the pyproject files, the pins, the noxfile, ``pytest.ini``,
  this script and the environment the tests read;
* for a listed equivalent, also its entry, still listed.

Everything else runs, as in the whole run. A ledger that does not describe the sources stops
the run: a malformed one (``load_ledger``), or one that records a function's code as it is,
under the same settings, with other mutants than mutmut makes of it (``mismatches``).

The limit: a call that neither the code names nor the unmutated tests make (one that only a
mutant's path takes), and code that uses a function's result without being called by it (a
caller, a test's later steps), are no dependencies; nor is a data file that a test reads
without importing it. The whole run, ``nox -s mutation``, covers them; run it, with
``--record``, before a release.
"""

from __future__ import annotations

import argparse
import ast
import copy
import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKSPACE = ROOT / ".mutation"
EQUIVALENT = ROOT / "tests" / "mutation" / "equivalent.toml"
LEDGER = ROOT / "tests" / "mutation" / "ledger.toml"
# The folders whose modules count as part of a test that imports them.
HELPER_ROOTS = ("tests", "benchmarks", "examples")
# The folders whose every file the slow tests may read: the pages and examples they run.
SLOW_DATA = ("docs", "examples")
OUTCOMES = ("fast", "slow", "equivalent")
# mutmut's record of the tests that reach each function, in the workspace.
STATS = Path("mutants") / "mutmut-stats.json"
# The score the ledger's header repeats from the run that wrote it.
LEDGER_SCORE = ("mutants", "killed", "equivalent")

# The tests that mutmut cannot run, selected from each package's test folder. They run in
# this order, cheapest first, and stop at the first failure.
SLOW_SELECTION = ("-k", "compile or distributed")
# An upper bound on one slow run; the multi-rank launches bound themselves well below it.
SLOW_TIMEOUT_S = 1200.0

# The settings every outcome depends on, as globs under the repository (setup_digest), and
# the environment variables the tests, torch and Hypothesis read; TOOLKIT_PYTHON only picks
# the interpreter, which the noxfile pins.
SETTINGS = (
    "pyproject.toml",
    "packages/*/pyproject.toml",
    "constraints.txt",
    "noxfile.py",
    "pytest.ini",
    "tests/**/pytest.ini",
    "scripts/mutation.py",
)
# The methods that constructing a class runs, which its name reaches (index_sources), and the
# bases whose subclasses' every method it reaches: torch calls them back, an autograd
# Function's backward after the caller returned.
CONSTRUCTION = frozenset({"__new__", "__init__", "__post_init__", "__init_subclass__"})
CALLED_BACK = ("Function",)  # torch.autograd.Function, however imported
ENVIRONMENT = (
    "TOOLKIT_",
    "HYPOTHESIS_",
    "PYTEST_",
    "TORCH",
    "PYTORCH_",
    "ATEN_",
    "OMP_",
    "MKL_",
    "KMP_",
    "CUDA_",
    "CUBLAS_",
    "GLOO_",
    "NCCL_",
    "MASTER_",
    "MUTMUT_",
)
UNREAD = frozenset({"TOOLKIT_PYTHON"})

# mutmut's statuses: which count as detected, and which send a mutant to the slow pass.
DETECTED = frozenset({"killed", "timeout", "segfault", "caught by type check"})
UNDETECTED = frozenset({"survived", "no tests", "suspicious"})


@dataclass(frozen=True)
class Mutant:
    """One mutant: mutmut's name for it, its file, and the change it makes."""

    name: str
    path: str  # relative to the workspace, under src/
    function: str  # module.Class.method or module.function
    line: str  # the original lines the mutation changes, stripped, joined by newlines
    mutant: str  # the same lines after the mutation


@dataclass(frozen=True)
class Equivalent:
    """A reviewed entry of the equivalent list."""

    function: str
    line: str
    mutant: str
    reason: str

    def matches(self, mutant: Mutant) -> bool:
        """Whether ``mutant`` makes exactly the change this entry describes."""
        return (self.function, self.line, self.mutant) == (
            mutant.function,
            mutant.line,
            mutant.mutant,
        )


@dataclass
class Outcome:
    """What the run found, for the report."""

    total: int = 0
    reused: int = 0  # of the counts below, the outcomes taken from the ledger
    fast_killed: list[Mutant] = field(default_factory=list)
    slow_killed: list[Mutant] = field(default_factory=list)
    equivalent: list[tuple[Mutant, Equivalent]] = field(default_factory=list)
    survivors: list[Mutant] = field(default_factory=list)
    stale: list[Equivalent] = field(default_factory=list)


def package_ids(root: Path = ROOT) -> list[str]:
    """Each package's id: its folder under ``packages/`` without the ``toolkit-`` prefix."""
    return sorted(
        p.parent.name.removeprefix("toolkit-") for p in root.glob("packages/*/pyproject.toml")
    )


def source_files(root: Path = ROOT) -> dict[str, Path]:
    """Every Python source file, keyed by its path in the workspace (``src/...``)."""
    files: dict[str, Path] = {}
    for src in sorted(root.glob("packages/*/src")):
        for path in sorted(src.rglob("*.py")):
            files[str(Path("src") / path.relative_to(src))] = path
    return files


def digest(path: Path) -> str:
    """The SHA-256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def lay_out_workspace(sources: dict[str, Path]) -> None:
    """Build ``.mutation/``: the merged ``src/``, ``tests/`` and the root ``pyproject.toml``.

    It also copies what ``also_copy`` of ``[tool.mutmut]`` names.
    """
    shutil.rmtree(WORKSPACE, ignore_errors=True)
    WORKSPACE.mkdir()
    for relative, path in sources.items():
        target = WORKSPACE / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    for name in ("tests", "pyproject.toml", *config.get("also_copy", [])):
        source = ROOT / name
        if source.is_dir():
            ignore = shutil.ignore_patterns("__pycache__")
            shutil.copytree(source, WORKSPACE / name, ignore=ignore)
        else:
            shutil.copy2(source, WORKSPACE / name)


def clean_env() -> dict[str, str]:
    """The environment without a path to the repository's own sources or an active mutant.

    Each worker gets one intra-op thread: the workers already fill the cores, and torch's
    spinning threads would otherwise eat the CPU time by which mutmut detects a hang. The
    property tests run Hypothesis's ``mutation`` profile (the root ``pyproject.toml``, and
    ``tests/conftest.py``, which leaves out the constants Hypothesis would take from the
    sources): the same examples on every run, so that a run's verdicts do not depend on its
    draws.
    """
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("MUTANT_UNDER_TEST", None)
    env["OMP_NUM_THREADS"] = "1"
    env["HYPOTHESIS_PROFILE"] = "mutation"
    return env


def mutmut_run(patterns: Sequence[str], max_children: int) -> None:
    """The fast pass: ``mutmut run`` in the workspace, over the mutants ``patterns`` match."""
    command = [sys.executable, "-m", "mutmut", "run", f"--max-children={max_children}"]
    subprocess.run([*command, *patterns], cwd=WORKSPACE, env=clean_env(), check=True)


def changed_lines(diff: str) -> tuple[str, str]:
    """The original and the mutated lines of a unified diff, stripped."""
    removed = [line[1:].strip() for line in diff.splitlines() if line.startswith("-")]
    added = [line[1:].strip() for line in diff.splitlines() if line.startswith("+")]
    removed = [line for line in removed if not line.startswith("--")]
    added = [line for line in added if not line.startswith("++")]
    return "\n".join(removed), "\n".join(added)


def module_name(path: str) -> str:
    """The module of a workspace path: ``src/toolkit/nn/_x.py`` is ``toolkit.nn._x``."""
    return path.removeprefix("src/").removesuffix(".py").replace("/", ".")


def make_mutant(name: str, path: str, diff: str) -> Mutant:
    """The mutant mutmut calls ``name``, of the file ``path``, that makes the change ``diff``."""
    from mutmut.utils.format_utils import (  # noqa: PLC0415
        orig_function_and_class_names_from_key,
    )

    function, owner = orig_function_and_class_names_from_key(name)
    module = module_name(path)
    qualname = f"{module}.{owner}.{function}" if owner else f"{module}.{function}"
    line, mutated = changed_lines(diff)
    return Mutant(name, path, qualname, line, mutated)


def read_mutants(paths: Iterable[str]) -> dict[str, tuple[Mutant, str]]:
    """Every mutant of ``paths`` with its fast-pass status, read from mutmut's records.

    It must run with the workspace as the working directory, where mutmut reads its
    configuration and records.
    """
    from mutmut.mutation.data import SourceFileMutationData  # noqa: PLC0415 - cwd-bound
    from mutmut.mutation.diff_apply import get_diff_for_mutant  # noqa: PLC0415
    from mutmut.stats import status_by_exit_code  # noqa: PLC0415

    found: dict[str, tuple[Mutant, str]] = {}
    for path in paths:
        data = SourceFileMutationData(path=path)
        data.load()
        for name, exit_code in data.exit_code_by_key.items():
            mutant = make_mutant(name, path, get_diff_for_mutant(name, path=path))
            found[name] = (mutant, status_by_exit_code[exit_code])
    return found


def generate_mutants(sources: Mapping[str, Path]) -> list[Mutant]:
    """Every mutant that ``mutmut run`` will make of ``sources``, without running anything.

    mutmut's own generator names them, so the names are those of the run.
    """
    import libcst  # noqa: PLC0415 - installed with mutmut
    from mutmut.mutation.file_mutation import mutate_file_contents  # noqa: PLC0415
    from mutmut.utils.format_utils import (  # noqa: PLC0415
        get_mutant_name,
        orig_function_and_class_names_from_key,
    )

    mutants: list[Mutant] = []
    for path, source in sources.items():
        mutated = mutate_file_contents(path, source.read_text())
        # mutmut's trampolines: every mutant and each original, as functions or methods.
        trampolines: dict[str, libcst.FunctionDef] = {}
        for node in libcst.parse_module(mutated.code).body:
            body = node.body.body if isinstance(node, libcst.ClassDef) else [node]
            for function in body:
                if isinstance(function, libcst.FunctionDef):
                    trampolines[function.name.value] = function
        for local in mutated.mutant_names:
            name = get_mutant_name(Path(path), local)
            # Under the function's own name, as mutmut's diffs show it: a change to the
            # signature (a default argument) keeps the line that the whole run records.
            own = libcst.Name(orig_function_and_class_names_from_key(name)[0])
            original, changed = (
                libcst.Module([trampolines[key].with_changes(name=own)]).code.strip().split("\n")
                for key in (local.partition("__mutmut_")[0] + "__mutmut_orig", local)
            )
            diff = "\n".join(difflib.unified_diff(original, changed, path, path, lineterm=""))
            mutants.append(make_mutant(name, path, diff))
    return mutants


def _forwards_to(
    node: ast.FunctionDef | ast.AsyncFunctionDef,
    owner: str,
    module: str,
    imported: Mapping[str, str],
) -> str | None:
    """The function ``node`` forwards to, or None if it does more than forward.

    Forwarding is one statement (a docstring aside) that calls a function of ``module`` (or
    one it imports), or a method of ``owner`` through ``self`` or ``cls``, with the function's
    own arguments as they came, in their order, and returns what it returns, yields from it,
    or nothing. A default value in its signature is code that mutation would miss.
    """
    if node.args.defaults or any(d is not None for d in node.args.kw_defaults):
        return None
    body = _without_docstring(node.body)
    statement = body[0] if len(body) == 1 else None
    call = statement.value if isinstance(statement, ast.Return | ast.Expr) else None
    if isinstance(call, ast.YieldFrom):  # a generator's, as under contextlib.contextmanager
        call = call.value
    if not isinstance(call, ast.Call):
        return None
    args = node.args
    own = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
    own += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    values = [v.value if isinstance(v, ast.Starred) else v for v in call.args]
    values += [k.value for k in call.keywords]
    names = [v.id if isinstance(v, ast.Name) else "" for v in values]
    if not all(names) or names != [n for n in own if n in names] or len(set(names)) < len(names):
        return None
    if isinstance(call.func, ast.Name):
        return imported.get(call.func.id, f"{module}.{call.func.id}")
    function = call.func
    if isinstance(function, ast.Attribute) and isinstance(function.value, ast.Name):
        return f"{owner}.{function.attr}" if function.value.id in ("self", "cls") else None
    return None


def unmutated(sources: Mapping[str, Path], mutants: Iterable[Mutant]) -> list[str]:
    """The functions that mutation would miss, each with what to do; none in a sound run.

    mutmut makes no mutant of a decorated function (but for ``staticmethod``, ``classmethod``
    and the signatures of ``typing.overload``: a property, ``torch.no_grad()``), of a name it
    never mutates (``__setattr__``), or of a function defined under a module's ``if``, ``try``
    or ``with`` (but ``if TYPE_CHECKING:``, which never runs). Such a function must only
    forward (``_forwards_to``) to a plain one that has mutants. Every public function (named
    in its module's ``__all__``) and every public or special method of a public class must
    have mutants, or forward to one that has.
    """
    from mutmut.mutation.file_mutation import NEVER_MUTATE_FUNCTION_NAMES  # noqa: PLC0415

    mutated = {mutant.function for mutant in mutants}
    problems: list[str] = []

    def check(node: ast.stmt, owner: str, public: bool, nested: bool = False) -> None:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return
        name = f"{owner}.{node.name}"
        decorators = {ast.unparse(d) for d in node.decorator_list}
        if decorators & {"overload", "typing.overload"}:
            return  # a signature for type checkers; the implementation follows it
        plain = decorators - {"staticmethod", "classmethod"}
        left_out = nested or bool(plain) or node.name in NEVER_MUTATE_FUNCTION_NAMES
        target = _forwards_to(node, owner, module, imported)
        if left_out and (target is None or target not in mutated):
            problems.append(
                f"{name}: mutation leaves it out (a decorator, a name mutmut never mutates, or "
                "a definition under an if, try or with); move its body into a plain function "
                "or method that it only forwards to"
            )
        elif public and name not in mutated and target not in mutated:
            problems.append(f"{name}: public, and no mutant reaches its code")

    for rel, path in sources.items():
        module = module_name(rel)
        tree = ast.parse(path.read_text())
        exported = {
            value.value
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            and isinstance(node.value, ast.List | ast.Tuple)
            for value in node.value.elts
            if isinstance(value, ast.Constant)
        }
        imported = {
            alias.asname or alias.name: f"{origin}.{alias.name}"
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for origin in [_absolute(node, module)]
            for alias in node.names
        }
        for node, nested in _definitions(tree.body):
            check(node, module, node_name(node) in exported, nested)
            if isinstance(node, ast.ClassDef):
                for method, inner in _definitions(node.body):
                    shown_name = node_name(method)
                    public = node.name in exported and (
                        not shown_name.startswith("_") or shown_name.startswith("__")
                    )
                    check(method, f"{module}.{node.name}", public, nested or inner)
    return problems


def _definitions(body: list[ast.stmt]) -> Iterable[tuple[ast.stmt, bool]]:
    """Each statement of ``body`` and of its ``if``, ``try`` and ``with`` blocks.

    With each, whether it lies in such a block.
    """
    for node in body:
        yield node, False
        if isinstance(node, ast.If | ast.Try | ast.With):
            # What ``if TYPE_CHECKING:`` holds is for type checkers, and never runs.
            checking = isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
            blocks = [[] if checking else node.body, getattr(node, "orelse", [])]
            blocks.append(getattr(node, "finalbody", []))
            blocks += [handler.body for handler in getattr(node, "handlers", [])]
            for block in blocks:
                yield from ((inner, True) for inner, _ in _definitions(block))


def _absolute(node: ast.ImportFrom, module: str) -> str:
    """The module that ``node``, in ``module``, imports from, as an absolute name."""
    package = module.split(".")[:-1]
    base = package[: len(package) - node.level + 1] if node.level else []
    return ".".join([*base, *(node.module.split(".") if node.module else [])])


def require_every_function_mutated(sources: Mapping[str, Path]) -> None:
    """Stop the run, before anything runs, if ``unmutated`` finds a function mutation misses."""
    missed = unmutated(sources, generate_mutants(sources))
    for problem in missed:
        print(f"UNMUTATED {problem}")
    if missed:
        raise SystemExit("mutation would miss the functions above")


def node_name(node: ast.stmt) -> str:
    """The name a definition binds, or an empty string for any other statement."""
    definition = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    return node.name if definition else ""


def slow_tests() -> list[str]:
    """The pytest arguments of the slow pass: single-process files first, then the rest."""
    args: list[str] = []
    for package in package_ids():
        folder = WORKSPACE / "tests" / package
        args += [str(p.relative_to(WORKSPACE)) for p in sorted(folder.glob("test_*.py"))]
        args += [str(p.relative_to(WORKSPACE)) for p in sorted(folder.iterdir()) if p.is_dir()]
    # The guides whose examples run on gloo ranks (tests/docs/test_distributed_pages.py).
    return [*args, "tests/docs", *SLOW_SELECTION]


def run_slow(args: Sequence[str], env: dict[str, str], *, show: bool = False) -> int | None:
    """Run the slow tests; their exit code, or None if they ran past ``SLOW_TIMEOUT_S``.

    Their output's tail is printed when pytest itself broke, or on any failure with ``show``.
    """
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args]
    try:
        done = subprocess.run(
            command,
            cwd=WORKSPACE,
            env=env,
            timeout=SLOW_TIMEOUT_S,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            check=False,
        )
    except subprocess.TimeoutExpired as expired:
        if show and expired.stdout:
            sys.stdout.write(expired.stdout.decode(errors="replace")[-4000:])
        return None
    if done.returncode not in (0, 1) or (show and done.returncode != 0):
        sys.stdout.write(done.stdout.decode(errors="replace")[-4000:])
    return done.returncode


def slow_pass(mutants: Sequence[Mutant], sources: dict[str, Path]) -> list[Mutant]:
    """Apply each mutant to a plain copy of the sources and run the slow tests; those killed."""
    from mutmut.mutation.diff_apply import apply_mutant  # noqa: PLC0415 - cwd-bound

    env = clean_env()
    env["PYTHONPATH"] = str(WORKSPACE / "src")
    args = slow_tests()
    started = time.monotonic()
    if run_slow(args, env, show=True) != 0:
        raise SystemExit("the slow tests fail on the unmutated sources; fix them first")
    print(f"slow tests pass on the unmutated sources in {time.monotonic() - started:.0f} s")
    killed: list[Mutant] = []
    for index, mutant in enumerate(mutants, 1):
        apply_mutant(mutant.name)
        started = time.monotonic()
        try:
            code = run_slow(args, env)
        finally:
            shutil.copy2(sources[mutant.path], WORKSPACE / mutant.path)
        # 1: a test failed; 2 and 3: the mutant broke collection or pytest itself. 4 and 5
        # would mean that the selection is wrong, which the unmutated run above rules out.
        if code is None or code in (1, 2, 3):
            killed.append(mutant)
            verdict = "killed" if code is not None else "killed (timed out)"
        elif code == 0:
            verdict = "survived"
        else:
            raise SystemExit(f"pytest exited with {code} on {mutant.name}")
        took = time.monotonic() - started
        print(f"  [{index}/{len(mutants)}] {mutant.name}: {verdict} ({took:.0f} s)")
    return killed


def load_equivalents() -> list[Equivalent]:
    """The reviewed list; every entry needs a function, the lines and a reason."""
    entries = tomllib.loads(EQUIVALENT.read_text()).get("equivalent", [])
    return [
        Equivalent(e["function"], e["line"].strip(), e["mutant"].strip(), e["reason"])
        for e in entries
    ]


# The ledger: what decided each recorded outcome, hashed.


def shown(path: Path) -> str:
    """``path`` as printed: relative to the repository where it lies in it."""
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def sha(text: str) -> str:
    """The SHA-256 of ``text``."""
    return hashlib.sha256(text.encode()).hexdigest()


def files_digest(paths: Iterable[Path], root: Path) -> str:
    """One digest of the files ``paths``: their paths under ``root`` and their contents."""
    return sha(
        "".join(f"{p.relative_to(root).as_posix()} {digest(p)}\n" for p in sorted(set(paths)))
    )


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    """``body`` without a leading docstring."""
    first = body[0] if body else None
    value = first.value if isinstance(first, ast.Expr) else None
    return body[1:] if isinstance(value, ast.Constant) and isinstance(value.value, str) else body


@dataclass
class Index:
    """What the sources define, for the dependencies of each function's outcomes.

    ``hashes``: each function and method by qualified name, with the hash of its code (``ast``'s
    dump, decorators included, docstring left out; same-named definitions, a property's getter
    and setter, share one). ``names``: the names each one may call by (``_read_names``).
    ``modules``: each function's module. ``contexts``: each module's code outside its
    functions' bodies (constants, class attributes, imports, signatures, decorators), hashed.
    ``imports``: the package modules each module imports. ``defines``: for a simple name, the
    functions it may call (same-named functions and methods, and what constructing a
    same-named class runs). ``called_back``: the classes whose methods torch calls back.
    """

    hashes: dict[str, str] = field(default_factory=dict)
    names: dict[str, set[str]] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)
    contexts: dict[str, str] = field(default_factory=dict)
    imports: dict[str, set[str]] = field(default_factory=dict)
    defines: dict[str, set[str]] = field(default_factory=dict)
    called_back: set[str] = field(default_factory=set)


def _read_names(node: ast.AST) -> set[str]:
    """The names ``node`` may call by: names, its own attributes, strings that could name them.

    An attribute counts when read from ``self``, ``cls`` or ``super()``; a method called on
    another object (``tie.broadcast()``, beside ``dist.broadcast()``) is left to the calls
    mutmut sees (``seen_calls``).
    """
    found: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.add(sub.id)
        elif isinstance(sub, ast.Attribute) and _is_own(sub.value):
            found.add(sub.attr)
        elif isinstance(sub, ast.Constant) and str(sub.value).isidentifier():
            found.add(str(sub.value))
    return found


def _is_own(value: ast.expr) -> bool:
    """Whether ``value`` is ``self``, ``cls`` or ``super()``."""
    if isinstance(value, ast.Call):
        return isinstance(value.func, ast.Name) and value.func.id == "super"
    return isinstance(value, ast.Name) and value.id in ("self", "cls")


def _imported_modules(tree: ast.Module, module: str) -> set[str]:
    """The absolute names of every module ``tree`` (the module ``module``) imports from."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            name = _absolute(node, module)
            found |= {name, *(f"{name}.{alias.name}" for alias in node.names)}
    return found


def _visit(
    index: Index,
    dumps: dict[str, list[str]],
    body: list[ast.stmt],
    owner: str,
    shell: list[ast.stmt],
    module: str,
) -> None:
    """Index the functions of ``body`` (in ``owner``); empty their twins in ``shell``."""
    for node, empty in zip(body, shell, strict=True):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert isinstance(empty, ast.FunctionDef | ast.AsyncFunctionDef)
            code = copy.copy(node)
            code.body = _without_docstring(node.body)
            name = f"{owner}.{node.name}"
            dumps.setdefault(name, []).append(ast.dump(code))
            index.names.setdefault(name, set()).update(_read_names(node))
            index.modules[name] = module
            index.defines.setdefault(node.name, set()).add(name)
            empty.body = []
        elif isinstance(node, ast.ClassDef):
            assert isinstance(empty, ast.ClassDef)
            empty.body = _without_docstring(empty.body)
            inner = _without_docstring(node.body)
            _visit(index, dumps, inner, f"{owner}.{node.name}", empty.body, module)
            if any(ast.unparse(base).endswith(CALLED_BACK) for base in node.bases):
                index.called_back.add(f"{owner}.{node.name}")


def _module_code(body: list[ast.stmt]) -> list[ast.stmt]:
    """The code of a module or class body that runs as it loads.

    Its imports, its ``__all__`` and its definitions (whose signatures belong to their
    functions) are left out; a class's bases and decorators are in.
    """
    found: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.ClassDef):
            found += node.bases + node.keywords + node.decorator_list  # type: ignore[arg-type]
            found += _module_code(node.body)
        elif not isinstance(
            node, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.AsyncFunctionDef
        ) and "__all__" not in {
            t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)
        }:
            found.append(node)
    return found


def index_sources(sources: Mapping[str, Path]) -> Index:
    """The index of the sources (workspace path: file)."""
    index = Index()
    dumps: dict[str, list[str]] = {}
    imports: dict[str, set[str]] = {}
    for rel, path in sources.items():
        module = module_name(rel)
        tree = ast.parse(path.read_text())
        imports[module] = _imported_modules(tree, module)
        context = copy.deepcopy(tree)
        context.body = _without_docstring(context.body)
        _visit(index, dumps, _without_docstring(tree.body), module, context.body, module)
        index.contexts[module] = sha(ast.dump(context))[:16]
        # What the module's own code outside its functions runs or names (a constant built by
        # a call, an alias, a table of functions) reaches every function of it.
        shared = set().union(*(_read_names(n) for n in _module_code(context.body)))
        for name, owner in index.modules.items():
            if owner == module:
                index.names[name] |= shared
    index.hashes = {name: sha("\n".join(parts))[:16] for name, parts in dumps.items()}
    # A class's name reaches what constructing it runs, or all of it for a class that torch
    # calls back (its backward runs after the caller returns); its other methods are reached
    # by their names, or by the calls mutmut sees.
    for name in index.hashes:
        owner, _, method = name.rpartition(".")
        if owner not in index.contexts and (method in CONSTRUCTION or owner in index.called_back):
            index.defines.setdefault(owner.rpartition(".")[2], set()).add(name)
    # ``import toolkit.nn`` runs the package's __init__.py.
    index.imports = {
        module: {m for name in found for m in (name, f"{name}.__init__") if m in index.contexts}
        for module, found in imports.items()
    }
    return index


def dependencies(index: Index, calls: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """Each function's dependency digest: what its mutants' outcomes read besides the tests.

    That is the code of every function it may call, transitively (a function or method named
    in its code, what constructing a class named there runs, what mutmut saw it call, ``calls``),
    and the context of every module those live in or import, transitively (``Index``). A
    change to any of them changes the digest, so that no outcome that it could change is
    reused.
    """

    def imported(modules: set[str]) -> set[str]:
        todo, seen = list(modules), set(modules)
        while todo:
            for other in index.imports.get(todo.pop(), set()) - seen:
                seen.add(other)
                todo.append(other)
        return seen

    callees = {
        name: {g for n in names for g in index.defines.get(n, ())} | set(calls.get(name, ()))
        for name, names in index.names.items()
    }
    digests: dict[str, str] = {}
    for function in index.hashes:
        reached, todo = {function}, [function]
        while todo:
            for callee in callees.get(todo.pop(), set()) - reached:
                if callee in index.hashes:
                    reached.add(callee)
                    todo.append(callee)
        modules = imported({index.modules[f] for f in reached})
        parts = [f"{f} {index.hashes[f]}" for f in sorted(reached)]
        parts += [f"{m} {index.contexts[m]}" for m in sorted(modules)]
        digests[function] = sha("\n".join(parts))[:16]
    return digests


def imported_helpers(path: Path, root: Path) -> set[Path]:
    """The modules of ``tests/``, ``benchmarks/`` and ``examples/`` that ``path`` imports."""
    package = path.relative_to(root).parent.parts
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            names += [module, *(f"{module}.{alias.name}" for alias in node.names)]
    found: set[Path] = set()
    for name in names:
        parts = name.split(".")
        if parts[0] in HELPER_ROOTS:
            for candidate in (
                root.joinpath(*parts[:-1], f"{parts[-1]}.py"),
                root.joinpath(*parts, "__init__.py"),
            ):
                if candidate.is_file():
                    found.add(candidate)
    return found


def test_dependencies(test: Path, root: Path) -> set[Path]:
    """``test``, the ``conftest.py`` files above it, and the helpers they import, transitively."""
    found = {test, *(p / "conftest.py" for p in test.parents if p.is_relative_to(root))}
    found = {p for p in found if p.is_file()}
    todo = list(found)
    while todo:
        for helper in imported_helpers(todo.pop(), root) - found:
            found.add(helper)
            todo.append(helper)
    return found


def fast_test_files(root: Path) -> list[Path]:
    """The test files of mutmut's selection, ``pytest_add_cli_args_test_selection``."""
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["mutmut"]
    paths: list[Path] = []
    ignored: list[Path] = []
    args = iter(config.get("pytest_add_cli_args_test_selection", ["tests"]))
    for arg in args:
        if arg in ("-k", "-m"):
            next(args, None)
        elif arg.startswith("--ignore="):
            ignored.append(root / arg.removeprefix("--ignore="))
        elif not arg.startswith("-"):
            paths.append(root / arg)
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("test_*.py")))]
    return [f for f in files if not any(f == i or f.is_relative_to(i) for i in ignored)]


def slow_files(root: Path) -> set[Path]:
    """Every file the slow selection may read: its test folders, their helpers, the docs."""
    folders = [root / "tests" / package for package in package_ids(root)] + [
        root / "tests" / "docs"
    ]
    found: set[Path] = set()
    for test in (p for folder in folders for p in folder.rglob("*.py")):
        found |= test_dependencies(test, root)
    data = (p for folder in SLOW_DATA for p in (root / folder).rglob("*") if p.is_file())
    return found | {p for p in data if "__pycache__" not in p.parts}


def setup_digest(root: Path, env: Mapping[str, str] | None = None) -> str:
    """The digest of the settings that decide every outcome.

    They are the files of ``SETTINGS`` (the root ``pyproject.toml`` whole, with its groups
    and tool tables; each package's ``pyproject.toml`` but for its version; the pins, which
    name torch's build; the noxfile; any ``pytest.ini``; this script), the variables of
    ``ENVIRONMENT`` in the environment the tests run in (``clean_env``) and the slow pass's
    selection.
    """
    env = clean_env() if env is None else env
    parts: list[str] = [json.dumps(SLOW_SELECTION)]
    for pattern in SETTINGS:
        for path in sorted(root.glob(pattern)):
            text = path.read_text()
            if path.parent.parent.name == "packages":
                project = tomllib.loads(text)
                project.get("project", {}).pop("version", None)
                text = json.dumps(project, sort_keys=True)
            parts.append(f"{path.relative_to(root).as_posix()}\n{text}")
    variables = {k: v for k, v in env.items() if k.startswith(ENVIRONMENT) and k not in UNREAD}
    parts.append(json.dumps(variables, sort_keys=True))
    return sha("\0".join(parts))


def listed_digest(equivalents: Iterable[Equivalent]) -> str:
    """The digest of the equivalent list's entries, reasons left out."""
    return sha(json.dumps(sorted((e.function, e.line, e.mutant) for e in equivalents)))


@dataclass(frozen=True)
class Inputs:
    """What the outcomes depend on, hashed: the ledger's header and tables, or the tree now."""

    setup: str
    slow: str
    listed: str
    sources: dict[str, str]  # repository path: SHA-256
    tests: dict[str, str]  # test file: digest of it and its dependencies
    functions: dict[str, str]  # qualified name: hash of its code
    depends: dict[str, str] = field(default_factory=dict)  # qualified name: dependencies()
    calls: dict[str, tuple[str, ...]] = field(default_factory=dict)  # mutmut saw, not named


def take_inputs(
    root: Path,
    sources: Mapping[str, Path],
    equivalents: Iterable[Equivalent],
    tests: Iterable[str] = (),
    calls: Mapping[str, Iterable[str]] | None = None,
) -> Inputs:
    """The inputs of the tree at ``root``: the fast selection's test files and ``tests``.

    ``calls`` holds the calls mutmut saw that the functions' code does not name (those of the
    ledger, or of this run's stats).
    """
    files = {f.relative_to(root).as_posix(): f for f in fast_test_files(root)}
    files |= {t: root / t for t in tests if (root / t).is_file()}
    index = index_sources(sources)
    calls = {f: tuple(sorted(c)) for f, c in (calls or {}).items() if c}
    return Inputs(
        setup=setup_digest(root),
        slow=files_digest(slow_files(root), root),
        listed=listed_digest(equivalents),
        sources={path.relative_to(root).as_posix(): digest(path) for path in sources.values()},
        tests={t: files_digest(test_dependencies(f, root), root) for t, f in sorted(files.items())},
        functions=index.hashes,
        depends=dependencies(index, calls),
        calls=calls,
    )


@dataclass(frozen=True)
class Record:
    """The ledger's account of one function: its hash, covering tests and mutants' outcomes."""

    hash: str
    tests: tuple[str, ...]
    depends: str = ""  # dependencies(): what the outcomes read besides the function and tests
    fast: tuple[str, ...] = ()
    slow: tuple[str, ...] = ()
    equivalent: tuple[str, ...] = ()

    def outcome(self, key: str) -> str | None:
        """``fast``, ``slow`` or ``equivalent``: how the mutant ``key`` was recorded."""
        return next((o for o in OUTCOMES if key in getattr(self, o)), None)

    def keys(self) -> Counter[str]:
        """Every mutant key the record holds."""
        return Counter(k for o in OUTCOMES for k in getattr(self, o))


@dataclass(frozen=True)
class Ledger:
    """The recorded run: the inputs it saw, and a record per function."""

    inputs: Inputs
    records: dict[str, Record]


def mutant_keys(mutants: Iterable[Mutant]) -> dict[str, str]:
    """Each mutant's key in the ledger, by name: a digest of its function and change.

    Like the equivalent list, the key leaves mutmut's number out; the n-th mutant of a
    function that makes the same change as an earlier one gets ``#n``.
    """
    seen: Counter[tuple[str, str, str]] = Counter()
    keys: dict[str, str] = {}
    for mutant in sorted(mutants, key=lambda m: (m.function, int(m.name.rpartition("_")[2]))):
        change = (mutant.function, mutant.line, mutant.mutant)
        seen[change] += 1
        key = sha("\0".join(change))[:12]
        keys[mutant.name] = key if seen[change] == 1 else f"{key}#{seen[change]}"
    return keys


HEX = re.compile(r"[0-9a-f]{12,64}(#[0-9]+)?")


class LedgerError(SystemExit):
    """The ledger is malformed: the run stops, naming what is wrong."""


def load_ledger(path: Path) -> Ledger | None:
    """The ledger at ``path``, or None if there is none; a malformed one stops the run.

    Well formed: TOML with hex digests ``setup``, ``slow`` and ``listed``; tables ``sources``
    and ``tests`` of hex digests; a table ``calls`` of lists of function names; and a table per
    function under ``functions`` with exactly hex ``hash`` and ``depends`` and lists ``tests``
    (each one in ``[tests]``), ``fast``, ``slow`` and ``equivalent`` (mutant keys, each listed
    once in the function).
    """
    if not path.is_file():
        return None
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise LedgerError(f"{path.name} is not TOML: {error}") from error

    def hexes(value: object, what: str) -> dict[str, str]:
        if isinstance(value, dict) and all(
            isinstance(v, str) and HEX.fullmatch(v) for v in value.values()
        ):
            return value
        raise LedgerError(f"{path.name}: {what} must map names to hex digests")

    def strings(value: object, what: str) -> tuple[str, ...]:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise LedgerError(f"{path.name}: {what} must be a list of strings")

    unknown = set(data) - {
        *LEDGER_SCORE,
        "setup",
        "slow",
        "listed",
        "sources",
        "tests",
        "calls",
        "functions",
    }
    if unknown:
        raise LedgerError(f"{path.name}: unknown keys {', '.join(sorted(unknown))}")
    header = hexes({k: data.get(k) for k in ("setup", "slow", "listed")}, "setup, slow, listed")
    tests = hexes(data.get("tests"), "[tests]")
    functions = data.get("functions", {})
    if not isinstance(functions, dict) or not all(isinstance(t, dict) for t in functions.values()):
        raise LedgerError(f"{path.name}: [functions] must hold a table per function")
    records: dict[str, Record] = {}
    for function, table in functions.items():
        if set(table) != {"hash", "depends", "tests", *OUTCOMES}:
            raise LedgerError(
                f"{path.name}: {function} must have hash, depends, tests, {', '.join(OUTCOMES)}"
            )
        what = f"the record of {function}"
        digests = hexes({k: table[k] for k in ("hash", "depends")}, what)
        tests_of, *lists = [strings(table[k], f"{what}: {k}") for k in ("tests", *OUTCOMES)]
        record = Record(digests["hash"], tests_of, digests["depends"], *lists)
        keys = record.keys()
        if not all(HEX.fullmatch(k) and n == 1 for k, n in keys.items()):
            raise LedgerError(f"{path.name}: {what}: mutant keys must be distinct hex digests")
        if not set(record.tests) <= set(tests):
            raise LedgerError(f"{path.name}: {what} names a test file missing from [tests]")
        records[function] = record
    sources = hexes(data.get("sources"), "[sources]")
    table = data.get("calls", {})
    if not isinstance(table, dict):
        raise LedgerError(f"{path.name}: [calls] must map function names to lists of them")
    calls = {f: strings(c, f"the calls of {f}") for f, c in table.items()}
    inputs = Inputs(
        header["setup"],
        header["slow"],
        header["listed"],
        sources,
        tests,
        {f: r.hash for f, r in records.items()},
        {f: r.depends for f, r in records.items()},
        calls,
    )
    return Ledger(inputs, records)


def write_ledger(path: Path, ledger: Ledger, score: str) -> None:
    """Write ``ledger`` to ``path`` as TOML: one line per source, test file and mutant key."""

    def strings(values: Iterable[str]) -> str:
        items = [f"    {json.dumps(v)},\n" for v in values]
        return f"[\n{''.join(items)}]" if items else "[]"

    lines = [
        "# Written by `nox -s mutation -- --record` after a run that passed (CONTRIBUTING.md,",
        '# "Mutation testing"). `--incremental` reuses an outcome only where its function, what it',
        "# depends on (the code it may call, the modules' constants and class attributes), the",
        "# test files that cover it and the settings hash as recorded here. A mutant's key is a",
        "# digest of its function, original line and mutated line (scripts/mutation.py).",
        score,
        f'setup = "{ledger.inputs.setup}"',
        f'slow = "{ledger.inputs.slow}"',
        f'listed = "{ledger.inputs.listed}"',
        "",
        "[sources]",
        *(f'{json.dumps(k)} = "{v}"' for k, v in sorted(ledger.inputs.sources.items())),
        "",
        "[tests]",
        *(f'{json.dumps(k)} = "{v}"' for k, v in sorted(ledger.inputs.tests.items())),
        "",
        "# The calls mutmut saw that the caller's code does not name.",
        "[calls]",
        *(f"{json.dumps(k)} = {strings(v)}" for k, v in sorted(ledger.inputs.calls.items())),
    ]
    for function, record in sorted(ledger.records.items()):
        lines += ["", f"[functions.{json.dumps(function)}]", f'hash = "{record.hash}"']
        lines.append(f'depends = "{record.depends}"')
        lines += [f"{name} = {strings(getattr(record, name))}" for name in ("tests", *OUTCOMES)]
    path.write_text("\n".join(lines) + "\n")


def covering_tests(stats: Path, mutants: Iterable[Mutant]) -> dict[str, set[str]]:
    """The test files that reach each function, by mutmut's stats of this run."""
    from mutmut.utils.format_utils import mangled_name_from_mutant_name  # noqa: PLC0415

    by_function = json.loads(stats.read_text())["tests_by_mangled_function_name"]
    covering: dict[str, set[str]] = {}
    for mutant in mutants:
        tests = by_function.get(mangled_name_from_mutant_name(mutant.name), [])
        covering.setdefault(mutant.function, set()).update(t.partition("::")[0] for t in tests)
    return covering


def seen_calls(stats: Path, index: Index) -> dict[str, set[str]]:
    """The calls between the package's functions that mutmut saw and the caller does not name.

    mutmut's stats record, for each function its trampoline reached, the mutated functions
    that called it (``function_dependencies``); a call the caller's code names is already a
    dependency (``dependencies``), so only the others, such as ``module(x)`` reaching a
    ``forward``, are kept.
    """
    from mutmut.utils.format_utils import get_module_from_key, parse_mutant_key  # noqa: PLC0415

    def qualified(key: str) -> str:
        module = get_module_from_key(key)
        function, owner = parse_mutant_key(key.removeprefix(f"{module}."))
        if module not in index.contexts:  # mutmut names a package's __init__.py by the package
            module = f"{module}.__init__"
        return ".".join(p for p in (module, owner, function) if p)

    graph = json.loads(stats.read_text()).get("function_dependencies", {})
    calls: dict[str, set[str]] = {}
    for callee_key, callers in graph.items():
        callee = qualified(callee_key)
        for caller in map(qualified, callers):
            named = {g for n in index.names.get(caller, ()) for g in index.defines.get(n, ())}
            if callee in index.hashes and caller in index.hashes and callee not in named:
                calls.setdefault(caller, set()).add(callee)
    return calls


def new_ledger(
    inputs: Inputs, outcome: Outcome, covering: Mapping[str, set[str]], root: Path = ROOT
) -> Ledger:
    """The ledger of a run that passed: ``outcome`` holds every mutant, run or reused."""
    sorted_out = {
        "fast": outcome.fast_killed,
        "slow": outcome.slow_killed,
        "equivalent": [mutant for mutant, _ in outcome.equivalent],
    }
    keys = mutant_keys(m for ms in sorted_out.values() for m in ms)
    functions = {m.function for ms in sorted_out.values() for m in ms}
    records = {
        function: Record(
            inputs.functions.get(function, "0" * 16),
            tuple(sorted(covering.get(function, ()))),
            inputs.depends.get(function, "0" * 16),
            *(
                tuple(sorted(keys[m.name] for m in ms if m.function == function))
                for ms in sorted_out.values()
            ),
        )
        for function in functions
    }
    more = {t for r in records.values() for t in r.tests} - set(inputs.tests)
    tests = {t: files_digest(test_dependencies(root / t, root), root) for t in more}
    return Ledger(replace(inputs, tests=inputs.tests | tests), records)


@dataclass
class Plan:
    """What an incremental run reuses from the ledger and what it runs."""

    run: list[Mutant] = field(default_factory=list)
    reused: dict[str, tuple[Mutant, str]] = field(default_factory=dict)  # name: (mutant, outcome)
    why: dict[str, str] = field(default_factory=dict)  # function run in full: the reason


def why_run(ledger: Ledger | None, function: str, now: Inputs) -> str | None:
    """Why every mutant of ``function`` must run, or None if the ledger's record can stand."""
    record = ledger.records.get(function) if ledger else None
    if ledger is None or record is None:
        return "not in the ledger"
    if ledger.inputs.setup != now.setup:
        return "the settings or pins changed"
    if now.functions.get(function) != record.hash:
        return "its code changed"
    if now.depends.get(function) != record.depends:
        return "what it depends on changed: a function it may call, or a module's constants"
    changed = [t for t in record.tests if now.tests.get(t) != ledger.inputs.tests[t]]
    return f"a test that covers it changed: {changed[0]}" if changed else None


def mismatches(ledger: Ledger | None, now: Inputs, keyed: Mapping[str, Counter[str]]) -> list[str]:
    """The functions that the ledger claims to describe as they are, and does not.

    The ledger claims a function when it records the function's hash as it is now under the
    same settings; it does not describe it when its mutant keys differ from those of the
    mutants mutmut makes of the function now (a key more, a key fewer, or another key).
    """
    if ledger is None or ledger.inputs.setup != now.setup:
        return []
    return [
        function
        for function, record in sorted(ledger.records.items())
        if now.functions.get(function) == record.hash
        and record.keys() != keyed.get(function, Counter())
    ]


def plan_run(
    ledger: Ledger | None, now: Inputs, mutants: Sequence[Mutant], equivalents: Sequence[Equivalent]
) -> Plan:
    """Sort ``mutants`` into those whose recorded outcome stands and those that must run."""
    plan = Plan()
    keys = mutant_keys(mutants)
    for mutant in mutants:
        reason = why_run(ledger, mutant.function, now)
        if reason is not None:
            plan.why.setdefault(mutant.function, reason)
            plan.run.append(mutant)
            continue
        assert ledger is not None
        recorded = ledger.records[mutant.function].outcome(keys[mutant.name])
        listed = any(entry.matches(mutant) for entry in equivalents)
        stands = (
            (recorded == "fast" and not listed)
            or (recorded == "slow" and not listed and ledger.inputs.slow == now.slow)
            or (recorded == "equivalent" and listed)
        )
        if stands and recorded is not None:
            plan.reused[mutant.name] = (mutant, recorded)
        else:
            plan.run.append(mutant)
    return plan


def recheck(plan: Plan, ledger: Ledger | None, covering: Mapping[str, set[str]]) -> list[Mutant]:
    """Move to ``plan.run`` the reused mutants of the functions whose covering tests changed.

    ``covering`` holds the test files that reach each function now, by this run's stats; a
    recorded outcome stands only where they are those recorded: a new one could kill a listed
    equivalent, and a file that no longer reaches the function may be the one that killed it.
    Return the mutants moved.
    """
    moved = [
        mutant
        for mutant, _ in plan.reused.values()
        if ledger is not None
        and set(ledger.records[mutant.function].tests) != covering.get(mutant.function, set())
    ]
    for mutant in moved:
        del plan.reused[mutant.name]
        plan.why.setdefault(mutant.function, "the tests that reach it changed")
    plan.run += moved
    return moved


def run_patterns(run: Sequence[Mutant], mutants: Sequence[Mutant]) -> list[str]:
    """The arguments of ``mutmut run`` for the mutants ``run`` of ``mutants``.

    None when all of them run; else a pattern for each function run in full and the names of
    the other mutants.
    """
    if len(run) == len(mutants):
        return []
    running = Counter(m.function for m in run)
    total = Counter(m.function for m in mutants)
    names = [m.name for m in run if running[m.function] < total[m.function]]
    whole = {
        m.name.partition("__mutmut_")[0] for m in run if running[m.function] == total[m.function]
    }
    return [*(f"{prefix}__mutmut_*" for prefix in sorted(whole)), *names]


def report(outcome: Outcome, seconds: float) -> bool:
    """Print the score, the survivors and the stale entries; whether the run passed."""
    killed = len(outcome.fast_killed) + len(outcome.slow_killed)
    listed = len(outcome.equivalent)
    print()
    print(f"mutants: {outcome.total}")
    print(f"  killed by the fast pass: {len(outcome.fast_killed)}")
    print(f"  killed by the slow tests: {len(outcome.slow_killed)}")
    print(f"  equivalent (listed): {listed}")
    print(f"  survived, not listed: {len(outcome.survivors)}")
    if outcome.total:
        print(
            f"score: {killed}/{outcome.total} = {100 * killed / outcome.total:.1f}% of all mutants"
        )
    if outcome.total > listed:
        print(
            f"score without the equivalent mutants: {killed}/{outcome.total - listed} = "
            f"{100 * killed / (outcome.total - listed):.1f}%"
        )
    if outcome.reused:
        print(f"of which reused from the ledger: {outcome.reused}")
    print(f"time: {seconds / 60:.1f} min")
    for mutant in outcome.survivors:
        print(f"\nSURVIVED {mutant.name}\n  in {mutant.function}")
        print(f"  line:   {mutant.line!r}\n  mutant: {mutant.mutant!r}")
    if outcome.survivors:
        print(
            "\nWrite a test that kills each survivor above, or, if it cannot change behaviour, "
            f"add it to {EQUIVALENT.relative_to(ROOT)} with the reason (`mutmut show NAME` "
            "in .mutation/ prints its diff)."
        )
    for entry in outcome.stale:
        print(f"\nSTALE entry of {EQUIVALENT.relative_to(ROOT)}: matches no surviving mutant")
        print(f"  function: {entry.function}\n  line:   {entry.line!r}\n  mutant: {entry.mutant!r}")
    if outcome.stale:
        print("\nRemove each stale entry, or update it to the code as it is now.")
    return not outcome.survivors and not outcome.stale


def second_run(
    found: dict[str, tuple[Mutant, str]], equivalents: Sequence[Equivalent]
) -> list[str]:
    """The mutants whose fast-pass verdict a busy machine could have decided: run them again.

    mutmut counts a mutant whose tests use far more CPU time than the clean run as a hang, and
    a test can fail on a time bound (a Hypothesis deadline, a rank's join bound) when the
    machine is busy. A listed equivalent killed that way would make its entry look stale, so
    it gets a second run too, on its own; killed again, the entry is stale.
    """
    return [
        name
        for name, (mutant, status) in found.items()
        if status == "timeout"
        or (status in DETECTED and any(entry.matches(mutant) for entry in equivalents))
    ]


def judge(
    found: dict[str, tuple[Mutant, str]],
    equivalents: Sequence[Equivalent],
    sources: dict[str, Path],
    reused: Mapping[str, tuple[Mutant, str]] | None = None,
) -> Outcome:
    """Sort the fast pass's mutants; run the slow tests on the unlisted ones still alive.

    ``reused`` holds the outcomes an incremental run takes from the ledger. An entry of the
    list that matches no listed survivor, run or reused, is stale.
    """
    reused = reused or {}
    outcome = Outcome(total=len(found) + len(reused), reused=len(reused))
    alive: list[Mutant] = []
    for mutant, status in found.values():
        if status in DETECTED:
            outcome.fast_killed.append(mutant)
        elif status in UNDETECTED:
            alive.append(mutant)
        else:
            raise SystemExit(f"mutmut left {mutant.name} {status}; run it again")
    # A listed equivalent skips the slow tests: it is accounted for whichever way they go.
    for mutant in [*alive, *(m for m, o in reused.values() if o == "equivalent")]:
        entry = next((e for e in equivalents if e.matches(mutant)), None)
        if entry is not None:
            outcome.equivalent.append((mutant, entry))
    outcome.fast_killed += [m for m, o in reused.values() if o == "fast"]
    outcome.slow_killed += [m for m, o in reused.values() if o == "slow"]
    listed = {mutant.name for mutant, _ in outcome.equivalent}
    unlisted = [mutant for mutant in alive if mutant.name not in listed]
    print(
        f"\nthe fast pass left {len(alive)} of {len(found)} mutants alive, "
        f"{len(listed & {m.name for m in alive})} of them listed as equivalent; the slow tests "
        f"run against the other {len(unlisted)}"
    )
    slow_killed = slow_pass(unlisted, sources) if unlisted else []
    outcome.slow_killed += slow_killed
    killed = {m.name for m in slow_killed}
    outcome.survivors = [m for m in unlisted if m.name not in killed]
    used = {id(entry) for _, entry in outcome.equivalent}
    outcome.stale = [e for e in equivalents if id(e) not in used]
    return outcome


def unchanged(ledger: Ledger | None, now: Inputs) -> bool:
    """Whether every input the ledger records is as it is now, so that nothing need run."""
    if ledger is None:
        return False
    recorded = all(
        now.functions.get(f) == r.hash and now.depends.get(f) == r.depends
        for f, r in ledger.records.items()
    )
    if not recorded:
        return False
    # The sources' digests stand for the other functions' code and what they depend on.
    return replace(ledger.inputs, functions={}, depends={}) == replace(
        now, functions={}, depends={}
    )


def plan_incremental(
    ledger: Ledger | None, now: Inputs, mutants: Sequence[Mutant], equivalents: Sequence[Equivalent]
) -> Plan:
    """The plan of an incremental run.

    It stops the run if the ledger does not describe the sources (``mismatches``).
    """
    keys = mutant_keys(mutants)
    keyed: dict[str, Counter[str]] = {}
    for mutant in mutants:
        keyed.setdefault(mutant.function, Counter())[keys[mutant.name]] += 1
    wrong = mismatches(ledger, now, keyed)
    if wrong:
        raise SystemExit(
            f"{shown(LEDGER)} does not describe the sources: it records the code of "
            f"{', '.join(wrong)} as it is now, with other mutants than mutmut makes of it. "
            "Record it again (`nox -s mutation -- --record`), or delete it to run everything."
        )
    plan = plan_run(ledger, now, mutants, equivalents)
    if not plan.run and plan.reused:
        # Something differs, yet no recorded outcome is in doubt: run the listed equivalents
        # (or one mutant) to learn from mutmut's stats which tests reach each function now.
        outcomes = list(plan.reused.values())
        probe = [m for m, o in outcomes if o == "equivalent"] or [outcomes[0][0]]
        for mutant in probe:
            del plan.reused[mutant.name]
        plan.run += probe
    return plan


def incremental_fast_pass(
    sources: dict[str, Path], equivalents: Sequence[Equivalent], only_list: bool, children: int
) -> Plan | None:
    """Plan an incremental run and run mutmut's pass over what must run; None if nothing must.

    With ``only_list`` it prints the functions that run in full and stops there.
    """
    ledger = load_ledger(LEDGER)
    now = take_inputs(
        ROOT,
        sources,
        equivalents,
        ledger.inputs.tests if ledger else (),
        ledger.inputs.calls if ledger else None,
    )
    if unchanged(ledger, now):
        print(f"nothing differs from {shown(LEDGER)}: nothing to mutate")
        return None
    if ledger is None or ledger.inputs.setup != now.setup:
        print("no ledger" if ledger is None else "the settings or pins changed", end="")
        print(": every mutant runs")
    # Listed one by one in every case: CI counts them against its budget.
    whole = {f: why for f in now.functions if (why := why_run(ledger, f, now))}
    print("functions to mutate in full:", *(f"{f} ({w})" for f, w in whole.items()), sep="\n  ")
    print("and each recorded mutant whose listing, slow tests or covering tests changed")
    if only_list:
        return None
    require_every_function_mutated(sources)
    mutants = generate_mutants(sources)
    plan = plan_incremental(ledger, now, mutants, equivalents)
    print(f"reusing {len(plan.reused)} recorded outcomes; running {len(plan.run)} mutants")
    lay_out_workspace(sources)
    mutmut_run(run_patterns(plan.run, mutants), children)
    moved = recheck(plan, ledger, covering_tests(WORKSPACE / STATS, mutants))
    if moved:
        print(f"running {len(moved)} more: the tests that reach their functions changed")
        mutmut_run(run_patterns(moved, mutants), children)
    return plan


def record(sources: dict[str, Path], equivalents: Sequence[Equivalent], outcome: Outcome) -> None:
    """Write the ledger of a run that passed; ``outcome`` holds every mutant, run or reused."""
    every = [*outcome.fast_killed, *outcome.slow_killed, *(m for m, _ in outcome.equivalent)]
    covering = covering_tests(WORKSPACE / STATS, every)
    score = (
        f"mutants = {outcome.total}\n"
        f"killed = {len(outcome.fast_killed) + len(outcome.slow_killed)}\n"
        f"equivalent = {len(outcome.equivalent)}"
    )
    calls = seen_calls(WORKSPACE / STATS, index_sources(sources))
    inputs = take_inputs(ROOT, sources, equivalents, calls=calls)
    write_ledger(LEDGER, new_ledger(inputs, outcome, covering), score)
    print(f"recorded in {shown(LEDGER)}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the fast and slow passes and report; 0 if every survivor is a listed equivalent."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--incremental",
        action="store_true",
        help=f"reuse the outcomes of {shown(LEDGER)} where they still hold and run "
        "the other mutants",
    )
    parser.add_argument(
        "--record", action="store_true", help=f"after a run that passes, write {LEDGER.name}"
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep the fast pass of the last whole run in .mutation/ and redo only what follows "
        "it, such as after editing the equivalent list",
    )
    parser.add_argument(
        "--list",
        action="store_true",
        help="print what the run would mutate and exit, without mutmut or torch",
    )
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    options = parser.parse_args(argv)
    if options.reuse and options.incremental:
        parser.error("--reuse keeps the fast pass of a whole run, not of --incremental")

    started = time.monotonic()
    sources = source_files()
    equivalents = load_equivalents()
    plan: Plan | None = None
    if options.incremental:
        planned = incremental_fast_pass(sources, equivalents, options.list, options.max_children)
        if planned is None:
            return 0
        plan = planned
        selected = sorted({m.path for m in plan.run})
    else:
        selected = list(sources)
        print("mutating:", *selected, sep="\n  ")
        if options.list:
            return 0
        require_every_function_mutated(sources)
        if not options.reuse:
            lay_out_workspace(sources)
            mutmut_run([], options.max_children)
        elif not (WORKSPACE / "mutants").is_dir():
            parser.error("--reuse needs the results of an earlier run in .mutation/")
        elif options.record and any(
            digest(WORKSPACE / rel) != digest(p) for rel, p in sources.items()
        ):
            parser.error("--record --reuse needs .mutation/ to hold the sources as they are now")
    os.chdir(WORKSPACE)
    found = read_mutants(selected)
    if plan is not None:
        names = {m.name for m in plan.run}
        if names - set(found):
            raise SystemExit(f"mutmut made none of {sorted(names - set(found))[:3]}; run it whole")
        found = {name: result for name, result in found.items() if name in names}
    again = second_run(found, equivalents)
    if again:
        print(f"running {len(again)} mutants again: those that timed out, or listed and killed")
        mutmut_run(again, 1)
        found = {name: result for name, result in read_mutants(selected).items() if name in found}
    outcome = judge(found, equivalents, sources, plan.reused if plan else None)

    seconds = time.monotonic() - started
    passed = report(outcome, seconds)
    if passed and options.record:
        record(sources, equivalents, outcome)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
