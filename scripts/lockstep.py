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

"Added in version vX.Y.Z" tells the release that first ships a name, a method or an argument.
The check reads it from the docstring that carries it (an argument's when it sits in that
argument's entry of ``Args:``) and finds the name in CHANGELOG.md: a name's release is the
oldest section with a bullet that names it in backticks (``toolkit.nn.`` and a call's
parentheses left out), and an argument's, the oldest with a bullet that names both the
function and the argument (``z_loss`` or ``z_loss=c``). A name first listed under
``[Unreleased]`` ships in the next release: the minor release after ``VERSION`` (3.58.0 ->
3.59.0), which ``bump`` writes into those lines when it cuts ``[Unreleased]`` into another
version. An "Added in" outside a docstring, as in a guide, must name a release of the
changelog or the next one.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import itertools
import re
import sys
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
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
SECTION_HEADING = re.compile(r"^## \[(?P<version>[^\]]+)\][^\n]*$", re.MULTILINE)
CODE_SPAN = re.compile(r"`(?P<code>[^`]+)`")
# An entry of a docstring's ``Args:`` section: ``name: text`` or ``name (type): text``.
ARG_ENTRY = re.compile(r"^(?P<indent> *)\*{0,2}(?P<name>\w+)(?: \([^)]*\))?: ")


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


def next_release(release: str) -> str:
    """The release after ``release``, as the unreleased "Added in" lines name it: its minor bump.

    ``bump`` may cut another version (a patch or a major release); it then rewrites those lines.
    """
    major, minor, _ = parse(release)
    return f"{major}.{minor + 1}.0"


@dataclass(frozen=True)
class AddedIn:
    """One "Added in version" phrase: where it is, what it says and whose docstring holds it."""

    path: str
    line: int
    text: str
    """The version without its ``v`` when well formed, else the phrase to the end of its word."""
    name: str | None = None
    """The dotted name, in its module, of the class or function whose docstring holds it."""
    argument: str | None = None
    """The argument whose ``Args:`` entry holds it, if one does."""


def added_in(root: Path) -> Iterator[AddedIn]:
    """Every "Added in version" in the docs and the package sources, in file and line order."""
    files = [*root.glob("docs/**/*.md"), *root.glob("packages/*/README.md")]
    files += root.glob("packages/*/src/**/*.py")
    for path in sorted(files):
        text = path.read_text(encoding="utf-8")
        owners = docstring_owners(text) if path.suffix == ".py" else {}
        for number, line in enumerate(text.splitlines(), 1):
            for match in ADDED_IN_PHRASE.finditer(line):
                well_formed = ADDED_IN.match(line, match.start())
                version = well_formed["version"] if well_formed else match[0]
                name, argument = owners.get(number, (None, None))
                yield AddedIn(str(path.relative_to(root)), number, version, name, argument)


def docstring_owners(source: str) -> dict[int, tuple[str, str | None]]:
    """For each line of a docstring in ``source``: its class or function, and its argument.

    The name is dotted from the module (``TiedLinear.cross_entropy``); the argument is the one
    whose entry of the ``Args:`` section holds the line, or None.
    """
    lines = source.splitlines()
    owners: dict[int, tuple[str, str | None]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            name = prefix + child.name
            first = child.body[0] if child.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                start, stop = first.lineno, first.end_lineno or first.lineno
                arguments = _arguments(lines[start - 1 : stop])
                for number, argument in enumerate(arguments, start):
                    owners[number] = (name, argument)
            visit(child, f"{name}.")

    visit(ast.parse(source), "")
    return owners


def _arguments(docstring: list[str]) -> list[str | None]:
    """For each line of a Google-style docstring, the argument whose ``Args:`` entry holds it."""
    result: list[str | None] = []
    section: int | None = None  # the indentation of the "Args:" heading, inside the section
    entry_indent: int | None = None
    entry: str | None = None
    for line in docstring:
        indent = len(line) - len(line.lstrip())
        if line.strip() in {"Args:", "Arguments:"}:
            section, entry_indent, entry = indent, None, None
        elif section is not None and line.strip() and indent <= section:
            section, entry = None, None  # the next section, or the docstring's end
        elif section is not None and line.strip():
            entry_indent = indent if entry_indent is None else entry_indent
            if indent == entry_indent:
                match = ARG_ENTRY.match(line)
                entry = match["name"] if match else None
        result.append(entry if section is not None else None)
    return result


def changelog_bullets(changelog: str) -> list[tuple[str, list[str]]]:
    """Each section of ``changelog``, oldest first: its version (or Unreleased) and bullets.

    A bullet is a line that starts with ``- `` and the indented lines that follow it, joined.
    """
    headings = list(SECTION_HEADING.finditer(changelog))
    sections: list[tuple[str, list[str]]] = []
    for heading, following in itertools.zip_longest(headings, headings[1:]):
        body = changelog[heading.end() : following.start() if following else len(changelog)]
        bullets: list[str] = []
        open_bullet = False
        for line in body.splitlines():
            if line.startswith("- "):
                bullets.append(line[2:])
                open_bullet = True
            elif open_bullet and line.startswith(" ") and line.strip():
                bullets[-1] += " " + line.strip()
            else:
                open_bullet = False
        sections.append((heading["version"], bullets))
    return sections[::-1]


def named(bullet: str) -> set[str]:
    """The code spans of a changelog bullet, as names: ``toolkit.x.`` and a call's ``(...)`` cut.

    ``toolkit.nn.tie_output_embeddings(model)`` names ``tie_output_embeddings``, and
    ``TiedLinear.requires_grad_()`` names ``TiedLinear.requires_grad_``.
    """
    spans = (match["code"].strip() for match in CODE_SPAN.finditer(bullet))
    return {re.sub(r"\(.*\)$", "", re.sub(r"^toolkit\.\w+\.", "", span)) for span in spans}


def first_listed(
    sections: Sequence[tuple[str, list[str]]], name: str, argument: str | None
) -> str | None:
    """The oldest section with a bullet that names ``name`` (and ``argument``), or None.

    An argument is named as ``argument`` or with a value, ``argument=...``.
    """
    for version, bullets in sections:
        for bullet in bullets:
            names = named(bullet)
            if name not in names:
                continue
            if argument is None or any(
                code == argument or code.startswith(f"{argument}=") for code in names
            ):
                return version
    return None


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
    changelog_problems = check_changelog(root, release)
    problems += changelog_problems
    releases = changelog_releases(root)
    sections = changelog_bullets((root / "CHANGELOG.md").read_text(encoding="utf-8"))
    upcoming = next_release(release)
    for found in added_in(root):
        where, version = f"{found.path}:{found.line}", found.text
        if not VERSION_FORMAT.fullmatch(version):
            problems.append(
                f"{where}: '{version}' is not a release; write it on one line as "
                f"'Added in version v{release}' (with the v), naming the release that ships it"
            )
        elif found.name is not None:
            # Read against the sections only once their headings are right.
            if not changelog_problems:
                problems += _check_named(found, where, sections, upcoming)
        elif version in releases or version == upcoming:
            pass
        elif parse(version) > parse(release):
            problems.append(
                f"{where}: 'Added in version v{version}' is newer than the release {release} "
                f"and is not the next release, {upcoming}; name the release that ships it"
            )
        else:
            problems.append(
                f"{where}: 'Added in version v{version}' names a version with no "
                "CHANGELOG.md heading; name a released version"
            )
    return problems


def _check_named(
    found: AddedIn, where: str, sections: Sequence[tuple[str, list[str]]], upcoming: str
) -> list[str]:
    """The problem, if any, of a docstring's "Added in" against the CHANGELOG.md section."""
    assert found.name is not None
    what = f"`{found.name}`"
    if found.argument is not None:
        what = f"the argument `{found.argument}` of `{found.name}`"
    section = first_listed(sections, found.name, found.argument)
    if section is None:
        both = f" and `{found.argument}`" if found.argument else ""
        return [
            f"{where}: 'Added in version v{found.text}' for {what}, which no CHANGELOG.md "
            f"bullet names; name `{found.name}`{both} in backticks in the bullet that adds it"
        ]
    expected = upcoming if section == "Unreleased" else section
    if found.text == expected:
        return []
    due = " (the next release)" if section == "Unreleased" else ""
    return [
        f"{where}: {what} says 'Added in version v{found.text}' but CHANGELOG.md first "
        f"lists it under [{section}]; write 'Added in version v{expected}'{due}"
    ]


def bump(root: Path, new: str, date: datetime.date) -> None:
    """Move ``VERSION`` and every package to ``new`` and open its CHANGELOG section.

    The section takes what was under ``## [Unreleased]``, and the changelog's link
    definitions are rewritten for the new release. Every "Added in version" newer than the
    old release (the next release's, ``next_release``, in a tree that passes the check) is
    rewritten to ``new``. Every file is computed before any is written, so a rejected bump
    changes nothing.

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
    for name in sorted({found.path for found in added_in(root)}):
        path = root / name
        content = writes.get(path, path.read_text(encoding="utf-8"))
        writes[path] = ADDED_IN.sub(
            lambda m: m[0] if parse(m["version"]) <= parse(old) else f"Added in version v{new}",
            content,
        )
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
