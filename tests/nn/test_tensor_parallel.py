"""TiedLinearParallel in one process: its arguments, its name, and its errors on a 1-rank mesh.

Its logits, gradients and training on several ranks are tested in
``test_tensor_parallel_ranks.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel, parallelize_module

import toolkit.nn
from toolkit.nn import TiedLinear, TiedLinearParallel


def test_the_arguments_are_kept_as_torch_styles_keep_them() -> None:
    style = TiedLinearParallel()
    assert isinstance(style, ParallelStyle)
    assert (style.input_layouts, style.output_layouts) == ((Replicate(),), (Shard(-1),))
    assert (style.desired_input_layouts, style.use_local_output) == ((Replicate(),), False)
    style = TiedLinearParallel(
        input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True
    )
    assert style.desired_input_layouts == (Replicate(),)
    assert repr(style) == (
        "TiedLinearParallel(input_layouts=(Shard(dim=1),), output_layouts=(Replicate(),), "
        "use_local_output=True)"
    )


@pytest.mark.parametrize("kwargs", [{}, {"output_layouts": Shard(-1)}], ids=["default", "shard-1"])
def test_a_local_tensor_of_vocabulary_sharded_logits_is_refused_naming_both_fixes(
    kwargs: dict[str, object],
) -> None:
    """A plain loss on this rank's slice of the vocabulary is silently wrong."""
    with pytest.raises(ValueError, match=r"^TiedLinearParallel\(use_local_output=True") as info:
        TiedLinearParallel(use_local_output=True, **kwargs)  # type: ignore[arg-type]
    assert str(info.value) == (  # the one golden message
        "TiedLinearParallel(use_local_output=True, output_layouts=Shard(dim=-1)) would return "
        "this rank's slice of the vocabulary as a plain tensor, and a loss computed on it is "
        "silently wrong. Keep use_local_output=False and compute the loss inside "
        "torch.distributed.tensor.parallel.loss_parallel(), or pass output_layouts=Replicate() "
        "for the full logits"
    )


def test_the_style_is_a_lazy_name_of_the_package_that_prints_as_one() -> None:
    assert repr(TiedLinearParallel) == "<class 'toolkit.nn.TiedLinearParallel'>"
    assert "TiedLinearParallel" not in vars(toolkit.nn)  # looked up on each use
    assert toolkit.nn.TiedLinearParallel is TiedLinearParallel
    with pytest.raises(AttributeError, match=r"^module 'toolkit.nn' has no attribute 'Nope'$"):
        toolkit.nn.Nope  # noqa: B018


@pytest.mark.parametrize("module", [nn.Linear(8, 17, bias=False), nn.Embedding(17, 8)])
def test_the_style_on_another_module_names_its_type_and_the_right_module(
    one_rank: DeviceMesh, module: nn.Module
) -> None:
    with pytest.raises(TypeError) as info:
        parallelize_module(module, one_rank, TiedLinearParallel())
    assert str(info.value) == (  # the one golden message
        f"TiedLinearParallel applies to a TiedLinear's linear module, got {type(module).__name__}; "
        "pass the head's linear module: "
        "parallelize_module(head.linear, tp_mesh, TiedLinearParallel())"
    )


def test_a_tied_module_left_unsharded_names_the_cause_and_both_fixes(one_rank: DeviceMesh) -> None:
    head = TiedLinear(nn.Embedding(17, 8))
    parallelize_module(head.linear, one_rank, TiedLinearParallel())
    with pytest.raises(RuntimeError) as info:
        head(torch.randn(2, 8))
    assert str(info.value) == (  # the one golden message
        "TiedLinearParallel prepared the head's input for tensor parallelism, but the weight of "
        "the tied module is a plain tensor, not sharded on the device mesh: the tied module was "
        "not parallelised. Shard it on the same mesh (RowwiseParallel on the embedding shards "
        "its weight on the vocabulary), or remove TiedLinearParallel from head.linear."
    )


def test_logits_sharded_on_their_last_dimension_are_refused_as_a_local_tensor(
    one_rank: DeviceMesh,
) -> None:
    """Shard(-1) is refused when the style is made; Shard(1) of 2-D logits when it is called."""
    emb = nn.Embedding(17, 8)
    parallelize_module(emb, one_rank, RowwiseParallel(input_layouts=Replicate()))
    head = TiedLinear(emb)
    style = TiedLinearParallel(output_layouts=Shard(1), use_local_output=True)
    parallelize_module(head.linear, one_rank, style)
    assert head(torch.randn(2, 3, 8)).shape == (2, 3, 17)  # the sequence: allowed
    with pytest.raises(ValueError, match=r"output_layouts=Shard\(dim=1\)\) would return"):
        head(torch.randn(6, 8))
