"""The parts of scripts/mutation.py that decide a verdict, and the equivalent list itself."""

from __future__ import annotations

import fnmatch
import importlib.util
import sys
import tomllib
from pathlib import Path
from types import ModuleType

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


def test_a_source_without_functions_is_never_selected(mutation: ModuleType, tmp_path: Path) -> None:
    plain = tmp_path / "plain.py"
    plain.write_text("X = 1\n__all__ = ['X']\n")
    code = tmp_path / "code.py"
    code.write_text("class A:\n    def f(self):\n        return 1\n")
    assert not mutation.defines_functions(plain)
    assert mutation.defines_functions(code)


def test_a_listed_survivor_is_equivalent_and_an_unmatched_entry_is_stale(
    mutation: ModuleType,
) -> None:
    listed = mutation.Equivalent("m.f", "return a + 1", "return a - 1", "why")
    gone = mutation.Equivalent("m.g", "x = 1", "x = 2", "the code changed since")
    elsewhere = mutation.Equivalent("other.h", "y = 1", "y = 2", "a module not mutated now")
    alive = mutation.Mutant("m.x_f__mutmut_1", "src/m.py", "m.f", "return a + 1", "return a - 1")
    killed = mutation.Mutant("m.x_f__mutmut_2", "src/m.py", "m.f", "return a + 1", "return a")
    found = {alive.name: (alive, "survived"), killed.name: (killed, "killed")}
    outcome = mutation.judge(found, [listed, gone, elsewhere], ["m"], {})
    assert outcome.total == 2
    assert outcome.fast_killed == [killed.name]
    assert outcome.equivalent == [(alive, listed)]
    assert outcome.survivors == []
    # Only entries of the modules that were mutated can be judged stale.
    assert outcome.stale == [gone]
    assert not mutation.report(outcome, 0.0)


def test_list_prints_the_files_to_mutate_and_touches_nothing(
    mutation: ModuleType, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    laid_out: list[object] = []
    monkeypatch.setattr(mutation, "lay_out_workspace", laid_out.append)
    assert mutation.main(["--list"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["mutating:", *(f"  {rel}" for rel in mutation.source_files())]
    assert laid_out == []


def test_changed_with_every_source_recorded_has_nothing_to_mutate(
    mutation: ModuleType,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    sources = mutation.source_files()
    record = tmp_path / "full_run.toml"
    record.write_text(
        "[sources]\n"
        + "".join(
            f'"{path.relative_to(mutation.ROOT)}" = "{mutation.digest(path)}"\n'
            for path in sources.values()
        )
    )
    monkeypatch.setattr(mutation, "FULL_RUN", record)
    assert mutation.main(["--changed", "--list"]) == 0
    assert capsys.readouterr().out == (
        "no source file differs from the last recorded full run: nothing to mutate\n"
    )


def test_the_patterns_of_a_package_init_match_its_mutants_only(mutation: ModuleType) -> None:
    patterns = mutation.mutant_patterns("toolkit.nn.__init__")
    names = {
        "toolkit.nn.x___getattr____mutmut_1": True,
        "toolkit.nn.x\u01c1Cls\u01c1method__mutmut_2": True,
        "toolkit.nn._tied_linear.x_f__mutmut_1": False,
        "toolkit.nn._tied_linear.x\u01c1TiedLinear\u01c1weight__mutmut_1": False,
    }
    for name, wanted in names.items():
        assert any(fnmatch.fnmatchcase(name, p) for p in patterns) is wanted, name
    assert mutation.mutant_patterns("toolkit.nn._tied_linear") == ["toolkit.nn._tied_linear.*"]


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
