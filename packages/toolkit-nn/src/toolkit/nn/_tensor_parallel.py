"""TiedLinearParallel: the tensor-parallel style for a TiedLinear head."""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from toolkit.nn._common import _Linear

__all__ = ["TiedLinearParallel"]


class TiedLinearParallel(ParallelStyle):
    """A ``parallelize_module`` style that runs a TiedLinear head on a vocabulary-sharded weight.

    Apply it to the head's ``linear`` module once the tied embedding is sharded on the
    vocabulary (``RowwiseParallel``): it shards nothing, and prepares the head's input and
    logits around the live read of the tied weight. The input is redistributed to
    ``Replicate()`` and the logits to ``output_layouts``. The
    [tensor parallelism guide][tensor-parallelism-with-a-tied-head] has the recipe, sequence
    parallelism, the chunked loss and what each layout costs.

    Args:
        input_layouts: The layout of a plain-tensor input on the mesh (a DTensor input
            keeps its own). Default: ``Replicate()``.
        output_layouts: The layout of the logits. Default: ``Shard(-1)``, the
            vocabulary-sharded logits that ``loss_parallel()`` takes.
        use_local_output: Return this rank's local tensor instead of the DTensor. Default:
            False; refused for logits sharded on the vocabulary, whose local loss is wrong.

    Raises:
        TypeError: If applied to anything but a TiedLinear's ``linear`` module.
        ValueError: If ``use_local_output`` is True for logits sharded on their last
            dimension: at construction for ``Shard(-1)``, at the call otherwise.
        RuntimeError: At the call, if the tied module's weight is not a DTensor.

    Added in version v3.58.0.

    Examples:
        A sketch on a tensor-parallel mesh; the guide has the full, tested version:

        ```python
        parallelize_module(model, tp_mesh, {"emb": RowwiseParallel(input_layouts=Replicate())})
        parallelize_module(model.head.linear, tp_mesh, TiedLinearParallel())
        with loss_parallel():
            loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
            loss.backward()
        ```
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = False,
    ) -> None:
        super().__init__()
        self.input_layouts = (input_layouts or Replicate(),)
        self.output_layouts = (output_layouts or Shard(-1),)
        if use_local_output and self.output_layouts == (Shard(-1),):
            raise ValueError(_local_vocabulary(Shard(-1)))
        # The head multiplies a replicated input by the vocabulary rows of this rank.
        self.desired_input_layouts = (Replicate(),)
        self.use_local_output = use_local_output

    @staticmethod
    def _prepare_input_fn(
        input_layouts: tuple[Placement, ...],
        desired_input_layouts: tuple[Placement, ...],
        module: nn.Module,
        inputs: tuple[object, ...],
        device_mesh: DeviceMesh,
    ) -> tuple[object, ...]:
        x, weight = inputs
        if not isinstance(weight, DTensor):
            raise RuntimeError(
                "TiedLinearParallel prepared the head's input for tensor parallelism, but the "
                "weight of the tied module is a plain tensor, not sharded on the device mesh: "
                "the tied module was not parallelised. Shard it on the same mesh "
                "(RowwiseParallel on the embedding shards its weight on the vocabulary), or "
                "remove TiedLinearParallel from head.linear."
            )
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, input_layouts)  # type: ignore[arg-type]
        if x.placements != desired_input_layouts:
            x = x.redistribute(placements=desired_input_layouts, async_op=True)
        return (x, weight)

    @staticmethod
    def _prepare_output_fn(
        output_layouts: tuple[Placement, ...],
        use_local_output: bool,
        module: nn.Module,
        outputs: DTensor,
        device_mesh: DeviceMesh,
    ) -> object:
        layout = output_layouts[0]
        last = outputs.ndim - 1
        if use_local_output and isinstance(layout, Shard) and layout.dim % outputs.ndim == last:
            raise ValueError(_local_vocabulary(layout))
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=True)
        return outputs.to_local() if use_local_output else outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, _Linear):
            raise TypeError(
                f"TiedLinearParallel applies to a TiedLinear's linear module, got "
                f"{type(module).__name__}; pass the head's linear module: "
                "parallelize_module(head.linear, tp_mesh, TiedLinearParallel())"
            )
        # torch annotates the hooks as returning None, but uses what they return, as its
        # own styles do.
        return distribute_module(
            module,
            device_mesh,
            input_fn=partial(  # type: ignore[arg-type]
                self._prepare_input_fn, self.input_layouts, self.desired_input_layouts
            ),
            output_fn=partial(  # type: ignore[arg-type]
                self._prepare_output_fn, self.output_layouts, self.use_local_output
            ),
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts}, "
            f"output_layouts={self.output_layouts}, use_local_output={self.use_local_output})"
        )


# Where users find it, as every public name of the package (see __init__.py).
TiedLinearParallel.__module__ = "toolkit.nn"


def _local_vocabulary(layout: Shard) -> str:
    """The error for a plain local tensor of logits sharded on the vocabulary by ``layout``."""
    return (
        f"TiedLinearParallel(use_local_output=True, output_layouts={layout!r}) would return "
        "this rank's slice of the vocabulary as a plain tensor, and a loss computed on it "
        "is silently wrong. Keep use_local_output=False and compute the loss inside "
        "torch.distributed.tensor.parallel.loss_parallel(), or pass "
        "output_layouts=Replicate() for the full logits"
    )
