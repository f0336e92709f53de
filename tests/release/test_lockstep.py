"""The lockstep check passes on the repository and fails on each kind of skew.

Each test copies the files the check reads (VERSION, CHANGELOG.md, docs/, packages/) into a
temporary folder, skews one thing, and checks that the problem is reported, by file.
"""

from __future__ import annotations

import datetime
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import lockstep

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "lockstep.py"
DATE = datetime.date(2027, 1, 15)
MDD = "packages/toolkit-nn/src/toolkit/nn/_module_default_dict.py"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of the parts of the repository that the check reads."""
    copy = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "dist", "build")
    for folder in ("docs", "packages"):
        shutil.copytree(ROOT / folder, copy / folder, ignore=ignore)
    for name in ("VERSION", "CHANGELOG.md"):
        shutil.copy2(ROOT / name, copy / name)
    return copy


def release(root: Path) -> str:
    return (root / "VERSION").read_text().strip()


def later(version: str, part: int = 1) -> str:
    """``version`` with its ``part`` (0 major, 1 minor, 2 patch) raised, as the next release."""
    numbers = [int(n) for n in version.split(".")]
    numbers[part] += 1
    numbers[part + 1 :] = [0] * (2 - part)
    return ".".join(map(str, numbers))


def earlier(version: str) -> str:
    major, minor, patch = (int(n) for n in version.split("."))
    return f"{major}.{minor}.{patch - 1}" if patch else f"{major}.{minor - 1}.9"


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} is not in {path}"
    path.write_text(text.replace(old, new, 1))


def add_package(root: Path, pyproject: str) -> Path:
    folder = root / "packages" / "toolkit-zz"
    folder.mkdir()
    (folder / "pyproject.toml").write_text(pyproject)
    return folder / "pyproject.toml"


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_the_repository_is_in_lockstep() -> None:
    assert lockstep.check(ROOT) == []


def test_the_copy_is_in_lockstep_and_names_versions(repo: Path) -> None:
    assert lockstep.check(repo) == []
    assert (MDD, release(repo)) in {(path, version) for path, _, version in lockstep.added_in(repo)}


def test_a_package_at_another_version_is_reported(repo: Path) -> None:
    pyproject = repo / "packages" / "toolkit-nn" / "pyproject.toml"
    old = earlier(release(repo))
    edit(pyproject, f'version = "{release(repo)}"', f'version = "{old}"')
    (problem,) = lockstep.check(repo)
    assert problem.startswith(f"packages/toolkit-nn/pyproject.toml: version is '{old}'")


def test_every_package_is_checked_not_only_the_first(repo: Path) -> None:
    add_package(repo, '[project]\nname = "toolkit-zz"\nversion = "1.0.0"\n')
    (problem,) = lockstep.check(repo)
    assert problem.startswith("packages/toolkit-zz/pyproject.toml: version is '1.0.0'")


def test_a_package_without_a_static_version_is_reported(repo: Path) -> None:
    pyproject = repo / "packages" / "toolkit-nn" / "pyproject.toml"
    edit(pyproject, f'version = "{release(repo)}"', 'dynamic = ["version"]')
    (problem,) = lockstep.check(repo)
    assert "version is None" in problem


def test_a_changelog_whose_newest_release_is_older_is_reported(repo: Path) -> None:
    old = earlier(release(repo))
    edit(repo / "CHANGELOG.md", f"## [{release(repo)}]", f"## [{old}]")
    problems = lockstep.check(repo)
    assert problems[0].startswith(f"CHANGELOG.md: the newest release heading is {old}")


def test_a_changelog_with_a_newer_release_is_reported(repo: Path) -> None:
    new = later(release(repo))
    edit(
        repo / "CHANGELOG.md", "## [Unreleased]\n", f"## [Unreleased]\n\n## [{new}] - 2027-01-01\n"
    )
    (problem,) = lockstep.check(repo)
    assert problem.startswith(f"CHANGELOG.md: the newest release heading is {new}")


def test_a_changelog_without_releases_is_reported(repo: Path) -> None:
    (repo / "CHANGELOG.md").write_text("# Changelog\n\n## [Unreleased]\n")
    problems = lockstep.check(repo)
    assert problems[0].startswith("CHANGELOG.md has no release heading")


@pytest.mark.parametrize("where", ["docs/quickstart.md", MDD, "packages/toolkit-nn/README.md"])
def test_added_in_a_version_newer_than_the_release_is_reported(repo: Path, where: str) -> None:
    new = later(release(repo), part=2)
    with (repo / where).open("a") as file:
        file.write(f"\n# Added in version v{new}.\n")
    (problem,) = lockstep.check(repo)
    assert problem.startswith(f"{where}:")
    assert f"'Added in version v{new}' is newer than the release" in problem


def test_added_in_a_version_missing_from_the_changelog_is_reported(repo: Path) -> None:
    old = earlier(release(repo))
    edit(repo / MDD, f"Added in version v{release(repo)}.", f"Added in version v{old}.")
    (problem,) = lockstep.check(repo)
    assert problem.startswith(f"{MDD}:")
    assert f"'Added in version v{old}' names a version with no CHANGELOG.md heading" in problem


def test_added_in_an_older_released_version_is_accepted(repo: Path) -> None:
    with (repo / "CHANGELOG.md").open("a") as file:
        file.write("\n## [3.1.0] - 2025-01-01\n")
    with (repo / "docs" / "quickstart.md").open("a") as file:
        file.write("\nAdded in version v3.1.0.\n")
    assert lockstep.check(repo) == []


def test_a_malformed_version_file_is_an_error(repo: Path) -> None:
    (repo / "VERSION").write_text("3.58\n")
    with pytest.raises(ValueError, match=r"must be one X\.Y\.Z version"):
        lockstep.check(repo)


def test_bump_moves_everything_in_one_step(repo: Path) -> None:
    old, new = release(repo), later(release(repo))
    sibling = add_package(
        repo, f'[project]\nname = "toolkit-zz"\nversion = "{old}"\n\n[tool.x]\nversion = "7"\n'
    )

    lockstep.bump(repo, new, DATE)

    assert lockstep.check(repo) == []
    assert release(repo) == new
    assert set(lockstep.package_versions(repo).values()) == {new}
    assert 'version = "7"' in sibling.read_text()
    changelog = (repo / "CHANGELOG.md").read_text()
    assert f"## [Unreleased]\n\n## [{new}] - 2027-01-15\n" in changelog
    assert lockstep.changelog_releases(repo)[:2] == [new, old]


@pytest.mark.parametrize("bad", ["same", "older", "3.59", "v3.59.0", "3.59.0rc1"])
def test_a_bump_to_a_bad_version_writes_nothing(repo: Path, bad: str) -> None:
    bad = {"same": release(repo), "older": earlier(release(repo))}.get(bad, bad)
    before = snapshot(repo)
    with pytest.raises(ValueError, match=r"not newer|not an X\.Y\.Z"):
        lockstep.bump(repo, bad, DATE)
    assert snapshot(repo) == before


def test_a_bump_that_cannot_update_a_file_writes_nothing(repo: Path) -> None:
    add_package(repo, '[project]\nname = "toolkit-zz"\n')
    before = snapshot(repo)
    with pytest.raises(ValueError, match="no static `version"):
        lockstep.bump(repo, later(release(repo)), DATE)
    assert snapshot(repo) == before


def test_the_command_line_exits_1_on_skew_and_0_in_lockstep(repo: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, str(SCRIPT), "--root", str(repo), *args]
        return subprocess.run(command, capture_output=True, text=True, check=False)

    old = release(repo)
    assert run("check").returncode == 0
    edit(repo / "VERSION", old, later(old, part=2))
    skewed = run("check")
    assert skewed.returncode == 1
    assert f"but VERSION is {later(old, part=2)}" in skewed.stderr
    assert run("bump", old).returncode == 1
    bumped = run("bump", later(old), "--date", "2027-01-15")
    assert bumped.returncode == 0, bumped.stderr
    assert run("check").returncode == 0
