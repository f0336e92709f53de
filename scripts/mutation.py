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
listed entry that matches no mutant of the files that were mutated is stale and also fails the
run, so that the list stays reviewed.

``--changed`` mutates only the source files whose content differs from the last full run,
recorded in ``tests/mutation/full_run.toml``; ``--record`` rewrites that record after a full
run that passed.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKSPACE = ROOT / ".mutation"
EQUIVALENT = ROOT / "tests" / "mutation" / "equivalent.toml"
FULL_RUN = ROOT / "tests" / "mutation" / "full_run.toml"

# The tests that mutmut cannot run, selected from each package's test folder. They run in
# this order, cheapest first, and stop at the first failure.
SLOW_SELECTION = ("-k", "compile or distributed")
# An upper bound on one slow run; the multi-rank launches bound themselves well below it.
SLOW_TIMEOUT_S = 1200.0

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
    fast_killed: list[str] = field(default_factory=list)
    slow_killed: list[Mutant] = field(default_factory=list)
    equivalent: list[tuple[Mutant, Equivalent]] = field(default_factory=list)
    survivors: list[Mutant] = field(default_factory=list)
    stale: list[Equivalent] = field(default_factory=list)


def package_ids() -> list[str]:
    """Each package's id: its folder under ``packages/`` without the ``toolkit-`` prefix."""
    return sorted(
        p.parent.name.removeprefix("toolkit-") for p in ROOT.glob("packages/*/pyproject.toml")
    )


def source_files() -> dict[str, Path]:
    """Every Python source file, keyed by its path in the workspace (``src/...``)."""
    files: dict[str, Path] = {}
    for src in sorted(ROOT.glob("packages/*/src")):
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
    property tests run Hypothesis's ``mutation`` profile (the root ``pyproject.toml``): the
    same examples on every run, so that a run's verdicts do not depend on its draws.
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


def read_mutants(paths: Iterable[str]) -> dict[str, tuple[Mutant, str]]:
    """Every mutant of ``paths`` with its fast-pass status, read from mutmut's records.

    It must run with the workspace as the working directory, where mutmut reads its
    configuration and records.
    """
    from mutmut.mutation.data import SourceFileMutationData  # noqa: PLC0415 - cwd-bound
    from mutmut.mutation.diff_apply import get_diff_for_mutant  # noqa: PLC0415
    from mutmut.stats import status_by_exit_code  # noqa: PLC0415
    from mutmut.utils.format_utils import (  # noqa: PLC0415
        orig_function_and_class_names_from_key,
    )

    found: dict[str, tuple[Mutant, str]] = {}
    for path in paths:
        data = SourceFileMutationData(path=path)
        data.load()
        module = path.removeprefix("src/").removesuffix(".py").replace("/", ".")
        for name, exit_code in data.exit_code_by_key.items():
            function, owner = orig_function_and_class_names_from_key(name)
            qualname = f"{module}.{owner}.{function}" if owner else f"{module}.{function}"
            line, mutated = changed_lines(get_diff_for_mutant(name, path=path))
            found[name] = (
                Mutant(name, path, qualname, line, mutated),
                status_by_exit_code[exit_code],
            )
    return found


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


def record_full_run(sources: dict[str, Path], outcome: Outcome) -> None:
    """Write ``tests/mutation/full_run.toml``: the sources a full run covered, and its score."""
    lines = [
        "# Written by `nox -s mutation -- --record` after a full run that passed.",
        "# `--changed` mutates only the source files whose SHA-256 differs from these.",
        f"mutants = {outcome.total}",
        f"killed = {len(outcome.fast_killed) + len(outcome.slow_killed)}",
        f"equivalent = {len(outcome.equivalent)}",
        "",
        "[sources]",
        *(f'"{sources[rel].relative_to(ROOT)}" = "{digest(sources[rel])}"' for rel in sources),
        "",
    ]
    FULL_RUN.write_text("\n".join(lines))


def defines_functions(path: Path) -> bool:
    """Whether ``path`` defines a function or method: mutmut mutates nothing else."""
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in ast.walk(tree))


def mutant_patterns(module: str) -> list[str]:
    """The patterns of mutmut's names for the mutants of ``module``, for ``mutmut run``.

    mutmut names a mutant after its module, then ``x_function`` or ``xǁClassǁmethod``; a
    package's ``__init__`` module goes by the package's name, so its patterns must not match
    the mutants of the package's other modules.
    """
    package = module.removesuffix(".__init__")
    if package == module:
        return [f"{module}.*"]
    return [f"{package}.x_*", f"{package}.x\u01c1*"]


