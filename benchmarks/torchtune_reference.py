"""torchtune's own ``TiedLinear``, loaded from its single file.

``toolkit.nn.TiedLinear`` replaces ``torchtune.modules.TiedLinear``; the drop-in tests and the
benchmarks compare with the original. The torchtune package no longer imports beside current
torchao, so the nox sessions install ``torchtune==0.6.1`` without its dependencies, and this
module executes only ``torchtune/modules/tied_linear.py``, which needs torch alone.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

__all__ = ["TIED_LINEAR_FILE", "load_tied_linear"]

TIED_LINEAR_FILE = "torchtune/modules/tied_linear.py"


def load_tied_linear() -> tuple[type, str]:
    """Load torchtune's ``TiedLinear`` class from the installed distribution's file.

    Returns:
        The class, and the installed torchtune version.

    Raises:
        ImportError: If torchtune is not installed, or its distribution has no
            ``torchtune/modules/tied_linear.py``.
    """
    try:
        dist = importlib.metadata.distribution("torchtune")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(
            "torchtune is not installed; install it without its dependencies: "
            "pip install --no-deps torchtune==0.6.1"
        ) from None
    files = [f for f in dist.files or () if str(f) == TIED_LINEAR_FILE]
    if not files:
        raise ImportError(f"torchtune {dist.version} has no {TIED_LINEAR_FILE}")
    path = str(dist.locate_file(files[0]))
    spec = importlib.util.spec_from_file_location("torchtune_tied_linear", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TiedLinear, dist.version
