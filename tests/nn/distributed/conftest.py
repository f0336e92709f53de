"""The multi-rank runs, each launched once and shared by the tests that read their results.

Starting ranks and importing torch in them costs far more than training the tiny model, so
one launch per world size runs every setup one after another (see ``workers.main``).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.nn.distributed import workers
from tests.nn.distributed.launch import run_ranks

# The hard bound on one launch. A normal two-rank run takes about 15 s on two cores; a
# collective that hangs fails after workers.COLLECTIVE_TIMEOUT, and anything still running at
# the bound is killed, so no hang can stall the suite.
TIMEOUT = 150.0

# The setups each world size runs. Three ranks on two cores are slower: they run the
# setups whose sharding differs most from the two-rank one.
WORLDS = {
    2: list(workers.SETUPS),
    3: ["fsdp2_blocks", "fsdp2_grouped", "fsdp1_flat_params"],
}


@pytest.fixture(scope="session")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    """``worlds[n][rank][check]``: what each check returned on each rank of an n-rank run."""
    results: dict[int, list[dict[str, Any]]] = {}
    for world_size, setups in WORLDS.items():
        checkpoints = tmp_path_factory.mktemp(f"dcp-{world_size}")
        results[world_size] = run_ranks(
            workers.main, world_size, world_size, setups, str(checkpoints), timeout=TIMEOUT
        )
    return results
