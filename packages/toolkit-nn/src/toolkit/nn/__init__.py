"""PyTorch neural-network utilities: ModuleDefaultDict, TiedLinear and their distributed kin.

The public names: ModuleDefaultDict, create_entries, sync_entries, TiedLinear,
TiedLinearParallel, PipelineTie, pipeline_clip_grad_norm_, clip_grad_norm_ and
tie_output_embeddings.
"""

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from toolkit.nn._clip_grad import clip_grad_norm_, pipeline_clip_grad_norm_
from toolkit.nn._entries import create_entries, sync_entries
from toolkit.nn._module_default_dict import ModuleDefaultDict
from toolkit.nn._pipeline_tie import PipelineTie
from toolkit.nn._tied_linear import TiedLinear
from toolkit.nn._transformers import tie_output_embeddings

if TYPE_CHECKING:
    from toolkit.nn._tensor_parallel import TiedLinearParallel

try:
    __version__ = version("toolkit-nn")
except PackageNotFoundError:  # pragma: no cover - only when run from an uninstalled tree
    __version__ = "0+unknown"

__all__ = [
    "ModuleDefaultDict",
    "PipelineTie",
    "TiedLinear",
    "TiedLinearParallel",
    "__version__",
    "clip_grad_norm_",
    "create_entries",
    "pipeline_clip_grad_norm_",
    "sync_entries",
    "tie_output_embeddings",
]


# Public names print, pickle and appear in torch's errors as toolkit.nn.X, where users find
# them, not under the private module that defines them (TiedLinearParallel, loaded lazily,
# says so in its own module).
for _public in (
    ModuleDefaultDict,
    PipelineTie,
    TiedLinear,
    clip_grad_norm_,
    create_entries,
    pipeline_clip_grad_norm_,
    sync_entries,
    tie_output_embeddings,
):
    _public.__module__ = __name__
del _public


def __getattr__(name: str) -> object:
    # The tensor-parallel style needs torch.distributed.tensor, a large import that most
    # users of this package never need: it is loaded on first use (PEP 562).
    if name == "TiedLinearParallel":
        from toolkit.nn._tensor_parallel import TiedLinearParallel  # noqa: PLC0415

        return TiedLinearParallel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
