"""The lockstep check passes on the repository and fails on each kind of skew.

Each test copies the files the check reads (VERSION, CHANGELOG.md, docs/, packages/) into a
temporary folder, skews one thing, and checks that the problem is reported, by file.
"""

from __future__ import annotations

import datetime
import re
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
TIED = "packages/toolkit-nn/src/toolkit/nn/_tied_linear.py"
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
    assert (MDD, release(repo)) in {(found.path, found.text) for found in lockstep.added_in(repo)}


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
    # Outside a docstring (a guide), where no name says which section to read.
    old = earlier(release(repo))
    with (repo / "docs" / "quickstart.md").open("a") as file:
        file.write(f"\nAdded in version v{old}.\n")
    (problem,) = lockstep.check(repo)
    assert problem.startswith("docs/quickstart.md:")
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


# "Added in" against the CHANGELOG.md section that first lists the name.


def added(root: Path, name: str, argument: str | None = None) -> lockstep.AddedIn:
    """The one "Added in" of ``name`` (or of its ``argument``) in the sources of ``root``."""
    (found,) = (f for f in lockstep.added_in(root) if (f.name, f.argument) == (name, argument))
    return found


def say(root: Path, found: lockstep.AddedIn, version: str) -> None:
    """Make the line of ``found`` say ``Added in version v{version}``."""
    path = root / found.path
    lines = path.read_text().splitlines(keepends=True)
    old = f"Added in version v{found.text}"
    assert old in lines[found.line - 1]
    lines[found.line - 1] = lines[found.line - 1].replace(old, f"Added in version v{version}")
    path.write_text("".join(lines))


def test_the_next_release_is_the_minor_bump() -> None:
    assert lockstep.next_release("3.58.0") == "3.59.0"
    assert lockstep.next_release("3.58.2") == "3.59.0"
    assert lockstep.next_release("4.0.0") == "4.1.0"


def test_names_the_changelog_lists_as_unreleased_say_the_next_release(repo: Path) -> None:
    upcoming = lockstep.next_release(release(repo))
    for name in ("clip_grad_norm_", "tie_output_embeddings", "TiedLinear.requires_grad_"):
        assert added(repo, name).text == upcoming, name
    for argument in ("reduction", "z_loss", "softcap"):
        assert added(repo, "TiedLinear.cross_entropy", argument).text == upcoming, argument
    for name in ("ModuleDefaultDict", "TiedLinear", "TiedLinearParallel", "PipelineTie"):
        assert added(repo, name).text == release(repo), name


@pytest.mark.parametrize("name", ["clip_grad_norm_", "tie_output_embeddings"])
@pytest.mark.parametrize("written", ["release", "older", "later"])
def test_an_unreleased_name_that_says_another_version_is_reported(
    repo: Path, name: str, written: str
) -> None:
    upcoming = lockstep.next_release(release(repo))
    version = {"release": release(repo), "older": "3.1.0", "later": later(upcoming)}[written]
    found = added(repo, name)
    say(repo, found, version)
    assert lockstep.check(repo) == [
        f"{found.path}:{found.line}: `{name}` says 'Added in version v{version}' but "
        f"CHANGELOG.md first lists it under [Unreleased]; write 'Added in version v{upcoming}' "
        "(the next release)"
    ]


@pytest.mark.parametrize("written", ["next", "older"])
def test_a_released_name_that_says_another_version_is_reported(repo: Path, written: str) -> None:
    add_old_release(repo, "3.1.0")  # an older release that exists, so only the name is wrong
    version = {"next": lockstep.next_release(release(repo)), "older": "3.1.0"}[written]
    found = added(repo, "ModuleDefaultDict")
    say(repo, found, version)
    assert lockstep.check(repo) == [
        f"{MDD}:{found.line}: `ModuleDefaultDict` says 'Added in version v{version}' but "
        f"CHANGELOG.md first lists it under [{release(repo)}]; write 'Added in version "
        f"v{release(repo)}'"
    ]


def test_an_argument_is_checked_against_the_bullet_that_names_it(repo: Path) -> None:
    found = added(repo, "TiedLinear.cross_entropy", "z_loss")
    say(repo, found, release(repo))
    upcoming = lockstep.next_release(release(repo))
    assert lockstep.check(repo) == [
        f"{TIED}:{found.line}: the argument `z_loss` of `TiedLinear.cross_entropy` says "
        f"'Added in version v{release(repo)}' but CHANGELOG.md first lists it under "
        f"[Unreleased]; write 'Added in version v{upcoming}' (the next release)"
    ]


