"""Keep every package, the changelog and the docs at the one release version in ``VERSION``.

``python scripts/lockstep.py check`` lists every place that disagrees with ``VERSION`` and
exits 1 if there is any. ``python scripts/lockstep.py bump X.Y.Z`` moves ``VERSION`` and every
package to ``X.Y.Z``, opens its CHANGELOG section and rewrites the changelog's link
definitions, writing nothing unless all succeed.

CHANGELOG.md follows Keep a Changelog: ``## [Unreleased]`` first, then one ``## [X.Y.Z]``
heading per release, newest first, and at the end one link definition per heading:
``[Unreleased]`` compares the newest release's tag with HEAD, each release compares its tag
with the previous one, and the oldest links to its tag. The repository is the ``Repository``
project URL of the packages.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import re
import sys
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION_FORMAT = re.compile(r"\d+\.\d+\.\d+")
RELEASE_HEADING = re.compile(r"^## \[(?P<version>[^\]]+)\]", re.MULTILINE)
UNRELEASED_HEADING = re.compile(r"^## \[Unreleased\][^\n]*\n", re.MULTILINE)
ADDED_IN = re.compile(r"Added in version v(?P<version>\d+\.\d+\.\d+)\b")
# Any spelling of the phrase; what ADDED_IN does not match is reported as malformed.
ADDED_IN_PHRASE = re.compile(r"added\s+in\s+version\b\s*(?P<rest>\S*)", re.IGNORECASE)
LINK_DEFINITION = re.compile(r"^\[(?P<label>[^\]]+)\]:[ \t]*(?P<url>\S*)[ \t]*\n?", re.MULTILINE)
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
    """The versions of the CHANGELOG.md release headings, in file order, without Unreleased."""
    return releases_of((root / "CHANGELOG.md").read_text(encoding="utf-8"))


def releases_of(changelog: str) -> list[str]:
    """The versions of the release headings of the ``changelog`` text, without Unreleased."""
    found = (m["version"] for m in RELEASE_HEADING.finditer(changelog))
    return [version for version in found if version != "Unreleased"]


def repository_url(root: Path) -> str | None:
    """The ``Repository`` project URL that every package gives, or None if they disagree."""
    urls = set()
    for pyproject in sorted(root.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
        urls.add(project.get("urls", {}).get("Repository"))
    return urls.pop().rstrip("/") if len(urls) == 1 and None not in urls else None


def changelog_links(repository: str, releases: Sequence[str]) -> dict[str, str]:
    """The link definitions CHANGELOG.md needs for ``releases`` (newest first), by label."""
    if not releases:
        return {}
    links = {"Unreleased": f"{repository}/compare/v{releases[0]}...HEAD"}
    for newer, older in itertools.pairwise(releases):
        links[newer] = f"{repository}/compare/v{older}...v{newer}"
    links[releases[-1]] = f"{repository}/releases/tag/v{releases[-1]}"
    return links


def check_changelog(root: Path, release: str) -> list[str]:
    """Every problem of CHANGELOG.md's headings and link definitions."""
    text = (root / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = [m["version"] for m in RELEASE_HEADING.finditer(text)]
    releases = releases_of(text)
    problems: list[str] = []
    if "Unreleased" not in headings:
        problems.append(
            "CHANGELOG.md has no `## [Unreleased]` heading; add it above the newest release "
            "(`nox -s bump` moves what is under it into the new release)"
        )
    elif headings[0] != "Unreleased":
        problems.append("CHANGELOG.md: `## [Unreleased]` must come before every release heading")
    if not releases:
        problems.append(f"CHANGELOG.md has no release heading; add `## [{release}] - YYYY-MM-DD`")
        return problems
    if malformed := [version for version in releases if not VERSION_FORMAT.fullmatch(version)]:
        problems += [f"CHANGELOG.md: `## [{v}]` is not an X.Y.Z release" for v in malformed]
        return problems
    if releases[0] != release:
        problems.append(
            f"CHANGELOG.md: the newest release heading is {releases[0]} but VERSION is "
            f"{release}; the newest `## [X.Y.Z]` heading must be the release"
        )
    for newer, older in itertools.pairwise(releases):
        if parse(older) >= parse(newer):
            problems.append(
                f"CHANGELOG.md: `## [{older}]` sits below `## [{newer}]` but is not older; "
                "release headings go newest first, one per version"
            )
    repository = repository_url(root)
    if repository is None:
        problems.append(
            "packages/*/pyproject.toml: every package must give the same `Repository` in "
            "[project.urls]; the changelog's links point there"
        )
        return problems
    found = {m["label"]: m["url"] for m in LINK_DEFINITION.finditer(text)}
    for label, url in changelog_links(repository, releases).items():
        if label not in found:
            problems.append(f"CHANGELOG.md has no link for [{label}]; add `[{label}]: {url}`")
        elif found[label] != url:
            problems.append(
                f"CHANGELOG.md: the link for [{label}] is {found[label]}; it must be {url}"
            )
    return problems


def added_in(root: Path) -> Iterator[tuple[str, int, str]]:
    """Every "Added in version" in the docs and the package sources, as (file, line, text).

    ``text`` is the version without its ``v`` when the phrase is well formed (``Added in
    version vX.Y.Z``), and otherwise everything from the phrase to the end of its word.
    """
    files = [*root.glob("docs/**/*.md"), *root.glob("packages/*/README.md")]
    files += root.glob("packages/*/src/**/*.py")
    for path in sorted(files):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in ADDED_IN_PHRASE.finditer(line):
                well_formed = ADDED_IN.match(line, match.start())
                text = well_formed["version"] if well_formed else match[0]
                yield str(path.relative_to(root)), number, text


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
    problems += check_changelog(root, release)
    releases = changelog_releases(root)
    for path, line, version in added_in(root):
        if not VERSION_FORMAT.fullmatch(version):
            problems.append(
                f"{path}:{line}: '{version}' is not a release; write it on one line as "
                f"'Added in version v{release}' (with the v), naming the release that ships it"
            )
        elif parse(version) > parse(release):
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

    The section takes what was under ``## [Unreleased]``, and the changelog's link
    definitions are rewritten for the new release. Every file is computed before any is
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
    repository = repository_url(root)
    if repository is None:
        raise ValueError("the packages give no single `Repository` URL for the changelog links")
    links = changelog_links(repository, [new, *releases_of(text)])
    heading = f"\n## [{new}] - {date.isoformat()}\n"
    text = text[: unreleased.end()] + heading + text[unreleased.end() :]
    writes[changelog] = _set_links(text, links)
    for path, content in writes.items():
        path.write_text(content, encoding="utf-8")


def _set_links(text: str, links: dict[str, str]) -> str:
    """``text`` with its release link definitions replaced by ``links``, at the end."""
    kept = LINK_DEFINITION.sub(
        lambda m: (
            "" if m["label"] == "Unreleased" or VERSION_FORMAT.fullmatch(m["label"]) else m[0]
        ),
        text,
    )
    block = "".join(f"[{label}]: {url}\n" for label, url in links.items())
    return kept.rstrip("\n") + "\n\n" + block


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
