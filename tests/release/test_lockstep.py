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
REPO = "https://github.com/toolkit-dev/toolkit"


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


def add_package(root: Path, pyproject: str, repository: str = REPO) -> Path:
    folder = root / "packages" / "toolkit-zz"
    folder.mkdir()
    urls = f'\n[project.urls]\nRepository = "{repository}"\n'
    (folder / "pyproject.toml").write_text(pyproject + urls)
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
    problems = lockstep.check(repo)
    assert problems[0].startswith(f"CHANGELOG.md: the newest release heading is {new}")


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


def add_old_release(root: Path, version: str) -> None:
    """Add the release ``version``, older than 3.58.0, below it, with its links."""
    changelog = root / "CHANGELOG.md"
    edit(changelog, "\n[Unreleased]: ", f"\n## [{version}] - 2025-01-01\n\n[Unreleased]: ")
    edit(
        changelog,
        f"[3.58.0]: {REPO}/releases/tag/v3.58.0\n",
        f"[3.58.0]: {REPO}/compare/v{version}...v3.58.0\n"
        f"[{version}]: {REPO}/releases/tag/v{version}\n",
    )


def test_added_in_an_older_released_version_is_accepted(repo: Path) -> None:
    add_old_release(repo, "3.1.0")
    with (repo / "docs" / "quickstart.md").open("a") as file:
        file.write("\nAdded in version v3.1.0.\n")
    assert lockstep.check(repo) == []


def test_a_newer_release_below_the_current_one_is_reported(repo: Path) -> None:
    add_old_release(repo, "9.0.0")
    assert lockstep.check(repo) == [
        "CHANGELOG.md: `## [9.0.0]` sits below `## [3.58.0]` but is not older; release "
        "headings go newest first, one per version"
    ]


def test_a_release_listed_twice_is_reported(repo: Path) -> None:
    add_old_release(repo, "3.58.0")
    (problem, *_) = lockstep.check(repo)
    assert problem.startswith("CHANGELOG.md: `## [3.58.0]` sits below `## [3.58.0]` but is not")


def test_a_missing_unreleased_heading_is_reported(repo: Path) -> None:
    edit(repo / "CHANGELOG.md", "## [Unreleased]\n", "")
    assert lockstep.check(repo) == [
        "CHANGELOG.md has no `## [Unreleased]` heading; add it above the newest release "
        "(`nox -s bump` moves what is under it into the new release)"
    ]


def test_an_unreleased_heading_below_a_release_is_reported(repo: Path) -> None:
    edit(repo / "CHANGELOG.md", "## [Unreleased]\n", "")
    edit(repo / "CHANGELOG.md", "\n[Unreleased]: ", "\n## [Unreleased]\n\n[Unreleased]: ")
    assert lockstep.check(repo) == [
        "CHANGELOG.md: `## [Unreleased]` must come before every release heading"
    ]


def test_a_release_heading_that_is_no_version_is_reported(repo: Path) -> None:
    edit(repo / "CHANGELOG.md", "\n[Unreleased]: ", "\n## [3.1] - 2025-01-01\n\n[Unreleased]: ")
    assert lockstep.check(repo) == ["CHANGELOG.md: `## [3.1]` is not an X.Y.Z release"]


@pytest.mark.parametrize(
    ("label", "url"),
    [
        ("Unreleased", f"{REPO}/compare/v3.58.0...HEAD"),
        ("3.58.0", f"{REPO}/releases/tag/v3.58.0"),
    ],
)
def test_a_missing_or_wrong_changelog_link_is_reported(repo: Path, label: str, url: str) -> None:
    edit(repo / "CHANGELOG.md", f"[{label}]: {url}\n", "")
    assert lockstep.check(repo) == [
        f"CHANGELOG.md has no link for [{label}]; add `[{label}]: {url}`"
    ]
    wrong = url.replace("toolkit-dev", "elsewhere")
    with (repo / "CHANGELOG.md").open("a") as file:
        file.write(f"[{label}]: {wrong}\n")
    assert lockstep.check(repo) == [
        f"CHANGELOG.md: the link for [{label}] is {wrong}; it must be {url}"
    ]


def test_packages_that_disagree_on_the_repository_are_reported(repo: Path) -> None:
    add_package(repo, f'[project]\nname = "toolkit-zz"\nversion = "{release(repo)}"\n', "x")
    assert lockstep.check(repo) == [
        "packages/*/pyproject.toml: every package must give the same `Repository` in "
        "[project.urls]; the changelog's links point there"
    ]


@pytest.mark.parametrize(
    ("written", "reported"),
    [
        ("Added in version 3.99.0.", "Added in version 3.99.0."),
        ("Added in version V3.58.0.", "Added in version V3.58.0."),
        ("Added in version v3.58.", "Added in version v3.58."),
        ("Added in version v 3.58.0.", "Added in version v"),
        ("added in version v3.58.0.", "added in version v3.58.0."),
        ("Added in version", "Added in version"),  # wrapped: the version is on the next line
    ],
)
def test_a_malformed_added_in_is_reported(repo: Path, written: str, reported: str) -> None:
    with (repo / "docs" / "quickstart.md").open("a") as file:
        file.write(f"\n{written}\nv3.58.0\n")
    line = len((repo / "docs" / "quickstart.md").read_text().splitlines()) - 1
    assert lockstep.check(repo) == [
        f"docs/quickstart.md:{line}: '{reported}' is not a release; write it on one line as "
        "'Added in version v3.58.0' (with the v), naming the release that ships it"
    ]


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
    assert changelog.endswith(
        f"\n\n[Unreleased]: {REPO}/compare/v{new}...HEAD\n"
        f"[{new}]: {REPO}/compare/v{old}...v{new}\n"
        f"[{old}]: {REPO}/releases/tag/v{old}\n"
    )
    assert changelog.count("]: https://") == 3
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
