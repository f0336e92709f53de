"""TiedLinear's error messages and repr, matched whole.

A user reads these to fix a call, so every part counts: the type names, the shapes, the sizes
and the fix. Each test writes the expected text out in full, so that a changed word, type name
or number fails it. The sharded-weight error also runs here on one gloo rank, where a DTensor
needs no other process; ``tests/nn/distributed`` checks it again on two ranks.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

# Imported here, once, rather than in the tests: this import takes seconds, and a test that
# paid for it would look like a hang to mutmut, which forks each mutant's worker after
# collecting the tests.
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from toolkit.nn import TiedLinear


def sharded_weight_message(tied: str, placements: str) -> str:
    """The whole error for a weight that FSDP2 resharded before TiedLinear read it."""
    return (
        f"TiedLinear cannot use the weight of the tied module {tied}: that weight is "
        f"sharded (a DTensor with placements {placements}) when TiedLinear reads it, and the "
        "input is a plain tensor. This happens when the FSDP2 unit (fully_shard) holding the "
        "tied module reshards its parameters after a forward that ends before TiedLinear "
        "runs: the tied module is its own unit, or is grouped only with modules that do not "
        "call TiedLinear. Keep the tied module in the unit whose forward calls TiedLinear, "
        "group it with the module that calls TiedLinear in one unit "
        "(fully_shard([tied_module, caller])), or keep its weight unsharded after forward "
        "with fully_shard(tied_module, reshard_after_forward=False)."
    )


def test_a_missing_weight_names_the_type_and_the_fix_and_hides_the_lookup() -> None:
    with pytest.raises(AttributeError) as info:
        TiedLinear(nn.ReLU())
    assert str(info.value) == (
        "TiedLinear needs a module with a 'weight' attribute to tie to, but ReLU has none; "
        "pass the module that owns the shared weight, such as the token embedding"
    )
    # ``from None``: the failed attribute lookup inside TiedLinear is noise to the caller.
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        (types.SimpleNamespace(weight=nn.Parameter(torch.ones(2, 2))), "SimpleNamespace"),
        (TiedLinear(nn.Embedding(2, 2)), "TiedLinear"),
    ],
)
def test_something_that_is_not_a_module_names_its_type_and_the_fix(
    value: object, type_name: str
) -> None:
    with pytest.raises(TypeError) as info:
        TiedLinear(value)  # type: ignore[arg-type]
    assert str(info.value) == (
        f"TiedLinear ties to an nn.Module, got {type_name}, which has a 'weight' but is not a "
        "Module; pass the nn.Module that owns the weight, such as the nn.Embedding"
    )


class _IntWeight(nn.Module):
    weight = 3


@pytest.mark.parametrize(
    ("module", "owner", "type_name"),
    [
        (nn.LayerNorm(4, elementwise_affine=False), "LayerNorm", "NoneType"),
        (_IntWeight(), "_IntWeight", "int"),
    ],
)
def test_a_weight_that_is_not_a_tensor_names_owner_and_type(
    module: nn.Module, owner: str, type_name: str
) -> None:
    with pytest.raises(TypeError) as info:
        TiedLinear(module)
    assert str(info.value) == (
        f"TiedLinear needs {owner}.weight to be a 2-D tensor, got {type_name}; tie to a module "
        "whose weight is a tensor"
    )


@pytest.mark.parametrize(
    ("module", "text"),
    [
        (nn.LayerNorm(4), "LayerNorm.weight to be 2-D (out_features, in_features), got shape (4,)"),
        (
            nn.Conv1d(2, 3, 5),
            "Conv1d.weight to be 2-D (out_features, in_features), got shape (3, 2, 5)",
        ),
    ],
)
def test_a_weight_that_is_not_2d_names_owner_shape_and_fix(module: nn.Module, text: str) -> None:
    with pytest.raises(ValueError, match=r"^TiedLinear needs ") as info:
        TiedLinear(module)
    assert str(info.value) == (
        f"TiedLinear needs {text}; tie to a module with a matrix weight, such as nn.Embedding "
        "or nn.Linear"
    )


@pytest.mark.parametrize(
    ("shape", "shown"), [((2, 4), "(2, 4)"), ((4,), "(4,)"), ((), "()"), ((3, 0, 5), "(3, 0, 5)")]
)
def test_a_wrong_input_width_names_both_shapes_in_features_and_the_fix(
    shape: tuple[int, ...], shown: str
) -> None:
    with pytest.raises(RuntimeError) as info:
        TiedLinear(nn.Embedding(7, 3))(torch.randn(shape))
    assert str(info.value) == (
        f"TiedLinear input has shape {shown}, but Embedding.weight has shape (7, 3): the "
        "input's last dimension must equal in_features=3; reshape the input or tie to the "
        "right module"
    )
    # torch's own error stays attached as the cause.
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "TiedLinear" not in str(info.value.__cause__)


def test_the_shape_error_names_a_weight_read_through_the_attribute() -> None:
    # A weight that is not a registered Parameter (here a buffer) takes the attribute path.
    owner = nn.Module()
    owner.register_buffer("weight", torch.randn(5, 2))
    with pytest.raises(RuntimeError) as info:
        TiedLinear(owner)(torch.randn(3))
    assert str(info.value) == (
        "TiedLinear input has shape (3,), but Module.weight has shape (5, 2): the input's "
        "last dimension must equal in_features=2; reshape the input or tie to the right module"
    )


def test_a_weight_that_is_no_longer_2d_names_its_shape_and_the_fix() -> None:
    emb = nn.Embedding(7, 3)
    head = TiedLinear(emb)
    emb.weight = nn.Parameter(torch.randn(7, 3, 2))
    with pytest.raises(ValueError, match="2-D") as info:
        head(torch.randn(2, 3))
    assert str(info.value) == (
        "TiedLinear needs Embedding.weight to be 2-D (out_features, in_features) when called, "
        "got shape (7, 3, 2); a weight assigned to the tied module after TiedLinear was built "
        "must be 2-D too"
    )


def test_a_failure_on_a_non_tensor_input_keeps_torchs_error() -> None:
    head = TiedLinear(nn.Embedding(7, 3))
    with pytest.raises(TypeError) as info:
        head([1.0, 2.0, 3.0])  # type: ignore[arg-type]
    assert "TiedLinear" not in str(info.value)


def test_a_failure_after_a_hook_made_the_tensors_keeps_torchs_error() -> None:
    # A forward pre-hook on ``head.linear`` may turn what the caller passed into tensors. The
    # diagnosis sees the caller's input, not a tensor, so it leaves torch's error alone.
    head = TiedLinear(nn.Embedding(7, 3))

    def to_tensors(module: nn.Module, args: tuple[object, ...]) -> tuple[object, ...]:
        x, weight = args
        return torch.as_tensor(x, dtype=torch.float32), weight

    head.linear.register_forward_pre_hook(to_tensors)
    assert head([1.0, 2.0, 3.0]).shape == (7,)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError) as info:
        head([1.0, 2.0])  # type: ignore[arg-type]
    assert "TiedLinear" not in str(info.value)
    assert info.value.__cause__ is None


def test_the_repr_of_a_lazy_weight_says_uninitialized_for_both_features() -> None:
    head = TiedLinear(nn.LazyLinear(5, bias=False))
    assert repr(head) == (
        "TiedLinear(in_features=<uninitialized>, out_features=<uninitialized>, "
        "tied_to=LazyLinear(in_features=0, out_features=5, bias=False).weight)"
    )


def test_the_repr_reads_features_live_and_names_the_owner() -> None:
    lin = nn.Linear(3, 4)
    head = TiedLinear(lin)
    assert repr(head) == (
        "TiedLinear(in_features=3, out_features=4, "
        "tied_to=Linear(in_features=3, out_features=4, bias=True).weight)"
    )
    lin.weight = nn.Parameter(torch.randn(6, 2))
    assert repr(head) == (
        "TiedLinear(in_features=2, out_features=6, "
        "tied_to=Linear(in_features=3, out_features=4, bias=True).weight)"
    )


# One gloo rank: a DTensor weight without other processes -----------------------------------


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[DeviceMesh]:
    """A one-rank gloo group and its CPU mesh, torn down after the test."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _sharded_embedding(mesh: DeviceMesh) -> nn.Embedding:
    emb = nn.Embedding(7, 3)
    emb.weight = nn.Parameter(distribute_tensor(emb.weight.detach(), mesh, [Shard(0)]))
    return emb


