"""Mutation testing of every package: mutmut's pass, the slow tests, the equivalent list.

``nox -s mutation`` runs it. It copies every ``packages/*/src`` into one ``.mutation/src``
(mutmut's src layout; the ``toolkit`` namespace merges) beside ``tests/`` and the root
``pyproject.toml``, whose ``[tool.mutmut]`` configures mutmut. mutmut's pass runs the
single-process tests that reach each mutant; the slow pass runs the compile and multi-rank
tests, which mutmut cannot, against each mutant still alive, written into a plain copy of the
sources. A survivor fails the run unless ``tests/mutation/equivalent.toml`` lists it.

``--record`` writes a whole run's commit and score to ``tests/mutation/whole-run.toml``;
``--resume`` goes on with a whole run's ``.mutation/``. ``--changed`` runs the mutants of the
functions whose text differs from that commit's, then of those a changed test module reaches,
at most ``--budget``. ``--check-release`` fails on other sources or a run that did not pass.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKSPACE = ROOT / ".mutation"
EQUIVALENT = ROOT / "tests" / "mutation" / "equivalent.toml"
RECORD = Path("tests", "mutation", "whole-run.toml")  # under the repository
SOURCES = "packages/*/src/*"  # as a git pathspec, whose * matches a /
# mutmut's record of the tests that reach each function, in the workspace.
STATS = Path("mutants") / "mutmut-stats.json"
# The tests that mutmut cannot run, selected from each package's test folder.
SLOW_SELECTION = ("-k", "compile or distributed")
# An upper bound on one slow run; the multi-rank launches bound themselves well below it.
SLOW_TIMEOUT_S = 1200.0
# mutmut's statuses: which count as detected, and which send a mutant to the slow pass.
DETECTED = frozenset({"killed", "timeout", "segfault", "caught by type check"})
DETECTED |= {"check was interrupted by user"}  # pytest's 2: the mutant broke its collection
UNDETECTED = frozenset({"survived", "no tests", "suspicious"})
# mutmut's stats without running a mutant: the first steps of its ``run`` (pinned mutmut).
COLLECT_STATS = """
import sys
from mutmut import __main__ as m
m.makedirs("mutants", exist_ok=True)
m.copy_src_dir(); m.copy_also_copy_files(); m.setup_source_paths()
m.create_mutants(int(sys.argv[1]))
m.collect_or_load_stats(m.get_mutant_runner(int(sys.argv[1])))
"""


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

    def matches(self, m: Mutant) -> bool:
        """Whether ``m`` makes exactly the change this entry describes."""
        return (self.function, self.line, self.mutant) == (m.function, m.line, m.mutant)


@dataclass
class Outcome:
    """What the run found, for the report."""

    total: int = 0
    fast_killed: list[Mutant] = field(default_factory=list)
    slow_killed: list[Mutant] = field(default_factory=list)
    equivalent: list[tuple[Mutant, Equivalent]] = field(default_factory=list)
    survivors: list[Mutant] = field(default_factory=list)
    stale: list[Equivalent] = field(default_factory=list)


def source_files(root: Path = ROOT) -> dict[str, Path]:
    """Every Python source file, keyed by its path in the workspace (``src/...``)."""
    files: dict[str, Path] = {}
    for src in sorted(root.glob("packages/*/src")):
        for path in sorted(src.rglob("*.py")):
            files[str(Path("src") / path.relative_to(src))] = path
    return files


def module_name(path: str) -> str:
    """The module of a workspace path: ``src/toolkit/nn/_x.py`` is ``toolkit.nn._x``."""
    return path.removeprefix("src/").removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def function_name(mangled: str) -> str:
    """``module.Class.method`` for mutmut's ``module.xǁClassǁmethod__mutmut_3``, and so on."""
    module, _, key = mangled.partition("__mutmut_")[0].rpartition(".")
    if key.startswith("xǁ"):
        _, owner, name = key.split("ǁ")
        return f"{module}.{owner}.{name}"
    return f"{module}.{key.removeprefix('x_')}"


def changed_lines(diff: str) -> tuple[str, str]:
    """The original and the mutated lines of a unified diff, stripped, without its header."""
    lines = diff.splitlines()[2:]
    removed, added = ([x[1:].strip() for x in lines if x.startswith(c)] for c in "-+")
    return "\n".join(removed), "\n".join(added)


