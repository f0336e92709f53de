"""The parts of scripts/mutation.py that decide a verdict, and the equivalent list itself."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import sys
import tomllib
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mutation() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutation", ROOT / "scripts" / "mutation.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutation"] = module
    spec.loader.exec_module(module)
    return module


DIFF = """\
--- src/toolkit/nn/_x.py
+++ src/toolkit/nn/_x.py
@@ -1,3 +1,3 @@
 def f(a):
-    return a + 1
+    return a - 1
"""


def test_a_diff_gives_its_stripped_lines_without_the_headers(mutation: ModuleType) -> None:
    assert mutation.changed_lines(DIFF) == ("return a + 1", "return a - 1")


def test_a_multi_line_change_joins_its_lines(mutation: ModuleType) -> None:
    diff = DIFF.replace("-    return a + 1\n", "-    x = (\n-        'a'\n-    )\n")
    assert mutation.changed_lines(diff) == ("x = (\n'a'\n)", "return a - 1")


def test_an_entry_matches_function_line_and_mutant_only(mutation: ModuleType) -> None:
    entry = mutation.Equivalent("m.f", "return a + 1", "return a - 1", "why")
    mutant = mutation.Mutant("m.x_f__mutmut_7", "src/m.py", "m.f", "return a + 1", "return a - 1")
    assert entry.matches(mutant)
    # The number in mutmut's name does not matter; the function and both lines do.
    renumbered = mutation.Mutant(
        "m.x_f__mutmut_9", "src/m.py", "m.f", "return a + 1", "return a - 1"
    )
    assert entry.matches(renumbered)
    for other in (
        mutation.Mutant("m.x_g__mutmut_7", "src/m.py", "m.g", "return a + 1", "return a - 1"),
        mutation.Mutant("m.x_f__mutmut_7", "src/m.py", "m.f", "return a + 2", "return a - 1"),
        mutation.Mutant("m.x_f__mutmut_7", "src/m.py", "m.f", "return a + 1", "return a * 1"),
    ):
        assert not entry.matches(other)


def test_every_listed_equivalent_is_complete_and_listed_once(mutation: ModuleType) -> None:
    raw = tomllib.loads(mutation.EQUIVALENT.read_text()).get("equivalent", [])
    for entry in raw:
        assert set(entry) == {"function", "line", "mutant", "reason"}
        assert entry["function"].startswith("toolkit.")
        assert entry["line"] != entry["mutant"]
        assert entry["reason"].strip()
        assert "\n" not in entry["reason"]
    keys = [(e["function"], e["line"], e["mutant"]) for e in raw]
    assert len(keys) == len(set(keys))
    assert len(mutation.load_equivalents()) == len(raw)


def test_sources_map_every_package_file_into_one_src_tree(mutation: ModuleType) -> None:
    sources = mutation.source_files()
    assert "src/toolkit/nn/_tied_linear.py" in sources
    assert "src/toolkit/nn/_module_default_dict.py" in sources
    assert all(key.startswith("src/toolkit/") for key in sources)
    # PEP 420: the namespace itself has no __init__.py to merge.
    assert "src/toolkit/__init__.py" not in sources
    for key, path in sources.items():
        assert path.as_posix().endswith(key.removeprefix("src/"))


def test_a_listed_survivor_is_equivalent_and_an_unmatched_entry_is_stale(
    mutation: ModuleType,
) -> None:
    listed = mutation.Equivalent("m.f", "return a + 1", "return a - 1", "why")
    gone = mutation.Equivalent("m.g", "x = 1", "x = 2", "the code changed since")
    alive = mutation.Mutant("m.x_f__mutmut_1", "src/m.py", "m.f", "return a + 1", "return a - 1")
    killed = mutation.Mutant("m.x_f__mutmut_2", "src/m.py", "m.f", "return a + 1", "return a")
    found = {alive.name: (alive, "survived"), killed.name: (killed, "killed")}
    outcome = mutation.judge(found, [listed, gone], {})
    assert outcome.total == 2
    assert outcome.fast_killed == [killed]
    assert outcome.equivalent == [(alive, listed)]
    assert outcome.survivors == []
    assert outcome.stale == [gone]
    assert not mutation.report(outcome, 0.0)


def test_reused_outcomes_count_and_a_reused_equivalent_keeps_its_entry(
    mutation: ModuleType,
) -> None:
    entry = mutation.Equivalent("m.f", "return a + 1", "return a - 1", "why")
    listed = mutation.Mutant("m.x_f__mutmut_1", "src/m.py", "m.f", "return a + 1", "return a - 1")
    fast = mutation.Mutant("m.x_f__mutmut_2", "src/m.py", "m.f", "return a + 1", "return a")
    slow = mutation.Mutant("m.x_f__mutmut_3", "src/m.py", "m.f", "return a + 1", "return a + 2")
    reused = {
        listed.name: (listed, "equivalent"),
        fast.name: (fast, "fast"),
        slow.name: (slow, "slow"),
    }
    outcome = mutation.judge({}, [entry], {}, reused)
    assert (outcome.total, outcome.reused) == (3, 3)
    assert outcome.fast_killed == [fast]
    assert outcome.slow_killed == [slow]
    assert outcome.equivalent == [(listed, entry)]
    assert outcome.stale == []
    assert mutation.report(outcome, 0.0)


def test_list_prints_the_files_to_mutate_and_touches_nothing(
    mutation: ModuleType, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    laid_out: list[object] = []
    monkeypatch.setattr(mutation, "lay_out_workspace", laid_out.append)
    assert mutation.main(["--list"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["mutating:", *(f"  {rel}" for rel in mutation.source_files())]
    assert laid_out == []


def test_incremental_with_a_ledger_of_the_tree_as_it_is_has_nothing_to_mutate(
    mutation: ModuleType,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    now = mutation.take_inputs(mutation.ROOT, mutation.source_files(), mutation.load_equivalents())
    ledger = tmp_path / "ledger.toml"
    mutation.write_ledger(ledger, mutation.Ledger(now, {}), "mutants = 0")
    monkeypatch.setattr(mutation, "LEDGER", ledger)
    assert mutation.main(["--incremental", "--list"]) == 0
    assert "nothing to mutate" in capsys.readouterr().out


def test_the_pattern_of_a_function_run_whole_matches_its_mutants_only(
    mutation: ModuleType,
) -> None:
    def mutant(name: str, function: str) -> Any:
        return mutation.Mutant(name, "src/toolkit/nn/__init__.py", function, "a", "b")

    getattr_ = "toolkit.nn.__init__.__getattr__"
    init = [mutant(f"toolkit.nn.x___getattr____mutmut_{n}", getattr_) for n in (1, 2)]
    other = [
        mutant(f"toolkit.nn._t.x\u01c1T\u01c1w__mutmut_{n}", "toolkit.nn._t.T.w") for n in (1, 2)
    ]
    every = [*init, *other]
    assert mutation.run_patterns(every, every) == []
    patterns = mutation.run_patterns([*init, other[1]], every)
    assert patterns == ["toolkit.nn.x___getattr____mutmut_*", other[1].name]
    chosen = {m.name for m in every if any(fnmatch.fnmatchcase(m.name, p) for p in patterns)}
    assert chosen == {init[0].name, init[1].name, other[1].name}


def test_a_second_run_takes_the_timed_out_and_the_listed_mutants_that_were_killed(
    mutation: ModuleType,
) -> None:
    entry = mutation.Equivalent("m.f", "a = 1", "a = None", "why")

    def mutant(number: int, line: str = "a = 1", changed: str = "a = None") -> object:
        return mutation.Mutant(f"m.x_f__mutmut_{number}", "src/m.py", "m.f", line, changed)

    found = {
        "listed-killed": (mutant(1), "killed"),
        "listed-alive": (mutant(2), "survived"),
        "unlisted-killed": (mutant(3, changed="a = 2"), "killed"),
        "unlisted-timeout": (mutant(4, changed="a = 3"), "timeout"),
        "listed-timeout": (mutant(5), "timeout"),
    }
    assert mutation.second_run(found, [entry]) == [
        "listed-killed",
        "unlisted-timeout",
        "listed-timeout",
    ]
    assert mutation.second_run(found, []) == ["unlisted-timeout", "listed-timeout"]


# The incremental run, on a small synthetic tree: one package with a module of three
# functions, tests that cover them, a helper, conftest files and a docs page.

MODULE = '''\
def f(a):
    """Add one."""
    return a + 1


def g(a):
    return a * 2


class C:
    def h(self):
        return 3
'''

TREE = {
    "pyproject.toml": (
        '[tool.mutmut]\npytest_add_cli_args_test_selection = ["tests/x", "-k", "fast"]\n'
    ),
    "packages/toolkit-x/pyproject.toml": "",
    "packages/toolkit-x/src/toolkit/x/m.py": MODULE,
    "tests/conftest.py": "PROFILE = 'dev'\n",
    "tests/x/conftest.py": "",
    "tests/x/helpers.py": "from .deep import TWO\n\nONE = 1\n",
    "tests/x/deep.py": "TWO = 2\n",
    "tests/x/test_f.py": "from tests.x.helpers import ONE\n\ndef test_f(): ...\n",
    "tests/x/test_g.py": "def test_g(): ...\n",
    "tests/x/test_h.py": "def test_h(): ...\n",
    "docs/page.md": "A page the slow tests run.\n",
}

SRC = "src/toolkit/x/m.py"


def _mutant(mutation: ModuleType, function: str, n: int, line: str, changed: str) -> Any:
    local = f"x\u01c1C\u01c1{function}" if function == "h" else f"x_{function}"
    qualname = f"toolkit.x.m.C.{function}" if function == "h" else f"toolkit.x.m.{function}"
    return mutation.Mutant(f"toolkit.x.m.{local}__mutmut_{n}", SRC, qualname, line, changed)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for name, text in TREE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.fixture
def mutants(mutation: ModuleType) -> list[Any]:
    return [
        _mutant(mutation, "f", 1, "return a + 1", "return a - 1"),  # killed fast
        _mutant(mutation, "f", 2, "return a + 1", "return a + 2"),  # killed by the slow tests
        _mutant(mutation, "g", 1, "return a * 2", "return a / 2"),  # killed fast
        _mutant(mutation, "g", 2, "return a * 2", "return a * 3"),  # listed equivalent
        _mutant(mutation, "h", 1, "return 3", "return 4"),  # killed fast
    ]


@pytest.fixture
def listed(mutation: ModuleType) -> list[Any]:
    return [mutation.Equivalent("toolkit.x.m.g", "return a * 2", "return a * 3", "probe")]


COVERING = {
    "toolkit.x.m.f": {"tests/x/test_f.py"},
    "toolkit.x.m.g": {"tests/x/test_g.py"},
    "toolkit.x.m.C.h": {"tests/x/test_h.py"},
}


def _record(mutation: ModuleType, root: Path, mutants: list[Any], listed: list[Any]) -> Any:
    """Record the synthetic run in ``root/ledger.toml`` and read it back."""
    outcome = mutation.Outcome(
        total=len(mutants),
        fast_killed=[mutants[0], mutants[2], mutants[4]],
        slow_killed=[mutants[1]],
        equivalent=[(mutants[3], listed[0])],
    )
    inputs = mutation.take_inputs(root, mutation.source_files(root), listed)
    ledger = mutation.new_ledger(inputs, outcome, COVERING, root)
    mutation.write_ledger(root / "ledger.toml", ledger, f"mutants = {outcome.total}")
    return mutation.load_ledger(root / "ledger.toml")


def _to_run(
    mutation: ModuleType, root: Path, ledger: Any, mutants: list[Any], listed: list[Any]
) -> set[str]:
    """The mutants an incremental run over ``root`` as it is now would run, by function:n."""
    now = mutation.take_inputs(root, mutation.source_files(root), listed, ledger.inputs.tests)
    plan = mutation.plan_run(ledger, now, mutants, listed)
    assert len(plan.run) + len(plan.reused) == len(mutants)
    return {f"{m.function.rpartition('.')[2]}:{m.name.rpartition('_')[2]}" for m in plan.run}


def _edit(root: Path, name: str, old: str, new: str) -> None:
    path = root / name
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))


def test_the_ledger_reads_back_as_written(
    mutation: ModuleType, tree: Path, mutants: list[Any], listed: list[Any]
) -> None:
    ledger = _record(mutation, tree, mutants, listed)
    assert set(ledger.records) == set(COVERING)
    keys = mutation.mutant_keys(mutants)
    f = ledger.records["toolkit.x.m.f"]
    assert f.tests == ("tests/x/test_f.py",)
    assert (f.fast, f.slow, f.equivalent) == (
        (keys[mutants[0].name],),
        (keys[mutants[1].name],),
        (),
    )
    assert ledger.records["toolkit.x.m.g"].equivalent == (keys[mutants[3].name],)
    assert set(ledger.inputs.tests) == {
        "tests/x/test_f.py",
        "tests/x/test_g.py",
        "tests/x/test_h.py",
    }
    assert ledger.inputs.sources == {
        "packages/toolkit-x/src/toolkit/x/m.py": mutation.digest(
            tree / "packages/toolkit-x/src/toolkit/x/m.py"
        )
    }


def test_unchanged_sources_and_tests_rerun_nothing(
    mutation: ModuleType, tree: Path, mutants: list[Any], listed: list[Any]
) -> None:
    ledger = _record(mutation, tree, mutants, listed)
    now = mutation.take_inputs(tree, mutation.source_files(tree), listed, ledger.inputs.tests)
    assert mutation.unchanged(ledger, now)
    assert _to_run(mutation, tree, ledger, mutants, listed) == set()


def test_changing_one_function_reruns_its_mutants_only(
    mutation: ModuleType, tree: Path, mutants: list[Any], listed: list[Any]
) -> None:
    ledger = _record(mutation, tree, mutants, listed)
    _edit(tree, "packages/toolkit-x/src/toolkit/x/m.py", "a * 2", "2 * a")
    assert _to_run(mutation, tree, ledger, mutants, listed) == {"g:1", "g:2"}


def test_a_docstring_comment_or_layout_change_reruns_nothing(
    mutation: ModuleType, tree: Path, mutants: list[Any], listed: list[Any]
) -> None:
    ledger = _record(mutation, tree, mutants, listed)
    source = "packages/toolkit-x/src/toolkit/x/m.py"
    _edit(tree, source, '"""Add one."""', '"""Add one to ``a``."""')
    _edit(tree, source, "        return 3\n", "        # three\n        return (3)\n")
    assert _to_run(mutation, tree, ledger, mutants, listed) == set()


def test_changing_a_test_file_reruns_the_mutants_of_what_it_covers(
    mutation: ModuleType, tree: Path, mutants: list[Any], listed: list[Any]
) -> None:
    ledger = _record(mutation, tree, mutants, listed)
    _edit(tree, "tests/x/test_h.py", "...", "assert True")
    # test_h.py covers C.h only; a test file is also in the slow selection, so the mutant
    # that the slow tests killed runs again too.
    assert _to_run(mutation, tree, ledger, mutants, listed) == {"h:1", "f:2"}


@pytest.mark.parametrize("helper", ["tests/x/helpers.py", "tests/x/deep.py"])
def test_changing_a_helper_reruns_the_mutants_of_every_test_that_imports_it(
    mutation: ModuleType, tree: Path, mutants: list[Any], listed: list[Any], helper: str
) -> None:
    # test_f.py imports helpers.py, which imports deep.py.
    ledger = _record(mutation, tree, mutants, listed)
    (tree / helper).write_text((tree / helper).read_text() + "THREE = 3\n")
    assert _to_run(mutation, tree, ledger, mutants, listed) == {"f:1", "f:2"}


@pytest.mark.parametrize("conftest", ["tests/conftest.py", "tests/x/conftest.py"])
def test_changing_a_conftest_reruns_the_mutants_of_every_test_below_it(
    mutation: ModuleType, tree: Path, mutants: list[Any], listed: list[Any], conftest: str
) -> None:
    ledger = _record(mutation, tree, mutants, listed)
    (tree / conftest).write_text("CHANGED = True\n")
    assert _to_run(mutation, tree, ledger, mutants, listed) == {"f:1", "f:2", "g:1", "g:2", "h:1"}


def test_changing_a_page_the_slow_tests_run_reruns_the_mutants_they_killed(
    mutation: ModuleType, tree: Path, mutants: list[Any], listed: list[Any]
) -> None:
    ledger = _record(mutation, tree, mutants, listed)
    _edit(tree, "docs/page.md", "A page", "The page")
    assert _to_run(mutation, tree, ledger, mutants, listed) == {"f:2"}


def test_changing_the_settings_reruns_everything(
    mutation: ModuleType, tree: Path, mutants: list[Any], listed: list[Any]
) -> None:
    ledger = _record(mutation, tree, mutants, listed)
    _edit(tree, "pyproject.toml", '"fast"', '"fast or quick"')
    assert len(_to_run(mutation, tree, ledger, mutants, listed)) == len(mutants)


def test_a_listed_equivalent_stands_only_while_its_entry_does(
    mutation: ModuleType, tree: Path, mutants: list[Any], listed: list[Any]
) -> None:
    ledger = _record(mutation, tree, mutants, listed)
    assert _to_run(mutation, tree, ledger, mutants, []) == {"g:2"}
    # A killed mutant that is newly listed runs again, as in the whole run.
    newly = mutation.Equivalent("toolkit.x.m.C.h", "return 3", "return 4", "why")
    assert _to_run(mutation, tree, ledger, mutants, [*listed, newly]) == {"h:1"}


def test_a_function_or_mutant_missing_from_the_ledger_runs_in_full(
    mutation: ModuleType, tree: Path, mutants: list[Any], listed: list[Any]
) -> None:
    ledger = _record(mutation, tree, mutants, listed)
    del ledger.records["toolkit.x.m.C.h"]
    assert _to_run(mutation, tree, ledger, mutants, listed) == {"h:1"}
    now = mutation.take_inputs(tree, mutation.source_files(tree), listed)
    assert len(mutation.plan_run(None, now, mutants, listed).run) == len(mutants)


def test_a_reused_mutant_runs_when_the_tests_that_reach_its_function_changed(
    mutation: ModuleType, tree: Path, mutants: list[Any], listed: list[Any]
) -> None:
    ledger = _record(mutation, tree, mutants, listed)
    now = mutation.take_inputs(tree, mutation.source_files(tree), listed, ledger.inputs.tests)
    plan = mutation.plan_run(ledger, now, mutants, listed)
    assert mutation.recheck(plan, ledger, COVERING) == []
    # test_f.py now reaches g too: it could kill g's listed equivalent.
    covering = COVERING | {"toolkit.x.m.g": {"tests/x/test_f.py", "tests/x/test_g.py"}}
    moved = mutation.recheck(plan, ledger, covering)
    assert moved == [mutants[2], mutants[3]]
    assert moved[0] in plan.run
    assert moved[0].name not in plan.reused


def test_a_ledger_that_claims_a_function_with_other_mutants_does_not_match(
    mutation: ModuleType, tree: Path, mutants: list[Any], listed: list[Any]
) -> None:
    ledger = _record(mutation, tree, mutants, listed)
    now = mutation.take_inputs(tree, mutation.source_files(tree), listed, ledger.inputs.tests)
    keys = mutation.mutant_keys(mutants)

    def keyed(mutants: list[Any]) -> dict[str, Counter[str]]:
        found: dict[str, Counter[str]] = {}
        for m in mutants:
            found.setdefault(m.function, Counter())[keys[m.name]] += 1
        return found

    assert mutation.mismatches(ledger, now, keyed(mutants)) == []
    extra = _mutant(mutation, "h", 2, "return 3", "return None")
    keys[extra.name] = mutation.mutant_keys([extra])[extra.name]
    # mutmut makes a mutant of the unchanged C.h that the ledger lacks, or lacks one it lists.
    assert mutation.mismatches(ledger, now, keyed([*mutants, extra])) == ["toolkit.x.m.C.h"]
    assert mutation.mismatches(ledger, now, keyed(mutants[:4])) == ["toolkit.x.m.C.h"]
    # A changed function is not claimed: its mutants may differ.
    _edit(tree, "packages/toolkit-x/src/toolkit/x/m.py", "return 3", "return 30")
    now = mutation.take_inputs(tree, mutation.source_files(tree), listed, ledger.inputs.tests)
    assert mutation.mismatches(ledger, now, keyed(mutants[:4])) == []


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("setup = ", "setup_ = "),
        ('hash = "', 'hash = "zz'),
        ("fast = [", "killed = ["),
        ('"tests/x/test_h.py",\n]', '"tests/x/test_gone.py",\n]'),
        ("[functions.", "[function."),
        ("slow = [", "slow = [\n    1,"),
    ],
)
def test_a_malformed_ledger_stops_the_run(
    mutation: ModuleType, tree: Path, mutants: list[Any], listed: list[Any], old: str, new: str
) -> None:
    _record(mutation, tree, mutants, listed)
    _edit(tree, "ledger.toml", old, new)
    with pytest.raises(mutation.LedgerError):
        mutation.load_ledger(tree / "ledger.toml")


def test_a_mutant_key_leaves_the_number_out_and_tells_repeats_apart(mutation: ModuleType) -> None:
    first = mutation.Mutant("m.x_f__mutmut_1", "src/m.py", "m.f", "x = 1", "x = 2")
    again = mutation.Mutant("m.x_f__mutmut_2", "src/m.py", "m.f", "x = 1", "x = 2")
    renumbered = mutation.Mutant("m.x_f__mutmut_5", "src/m.py", "m.f", "x = 1", "x = 2")
    keys = mutation.mutant_keys([again, first])
    assert keys[again.name] == keys[first.name] + "#2"
    assert mutation.mutant_keys([renumbered])[renumbered.name] == keys[first.name]


def test_recording_an_incremental_run_merges_what_it_ran_into_the_ledger(
    mutation: ModuleType, tree: Path, mutants: list[Any], listed: list[Any]
) -> None:
    ledger = _record(mutation, tree, mutants, listed)
    _edit(tree, "packages/toolkit-x/src/toolkit/x/m.py", "a * 2", "2 * a")
    now = mutation.take_inputs(tree, mutation.source_files(tree), listed, ledger.inputs.tests)
    plan = mutation.plan_run(ledger, now, mutants, listed)
    found = {plan.run[0].name: (plan.run[0], "killed"), plan.run[1].name: (plan.run[1], "survived")}
    outcome = mutation.judge(found, listed, {}, plan.reused)
    assert mutation.report(outcome, 0.0)
    merged = mutation.new_ledger(now, outcome, COVERING, tree)
    assert merged.records["toolkit.x.m.g"].hash == now.functions["toolkit.x.m.g"]
    assert merged.records["toolkit.x.m.g"].hash != ledger.records["toolkit.x.m.g"].hash
    for function in ("toolkit.x.m.f", "toolkit.x.m.C.h"):
        assert merged.records[function] == ledger.records[function]
    mutation.write_ledger(tree / "ledger.toml", merged, "mutants = 5")
    merged = mutation.load_ledger(tree / "ledger.toml")
    assert mutation.unchanged(merged, now)
    assert _to_run(mutation, tree, merged, mutants, listed) == set()


def test_when_no_outcome_is_in_doubt_but_a_source_changed_the_listed_mutants_run(
    mutation: ModuleType, tree: Path, mutants: list[Any], listed: list[Any]
) -> None:
    # A change that no function's code or context sees (a comment): mutmut's stats of a run
    # tell which tests reach what.
    ledger = _record(mutation, tree, mutants, listed)
    (tree / "packages/toolkit-x/src/toolkit/x/m.py").write_text(MODULE + "# LIMIT = 3\n")
    now = mutation.take_inputs(tree, mutation.source_files(tree), listed, ledger.inputs.tests)
    assert not mutation.unchanged(ledger, now)
    plan = mutation.plan_incremental(ledger, now, mutants, listed)
    assert plan.run == [mutants[3]]
    assert len(plan.reused) == len(mutants) - 1


def test_an_incremental_run_stops_on_a_ledger_that_does_not_describe_the_sources(
    mutation: ModuleType, tree: Path, mutants: list[Any], listed: list[Any]
) -> None:
    ledger = _record(mutation, tree, mutants, listed)
    now = mutation.take_inputs(tree, mutation.source_files(tree), listed, ledger.inputs.tests)
    with pytest.raises(SystemExit, match=r"toolkit\.x\.m\.C\.h"):
        mutation.plan_incremental(ledger, now, mutants[:4], listed)


def test_a_mutant_of_a_signature_is_named_as_mutmut_shows_it(
    mutation: ModuleType, tmp_path: Path
) -> None:
    """The planned mutants' lines are those the whole run records, from mutmut's diffs."""
    source = tmp_path / "_x.py"
    source.write_text("def g(a: int = 1) -> int:\n    return a + 1\n")
    mutants = mutation.generate_mutants({"src/toolkit/nn/_x.py": source})
    changes = {(m.function, m.line, m.mutant) for m in mutants}
    signature = "def g(a: int = {}) -> int:"
    assert ("toolkit.nn._x.g", signature.format(1), signature.format(2)) in changes


# Soundness: an outcome depends on more than its function's code. A second module, whose
# functions call each other, read a constant and a class attribute, and call an object.

LAYERED = """\
from toolkit.x.m import g

