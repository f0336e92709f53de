"""Keep every package, the changelog and the docs at the one release version in ``VERSION``.

``python scripts/lockstep.py check`` lists every place that disagrees with ``VERSION`` and
exits 1 if there is any. ``python scripts/lockstep.py bump X.Y.Z`` moves ``VERSION`` and every
package to ``X.Y.Z`` and opens its CHANGELOG section, writing nothing unless all succeed.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION_FORMAT = re.compile(r"\d+\.\d+\.\d+")
RELEASE_HEADING = re.compile(r"^## \[(?P<version>[^\]]+)\]", re.MULTILINE)
UNRELEASED_HEADING = re.compile(r"^## \[Unreleased\][^\n]*\n", re.MULTILINE)
ADDED_IN = re.compile(r"Added in version v(?P<version>\d+(?:\.\d+)*)")
PROJECT_VERSION = re.compile(r'^(version\s*=\s*")[^"]*(")', re.MULTILINE)


def parse(version: str) -> tuple[int, ...]:
    """The numeric parts of ``version``, for comparing releases."""
    return tuple(int(part) for part in version.split("."))


def read_release(root: Path) -> str:
    """The release version: the one line of ``VERSION``."""
    version = (root / "VERSION").read_text(encoding="utf-8").strip()
    if not VERSION_FORMAT.fullmatch(version):
        raise ValueError(f"VERSION holds {version!r}; it must be one X.Y.Z version")
    return version


def package_versions(root: Path) -> dict[Path, str | None]:
    """The static ``[project] version`` of every ``packages/*/pyproject.toml``."""
    versions: dict[Path, str | None] = {}
    for pyproject in sorted(root.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
        versions[pyproject.relative_to(root)] = project.get("version")
    return versions


def changelog_releases(root: Path) -> list[str]:
    """The versions of the CHANGELOG.md release headings, newest first, without Unreleased."""
    text = (root / "CHANGELOG.md").read_text(encoding="utf-8")
    found = (m["version"] for m in RELEASE_HEADING.finditer(text))
    return [version for version in found if version != "Unreleased"]


def added_in(root: Path) -> Iterator[tuple[str, int, str]]:
    """Every "Added in version vX" in the docs and the package sources, as (file, line, X)."""
    files = [*root.glob("docs/**/*.md"), *root.glob("packages/*/README.md")]
    files += root.glob("packages/*/src/**/*.py")
    for path in sorted(files):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in ADDED_IN.finditer(line):
                yield str(path.relative_to(root)), number, match["version"]


def check(root: Path) -> list[str]:
    """Every disagreement with the release version, as messages that say how to fix it."""
    release = read_release(root)
    problems: list[str] = []
    versions = package_versions(root)
    if not versions:
        problems.append("no packages/*/pyproject.toml found; run from the repository root")
    for pyproject, version in versions.items():
        if version != release:
            problems.append(
                f"{pyproject}: version is {version!r} but VERSION is {release}; set "
                f'`version = "{release}"` (or move everything with `nox -s bump -- X.Y.Z`)'
            )
    releases = changelog_releases(root)
    if not releases:
        problems.append(f"CHANGELOG.md has no release heading; add `## [{release}] - YYYY-MM-DD`")
    elif releases[0] != release:
        problems.append(
            f"CHANGELOG.md: the newest release heading is {releases[0]} but VERSION is "
            f"{release}; the newest `## [X.Y.Z]` heading must be the release"
        )
    for path, line, version in added_in(root):
        if parse(version) > parse(release):
            problems.append(
                f"{path}:{line}: 'Added in version v{version}' is newer than the release "
                f"{release}; name the release that ships it"
            )
        elif version not in releases:
            problems.append(
                f"{path}:{line}: 'Added in version v{version}' names a version with no "
                "CHANGELOG.md heading; name a released version"
            )
    return problems


def bump(root: Path, new: str, date: datetime.date) -> None:
    """Move ``VERSION`` and every package to ``new`` and open its CHANGELOG section.

    The section takes what was under ``## [Unreleased]``. Every file is computed before any is
    written, so a rejected bump changes nothing.

    Raises:
        ValueError: If ``new`` is not X.Y.Z, is not newer than the release, or a file cannot
            be updated.
    """
    if not VERSION_FORMAT.fullmatch(new):
        raise ValueError(f"{new!r} is not an X.Y.Z version")
    old = read_release(root)
    if parse(new) <= parse(old):
        raise ValueError(f"{new} is not newer than the release {old}")
    writes: dict[Path, str] = {root / "VERSION": f"{new}\n"}
    for pyproject in package_versions(root):
        path = root / pyproject
        writes[path] = _set_project_version(path.read_text(encoding="utf-8"), new, path)
    changelog = root / "CHANGELOG.md"
    text = changelog.read_text(encoding="utf-8")
    unreleased = UNRELEASED_HEADING.search(text)
    if unreleased is None:
        raise ValueError("CHANGELOG.md has no `## [Unreleased]` heading to release")
    heading = f"\n## [{new}] - {date.isoformat()}\n"
    writes[changelog] = text[: unreleased.end()] + heading + text[unreleased.end() :]
    for path, content in writes.items():
        path.write_text(content, encoding="utf-8")


def _set_project_version(text: str, new: str, path: Path) -> str:
    start = re.search(r"^\[project\]\s*$", text, re.MULTILINE)
    if start is None:
        raise ValueError(f"{path} has no [project] table")
    end = re.compile(r"^\[", re.MULTILINE).search(text, start.end())
    stop = len(text) if end is None else end.start()
    table, count = PROJECT_VERSION.subn(rf"\g<1>{new}\g<2>", text[start.end() : stop], count=1)
    if count != 1:
        raise ValueError(f'{path} has no static `version = "..."` in its [project] table')
    return text[: start.end()] + table + text[stop:]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``check`` or ``bump`` from the command line; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("check", help="fail if anything disagrees with VERSION")
    bumper = commands.add_parser("bump", help="move every package to a new release")
    bumper.add_argument("version", help="the new X.Y.Z release")
    bumper.add_argument("--date", type=datetime.date.fromisoformat, default=None)
    args = parser.parse_args(argv)
    if args.command == "bump":
        date = args.date or datetime.datetime.now(datetime.UTC).date()
        try:
            bump(args.root, args.version, date)
        except ValueError as error:
            print(f"bump: {error}", file=sys.stderr)
            return 1
        print(f"Bumped to {args.version}; fill in its CHANGELOG.md section.")
    problems = check(args.root)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"Lockstep at {read_release(args.root)}.")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
