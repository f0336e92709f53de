"""Fixtures shared by the tests of ``toolkit.nn``."""

from __future__ import annotations

import importlib.metadata
import importlib.util
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


@pytest.fixture(scope="session")
def torchtune_tied_linear() -> type:
    """torchtune's own ``TiedLinear``, which ``toolkit.nn.TiedLinear`` replaces.

    torchtune no longer imports beside current torchao, so it is installed without its
    dependencies and only its ``torchtune/modules/tied_linear.py``, which needs torch alone,
    is executed.
    """
    path = "torchtune/modules/tied_linear.py"
    dist_files = importlib.metadata.distribution("torchtune").files or []
    (file,) = [f for f in dist_files if str(f) == path]
    spec = importlib.util.spec_from_file_location("torchtune_tied_linear", file.locate())
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TiedLinear  # type: ignore[no-any-return]
