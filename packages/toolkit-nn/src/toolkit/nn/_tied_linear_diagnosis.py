"""Why a TiedLinear call failed: the errors that name the cause and the fix.

Everything here runs only after a call has failed (or, for ``cross_entropy``, on a weight that
is a DTensor), so the normal path pays nothing for it and compiles without a graph break.
"""

from __future__ import annotations

import torch
from torch import nn

from toolkit.nn._common import _describe, _is_dtensor


def explain_failure(tied_module: nn.Module, x: object, weight: object) -> Exception | None:
    """Return a clearer error for a failed call, or None to re-raise the original."""
    owner = type(tied_module).__name__
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return None
    if _is_dtensor(weight) and not _is_dtensor(x):
        if resharded_by_fsdp(tied_module, weight):
            return _sharded_weight_error(tied_module, weight)
        return _unprepared_input_error(tied_module, weight)
    if weight.dim() == 2 and (x.dim() == 0 or x.shape[-1] != weight.shape[1]):
        return RuntimeError(
            f"TiedLinear input has shape {tuple(x.shape)}, but {owner}.weight has shape "
            f"{tuple(weight.shape)}: the input's last dimension must equal "
            f"in_features={weight.shape[1]}; reshape the input or tie to the right module"
        )
    return None


def resharded_by_fsdp(tied_module: nn.Module, weight: torch.Tensor) -> bool:
    """Whether FSDP2 resharded ``weight``, rather than tensor parallelism sharding it.

    Both leave a DTensor with the same placements, so the modules tell them apart.
    ``fully_shard`` turns each module it is applied to into an ``FSDPModule`` and marks every
    module it manages, its units' descendants included, with ``_is_fsdp_managed_module``
    (which TorchDynamo reads too). A managed module holds a DTensor weight while unsharded
    only if tensor parallelism distributed it (``distribute_module``, which every torch
    ``ParallelStyle`` that shards uses, marks it ``_distribute_module_applied``), and then on
    the tensor-parallel mesh alone; resharded, FSDP2 puts it on its own mesh joined with that
    one, which has more dimensions.
    """
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415 - only once a call failed

    managed = isinstance(tied_module, FSDPModule) or getattr(
        tied_module, "_is_fsdp_managed_module", None
    )
    if not managed:
        return False
    tensor_parallel = getattr(tied_module, "_distribute_module_applied", None)
    return weight.device_mesh.ndim > 1 or not tensor_parallel  # type: ignore[attr-defined]


def _unprepared_input_error(tied_module: nn.Module, weight: torch.Tensor) -> RuntimeError:
    """The error for a plain input to a head whose weight tensor parallelism has sharded."""
    placements = tuple(weight.placements)  # type: ignore[attr-defined]
    return RuntimeError(
        f"TiedLinear got a plain-tensor input, but the weight of the tied module "
        f"{_describe(tied_module)} is sharded by tensor parallelism (a DTensor with "
        f"placements {placements}): the head's input must be a DTensor on the same device "
        "mesh. Prepare the head's input by applying toolkit.nn.TiedLinearParallel to the "
        "head's linear module, parallelize_module(head.linear, tp_mesh, "
        "TiedLinearParallel()), with input_layouts=Shard(1) under sequence parallelism; or "
        "apply torch's PrepareModuleInput(input_layouts=(Replicate(), None), "
        "desired_input_layouts=(Replicate(), None)) to head.linear."
    )


def _sharded_weight_error(tied_module: nn.Module, weight: torch.Tensor) -> RuntimeError:
    """The error for a weight that FSDP2 has sharded again before TiedLinear reads it."""
    tied = _describe(tied_module)
    placements = weight.placements  # type: ignore[attr-defined] # a DTensor here
    return RuntimeError(
        f"TiedLinear cannot use the weight of the tied module {tied}: that weight is sharded "
        f"(a DTensor with placements {tuple(placements)}) when TiedLinear reads it, and the "
        "input is a plain tensor. This happens when the FSDP2 unit (fully_shard) holding the "
        "tied module reshards its parameters after a forward that ends before TiedLinear "
        "runs: the tied module is its own unit, or is grouped only with modules that do not "
        "call TiedLinear. Keep the tied module in the unit whose forward calls TiedLinear, "
        "group it with the module that calls TiedLinear in one unit "
        "(fully_shard([tied_module, caller])), or keep its weight unsharded after forward "
        "with fully_shard(tied_module, reshard_after_forward=False)."
    )


def dtensor_cross_entropy_error(tied_module: nn.Module, weight: torch.Tensor) -> RuntimeError:
    """The error for ``cross_entropy`` on a DTensor weight it cannot take."""
    tied = _describe(tied_module)
    placements = weight.placements  # type: ignore[attr-defined] # a DTensor here
    return RuntimeError(
        f"TiedLinear.cross_entropy cannot use the weight of the tied module {tied}: it is a "
        f"DTensor with placements {tuple(placements)}, and the chunked loss needs the whole "
        "weight on every rank (a plain tensor, or a DTensor replicated on every mesh "
        "dimension, Replicate()), or the vocabulary sharded by tensor parallelism on a "
        "1-D mesh (Shard(0)). Under FSDP2, call cross_entropy inside the forward of the "
        "unit that holds the tied module, or register the method that calls it with "
        "torch.distributed.fsdp.register_fsdp_forward_method(model, 'method_name'). Under "
        "tensor parallelism, shard the tied module on the vocabulary (RowwiseParallel on "
        "an embedding) on the tensor-parallel mesh, or compute the logits with head(x) and "
        "take F.cross_entropy of them inside torch.distributed.tensor.parallel.loss_parallel()."
    )