def lay_out_workspace(sources: Mapping[str, Path]) -> None:
    """Build ``.mutation/``: the merged ``src/``, ``tests/``, ``pyproject.toml``, ``also_copy``."""
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
    """The environment without the repository's sources or an active mutant on the path.

    One intra-op thread a worker: the workers fill the cores, and torch's spinning threads
    would eat the CPU time by which mutmut tells a hang. Hypothesis: the same draws every run.
    """
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("MUTANT_UNDER_TEST", None)
    env["OMP_NUM_THREADS"] = "1"
    env["HYPOTHESIS_PROFILE"] = "mutation"
    return env


def mutmut_run(patterns: Sequence[str]) -> None:
    """The fast pass: ``mutmut run`` in the workspace, over the mutants ``patterns`` match."""
    children = os.cpu_count() or 1
    command = [sys.executable, "-m", "mutmut", "run", f"--max-children={children}", *patterns]
    subprocess.run(command, cwd=WORKSPACE, env=clean_env(), check=True)


def collect_stats() -> None:
    """Collect mutmut's stats (the tests that reach each function) in the workspace, no mutant."""
    command = [sys.executable, "-c", COLLECT_STATS, str(os.cpu_count() or 1)]
    subprocess.run(command, cwd=WORKSPACE, env=clean_env(), check=True)


def read_mutants(paths: Iterable[str]) -> dict[str, tuple[Mutant, str]]:
    """Every mutant of ``paths`` with its status, from mutmut's records (in the workspace)."""
    from mutmut.mutation.data import SourceFileMutationData  # noqa: PLC0415 - cwd-bound
    from mutmut.mutation.diff_apply import get_diff_for_mutant  # noqa: PLC0415
    from mutmut.stats import status_by_exit_code  # noqa: PLC0415

    found: dict[str, tuple[Mutant, str]] = {}
    for path in paths:
        data = SourceFileMutationData(path=path)
        data.load()
        for name, code in data.exit_code_by_key.items():
            line, mutated = changed_lines(get_diff_for_mutant(name, path=path))
            mutant = Mutant(name, path, function_name(name), line, mutated)
            found[name] = (mutant, status_by_exit_code[code])
    return found


def mutant_names(sources: Mapping[str, Path]) -> dict[str, list[str]]:
    """The names mutmut gives the mutants of ``sources``, by function, in their order."""
    from mutmut.mutation.file_mutation import mutate_file_contents  # noqa: PLC0415
    from mutmut.utils.format_utils import get_mutant_name  # noqa: PLC0415

    names: dict[str, list[str]] = {}
    for path, source in sources.items():
        for local in mutate_file_contents(path, source.read_text()).mutant_names:
            name = get_mutant_name(Path(path), local)
            names.setdefault(function_name(name), []).append(name)
    return names


def git(*args: str, root: Path = ROOT) -> str:
    """The output of ``git args`` in ``root``."""
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def recorded_commit(root: Path = ROOT) -> str:
    """The commit of the last whole run, from ``whole-run.toml``; it must be in the history."""
    path = root / RECORD
    if not path.is_file():
        raise SystemExit(f"no whole run in {path.name}: run nox -s mutation -- --record")
    commit = str(tomllib.loads(path.read_text())["commit"])
    found = subprocess.run(
        ["git", "cat-file", "-e", commit], cwd=root, capture_output=True, check=False
    )
    if len(commit) != 40 or found.returncode:  # a full commit id, in this clone
        raise SystemExit(f"the recorded commit {commit} is not in this clone: fetch the history")
    return commit


