"""The choices of noxfile.py: which Python, which pytest paths, which messages.

The sessions themselves run in `nox`; these tests load the noxfile as a module and check the
functions its sessions rely on, against small folders and fake interpreters made here.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def noxfile() -> ModuleType:
    spec = importlib.util.spec_from_file_location("toolkit_noxfile", ROOT / "noxfile.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a test of tests/nn and one of tests/docs, both matching ``-k docs``."""
    root = tmp_path_factory.mktemp("project")
    (root / "pytest.ini").write_text("[pytest]\ntestpaths = tests\n")
    for folder, name in (("nn", "test_docs_link"), ("docs", "test_docs_page")):
        (root / "tests" / folder).mkdir(parents=True)
        (root / "tests" / folder / f"test_{folder}.py").write_text(f"def {name}():\n    pass\n")
    return root


def collected(project: Path, args: list[str]) -> list[str]:
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [*command, *args], cwd=project, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return [line for line in result.stdout.splitlines() if "::" in line]


@pytest.mark.parametrize(
    ("posargs", "expected"),
    [
        ([], ["tests/nn/test_nn.py::test_docs_link"]),
        (["-k", "docs"], ["tests/nn/test_nn.py::test_docs_link"]),
        (["-kdocs", "-x"], ["tests/nn/test_nn.py::test_docs_link"]),
        (["tests/docs"], ["tests/docs/test_docs.py::test_docs_page"]),
        (["-k", "page", "tests/docs"], ["tests/docs/test_docs.py::test_docs_page"]),
        (
            ["tests/docs/test_docs.py::test_docs_page"],
            ["tests/docs/test_docs.py::test_docs_page"],
        ),
    ],
)
def test_the_tests_session_passes_paths_only_when_given(
    noxfile: ModuleType, project: Path, posargs: list[str], expected: list[str]
) -> None:
    """A pattern after -k (`nox -s tests -- -k docs`) never becomes a path."""
    assert collected(project, noxfile.pytest_args("nn", posargs)) == expected


def test_the_supported_pythons_are_3_11_to_3_13(noxfile: ModuleType) -> None:
    assert noxfile.SUPPORTED == ("3.11", "3.12", "3.13")


def fake_interpreters(folder: Path, working: dict[str, bool]) -> str:
    """A PATH of ``pythonX.Y`` commands that run (or fail, as a stale shim does)."""
    folder.mkdir()
    for version, works in working.items():
        command = folder / f"python{version}"
        command.write_text(f"#!/bin/sh\nexit {0 if works else 1}\n")
        command.chmod(0o755)
    return str(folder)


@pytest.mark.parametrize(
    ("working", "expected"),
    [
        ({"3.11": True, "3.12": True, "3.13": True}, "3.11"),
        ({"3.12": True, "3.13": True}, "3.12"),
        ({"3.11": False, "3.13": True}, "3.13"),  # a shim without its interpreter is skipped
        ({}, "3.11"),  # nox then reports that 3.11 is missing
    ],
)
def test_the_first_supported_python_that_runs_is_chosen(
    noxfile: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    working: dict[str, bool],
    expected: str,
) -> None:
    monkeypatch.delenv("TOOLKIT_PYTHON", raising=False)
    monkeypatch.setenv("PATH", fake_interpreters(tmp_path / "bin", working))
    assert noxfile.find_python() == expected


def test_toolkit_python_chooses_the_python(
    noxfile: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", fake_interpreters(tmp_path / "bin", {"3.11": True}))
    monkeypatch.setenv("TOOLKIT_PYTHON", "3.13")
    assert noxfile.find_python() == "3.13"


def test_only_the_uv_probe_message_is_dropped(noxfile: ModuleType) -> None:
    logger = logging.getLogger("nox")

    def shown(message: str) -> bool:
        record = logger.makeRecord("nox", logging.INFO, __file__, 1, message, (), None)
        return bool(logger.filter(record))

    assert not shown("uv binary not found.")
    assert shown("Running session lint")
    assert shown("uv binary not found. (and more)")


def test_ci_runs_nox_the_torchtitan_session_then_lists_what_changed_since_the_whole_run(
    tmp_path: Path,
) -> None:
    """The commands ``.ci/run`` runs from its first nox on, with nox and python3 stubbed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "log"
    for name in ("nox", "python3"):
        (bin_dir / name).write_text(f'#!/usr/bin/env bash\necho "{name} $*" >> {log}\n')
        (bin_dir / name).chmod(0o755)
    script = (ROOT / ".ci" / "run").read_text()
    # From the first nox on: the venv's install is CI's own.
    body = script[script.index("TOOLKIT_PYTHON=3.11 nox\n") :]
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["bash", "-c", f"set -euo pipefail\n{body}"], env=env, cwd=ROOT, check=True)
    assert log.read_text().splitlines() == [
        "nox ",
        "nox -s torchtitan",
        "nox -s mutation -- --changed --budget 300",
    ]
    assert '-c constraints.txt "nox' in script
    assert os.access(ROOT / ".ci" / "run", os.X_OK)


def test_a_release_first_checks_the_sources_against_the_whole_mutation_run(
    noxfile: ModuleType,
) -> None:
    ran: list[tuple[str, ...]] = []
    session = SimpleNamespace(posargs=["3.59.0"], run=lambda *args: ran.append(args))
    noxfile.bump(session)
    assert ran == [
        ("python", "scripts/mutation.py", "--check-release"),
        ("python", "scripts/lockstep.py", "bump", "3.59.0"),
    ]


@pytest.mark.parametrize(
    ("posargs", "programs"),
    [
        (["build"], [("mkdocs", "build")]),
        (["serve"], [("mkdocs", "serve")]),
        ([], [("mkdocs", "build"), ("pytest", "tests/docs")]),
        (["-k", "api"], [("mkdocs", "build"), ("pytest", "tests/docs")]),
    ],
)
def test_the_docs_session_only_builds_the_site_when_asked(
    noxfile: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    posargs: list[str],
    programs: list[tuple[str, str]],
) -> None:
    """`nox -s docs -- build` builds the site and runs no example; without it, both."""
    ran: list[tuple[str, str]] = []

    def run(session: object, program: str, *args: str, **env: str) -> None:
        ran.append((program, args[0]))

    monkeypatch.setattr(noxfile, "run_in_torch_venv", run)
    noxfile.docs(SimpleNamespace(posargs=posargs))
    assert ran == programs