LIMIT = 3


def top(a):
    return middle(a) + g(a)


def middle(a):
    return a if a < LIMIT else LIMIT


def alone(a):
    return -a


def apply(module, a):
    return module(a)


class D:
    scale = 2

    def __call__(self, a):
        return a * self.scale
"""

LAYERED_SRC = "packages/toolkit-x/src/toolkit/x/n.py"


@pytest.fixture
def layered(mutation: ModuleType, tree: Path) -> list[Any]:
    """The second module in ``tree``, and one mutant of each of its functions."""
    (tree / LAYERED_SRC).write_text(LAYERED)
    (tree / "tests/x/test_n.py").write_text("def test_n(): ...\n")
    changes = {
        "top": ("return middle(a) + g(a)", "return middle(a) - g(a)"),
        "middle": ("return a if a < LIMIT else LIMIT", "return a if a <= LIMIT else LIMIT"),
        "alone": ("return -a", "return a"),
        "apply": ("return module(a)", "return module(None)"),
        "__call__": ("return a * self.scale", "return a / self.scale"),
    }
    found = []
    for function, (line, changed) in changes.items():
        local = f"x\u01c1D\u01c1{function}" if function == "__call__" else f"x_{function}"
        qualname = f"toolkit.x.n.{'D.' if function == '__call__' else ''}{function}"
        name = f"toolkit.x.n.{local}__mutmut_1"
        found.append(mutation.Mutant(name, "src/toolkit/x/n.py", qualname, line, changed))
    return found


def _record_killed(
    mutation: ModuleType, root: Path, mutants: list[Any], calls: dict[str, list[str]]
) -> Any:
    """Record every mutant of ``mutants`` as killed, with the calls mutmut saw, and read back."""
    outcome = mutation.Outcome(total=len(mutants), fast_killed=list(mutants))
    covering = {m.function: {"tests/x/test_n.py"} for m in mutants}
    inputs = mutation.take_inputs(root, mutation.source_files(root), [], calls=calls)
    mutation.write_ledger(
        root / "ledger.toml", mutation.new_ledger(inputs, outcome, covering, root), "mutants = 5"
    )
    return mutation.load_ledger(root / "ledger.toml")


def _layered_to_run(mutation: ModuleType, root: Path, ledger: Any, mutants: list[Any]) -> set[str]:
    """The functions whose mutants an incremental run over ``root`` as it is now would run."""
    now = mutation.take_inputs(
        root, mutation.source_files(root), [], ledger.inputs.tests, ledger.inputs.calls
    )
    plan = mutation.plan_run(ledger, now, mutants, [])
    return {m.function.rpartition(".")[2] for m in plan.run}


def test_changing_a_callee_reruns_its_callers_and_no_other_function(
    mutation: ModuleType, tree: Path, layered: list[Any]
) -> None:
    ledger = _record_killed(mutation, tree, layered, {})
    assert _layered_to_run(mutation, tree, ledger, layered) == set()
    _edit(tree, LAYERED_SRC, "return a if a < LIMIT", "return a if LIMIT > a")
    assert _layered_to_run(mutation, tree, ledger, layered) == {"middle", "top"}


def test_changing_a_callee_in_another_module_reruns_its_callers(
    mutation: ModuleType, tree: Path, layered: list[Any]
) -> None:
    ledger = _record_killed(mutation, tree, layered, {})
    _edit(tree, "packages/toolkit-x/src/toolkit/x/m.py", "a * 2", "2 * a")
    assert _layered_to_run(mutation, tree, ledger, layered) == {"top"}


@pytest.mark.parametrize(
    ("old", "new"),
    [("LIMIT = 3", "LIMIT = 4"), ("scale = 2", "scale = 3")],
    ids=["constant", "class"],
)
def test_changing_a_module_constant_or_class_attribute_reruns_the_module(
    mutation: ModuleType, tree: Path, layered: list[Any], old: str, new: str
) -> None:
    ledger = _record_killed(mutation, tree, layered, {})
    _edit(tree, LAYERED_SRC, old, new)
    # Every function of the module, and of a module that imports it (none here).
    assert _layered_to_run(mutation, tree, ledger, layered) == {
        "top",
        "middle",
        "alone",
        "apply",
        "__call__",
    }


def test_changing_the_backward_of_an_autograd_function_reruns_what_applies_it(
    mutation: ModuleType, tree: Path, layered: list[Any]
) -> None:
    (tree / LAYERED_SRC).write_text(
        LAYERED.replace("class D:", "class D(torch.autograd.Function):")
        + "\n    @staticmethod\n    def backward(ctx, g):\n        return g * 2\n"
        + "\n\ndef loss(x):\n    return D.apply(x)\n"
    )
    found = [
        *layered,
        layered[0].__class__(
            "toolkit.x.n.x_loss__mutmut_1",
            "src/toolkit/x/n.py",
            "toolkit.x.n.loss",
            "return D.apply(x)",
            "return D.apply(None)",
        ),
    ]
    ledger = _record_killed(mutation, tree, found, {})
    _edit(tree, LAYERED_SRC, "return g * 2", "return 2 * g")
    assert _layered_to_run(mutation, tree, ledger, found) == {"loss"}


def test_a_call_that_mutmut_saw_and_the_code_does_not_name_reruns_the_caller(
    mutation: ModuleType, tree: Path, layered: list[Any]
) -> None:
    # apply(module, a) calls D.__call__ through its argument: only the run sees that call.
    unseen = _record_killed(mutation, tree, layered, {})
    seen = _record_killed(
        mutation, tree, layered, {"toolkit.x.n.apply": ["toolkit.x.n.D.__call__"]}
    )
    assert seen.inputs.calls == {"toolkit.x.n.apply": ("toolkit.x.n.D.__call__",)}
    _edit(tree, LAYERED_SRC, "return a * self.scale", "return self.scale * a")
    assert _layered_to_run(mutation, tree, unseen, layered) == {"__call__"}
    assert _layered_to_run(mutation, tree, seen, layered) == {"__call__", "apply"}


def test_changing_what_a_module_constant_is_built_by_reruns_the_module(
    mutation: ModuleType, tree: Path, layered: list[Any]
) -> None:
    (tree / LAYERED_SRC).write_text(
        LAYERED + "\n\ndef _build(n):\n    return n + 1\n\n\nTABLE = _build(4)\n"
    )
    ledger = _record_killed(mutation, tree, layered, {})
    _edit(tree, LAYERED_SRC, "return n + 1", "return 1 + n")
    assert len(_layered_to_run(mutation, tree, ledger, layered)) == len(layered)


def test_a_ledger_whose_record_is_stale_is_not_taken_for_the_tree_as_it_is(
    mutation: ModuleType, tree: Path, layered: list[Any]
) -> None:
    ledger = _record_killed(mutation, tree, layered, {})
    now = mutation.take_inputs(
        tree, mutation.source_files(tree), [], ledger.inputs.tests, ledger.inputs.calls
    )
    assert mutation.unchanged(ledger, now)
    _edit(tree, "ledger.toml", 'depends = "', 'depends = "0')
    assert not mutation.unchanged(mutation.load_ledger(tree / "ledger.toml"), now)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("noxfile.py", "PYTHON = '3.12'\n"),
        ("scripts/mutation.py", "SLOW_TIMEOUT_S = 60.0\n"),
        ("tests/pytest.ini", "[pytest]\naddopts = -p no:randomly\n"),
        ("packages/toolkit-x/pyproject.toml", '[project]\ndependencies = ["torch==2.12"]\n'),
        ("constraints.txt", "torch==2.12.0\n"),
    ],
)
def test_changing_a_setting_reruns_everything(
    mutation: ModuleType, tree: Path, layered: list[Any], name: str, text: str
) -> None:
    ledger = _record_killed(mutation, tree, layered, {})
    (tree / name).parent.mkdir(parents=True, exist_ok=True)
    (tree / name).write_text(text)
    assert len(_layered_to_run(mutation, tree, ledger, layered)) == len(layered)


def test_the_environment_the_tests_read_is_a_setting(
    mutation: ModuleType, tree: Path, layered: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TOOLKIT_TEST_DEVICES", raising=False)
    ledger = _record_killed(mutation, tree, layered, {})
    # The interpreter the noxfile pins is no setting of its own.
    monkeypatch.setenv("TOOLKIT_PYTHON", "3.11")
    assert _layered_to_run(mutation, tree, ledger, layered) == set()
    monkeypatch.setenv("TOOLKIT_TEST_DEVICES", "cpu,cuda")
    assert len(_layered_to_run(mutation, tree, ledger, layered)) == len(layered)


def test_a_package_release_alone_reruns_nothing(
    mutation: ModuleType, tree: Path, layered: list[Any]
) -> None:
    pyproject = tree / "packages/toolkit-x/pyproject.toml"
    pyproject.write_text('[project]\nname = "toolkit-x"\nversion = "3.58.0"\n')
    ledger = _record_killed(mutation, tree, layered, {})
    _edit(tree, "packages/toolkit-x/pyproject.toml", "3.58.0", "3.59.0")
    assert _layered_to_run(mutation, tree, ledger, layered) == set()


def test_the_calls_kept_from_mutmuts_stats_are_those_the_code_does_not_name(
    mutation: ModuleType, tree: Path, layered: list[Any]
) -> None:
    stats = tree / "stats.json"
    graph = {
        # callee: its callers, by mutmut's names
        "toolkit.x.n.x_middle": ["toolkit.x.n.x_top"],
        "toolkit.x.n.x\u01c1D\u01c1__call__": ["toolkit.x.n.x_apply"],
        "outside.x_f": ["toolkit.x.n.x_top"],
        # mutmut names a package's __init__.py by the package
        "toolkit.x.x_setup": ["toolkit.x.n.x_alone"],
    }
    stats.write_text(json.dumps({"function_dependencies": graph}))
    (tree / "packages/toolkit-x/src/toolkit/x/__init__.py").write_text("def setup():\n    pass\n")
    index = mutation.index_sources(mutation.source_files(tree))
    assert mutation.seen_calls(stats, index) == {
        "toolkit.x.n.apply": {"toolkit.x.n.D.__call__"},
        "toolkit.x.n.alone": {"toolkit.x.__init__.setup"},
    }


# Every function's code is mutated: what mutmut leaves out must only forward to what it mutates.

HIDING = """\
import contextlib
import functools
from typing import TYPE_CHECKING, overload

