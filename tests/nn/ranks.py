"""The multi-rank harness of the tests: ranks as threads of this process, or as processes.

- ``run_threads(world_size, fn)`` runs ``fn(rank)`` on threads with torch's threaded process
  group. It is the default: fast, and every line it runs is seen by the mutation pass.
- ``run_processes(world_size, target, *args, timeout=...)`` starts one process per rank with
  gloo, as ``torchrun`` would. It is for what threads cannot run: documentation pages and
  examples written as scripts, and the launches that prove parity with real collectives. A
  target joins the gloo group with ``with process_group():``.

Both return each rank's result in rank order, and raise :class:`RanksFailedError` naming the
rank that failed.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "RankCrashedError",
    "RanksFailedError",
    "crashed",
    "loopback_interface",
    "process_group",
    "process_main",
    "run_processes",
    "run_threads",
]

T = TypeVar("T")
HOST = "127.0.0.1"
FAILURE_GRACE = 10.0
# How long a gloo collective of a launched rank waits for its peers before it fails.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=30)


class RanksFailedError(AssertionError):
    """A rank raised, exited abnormally or was still running at the time bound.

    Raised by both harnesses; for threads, the rank's own error is the cause.
    """


class RankCrashedError(RanksFailedError):
    """A rank process died by a crash signal of native code (see :func:`crashed`)."""


# The signals by which native code crashes, as opposed to the SIGKILL the harness sends.
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGFPE})


def crashed(returncode: int) -> bool:
    """Whether a process that exited with ``returncode`` died by a crash of native code."""
    return returncode < 0 and -returncode in CRASH_SIGNALS


# A collective that one rank never reaches would hang the others: the ranks still running this
# long after they started fail the test.
JOIN_TIMEOUT_S = 60.0


def run_threads(world_size: int, fn: Callable[[int], T]) -> list[T]:
    """Run ``fn(rank)`` on ``world_size`` threads, each a rank of one default process group.

    The collectives are those of torch's threaded backend (``all_gather_object``,
    ``broadcast``, ``all_reduce`` and DTensor's redistributions), so the per-rank code runs in
    a fraction of a second, in sight of coverage and mutation tools. Threads share torch's
    global random generator: build the models in the calling thread and give each rank its own
    (``copy.deepcopy``).

    The threaded backend copies with ``copy_``, which casts: a broadcast or all_reduce whose
    ranks pass tensors of different dtypes or sizes would work here and fail, or give garbage,
    on gloo or NCCL; so would a meta tensor, which it copies into as a no-op. Here each
    raises, as the rank's error.

    Returns what each rank returned, in rank order. If any rank raises, every rank's
    collectives are released and the error of the rank that raised first is raised again,
    chained: the others only fail because it left their collectives.
    """
    import torch  # noqa: PLC0415 - rank processes import this module: keep it light
    import torch.distributed as dist  # noqa: PLC0415
    from torch.testing._internal.distributed.multi_threaded_pg import (  # noqa: PLC0415
        AllReduce,
        Broadcast,
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    if dist.is_initialized():
        raise RuntimeError("run_threads needs no process group in the calling thread")
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
    works = {kind: kind.work for kind in (AllReduce, Broadcast)}
    for kind, work in works.items():
        kind.work = _matching(work)  # type: ignore[method-assign]
    try:
        # Daemon threads: a rank stuck in a collective cannot keep the test process alive.
        threads = [
            threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world_size)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    finally:
        for kind, work in works.items():
            kind.work = work  # type: ignore[method-assign]
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()
    if hung:
        raise RanksFailedError(f"ranks {hung} did not finish in {JOIN_TIMEOUT_S} s")
    if errors:
        rank, error = errors[0]
        raise RanksFailedError(f"rank {rank} raised {type(error).__name__}: {error}") from error
    return results  # type: ignore[return-value] # every rank returned


def _matching(work: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """``work`` of a threaded collective, refusing ranks whose tensors a real backend refuses.

    ``data`` holds each rank's tensors, by rank: they must agree in dtype and size, and hold
    data (not be on the meta device).
    """
    from torch.utils._pytree import tree_leaves  # noqa: PLC0415

    def checked(self: Any, data: Any) -> None:
        layouts = [[(t.dtype, t.numel()) for t in tree_leaves(ranks)] for ranks in data]
        if any(t.is_meta for ranks in data for t in tree_leaves(ranks)):
            raise RuntimeError(
                f"a rank of a {type(self).__name__} passes a meta tensor, which has no data to "
                "send or receive; gloo and NCCL refuse it"
            )
        if any(layout != layouts[0] for layout in layouts):
            raise RuntimeError(
                f"the ranks of a {type(self).__name__} pass tensors that differ in dtype or "
                f"size, (dtype, numel) by rank: {layouts}; gloo and NCCL need them equal"
            )
        work(self, data)

    return checked


def run_processes(
    world_size: int,
    target: Callable[..., Any],
    *args: Any,
    timeout: float,
    grace: float = FAILURE_GRACE,
) -> list[Any]:
    """Run ``target(*args)`` on ``world_size`` processes and return each rank's result, by rank.

    Each process gets the environment that ``torchrun`` gives its workers (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so code inside a rank,
    documentation examples included, calls ``dist.init_process_group("gloo")`` as it would under
    ``torchrun``. The rendezvous store is hosted in the calling process on a port the operating
    system picks (``TORCHELASTIC_USE_AGENT_STORE``, as ``torchrun``'s agent does), so no port is
    guessed, and gloo is kept on the loopback interface. Once ``timeout`` seconds have passed,
    every rank still running is killed: a hung collective cannot stall the suite. A launch in
    which a rank crashed in native code (a SIGSEGV inside torch or gloo, rare and unrelated to
    the code under test) runs once more; a second crash fails.

    Args:
        world_size: How many ranks to start.
        target: A module-level function, imported by name in each rank.
        *args: Picklable arguments, the same for every rank.
        timeout: Seconds after which ranks still running are killed.
        grace: Seconds the other ranks get to finish once one rank has failed.

    Returns:
        The return values of ``target``, indexed by rank.

    Raises:
        RanksFailedError: If a rank raised (its traceback is in the message), died, or was still
            running at the time bound; :class:`RankCrashedError` if a rank crashed twice.
    """
    try:
        return _launch(world_size, target, args, timeout, grace)
    except RankCrashedError:
        return _launch(world_size, target, args, timeout, grace)


def _launch(
    world_size: int, target: Callable[..., Any], args: tuple[Any, ...], timeout: float, grace: float
) -> list[Any]:
    """One launch of :func:`run_processes`."""
    import torch.distributed as dist  # noqa: PLC0415 - rank processes import this module: keep it light

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
        loopback = loopback_interface()
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
                    [
                        sys.executable,
                        "-c",
                        f"from {__name__} import process_main; process_main()",
                        tmp,
                    ],
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


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """Inside a rank of :func:`run_processes`: join its gloo group, and leave it at the end."""
    import torch.distributed as dist  # noqa: PLC0415 - rank processes import this module: keep it light

    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()


def loopback_interface() -> str | None:
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
        elif crashed(proc.returncode):
            name = signal.Signals(-proc.returncode).name
            problems.append(f"rank {rank} crashed ({name}); its output:\n{log}")
        elif timed_out and proc.returncode < 0:
            problems.append(f"rank {rank} was killed at the {timeout} s bound; its output:\n{log}")
        elif proc.returncode < 0:
            problems.append(f"rank {rank} was killed after a peer failed; its output:\n{log}")
        else:
            problems.append(f"rank {rank} exited with {proc.returncode}; its output:\n{log}")
    if any(crashed(proc.returncode) for proc in procs):
        raise RankCrashedError("\n\n".join(problems))
    if problems:
        raise RanksFailedError("\n\n".join(problems))
    return results


def process_main() -> None:
    """One rank process's entry point: call the target, write back its result or traceback."""
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