def functions(source: str, module: str) -> dict[str, str]:
    """Each module-level function and method of ``source``, by name: its text, with decorators."""
    lines, found = source.splitlines(), {}

    def add(node: ast.stmt, owner: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            name = f"{owner}.{node.name}"  # a getter and its setter, overloads: one entry
            found[name] = found.get(name, "") + "\n".join(lines[start - 1 : node.end_lineno])

    for node in ast.parse(source).body:
        add(node, module)
        if isinstance(node, ast.ClassDef):
            for method in node.body:
                add(method, f"{module}.{node.name}")
    return found


def changed_functions(commit: str, root: Path = ROOT) -> list[str]:
    """The functions of the working tree's sources whose code differs from ``commit``'s."""
    before: dict[str, str] = {}
    for path in git("ls-tree", "-r", "--name-only", commit, "--", "packages", root=root).split():
        if path.endswith(".py") and "/src/" in path:
            module = module_name("src/" + path.split("/src/", 1)[1])
            before |= functions(git("show", f"{commit}:{path}", root=root), module)
    now: dict[str, str] = {}
    for relative, path in source_files(root).items():
        now |= functions(path.read_text(), module_name(relative))
    return sorted(name for name, code in now.items() if before.get(name) != code)


def changed_test_files(commit: str, root: Path = ROOT) -> list[str]:
    """The test modules of the packages' test folders that differ from ``commit``'s, or are new."""
    folders = [f"tests/{p.name.removeprefix('toolkit-')}" for p in root.glob("packages/toolkit-*")]
    changed = git("diff", "--name-only", commit, "--", *folders, root=root).split()
    changed += git("ls-files", "--others", "--exclude-standard", "--", *folders, root=root).split()
    return sorted({path for path in changed if Path(path).name.startswith("test_")})


def reached_by(stats: Path, files: Sequence[str]) -> list[str]:
    """The functions that a test of ``files`` reaches, by mutmut's stats."""
    tests = json.loads(stats.read_text())["tests_by_mangled_function_name"]
    reached = {key for key, ids in tests.items() if any(i.split("::")[0] in files for i in ids)}
    return sorted(map(function_name, reached))


def select(
    order: Sequence[str], names: Mapping[str, list[str]], budget: int
) -> tuple[list[str], int]:
    """The mutants of the functions ``order``, whole, in order, while ``budget`` holds them.

    Returns them and how many are left.
    """
    run: list[str] = []
    for index, function in enumerate(order := list(dict.fromkeys(order))):
        if len(run) + len(names.get(function, [])) > budget:
            return run, sum(len(names.get(f, [])) for f in order[index:])
        run += names.get(function, [])
    return run, 0


def slow_tests() -> list[str]:
    """The pytest arguments of the slow pass: single-process files first, then the rest."""
    args: list[str] = []
    for package in sorted(ROOT.glob("packages/toolkit-*")):
        tests = WORKSPACE / "tests" / package.name.removeprefix("toolkit-")
        args += [str(p.relative_to(WORKSPACE)) for p in sorted(tests.glob("test_*.py"))]
        args += [str(p.relative_to(WORKSPACE)) for p in sorted(tests.iterdir()) if p.is_dir()]
    # The guides whose examples run on gloo ranks (tests/docs/test_distributed_pages.py).
    return [*args, "tests/docs", *SLOW_SELECTION]


def run_slow(args: Sequence[str], env: dict[str, str], *, show: bool = False) -> int | None:
    """Run the slow tests; their exit code, or None if they ran past ``SLOW_TIMEOUT_S``."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args]
    try:
        done = subprocess.run(
            command,
            cwd=WORKSPACE,
            env=env,
            timeout=SLOW_TIMEOUT_S,
            capture_output=True,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None
    if done.returncode not in (0, 1) or (show and done.returncode != 0):
        sys.stdout.write((done.stdout + done.stderr).decode(errors="replace")[-4000:])
    return done.returncode


def apply_mutant(mutant: Mutant) -> None:
    """Write ``mutant`` into its file's plain copy (mutmut's own apply ignores the class)."""
    import libcst  # noqa: PLC0415 - installed with mutmut
    from mutmut.mutation.diff_apply import read_mutant_function, read_mutants_module  # noqa: PLC0415

    module = libcst.parse_module(Path(mutant.path).read_text())
    owner, _, name = mutant.function.removeprefix(module_name(mutant.path) + ".").rpartition(".")
    body = module.body
    if owner:
        body = next(n for n in body if isinstance(n, libcst.ClassDef) and n.name.value == owner)
        body = body.body.body  # type: ignore[assignment]
    original = [n for n in body if isinstance(n, libcst.FunctionDef) and n.name.value == name]
    mutated = read_mutant_function(read_mutants_module(mutant.path), mutant.name)
    Path(mutant.path).write_text(module.deep_replace(original[-1], mutated).code)


def slow_pass(mutants: Sequence[Mutant], sources: Mapping[str, Path]) -> list[Mutant]:
    """Apply each mutant to a plain copy of the sources and run the slow tests; those killed."""
    env = clean_env()
    env["PYTHONPATH"] = str(WORKSPACE / "src")
    args = slow_tests()
    if run_slow(args, env, show=True) != 0:
        raise SystemExit("the slow tests fail on the unmutated sources; fix them first")
    killed: list[Mutant] = []
    for index, mutant in enumerate(mutants, 1):
        apply_mutant(mutant)
        started = time.monotonic()
        try:
            code = run_slow(args, env)
        finally:
            shutil.copy2(sources[mutant.path], WORKSPACE / mutant.path)
        # 1: a test failed; 2 and 3: the mutant broke collection or pytest itself.
        if code is None or code in (1, 2, 3):
            killed.append(mutant)
        elif code != 0:
            raise SystemExit(f"pytest exited with {code} on {mutant.name}")
        verdict = f"{'survived' if code == 0 else 'killed'} ({time.monotonic() - started:.0f} s)"
        print(f"  [{index}/{len(mutants)}] {mutant.name}: {verdict}")
    return killed


def load_equivalents() -> list[Equivalent]:
    """The reviewed list; every entry needs a function, the lines and a reason."""
    entries = tomllib.loads(EQUIVALENT.read_text()).get("equivalent", [])
    return [
        Equivalent(e["function"], e["line"].strip(), e["mutant"].strip(), e["reason"])
        for e in entries
    ]


def judge(
    found: Mapping[str, tuple[Mutant, str]],
    equivalents: Sequence[Equivalent],
    sources: Mapping[str, Path],
) -> Outcome:
    """Sort the fast pass's mutants; run the slow tests on the unlisted ones still alive.

    An entry of the list for a function that ran (``select`` runs functions whole) and that
    matches no survivor is stale.
    """
    outcome = Outcome(total=len(found))
    alive: list[Mutant] = []
    for mutant, status in found.values():
        if status in DETECTED:
            outcome.fast_killed.append(mutant)
        elif status in UNDETECTED:
            alive.append(mutant)
        else:
            raise SystemExit(f"mutmut left {mutant.name} {status}; run it again")
    unlisted: list[Mutant] = []
    for mutant in alive:
        entry = next((e for e in equivalents if e.matches(mutant)), None)
        if entry is None:
            unlisted.append(mutant)
        else:
            outcome.equivalent.append((mutant, entry))
    print(f"\nthe fast pass left {len(alive)} of {len(found)}; {len(unlisted)} go to the slow pass")
    killed = slow_pass(unlisted, sources) if unlisted else []
    outcome.slow_killed = killed
    outcome.survivors = [m for m in unlisted if m not in killed]
    used = {entry for _, entry in outcome.equivalent}
    ran = {m.function for m, _ in found.values()}
    outcome.stale = [e for e in equivalents if e not in used and e.function in ran]
    return outcome


def report(outcome: Outcome, seconds: float) -> bool:
    """Print the score, the survivors and the stale entries; whether the run passed."""
    listed = len(outcome.equivalent)
    print(f"\nmutants: {outcome.total}\n  killed by the fast pass: {len(outcome.fast_killed)}")
    print(
        f"  killed by the slow tests: {len(outcome.slow_killed)}\n  equivalent (listed): {listed}"
    )
    print(f"  survived, not listed: {len(outcome.survivors)}\ntime: {seconds / 60:.0f} min")
    for mutant in outcome.survivors:
        print(f"\nSURVIVED {mutant.name}\n  in {mutant.function}")
        print(f"  line:   {mutant.line!r}\n  mutant: {mutant.mutant!r}")
    if outcome.survivors:
        print(f"\nKill each with a test, or list it in {EQUIVALENT.name} (CONTRIBUTING.md).")
    for entry in outcome.stale:
        print(f"\nSTALE entry of {EQUIVALENT.relative_to(ROOT)}: matches no surviving mutant")
        print(f"  function: {entry.function}\n  line:   {entry.line!r}\n  mutant: {entry.mutant!r}")
    return not outcome.survivors and not outcome.stale


def record(commit: str, outcome: Outcome, root: Path = ROOT) -> None:
    """Write the commit and score of a whole run to ``whole-run.toml``, passed or not."""
    killed = len(outcome.fast_killed) + len(outcome.slow_killed)
    (root / RECORD).write_text(
        "# The last whole mutation run, written by nox -s mutation -- --record.\n"
        f'commit = "{commit}"\nmutants = {outcome.total}\nkilled = {killed}\n'
        f"equivalent = {len(outcome.equivalent)}\nsurvived = {len(outcome.survivors)}\n"
        f"stale = {len(outcome.stale)}\n"
    )
    print(f"recorded in {RECORD.name}")


def sources_differ(commit: str, root: Path = ROOT) -> list[str]:
    """The source files that differ from ``commit``'s, new ones included."""
    changed = git("diff", "--name-only", commit, "--", SOURCES, root=root).split()
    return changed + git("ls-files", "-o", "--exclude-standard", "--", SOURCES, root=root).split()


