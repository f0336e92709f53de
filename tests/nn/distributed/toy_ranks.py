"""Rank functions for the launcher's own tests; they import nothing heavy, so ranks start fast."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def identify(tag: str) -> tuple[int, int, str, str]:
    """Return this rank's number, the world size, the argument and the store's address."""
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), tag, address


def fail_on_rank_zero_and_hang_elsewhere() -> None:
    """Rank 0 raises at once; the others wait forever, as peers of a failed rank do."""
    if os.environ["RANK"] == "0":
        raise ValueError("rank zero broke")
    time.sleep(3600)


def hang() -> None:
    """Never return, as a rank stuck in a collective does."""
    time.sleep(3600)


def crash_on_rank_zero(folder: str, times: int) -> int:
    """Rank 0 dies by SIGSEGV in the first ``times`` launches (counted by files in ``folder``)."""
    rank = int(os.environ["RANK"])
    crashes = Path(folder)
    if rank == 0 and len(list(crashes.iterdir())) < times:
        (crashes / f"crash{len(list(crashes.iterdir()))}").touch()
        os.kill(os.getpid(), signal.SIGSEGV)
    return rank
