"""The documentation site, built once for every test that reads it."""

from __future__ import annotations

import os
from pathlib import Path

import mkdocs.commands.build as mkdocs_build
import mkdocs.config as mkdocs_config
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the site built from ``mkdocs.yml``.

    It is built without ``--strict``, so that a page still being written elsewhere cannot hide
    a regression in the tests that read it; ``nox -s docs`` builds strictly first.
    """
    folder = tmp_path_factory.mktemp("site")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        config = mkdocs_config.load_config(
            str(ROOT / "mkdocs.yml"), site_dir=str(folder), strict=False
        )
        mkdocs_build.build(config)
    finally:
        os.chdir(cwd)
    return folder