def test_a_name_moved_into_a_released_section_must_say_that_release(repo: Path) -> None:
    # The changelog decides: list clip_grad_norm_ under the release, and its docstring, which
    # says the next release, is wrong.
    edit(repo / "CHANGELOG.md", "### Removed\n", "### Removed\n\n- `toolkit.nn.clip_grad_norm_`\n")
    found = added(repo, "clip_grad_norm_")
    problems = lockstep.check(repo)
    assert problems == [
        f"{found.path}:{found.line}: `clip_grad_norm_` says 'Added in version "
        f"v{found.text}' but CHANGELOG.md first lists it under [{release(repo)}]; write "
        f"'Added in version v{release(repo)}'"
    ]


def test_a_docstring_whose_name_no_bullet_names_is_reported(repo: Path) -> None:
    upcoming = lockstep.next_release(release(repo))
    with (repo / MDD).open("a") as file:
        file.write(
            f'\n\ndef brand_new() -> None:\n    """New.\n\n    Added in version v{upcoming}.\n'
        )
        file.write('    """\n')
    line = len((repo / MDD).read_text().splitlines()) - 1
    assert lockstep.check(repo) == [
        f"{MDD}:{line}: 'Added in version v{upcoming}' for `brand_new`, which no CHANGELOG.md "
        "bullet names; name `brand_new` in backticks in the bullet that adds it"
    ]
    edit(
        repo / "CHANGELOG.md",
        "### Added\n\n",
        "### Added\n\n- `toolkit.nn.brand_new()`: new.\n",
    )
    assert lockstep.check(repo) == []


def test_an_argument_that_no_bullet_names_with_its_function_is_reported(repo: Path) -> None:
    changelog = repo / "CHANGELOG.md"  # every bullet that names the argument stops naming it
    text = changelog.read_text(encoding="utf-8")
    changelog.write_text(re.sub(r"`z_loss(=c)?`", "a z-loss", text), encoding="utf-8")
    found = added(repo, "TiedLinear.cross_entropy", "z_loss")
    (problem,) = lockstep.check(repo)
    assert problem == (
        f"{TIED}:{found.line}: 'Added in version v{found.text}' for the argument `z_loss` of "
        "`TiedLinear.cross_entropy`, which no CHANGELOG.md bullet names; name "
        "`TiedLinear.cross_entropy` and `z_loss` in backticks in the bullet that adds it"
    )


def test_a_guide_may_name_the_next_release(repo: Path) -> None:
    with (repo / "docs" / "quickstart.md").open("a") as file:
        file.write(f"\nAdded in version v{lockstep.next_release(release(repo))}.\n")
    assert lockstep.check(repo) == []


def test_docstring_owners_name_the_object_and_the_argument() -> None:
    source = '''
class A:
    """A.

    Added in version v1.0.0.
    """

    def f(self, x: int, y: int = 0) -> int:
        """F.

        Args:
            x: The x. Added in version v1.1.0.
            y (int): The y,
                wrapped. Added in version v1.2.0.

        Returns:
            Not y. Added in version v1.3.0.
        """
        def inner() -> None:
            """Added in version v1.4.0."""
        return x
'''
    owners = lockstep.docstring_owners(source)
    lines = source.splitlines()
    found = {
        lines[number - 1].split("v")[-1].rstrip('."'): owner
        for number, owner in owners.items()
        if "Added in" in lines[number - 1]
    }
    assert found == {
        "1.0.0": ("A", None),
        "1.1.0": ("A.f", "x"),
        "1.2.0": ("A.f", "y"),
        "1.3.0": ("A.f", None),
        "1.4.0": ("A.f.inner", None),
    }


def test_changelog_bullets_name_code_spans_without_the_package_or_the_call() -> None:
    assert lockstep.named("`toolkit.nn.tie_output_embeddings(model)` and `X.y_()` `z=c`") == {
        "tie_output_embeddings",
        "X.y_",
        "z=c",
    }


@pytest.mark.parametrize("part", [0, 1, 2])
def test_bump_writes_the_new_release_into_the_unreleased_lines_only(repo: Path, part: int) -> None:
    old, new = release(repo), later(release(repo), part=part)
    upcoming = lockstep.next_release(old)
    unreleased = {(f.path, f.line) for f in lockstep.added_in(repo) if f.text == upcoming}
    assert unreleased

    lockstep.bump(repo, new, DATE)

    assert lockstep.check(repo) == []
    for found in lockstep.added_in(repo):
        expected = new if (found.path, found.line) in unreleased else old
        assert found.text == expected, found