def check_release() -> int:
    """0 if the packages' sources are those of the last whole run, and it passed; else 1."""
    commit = recorded_commit()
    failed = sum(tomllib.loads((ROOT / RECORD).read_text())[k] for k in ("survived", "stale"))
    if differ := sources_differ(commit):
        print(f"the sources differ from the last whole mutation run's, {commit}:", *differ)
    if differ or failed:
        print(f"{failed} survived or stale in it; pass it: nox -s mutation -- --record")
    return int(bool(differ or failed))


def plan_changed(sources: Mapping[str, Path], budget: int, only_list: bool) -> list[str]:
    """Lay out the workspace and choose the mutants ``--changed`` runs (``select``)."""
    commit = recorded_commit()
    changed, tests = changed_functions(commit), changed_test_files(commit)
    print(f"changed since the whole run of {commit[:12]}:", *changed, *tests, sep="\n  ")
    if not changed and not tests:
        print("nothing changed: no mutant to run")
    if only_list or not (changed or tests):
        return []
    lay_out_workspace(sources)
    collect_stats()  # which functions the changed tests reach
    order = changed + reached_by(WORKSPACE / STATS, tests)
    run, left = select(order, mutant_names(sources), budget)
    print(f"running {len(run)} mutants; {left} past the budget are left for the whole run")
    return run


