"""Fixtures shared by the tests of ``toolkit.nn``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

# Imported here, once, at collection: this import takes seconds, and a test that paid for it
# would look like a hang to mutmut, which forks each mutant's worker after collecting.
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@pytest.fixture
def one_rank() -> Iterator[DeviceMesh]:
    """A default gloo process group of this process alone, and its 1-D CPU mesh."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
