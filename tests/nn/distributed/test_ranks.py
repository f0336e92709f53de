"""Laws of the multi-rank harness: results come back by rank, failures and hangs end the run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.nn import ranks
from tests.nn.distributed import toy_ranks
from tests.nn.ranks import RankCrashedError, RanksFailedError, run_processes, run_threads


def test_threads_each_rank_returns_in_rank_order_and_the_collectives_combine_them() -> None:
    def rank_main(rank: int) -> tuple[int, int, float]:
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        return rank, dist.get_world_size(), total.item()

    assert run_threads(3, rank_main) == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]


def test_threads_the_first_error_is_raised_and_the_next_run_starts_clean() -> None:
    def failing(rank: int) -> None:
        if rank == 1:
            raise ValueError("rank one fails")
        dist.barrier()

    with pytest.raises(RanksFailedError, match=r"^rank 1 raised ValueError: rank one fails$"):
        run_threads(2, failing)
    assert not dist.is_initialized()
    assert run_threads(2, lambda rank: rank) == [0, 1]


@pytest.mark.parametrize("collective", ["broadcast", "all_reduce"])
@pytest.mark.parametrize("differ", ["dtype", "size", "meta"])
def test_threads_refuse_a_collective_whose_ranks_pass_what_a_real_backend_cannot_combine(
    collective: str, differ: str
) -> None:
    # The threaded backend's copy_ would cast a float64 rank's tensor, or broadcast into a
    # larger one; gloo and NCCL move bytes, so the harness refuses both.
    def rank_main(rank: int) -> None:
        dtype = torch.float64 if differ == "dtype" and rank == 1 else torch.float32
        device = "meta" if differ == "meta" and rank == 1 else "cpu"
        tensor = torch.ones(3 if differ == "size" and rank == 1 else 2, dtype=dtype, device=device)
        if collective == "broadcast":
            dist.broadcast(tensor, src=0)
        else:
            dist.all_reduce(tensor)

    with pytest.raises(RanksFailedError) as info:
        run_threads(2, rank_main)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert {"dtype": "float64", "size": "3)", "meta": "meta tensor"}[differ] in str(info.value)
    assert run_threads(2, lambda rank: dist.broadcast(torch.ones(2), src=0)) == [None, None]


def test_threads_still_running_at_the_bound_fail_the_run_and_do_not_hold_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ranks, "JOIN_TIMEOUT_S", 2.0)

    def stuck(rank: int) -> None:
        if rank == 0:
            dist.barrier()  # rank 1 never comes
        time.sleep(3600)

    start = time.monotonic()
    with pytest.raises(RanksFailedError, match=r"ranks \[0, 1\] did not finish"):
        run_threads(2, stuck)
    assert time.monotonic() - start < 10


def test_processes_each_rank_runs_the_target_and_results_come_back_in_rank_order() -> None:
    results = run_processes(3, toy_ranks.identify, "x", timeout=60)
    assert [r[:3] for r in results] == [(0, 3, "x"), (1, 3, "x"), (2, 3, "x")]
    (address,) = {r[3] for r in results}
    assert address.startswith("127.0.0.1:")
    assert int(address.rpartition(":")[2]) > 0


def test_processes_a_failing_rank_is_reported_and_its_waiting_peers_are_stopped() -> None:
    start = time.monotonic()
    with pytest.raises(RanksFailedError) as info:
        run_processes(2, toy_ranks.fail_on_rank_zero_and_hang_elsewhere, timeout=60, grace=0.5)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "rank 0 raised" in message
    assert "ValueError: rank zero broke" in message
    assert "rank 1 was killed after a peer failed" in message


def test_processes_ranks_still_running_at_the_bound_are_killed_and_reported() -> None:
    start = time.monotonic()
    with pytest.raises(RanksFailedError, match=r"rank 0 was killed at the 2\.0 s bound") as info:
        run_processes(2, toy_ranks.hang, timeout=2.0)
    assert time.monotonic() - start < 20
    assert "rank 1 was killed at the 2.0 s bound" in str(info.value)


def test_processes_a_crash_in_native_code_relaunches_once_and_a_second_crash_fails(
    tmp_path: Path,
) -> None:
    once, twice = tmp_path / "once", tmp_path / "twice"
    once.mkdir()
    twice.mkdir()
    assert run_processes(2, toy_ranks.crash_on_rank_zero, str(once), 1, timeout=60) == [0, 1]
    assert len(list(once.iterdir())) == 1
    with pytest.raises(RankCrashedError, match=r"rank 0 crashed \(SIGSEGV\)"):
        run_processes(2, toy_ranks.crash_on_rank_zero, str(twice), 2, timeout=60)
    assert len(list(twice.iterdir())) == 2