from toolkit.nn._y import plus_one

__all__ = ["Public", "exported", "empty"]


def exported(a):
    return a + 1


def empty():
    pass


class Public:
    def __init__(self):
        self.x = 1

    @property
    def forwarded(self):
        return self._forwarded()

    def _forwarded(self):
        return self.x + 1

    @property
    def hidden(self):
        return self.x + 2

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value or 1)

    @property
    def with_literal(self):
        return self._plus(3)

    def _plus(self, b):
        return self.x + b

    @overload
    def get(self, key: int) -> int: ...
    @overload
    def get(self, key: str) -> str: ...
    def get(self, key):
        return key * 2


    @property
    def with_default(self, b=2):
        return self._plus(b)

    @property
    def swapped(self, a, b):
        return self._pair(b, a)

    def _pair(self, a, b):
        return a - b

    @contextlib.contextmanager
    def passed_on(self, *args, **kwargs):
        yield from self._passed_on(*args, **kwargs)

    def _passed_on(self, *args, **kwargs):
        yield len(args) + 1

    @functools.cache
    def imported(self, a):
        return plus_one(a)


try:
    from math import nextafter
except ImportError:

    def nextafter(a, b):
        return a + 1e-9


if TYPE_CHECKING:

    def checked(a: int) -> int: ...


