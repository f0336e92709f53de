"""TiedLinear under FSDP1 on gloo ranks: the tiny tied LM trains as one process does.

The FSDP2 and DDP setups run the same body on threaded ranks (``test_tied_linear_ranks.py``);
FSDP1 needs processes, since it asks the process group for a default device, which torch's
threaded group does not register.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from tests.nn.distributed.tiny_lm import check_setup, run_setup
from tests.nn.ranks import process_group, run_processes

SETUPS = ("fsdp1_orig_params", "fsdp1_flat_params")


def fsdp1_setups_in_a_process(checkpoint_dir: str) -> dict[str, dict[str, Any]]:
    """In each rank: every FSDP1 setup trained, saved and loaded, one after the other."""
    results = {}
    with process_group():
        for setup in SETUPS:
            results[setup] = run_setup(setup, dist.get_world_size(), Path(checkpoint_dir))
            dist.barrier()
    return results


def test_fsdp1_trains_saves_and_loads_as_one_process(tmp_path: Path) -> None:
    # One launch for both setups: starting ranks costs more than training the tiny model.
    ranks = run_processes(2, fsdp1_setups_in_a_process, str(tmp_path), timeout=240.0)
    for setup in SETUPS:
        check_setup([results[setup] for results in ranks], 2, setup)
