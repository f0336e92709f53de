"""TiedLinear under FSDP1 on gloo ranks: the tiny tied LM trains as one process does.

The FSDP2 and DDP setups run the same body on threaded ranks (``test_tied_linear_ranks.py``);
FSDP1 needs processes (see ``workers.FSDP1_SETUPS``).
"""

from __future__ import annotations

import pytest

from tests.nn.distributed.tiny_lm import check_setup
from tests.nn.distributed.workers import FSDP1_SETUPS
from tests.nn.distributed.worlds import Worlds, per_rank


@pytest.mark.parametrize("setup", FSDP1_SETUPS)
def test_fsdp1_trains_saves_and_loads_as_one_process(worlds: Worlds, setup: str) -> None:
    check_setup(per_rank(worlds, 2, f"setup/{setup}"), 2, setup)
