"""The threaded ranks of ``tests/nn/threads.py``: results in rank order, errors re-raised."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.nn.threads import RankError, run_ranks


def test_each_rank_returns_in_rank_order_and_the_collectives_combine_them() -> None:
    def rank_main(rank: int) -> tuple[int, int, float]:
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        return rank, dist.get_world_size(), total.item()

    assert run_ranks(3, rank_main) == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]


def test_the_first_error_is_raised_and_the_next_run_starts_clean() -> None:
    def failing(rank: int) -> None:
        if rank == 1:
            raise ValueError("rank one fails")
        dist.barrier()

    with pytest.raises(RankError, match=r"^rank 1 raised ValueError: rank one fails$"):
        run_ranks(2, failing)
    assert not dist.is_initialized()
    assert run_ranks(2, lambda rank: rank) == [0, 1]
