"""The gloo launches, one per world size, shared by the tests that read their results.

Starting ranks and importing torch in them costs far more than training the tiny model, so
one launch per world size runs every check one after another (see ``workers.main``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from tests.nn.distributed import workers
from tests.nn.ranks import RanksFailedError, run_processes

# The hard bound on one launch. A normal two-rank run takes about 15 s on two cores; a
# collective that hangs fails after workers.COLLECTIVE_TIMEOUT, and anything still running at
# the bound is killed, so no hang can stall the suite.
TIMEOUT = 240.0

# The setups of ``tiny_lm`` each world size runs; the others run on threaded ranks.
WORLDS: dict[int, list[str]] = {2: list(workers.FSDP1_SETUPS)}
# Further world sizes that only modules of ``workers.CHECK_MODULES`` use; they run no setup.
for _module in workers.CHECK_MODULES:
    for _size in importlib.import_module(_module).WORLD_SIZES:
        WORLDS.setdefault(_size, [])


class Worlds:
    """Launches each world size the first time a test asks for it, then keeps its results."""

    def __init__(self, checkpoint_root: Path) -> None:
        self._root = checkpoint_root
        self._results: dict[int, list[dict[str, Any]] | RanksFailedError] = {}

    def __getitem__(self, world_size: int) -> list[dict[str, Any]]:
        """``worlds[n][rank][check]``: what each check returned on each rank of an n-rank run."""
        if world_size not in self._results:
            checkpoints = self._root / f"dcp-{world_size}"
            try:
                self._results[world_size] = run_processes(
                    world_size,
                    workers.main,
                    world_size,
                    WORLDS[world_size],
                    str(checkpoints),
                    timeout=TIMEOUT,
                )
            except RanksFailedError as error:
                self._results[world_size] = error  # fail every test of it without relaunching
        result = self._results[world_size]
        if isinstance(result, RanksFailedError):
            raise result
        return result


def per_rank(worlds: Worlds, world_size: int, check: str) -> list[Any]:
    """What ``check`` returned on each rank; fails with the rank's traceback if it raised."""
    values = [results[check] for results in worlds[world_size]]
    for rank, value in enumerate(values):
        if isinstance(value, Exception):
            pytest.fail(f"{check} raised on rank {rank}:\n{value}")
    return values