class _Private:
    @staticmethod
    def fine(a):
        return a - 1

    @property
    def secret(self):
        return 4 + 4
"""


def test_code_that_mutation_would_miss_is_named(mutation: ModuleType, tmp_path: Path) -> None:
    source, other = tmp_path / "_x.py", tmp_path / "_y.py"
    source.write_text(HIDING)
    other.write_text("def plus_one(a):\n    return a + 1\n")
    sources = {"src/toolkit/nn/_x.py": source, "src/toolkit/nn/_y.py": other}
    found = mutation.unmutated(sources, mutation.generate_mutants(sources))
    missed = sorted(problem.partition(":")[0].rpartition(".")[2] for problem in found)
    # A function that mutmut leaves out (decorated, never mutated, defined under a try) and
    # that does more than forward its own arguments in their order, without defaults; and a
    # public function that no mutant reaches. Forwarding *args and **kwargs, or to a function
    # imported from another module, is forwarding; what ``if TYPE_CHECKING:`` holds never runs.
    assert missed == [
        "__setattr__",
        "empty",
        "hidden",
        "nextafter",
        "secret",
        "swapped",
        "with_default",
        "with_literal",
    ]


def test_every_function_of_the_packages_is_mutated(mutation: ModuleType) -> None:
    sources = mutation.source_files()
    assert mutation.unmutated(sources, mutation.generate_mutants(sources)) == []
