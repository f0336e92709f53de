"""What each rank of a gloo launch runs: the checks of every module of ``CHECK_MODULES``.

Every function here runs inside a rank started by :func:`tests.nn.ranks.run_processes`,
so the process group is set up from the environment, exactly as under ``torchrun``. One launch
runs many checks one after another, because starting processes and importing torch costs far
more than training the tiny model.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tests.nn.distributed.tiny_lm import run_setup

__all__ = ["FSDP1_SETUPS", "main", "process_group", "run_script"]

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=30)
# The sharded-training setups that need processes: FSDP1 asks the process group for its
# default device, which torch's threaded group does not register. The others run on threads.
FSDP1_SETUPS = ("fsdp1_orig_params", "fsdp1_flat_params")


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """Join the gloo process group described by the environment, and leave it at the end."""
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()


# Entry points: one launch each. -----------------------------------------------------------

# The modules whose checks every launch runs, after the setups. Each defines
# ``checks(world_size: int, checkpoint_dir: Path) -> dict[str, Callable[[], Any]]``, returning
# the checks it runs at that world size under names prefixed by its own subject
# (``"tp/..."``), and ``WORLD_SIZES``, the world sizes at which it has any.
CHECK_MODULES: tuple[str, ...] = ("tests.nn.distributed.pipeline_checks",)


def extra_checks(world_size: int, checkpoint_dir: Path) -> dict[str, Callable[[], Any]]:
    """The checks that the modules of :data:`CHECK_MODULES` run at ``world_size``."""
    checks: dict[str, Callable[[], Any]] = {}
    for name in CHECK_MODULES:
        module = importlib.import_module(name)
        if world_size in module.WORLD_SIZES:
            checks.update(module.checks(world_size, checkpoint_dir))
    return checks


def main(world_size: int, setups: list[str], checkpoint_dir: str) -> dict[str, Any]:
    """Run the named setups of ``tiny_lm`` (as ``"setup/<name>"``), then the further checks.

    A check that raises is recorded as its traceback, so one failure does not hide the rest.
    """
    out: dict[str, Any] = {}
    checks: dict[str, Callable[[], Any]] = {
        f"setup/{name}": (lambda name=name: run_setup(name, world_size, Path(checkpoint_dir)))
        for name in setups
    }
    checks.update(extra_checks(world_size, Path(checkpoint_dir)))
    with process_group():
        for name, check in checks.items():
            try:
                out[name] = check()
            except Exception:
                out[name] = RuntimeError(traceback.format_exc())
            dist.barrier()
    return out


def run_script(sources: list[tuple[int, str]], filename: str) -> dict[str, object]:
    """Run a page's code blocks in order in one namespace, as one ``torchrun`` script.

    Each block is padded to its line on the page, so tracebacks point at the page. Returns the
    namespace's picklable values, for the tests to inspect.
    """
    namespace: dict[str, object] = {"__name__": "__main__"}
    for line, source in sources:
        exec(compile("\n" * (line - 1) + source, filename, "exec"), namespace)
    return {
        name: value
        for name, value in namespace.items()
        if isinstance(value, (str, int, float, list, tuple)) and not name.startswith("__")
    }
