"""TiedLinearParallel in one process: its defaults, its repr, and its collectives left in flight.

Its logits, gradients and errors on ranks are tested in ``test_tensor_parallel_ranks.py`` and
``tests/nn/distributed/test_tensor_parallel.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.distributed.tensor.placement_types import Placement

import toolkit.nn
from tests.nn.ranks import run_threads
from toolkit.nn import TiedLinear, TiedLinearParallel


def test_the_defaults_give_vocabulary_sharded_logits_as_dtensors() -> None:
    style = TiedLinearParallel()
    assert isinstance(style, ParallelStyle)
    assert style.input_layouts == (Replicate(),)
    assert style.desired_input_layouts == (Replicate(),)
    assert style.output_layouts == (Shard(-1),)
    assert style.use_local_output is False


def test_the_arguments_are_kept_as_torch_styles_keep_them() -> None:
    style = TiedLinearParallel(
        input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True
    )
    assert style.input_layouts == (Shard(1),)
    assert style.desired_input_layouts == (Replicate(),)
    assert style.output_layouts == (Replicate(),)
    assert style.use_local_output is True
    assert repr(style) == (
        "TiedLinearParallel(input_layouts=(Shard(dim=1),), output_layouts=(Replicate(),), "
        "use_local_output=True)"
    )


@pytest.mark.parametrize("kwargs", [{}, {"output_layouts": Shard(-1)}], ids=["default", "shard-1"])
def test_a_local_tensor_of_vocabulary_sharded_logits_is_refused_naming_both_fixes(
    kwargs: dict[str, object],
) -> None:
    """A plain loss on this rank's slice of the vocabulary is silently wrong, so the
    combination is refused at once."""
    with pytest.raises(ValueError, match=r"^TiedLinearParallel\(use_local_output=True") as info:
        TiedLinearParallel(use_local_output=True, **kwargs)  # type: ignore[arg-type]
    assert str(info.value) == (
        "TiedLinearParallel(use_local_output=True, output_layouts=Shard(dim=-1)) would return "
        "this rank's slice of the vocabulary as a plain tensor, and a loss computed on it is "
        "silently wrong. Keep use_local_output=False and compute the loss inside "
        "torch.distributed.tensor.parallel.loss_parallel(), or pass output_layouts=Replicate() "
        "for the full logits"
    )


def test_an_unknown_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match=r"^module 'toolkit.nn' has no attribute 'Nope'$"):
        toolkit.nn.Nope  # noqa: B018


def test_the_style_prints_as_a_name_of_the_package() -> None:
    assert repr(TiedLinearParallel) == "<class 'toolkit.nn.TiedLinearParallel'>"


def test_the_package_attribute_is_looked_up_on_each_use_and_gives_the_style() -> None:
    # The name is not cached in the package's namespace: every access asks __getattr__.
    assert "TiedLinearParallel" not in vars(toolkit.nn)
    assert toolkit.nn.TiedLinearParallel is TiedLinearParallel
    assert getattr(toolkit.nn, "TiedLinearParallel") is TiedLinearParallel  # noqa: B009


# The redistributions the style makes are left in flight (async_op=True, as torch's own styles
# leave them): the result wraps an AsyncCollectiveTensor, waited for on first use, so the
# collective overlaps whatever runs before that. The values are the one-process head's. A
# vocabulary of 17 over 2 ranks: 9 rows and 8.
VOCAB, DIM, TOKENS = 17, 8, 4


def _head_on(mesh: DeviceMesh, emb: nn.Embedding, weight: Placement) -> TiedLinear:
    """A head tied to a copy of ``emb`` whose weight is distributed with ``weight``."""
    copied = copy.deepcopy(emb)
    copied.weight = nn.Parameter(distribute_tensor(copied.weight.detach(), mesh, [weight]))
    return TiedLinear(copied)


def test_a_batch_sharded_input_is_gathered_in_flight() -> None:
    torch.manual_seed(0)
    emb, x = nn.Embedding(VOCAB, DIM), torch.randn(TOKENS, DIM)
    expected = F.linear(x, emb.weight).detach()

    def rank_main(rank: int) -> tuple[list[type], torch.Tensor]:
        mesh = init_device_mesh("cpu", (2,))
        head = _head_on(mesh, emb, Shard(0))
        parallelize_module(head.linear, mesh, TiedLinearParallel(input_layouts=Shard(0)))
        seen: list[type] = []
        # Registered after the style's hook: it sees the input the style prepared.
        head.linear.register_forward_pre_hook(
            lambda module, args: seen.append(type(args[0].to_local()))
        )
        logits = head(x.chunk(2)[rank])
        return seen, logits.full_tensor().detach()

    for seen, logits in run_threads(2, rank_main):
        assert seen == [AsyncCollectiveTensor]
        torch.testing.assert_close(logits, expected)


def test_logits_reduced_across_ranks_are_returned_in_flight() -> None:
    # A weight sharded on its width (Shard(1)) gives partial logits, summed over the ranks.
    torch.manual_seed(0)
    emb, x = nn.Embedding(VOCAB, DIM), torch.randn(TOKENS, DIM)
    expected = F.linear(x, emb.weight).detach()

    def rank_main(rank: int) -> torch.Tensor:
        mesh = init_device_mesh("cpu", (2,))
        head = _head_on(mesh, emb, Shard(1))
        style = TiedLinearParallel(output_layouts=Replicate(), use_local_output=True)
        parallelize_module(head.linear, mesh, style)
        return head(x)

    for logits in run_threads(2, rank_main):
        assert type(logits) is AsyncCollectiveTensor
        torch.testing.assert_close(logits.detach(), expected)
