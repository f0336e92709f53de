"""A small torchrun for the tests: run one function on N local ranks with a hard time bound.

``run_ranks(target, world_size, *args, timeout=...)`` starts one Python process per rank with the
environment that ``torchrun`` gives its workers (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), so code inside a rank, documentation examples included, calls
``dist.init_process_group("gloo")`` exactly as it would under ``torchrun``.

The rendezvous store is hosted here, in the calling process, on a port the operating system
picks, and the ranks join it as clients (``TORCHELASTIC_USE_AGENT_STORE``, as ``torchrun``'s agent
does). No port is guessed, so concurrent runs never collide, and gloo is kept on the loopback
interface. Once ``timeout`` seconds have passed, every rank still running is killed and
:class:`RanksFailedError` reports what each rank printed: a hung collective can never stall the
test suite.

Each rank calls ``target(*args)`` and sends back its return value, which must be picklable. If a
rank raises, the traceback is sent back instead and the whole run raises :class:`RanksFailedError`.
"""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["RanksFailedError", "rank_main", "run_ranks"]

HOST = "127.0.0.1"
FAILURE_GRACE = 10.0


class RanksFailedError(AssertionError):
    """Some rank raised, exited abnormally or was killed at the time bound."""


def run_ranks(
    target: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float,
    grace: float = FAILURE_GRACE,
) -> list[Any]:
    """Run ``target(*args)`` on ``world_size`` ranks and return each rank's result, by rank.

    Args:
        target: A module-level function, imported by name in each rank.
        world_size: How many ranks to start.
        *args: Picklable arguments, the same for every rank.
        timeout: Seconds after which ranks still running are killed.
        grace: Seconds the other ranks get to finish once one rank has failed.

    Returns:
        The return values of ``target``, indexed by rank.

    Raises:
        RanksFailedError: If a rank raised (its traceback is in the message), died, or was still
            running at the time bound.
    """
    import torch.distributed as dist  # noqa: PLC0415 - ranks import this module; keep it light

    store = dist.TCPStore(
        HOST,
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        workdir = Path(tmp)
        (workdir / "call.pkl").write_bytes(
            pickle.dumps((target.__module__, target.__qualname__, args))
        )
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": HOST,
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "OMP_NUM_THREADS": "1",
        }
        loopback = _loopback_interface()
        if loopback is not None and "GLOO_SOCKET_IFNAME" not in env:
            # Every rank is local: keep gloo off interfaces that the host name may resolve to.
            env["GLOO_SOCKET_IFNAME"] = loopback
        procs = []
        logs = []
        for rank in range(world_size):
            log = (workdir / f"rank{rank}.log").open("wb")
            logs.append(log)
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", f"from {__name__} import rank_main; rank_main()", tmp],
                    env=rank_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        deadline = time.monotonic() + timeout
        timed_out = failure_seen = False
        try:
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    timed_out = not failure_seen
                    break
                if not failure_seen and any(
                    _failed(workdir, rank, p) for rank, p in enumerate(procs)
                ):
                    failure_seen = True
                    # The others may wait forever for the rank that failed: give them a
                    # moment to report their own errors, then stop them.
                    deadline = min(deadline, time.monotonic() + grace)
                time.sleep(0.05)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            for proc in procs:
                proc.wait()
            for log in logs:
                log.close()
            del store
        return _collect(workdir, procs, timeout, timed_out=timed_out)


def _loopback_interface() -> str | None:
    """The name of the loopback network interface, such as ``lo`` or ``lo0``, if known."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if name in {"lo", "lo0"}), None)


def _failed(workdir: Path, rank: int, proc: subprocess.Popen[bytes]) -> bool:
    if proc.poll() is None:
        return False
    out = workdir / f"rank{rank}.out"
    return proc.returncode != 0 or not out.exists() or not pickle.loads(out.read_bytes())[0]


def _collect(
    workdir: Path, procs: list[subprocess.Popen[bytes]], timeout: float, *, timed_out: bool
) -> list[Any]:
    results: list[Any] = []
    problems: list[str] = []
    for rank, proc in enumerate(procs):
        out = workdir / f"rank{rank}.out"
        log = (workdir / f"rank{rank}.log").read_text(errors="replace")
        if out.exists():
            ok, value = pickle.loads(out.read_bytes())
            if ok:
                results.append(value)
                continue
            problems.append(f"rank {rank} raised:\n{value}")
        elif timed_out and proc.returncode < 0:
            problems.append(f"rank {rank} was killed at the {timeout} s bound; its output:\n{log}")
        elif proc.returncode < 0:
            problems.append(f"rank {rank} was killed after a peer failed; its output:\n{log}")
        else:
            problems.append(f"rank {rank} exited with {proc.returncode}; its output:\n{log}")
    if problems:
        raise RanksFailedError("\n\n".join(problems))
    return results


def rank_main() -> None:
    """The entry point of one rank: call the target and write back its result or traceback."""
    workdir = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    module_name, qualname, args = pickle.loads((workdir / "call.pkl").read_bytes())
    try:
        target: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part)
        result = (True, target(*args))
    except BaseException:
        result = (False, traceback.format_exc())
    tmp = workdir / f"rank{rank}.out.tmp"
    tmp.write_bytes(pickle.dumps(result))
    tmp.rename(workdir / f"rank{rank}.out")
    sys.stdout.flush()
    # Leave at once: a peer that failed may leave collectives or store clients waiting.
    os._exit(0)
