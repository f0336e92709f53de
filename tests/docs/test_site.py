"""The site lists every page, rebuilds on source changes, and works opened from disk."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if p.name != "index.md")
LINK = re.compile(r'\b(?:href|src)="(?P<url>[^"]*)"')
MARKDOWN_LINK = re.compile(r"\]\((?P<target>[^)#\s]+)(?:#[^)]*)?\)")


def config() -> dict[str, object]:
    loaded = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


def nav_pages(entries: object) -> Iterator[str]:
    """Every page of a mkdocs ``nav``, however deeply its sections nest."""
    if isinstance(entries, str):
        yield entries
    elif isinstance(entries, list):
        for entry in entries:
            yield from nav_pages(entry)
    elif isinstance(entries, dict):
        for value in entries.values():
            yield from nav_pages(value)


def test_there_are_pages_to_check() -> None:
    assert {"quickstart.md", "api/nn.md", "changelog.md"} <= set(PAGES)


@pytest.mark.parametrize("page", PAGES)
def test_every_page_is_listed_on_the_home_page(page: str) -> None:
    listed = {m["target"] for m in MARKDOWN_LINK.finditer((DOCS / "index.md").read_text())}
    assert page in listed, f"docs/index.md does not link to {page}; add it to the page list"


@pytest.mark.parametrize("page", PAGES)
def test_every_page_is_in_the_nav(page: str) -> None:
    assert page in set(nav_pages(config()["nav"])), f"add {page} to the nav of mkdocs.yml"


def test_the_nav_names_only_pages_that_exist() -> None:
    assert sorted(set(nav_pages(config()["nav"])) - {"index.md"}) == PAGES


def test_serve_watches_every_package_source() -> None:
    watched = config()["watch"]
    assert isinstance(watched, list)
    sources = sorted(
        str(p.parent.relative_to(ROOT)) + "/src" for p in ROOT.glob("packages/*/pyproject.toml")
    )
    assert sources, "no package found"
    assert sorted(watched) == sources


def test_pages_are_files_not_folders() -> None:
    assert config()["use_directory_urls"] is False


def relative_links(page: Path) -> Iterator[str]:
    """The targets of the links and sources of ``page`` inside the site, fragments dropped."""
    for match in LINK.finditer(page.read_text(encoding="utf-8")):
        url = urlsplit(html.unescape(match["url"]))
        if url.scheme or url.netloc or not url.path:
            continue  # another site, or a link within the page
        yield unquote(url.path)


def test_every_link_of_the_built_site_opens_a_file(site: Path) -> None:
    """Opened from disk, a link to a folder shows a directory listing, not a page.

    404.html is left out: only a server shows it, and its links are absolute by design.
    """
    pages = sorted(set(site.rglob("*.html")) - {site / "404.html"})
    assert site / "index.html" in pages
    assert site / "api" / "nn.html" in pages
    checked = 0
    for page in pages:
        for target in relative_links(page):
            resolved = (page.parent / target).resolve()
            assert resolved.is_file(), f"{page.relative_to(site)} links to {target}, not a file"
            checked += 1
    assert checked > 100