def changed_sources(sources: dict[str, Path]) -> list[str]:
    """The workspace paths of the sources that differ from the last recorded full run.

    Files that define no function are left out: they have no mutants.
    """
    recorded: dict[str, str] = tomllib.loads(FULL_RUN.read_text())["sources"]
    return [
        rel
        for rel, path in sources.items()
        if recorded.get(str(path.relative_to(ROOT))) != digest(path) and defines_functions(path)
    ]


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
    modules: Sequence[str],
    sources: dict[str, Path],
) -> Outcome:
    """Sort the fast pass's mutants; run the slow tests on the unlisted ones still alive."""
    outcome = Outcome(total=len(found))
    alive: list[Mutant] = []
    for mutant, status in found.values():
        if status in DETECTED:
            outcome.fast_killed.append(mutant.name)
        elif status in UNDETECTED:
            alive.append(mutant)
        else:
            raise SystemExit(f"mutmut left {mutant.name} {status}; run it again")
    # A listed equivalent skips the slow tests: it is accounted for whichever way they go.
    for mutant in alive:
        entry = next((e for e in equivalents if e.matches(mutant)), None)
        if entry is not None:
            outcome.equivalent.append((mutant, entry))
    listed = {mutant.name for mutant, _ in outcome.equivalent}
    unlisted = [mutant for mutant in alive if mutant.name not in listed]
    print(
        f"\nthe fast pass left {len(alive)} of {len(found)} mutants alive, {len(listed)} of "
        f"them listed as equivalent; the slow tests run against the other {len(unlisted)}"
    )
    outcome.slow_killed = slow_pass(unlisted, sources) if unlisted else []
    slow_killed = {m.name for m in outcome.slow_killed}
    outcome.survivors = [m for m in unlisted if m.name not in slow_killed]
    used = {id(entry) for _, entry in outcome.equivalent}
    outcome.stale = [
        e
        for e in equivalents
        if id(e) not in used and any(e.function.startswith(f"{m}.") for m in modules)
    ]
    return outcome


def main(argv: Sequence[str] | None = None) -> int:
    """Run the fast and slow passes and report; 0 if every survivor is a listed equivalent."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--changed",
        action="store_true",
        help="mutate only the source files that differ from the last recorded full run",
    )
    parser.add_argument(
        "--record", action="store_true", help="after a full run that passes, record it"
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep the fast pass of the last run in .mutation/ and redo only what follows it, "
        "such as after editing the equivalent list",
    )
    parser.add_argument(
        "--list",
        action="store_true",
        help="print the source files the run would mutate and exit, without mutmut or torch",
    )
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    options = parser.parse_args(argv)
    if options.record and options.changed:
        parser.error("--record needs a full run, not --changed")

    started = time.monotonic()
    sources = source_files()
    selected = changed_sources(sources) if options.changed else list(sources)
    equivalents = load_equivalents()
    if not selected:
        print("no source file differs from the last recorded full run: nothing to mutate")
        return 0
    print("mutating:", *selected, sep="\n  ")
    if options.list:
        return 0

    modules = [rel.removeprefix("src/").removesuffix(".py").replace("/", ".") for rel in selected]
    if not options.reuse:
        lay_out_workspace(sources)
        patterns = [p for m in modules for p in mutant_patterns(m)] if options.changed else []
        mutmut_run(patterns, options.max_children)
    elif not (WORKSPACE / "mutants").is_dir():
        parser.error("--reuse needs the results of an earlier run in .mutation/")
    elif options.record and any(digest(WORKSPACE / rel) != digest(p) for rel, p in sources.items()):
        parser.error("--record --reuse needs .mutation/ to hold the sources as they are now")
    os.chdir(WORKSPACE)
    found = read_mutants(selected)
    again = second_run(found, equivalents)
    if again:
        print(f"running {len(again)} mutants again: those that timed out, or listed and killed")
        mutmut_run(again, 1)
        found = read_mutants(selected)
    outcome = judge(found, equivalents, modules, sources)

    seconds = time.monotonic() - started
    passed = report(outcome, seconds)
    if passed and options.record:
        record_full_run(sources, outcome)
        print(f"recorded in {FULL_RUN.relative_to(ROOT)}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
