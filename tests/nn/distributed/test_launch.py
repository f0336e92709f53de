"""Laws of the test launcher: results come back by rank, failures and hangs end the run."""

from __future__ import annotations

import time

import pytest

from tests.nn.distributed import toy_ranks
from tests.nn.distributed.launch import RanksFailedError, run_ranks


def test_each_rank_runs_the_target_and_results_come_back_in_rank_order() -> None:
    results = run_ranks(toy_ranks.identify, 3, "x", timeout=60)
    assert [r[:3] for r in results] == [(0, 3, "x"), (1, 3, "x"), (2, 3, "x")]
    (address,) = {r[3] for r in results}
    assert address.startswith("127.0.0.1:")
    assert int(address.rpartition(":")[2]) > 0


def test_a_failing_rank_is_reported_and_its_waiting_peers_are_stopped() -> None:
    start = time.monotonic()
    with pytest.raises(RanksFailedError) as info:
        run_ranks(toy_ranks.fail_on_rank_zero_and_hang_elsewhere, 2, timeout=60, grace=0.5)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "rank 0 raised" in message
    assert "ValueError: rank zero broke" in message
    assert "rank 1 was killed after a peer failed" in message


def test_ranks_still_running_at_the_bound_are_killed_and_reported() -> None:
    start = time.monotonic()
    with pytest.raises(RanksFailedError, match=r"rank 0 was killed at the 2\.0 s bound") as info:
        run_ranks(toy_ranks.hang, 2, timeout=2.0)
    assert time.monotonic() - start < 20
    assert "rank 1 was killed at the 2.0 s bound" in str(info.value)
