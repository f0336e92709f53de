"""Fixtures of the distributed tests."""

from __future__ import annotations

import pytest

from tests.nn.distributed.worlds import Worlds


@pytest.fixture(scope="session")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> Worlds:
    """The multi-rank runs, launched on first use."""
    return Worlds(tmp_path_factory.mktemp("worlds"))
