"""Module for PyTorch neural network utilities."""

from importlib.metadata import PackageNotFoundError, version

from toolkit.nn._module_default_dict import ModuleDefaultDict
from toolkit.nn._pipeline_tie import PipelineTie, pipeline_clip_grad_norm_
from toolkit.nn._tied_linear import TiedLinear

try:
    __version__ = version("toolkit-nn")
except PackageNotFoundError:  # pragma: no cover - only when run from an uninstalled tree
    __version__ = "0+unknown"

__all__ = [
    "ModuleDefaultDict",
    "PipelineTie",
    "TiedLinear",
    "__version__",
    "pipeline_clip_grad_norm_",
]