def main(argv: Sequence[str] | None = None) -> int:
    """Run the passes and report; 0 if every survivor is a listed equivalent."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add = parser.add_argument
    add("--changed", action="store_true", help="mutate what changed since the whole run")
    add("--budget", type=int, default=sys.maxsize, help="with --changed: the most mutants")
    add("--list", action="store_true", help="with --changed: print what changed, run nothing")
    add("--record", action="store_true", help=f"after a whole run that passes, write {RECORD.name}")
    add("--check-release", action="store_true", help="fail if sources differ from the whole run")
    add("--resume", action="store_true", help="go on with the whole run, with new tests")
    options = parser.parse_args(argv)
    if options.check_release:
        return check_release()
    if not options.changed and (options.list or options.budget != sys.maxsize):
        parser.error("--list and --budget go with --changed")
    if options.record and (options.changed or sources_differ("HEAD")):
        parser.error("--record needs the whole run on committed sources")

    started, commit = time.monotonic(), git("rev-parse", "HEAD").strip()
    sources = source_files()
    equivalents = load_equivalents()
    if options.changed:
        run = plan_changed(sources, options.budget, options.list)
        if not run:
            return 0
    elif options.resume:  # the whole run's fast pass kept: what it did not kill runs again
        if any(
            (WORKSPACE / rel).read_bytes() != path.read_bytes() for rel, path in sources.items()
        ):
            parser.error("--resume needs .mutation/ to hold the whole run of these sources")
        shutil.rmtree(WORKSPACE / "tests")
        shutil.copytree(ROOT / "tests", WORKSPACE / "tests", ignore=shutil.ignore_patterns("*.pyc"))
        os.chdir(WORKSPACE)
        run = [
            name for name, (_, status) in read_mutants(sources).items() if status not in DETECTED
        ]
    else:
        run = []
        lay_out_workspace(sources)
    mutmut_run(run)
    os.chdir(WORKSPACE)
    found = read_mutants(sources)
    found = {name: found[name] for name in run} if options.changed else found
    outcome = judge(found, equivalents, sources)
    seconds = time.monotonic() - started
    passed = report(outcome, seconds)
    if options.record:
        record(commit, outcome)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
