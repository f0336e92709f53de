"""scripts/mutation.py: what ``--changed`` selects, the verdict, and the equivalent list."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tomllib
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mutation() -> ModuleType:
    sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module("mutation")


DIFF = "--- m.py\n+++ m.py\n@@ -1,2 +1,2 @@\n def f(a):\n-    return a + 1\n+    return a - 1\n"


def test_a_diff_gives_its_stripped_lines_joined_without_the_headers(mutation: ModuleType) -> None:
    assert mutation.changed_lines(DIFF) == ("return a + 1", "return a - 1")
    diff = DIFF.replace("-    return a + 1\n", "-    x = (\n-        'a'\n-    )\n")
    assert mutation.changed_lines(diff) == ("x = (\n'a'\n)", "return a - 1")


@pytest.mark.parametrize(
    ("mangled", "function"),
    [
        ("toolkit.nn._x.x\u01c1C\u01c1method__mutmut_12", "toolkit.nn._x.C.method"),
        ("toolkit.nn._x.x\u01c1C\u01c1__init__", "toolkit.nn._x.C.__init__"),
        ("toolkit.nn.x___getattr____mutmut_1", "toolkit.nn.__getattr__"),
        ("toolkit.nn._c.x_clip_grad_norm___mutmut_2", "toolkit.nn._c.clip_grad_norm_"),
    ],
)
def test_mutmuts_names_read_as_the_functions_they_mutate(
    mutation: ModuleType, mangled: str, function: str
) -> None:
    assert mutation.function_name(mangled) == function


def test_an_entry_matches_function_line_and_mutant_only(mutation: ModuleType) -> None:
    entry = mutation.Equivalent("m.f", "return a + 1", "return a - 1", "why")
    mutant = mutation.Mutant("m.x_f__mutmut_7", "src/m.py", "m.f", "return a + 1", "return a - 1")
    assert entry.matches(mutant)
    assert entry.matches(replace(mutant, name="m.x_f__mutmut_9"))  # mutmut's number aside
    for change in ({"function": "m.g"}, {"line": "return a + 2"}, {"mutant": "return a * 1"}):
        assert not entry.matches(replace(mutant, **change))


def test_the_equivalent_list_is_short_complete_and_without_repeats(mutation: ModuleType) -> None:
    raw = tomllib.loads(mutation.EQUIVALENT.read_text()).get("equivalent", [])
    assert len(raw) <= 5
    for entry in raw:
        assert set(entry) == {"function", "line", "mutant", "reason"}
        assert entry["function"].startswith("toolkit.")
        assert entry["line"] != entry["mutant"]
        assert "tests/" in entry["reason"]  # its probe
    keys = [(e["function"], e["line"], e["mutant"]) for e in raw]
    assert len(keys) == len(set(keys))
    assert len(mutation.load_equivalents()) == len(raw)


def test_sources_map_every_package_file_into_one_src_tree(mutation: ModuleType) -> None:
    sources = mutation.source_files()
    assert "src/toolkit/nn/_tied_linear.py" in sources
    assert "src/toolkit/__init__.py" not in sources  # PEP 420: no __init__.py to merge
    for key, path in sources.items():
        assert path.as_posix().endswith(key.removeprefix("src/"))


def test_a_listed_survivor_is_equivalent_and_an_unmatched_entry_of_a_run_function_is_stale(
    mutation: ModuleType,
) -> None:
    listed = mutation.Equivalent("m.f", "return a + 1", "return a - 1", "why")
    gone = mutation.Equivalent("m.f", "x = 1", "x = 2", "the code changed since")
    elsewhere = mutation.Equivalent("m.g", "x = 1", "x = 2", "g did not run")
    alive = mutation.Mutant("m.x_f__mutmut_1", "src/m.py", "m.f", "return a + 1", "return a - 1")
    killed = mutation.Mutant("m.x_f__mutmut_2", "src/m.py", "m.f", "return a + 1", "return a")
    found = {alive.name: (alive, "survived"), killed.name: (killed, "killed")}
    outcome = mutation.judge(found, [listed, gone, elsewhere], {})
    assert outcome.total == 2
    assert outcome.fast_killed == [killed]
    assert outcome.equivalent == [(alive, listed)]
    assert outcome.survivors == []
    assert outcome.stale == [gone]
    assert not mutation.report(outcome, 0.0)


# --changed, on a small repository: one package with a module of three functions.

MODULE = '''\
def f(a):
    """Add one."""
    return a + 1


def g(a):
    return a * 2 + 3


class C:
    def h(self):
        return 3 - 1

    @property
    def s(self):
        return self._s

    @s.setter
    def s(self, value):
        self._s = value
'''
SRC = "packages/toolkit-x/src/toolkit/x/m.py"


def commit_all(root: Path, message: str) -> str:
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run(["git", "commit", "-qm", message], cwd=root, check=True)
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, str]:
    """A repository whose last whole run is its first commit, recorded in the second."""
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    for key, value in {"user.name": "t", "user.email": "t@t", "commit.gpgsign": "false"}.items():
        subprocess.run(["git", "config", key, value], cwd=tmp_path, check=True)
    (tmp_path / SRC).parent.mkdir(parents=True)
    (tmp_path / SRC).write_text(MODULE)
    (tmp_path / "tests" / "x").mkdir(parents=True)
    (tmp_path / "tests" / "x" / "test_f.py").write_text("def test_f(): ...\n")
    commit = commit_all(tmp_path, "sources")
    (tmp_path / "tests" / "mutation").mkdir()
    (tmp_path / "tests" / "mutation" / "whole-run.toml").write_text(f'commit = "{commit}"\n')
    commit_all(tmp_path, "the whole run")
    return tmp_path, commit


def edit(root: Path, old: str, new: str) -> None:
    (root / SRC).write_text((root / SRC).read_text().replace(old, new))


def test_a_clean_tree_selects_nothing(mutation: ModuleType, repo: tuple[Path, str]) -> None:
    root, commit = repo
    assert mutation.recorded_commit(root) == commit
    assert mutation.changed_functions(commit, root) == []
    assert mutation.changed_test_files(commit, root) == []
    assert mutation.sources_differ(commit, root) == []


def test_a_change_to_one_function_selects_its_mutants_and_only_those(
    mutation: ModuleType, repo: tuple[Path, str]
) -> None:
    root, commit = repo
    edit(root, "a * 2 + 3", "a * 2 + 4")
    assert mutation.changed_functions(commit, root) == ["toolkit.x.m.g"]
    assert mutation.sources_differ(commit, root) == [SRC]
    names = mutation.mutant_names(mutation.source_files(root))
    run, left = mutation.select(["toolkit.x.m.g"], names, sys.maxsize)
    assert (run, left) == (names["toolkit.x.m.g"], 0)
    assert len(names) == 3  # f, g and C.h each have mutants; only g's run


def test_a_change_to_a_property_getter_or_a_docstring_selects_it(
    mutation: ModuleType, repo: tuple[Path, str]
) -> None:
    root, commit = repo
    edit(root, "return self._s", "return self._s + 1")
    assert mutation.changed_functions(commit, root) == ["toolkit.x.m.C.s"]
    edit(root, '"""Add one."""', '"""Add one, as documented."""')
    assert mutation.changed_functions(commit, root) == ["toolkit.x.m.C.s", "toolkit.x.m.f"]


def test_a_change_since_the_recorded_run_is_never_skipped(
    mutation: ModuleType, repo: tuple[Path, str]
) -> None:
    """Committed, renamed into a new function, or in a new test file: each is selected."""
    root, commit = repo
    edit(root, "return 3 - 1", "return 3 + 1")
    commit_all(root, "a later change")
    assert mutation.changed_functions(commit, root) == ["toolkit.x.m.C.h"]
    edit(root, "def g(a):", "def k(a):")
    assert mutation.changed_functions(commit, root) == ["toolkit.x.m.C.h", "toolkit.x.m.k"]
    (root / "tests" / "x" / "test_new.py").write_text("def test_new(): ...\n")
    (root / "tests" / "x" / "test_f.py").write_text("def test_f(): assert True\n")
    assert mutation.changed_test_files(commit, root) == ["tests/x/test_f.py", "tests/x/test_new.py"]
    (root / "tests" / "x" / "helpers.py").write_text("ONE = 1\n")  # not a test module
    assert mutation.changed_test_files(commit, root) == ["tests/x/test_f.py", "tests/x/test_new.py"]


def test_a_missing_record_or_commit_names_the_fix(
    mutation: ModuleType, repo: tuple[Path, str]
) -> None:
    root, _ = repo
    record = root / "tests" / "mutation" / "whole-run.toml"
    record.write_text('commit = "' + "0" * 40 + '"\n')
    with pytest.raises(SystemExit, match="fetch"):
        mutation.recorded_commit(root)
    record.unlink()
    with pytest.raises(SystemExit, match="--record"):
        mutation.recorded_commit(root)


def test_the_tests_a_changed_file_holds_select_the_functions_they_reach(
    mutation: ModuleType, tmp_path: Path
) -> None:
    stats = tmp_path / "stats.json"
    tests = {
        "toolkit.x.m.x_f": ["tests/x/test_f.py::test_f", "tests/x/test_g.py::test_both"],
        "toolkit.x.m.x_g": ["tests/x/test_g.py::test_g[1]"],
        "toolkit.x.m.x\u01c1C\u01c1h": ["tests/x/test_h.py::test_h"],
    }
    stats.write_text(json.dumps({"tests_by_mangled_function_name": tests}))
    assert mutation.reached_by(stats, ["tests/x/test_g.py"]) == ["toolkit.x.m.f", "toolkit.x.m.g"]


def test_past_the_budget_whole_functions_run_in_the_fixed_order_and_the_rest_is_counted(
    mutation: ModuleType,
) -> None:
    names = {f: [f"m.x_{f[-1]}__mutmut_{n}" for n in (1, 2, 3)] for f in ("m.f", "m.g", "m.h")}
    run = [*names["m.g"], *names["m.f"]]
    assert mutation.select(["m.g", "m.f", "m.g", "m.h"], names, 7) == (run, 3)
    assert mutation.select(["m.g", "m.f"], names, 2) == ([], 6)


def test_a_whole_run_is_recorded_as_the_commit_that_the_checks_read(
    mutation: ModuleType, repo: tuple[Path, str]
) -> None:
    root, commit = repo
    mutant = mutation.Mutant("m.x_f__mutmut_1", "src/m.py", "m.f", "a", "b")
    entry = mutation.Equivalent("m.f", "a", "c", "why")
    mutation.record(commit, mutation.Outcome(2, [mutant], [], [(mutant, entry)]), root)
    assert mutation.recorded_commit(root) == commit
    recorded = tomllib.loads((root / mutation.RECORD).read_text())
    assert recorded.pop("survived") == recorded.pop("stale") == 0
    assert recorded == {"commit": commit, "mutants": 2, "killed": 1, "equivalent": 1}
