"""Several ranks in one process: each rank a thread, the collectives torch's threaded backend.

The multi-rank tests in ``tests/nn/distributed`` launch real processes with gloo, which is
the proof of parity but costs seconds per launch and runs the code out of the test process's
sight. The threaded process group of torch's own distributed tests runs every collective that
the package uses (``all_gather_object``, ``broadcast``, ``all_reduce``, and DTensor's
redistributions) between threads of this process, so a test can run the per-rank logic of
``sync_entries``, ``PipelineTie`` and ``TiedLinearParallel`` on 2 or 3 ranks in a fraction
of a second, where a coverage tool or a mutation tester sees every line it runs.

Threads share torch's global random generator, so a rank must not draw its model's values
from it concurrently: build the models first, in the calling thread, and give each rank its
own (``copy.deepcopy``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.multi_threaded_pg import (
    ProcessLocalGroup,
    _install_threaded_pg,
    _uninstall_threaded_pg,
)

T = TypeVar("T")

# A collective that one rank never reaches would hang the others; each thread is joined with
# this bound, and a rank still running after it fails the test.
JOIN_TIMEOUT_S = 60.0


class RankError(Exception):
    """A rank raised: its error is the cause, its rank in the message."""


def run_ranks(world_size: int, fn: Callable[[int], T]) -> list[T]:
    """Run ``fn(rank)`` on ``world_size`` threads, each a rank of one default process group.

    Returns what each rank returned, in rank order. If any rank raises, every rank's
    collectives are released and the error of the rank that raised first is raised again,
    chained: the others only fail because it left their collectives.
    """
    if dist.is_initialized():
        raise RuntimeError("run_ranks needs no process group in the calling thread")
    results: list[T | None] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []  # in the order the ranks raised
    store = dist.HashStore()

    def rank_main(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            results[rank] = fn(rank)
        except BaseException as error:  # re-raised in the calling thread
            errors.append((rank, error))
            ProcessLocalGroup.exception_handle(error)  # wake the ranks waiting on this one
        finally:
            dist.destroy_process_group()

    ProcessLocalGroup.reset()  # clear what a failed run before this one left
    _install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    try:
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN_TIMEOUT_S)
        hung = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()
    if hung:
        raise RuntimeError(f"ranks {hung} did not finish in {JOIN_TIMEOUT_S} s")
    if errors:
        rank, error = errors[0]
        raise RankError(f"rank {rank} raised {type(error).__name__}: {error}") from error
    return results  # type: ignore[return-value] # every rank returned