def test_a_sharded_weight_with_a_plain_input_names_the_placement_and_every_fix(
    one_rank: DeviceMesh,
) -> None:
    emb = nn.Embedding(7, 3)
    fully_shard(emb, mesh=one_rank)  # the weight stays sharded until a forward unshards it
    head = TiedLinear(emb)
    with pytest.raises(RuntimeError) as info:
        head(torch.randn(2, 3))
    assert str(info.value) == sharded_weight_message("FSDPEmbedding(7, 3)", "(Shard(dim=0),)")
    assert "mixed torch.Tensor and DTensor" in str(info.value.__cause__)


def test_a_weight_sharded_outside_fsdp2_with_a_plain_input_names_the_tensor_parallel_fix(
    one_rank: DeviceMesh,
) -> None:
    head = TiedLinear(_sharded_embedding(one_rank))
    with pytest.raises(RuntimeError) as info:
        head(torch.randn(2, 3))
    assert str(info.value) == (
        "TiedLinear got a plain-tensor input, but the weight of the tied module "
        "Embedding(7, 3) is sharded by tensor parallelism (a DTensor with placements "
        "(Shard(dim=0),)): the head's input must be a DTensor on the same device mesh. "
        "Prepare the head's input by applying toolkit.nn.TiedLinearParallel to the head's "
        "linear module, parallelize_module(head.linear, tp_mesh, TiedLinearParallel()), with "
        "input_layouts=Shard(1) under sequence parallelism; or apply torch's "
        "PrepareModuleInput(input_layouts=(Replicate(), None), "
        "desired_input_layouts=(Replicate(), None)) to head.linear."
    )
    assert "FSDP" not in str(info.value)


def test_a_wrong_width_with_both_input_and_weight_dtensors_is_a_shape_error(
    one_rank: DeviceMesh,
) -> None:
    head = TiedLinear(_sharded_embedding(one_rank))
    x = distribute_tensor(torch.randn(2, 4), one_rank, [Replicate()])
    with pytest.raises(RuntimeError) as info:
        head(x)
    # Both are DTensors, so the weight is not "sharded while the input is plain": the
    # message is the shape error.
    assert str(info.value) == (
        "TiedLinear input has shape (2, 4), but Embedding.weight has shape (7, 3): the "
        "input's last dimension must equal in_features=3; reshape the input or tie to the "
        "right module"
    )


def test_a_weight_replaced_by_a_non_tensor_names_the_new_type() -> None:
    emb = nn.Embedding(7, 3)
    head = TiedLinear(emb)
    del emb.weight
    emb.weight = 2.5  # a plain attribute now, read through the module
    with pytest.raises(TypeError) as info:
        head(torch.randn(2, 3))
    assert str(info.value) == (
        "TiedLinear needs Embedding.weight to be a 2-D tensor when called, got float; a weight "
        "assigned to the tied module after TiedLinear was built must be a 2-D tensor too"
    )
