"""TiedLinearParallel on two ranks of one process: logits, gradients, layouts and errors.

Each rank is a thread of torch's threaded process group (``tests.nn.ranks.run_threads``), so
the style's hooks run where the test can see them. The tied embedding has a vocabulary of 17,
which ``RowwiseParallel`` splits unevenly over the two ranks (9 rows and 8), and every result
is compared with the same head run in one process on the full weight. The real multi-process
runs of the whole recipe are in ``tests/nn/distributed/test_tensor_parallel.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import Placement
from torch.utils._python_dispatch import TorchDispatchMode

from tests.nn.ranks import RanksFailedError, run_threads
from toolkit.nn import TiedLinear, TiedLinearParallel

VOCAB, DIM, BATCH, SEQ = 17, 8, 2, 6
WORLD = 2
# RowwiseParallel gives rank 0 the first ceil(17 / 2) = 9 rows of the vocabulary, rank 1 the
# other 8; Shard(1) on a sequence of 6 gives each rank 3 positions.
VOCAB_ROWS = (slice(0, 9), slice(9, 17))
SEQ_POSITIONS = (slice(0, 3), slice(3, 6))


class _Collectives(TorchDispatchMode):
    """The functional collectives that run on this thread while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor dispatches again on its local tensors
        name = func.__name__.split(".")[0]
        # Leave out the waits and the wrappers: count the collectives themselves.
        if func.namespace == "_c10d_functional" and not name.startswith(("_", "wait")):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


class _Case:
    """An embedding, a gradient for its logits and an input, drawn once in the calling thread."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.x = torch.randn(BATCH, SEQ, DIM)
        self.grad_out = torch.randn(BATCH, SEQ, VOCAB)

    def reference(self) -> dict[str, torch.Tensor]:
        """The head in one process: logits, and gradients of ``(logits * grad_out).sum()``."""
        weight = self.emb.weight.detach().clone().requires_grad_()
        x = self.x.clone().requires_grad_()
        logits = F.linear(x, weight)
        (logits * self.grad_out).sum().backward()
        assert weight.grad is not None
        assert x.grad is not None
        return {"logits": logits.detach(), "weight_grad": weight.grad, "x_grad": x.grad}

    def parallel_head(self, style: TiedLinearParallel) -> tuple[TiedLinear, DeviceMesh]:
        """This rank's head: its embedding vocabulary-sharded, ``style`` on its linear."""
        mesh = init_device_mesh("cpu", (WORLD,))
        emb = copy.deepcopy(self.emb)
        head = TiedLinear(emb)
        parallelize_module(emb, mesh, RowwiseParallel(input_layouts=Replicate()))
        parallelize_module(head.linear, mesh, style)
        return head, mesh


def _record_input_placements(head: TiedLinear) -> list[tuple[Placement, ...]]:
    """The placements of the input that the head's matrix product receives, call by call."""
    seen: list[tuple[Placement, ...]] = []

    def record(module: nn.Module, args: tuple[Any, ...]) -> None:
        seen.append(tuple(args[0].placements))

    # Registered after the style's own hook, so it sees the input the style prepared.
    head.linear.register_forward_pre_hook(record)
    return seen


def _step(case: _Case, style: TiedLinearParallel, x: torch.Tensor) -> dict[str, Any]:
    """One forward and backward of this rank's head on its part ``x`` of the input.

    Returns the logits' placements, local part and full value, the collectives of the
    forward, the input placements the head's product received, and both full gradients.
    """
    head, _ = case.parallel_head(style)
    seen = _record_input_placements(head)
    x = x.clone().requires_grad_()
    with _Collectives() as forward:
        logits = head(x)
    (logits.full_tensor() * case.grad_out).sum().backward()
    assert isinstance(logits, DTensor)
    assert isinstance(head.weight.grad, DTensor)
    return {
        "placements": logits.placements,
        "local": logits.to_local().detach(),
        "full": logits.full_tensor().detach(),
        "forward": forward.ops,
        "seen": seen,
        "weight_grad": head.weight.grad.full_tensor(),
        "x_grad": x.grad,
    }


def test_the_defaults_give_each_rank_its_vocabulary_rows_of_the_logits_at_no_cost() -> None:
    case = _Case()
    expected = case.reference()

    def rank_main(rank: int) -> dict[str, Any]:
        return _step(case, TiedLinearParallel(), case.x)

    for rank, result in enumerate(run_threads(WORLD, rank_main)):
        # torch keeps Shard(-1) as the last dimension of the 3-D logits.
        assert result["placements"] == (Shard(2),)
        torch.testing.assert_close(result["local"], expected["logits"][..., VOCAB_ROWS[rank]])
        torch.testing.assert_close(result["full"], expected["logits"])
        assert result["forward"] == []  # a replicated input and sharded logits cost nothing
        assert result["seen"] == [(Replicate(),)]
        torch.testing.assert_close(result["weight_grad"], expected["weight_grad"])
        torch.testing.assert_close(result["x_grad"], expected["x_grad"])


def test_a_replicated_input_is_trusted_as_given_not_checked_or_broadcast() -> None:
    # As torch's own styles do, the style builds the DTensor without a check across ranks:
    # each rank multiplies the input it was given. (Here the ranks are given different
    # inputs, to show that nothing was sent from one to the other.)
    case = _Case()

    def rank_main(rank: int) -> torch.Tensor:
        head, _ = case.parallel_head(TiedLinearParallel())
        x = case.x + rank
        with torch.no_grad():
            return head(x).to_local()

    for rank, local in enumerate(run_threads(WORLD, rank_main)):
        weight_rows = case.emb.weight.detach()[VOCAB_ROWS[rank]]
        torch.testing.assert_close(local, F.linear(case.x + rank, weight_rows))


def test_a_sequence_sharded_input_is_gathered_once_and_multiplied_replicated() -> None:
    case = _Case()
    expected = case.reference()

    def rank_main(rank: int) -> dict[str, Any]:
        style = TiedLinearParallel(input_layouts=Shard(1))
        return _step(case, style, case.x[:, SEQ_POSITIONS[rank]])

    for rank, result in enumerate(run_threads(WORLD, rank_main)):
        assert result["placements"] == (Shard(2),)
        torch.testing.assert_close(result["full"], expected["logits"])
        assert result["forward"] == ["all_gather_into_tensor"]  # the input, once
        assert result["seen"] == [(Replicate(),)]
        torch.testing.assert_close(result["weight_grad"], expected["weight_grad"])
        torch.testing.assert_close(result["x_grad"], expected["x_grad"][:, SEQ_POSITIONS[rank]])


def test_a_dtensor_input_keeps_its_own_placements() -> None:
    # The style's input_layouts say Replicate(), but the input says Shard(1): the input wins.
    case = _Case()
    expected = case.reference()

    def rank_main(rank: int) -> dict[str, Any]:
        head, mesh = case.parallel_head(TiedLinearParallel())
        seen = _record_input_placements(head)
        x = DTensor.from_local(case.x[:, SEQ_POSITIONS[rank]], mesh, [Shard(1)])
        with torch.no_grad(), _Collectives() as forward:
            logits = head(x)
        return {"full": logits.full_tensor(), "forward": forward.ops, "seen": seen}

    for result in run_threads(WORLD, rank_main):
        torch.testing.assert_close(result["full"], expected["logits"])
        assert result["forward"] == ["all_gather_into_tensor"]
        assert result["seen"] == [(Replicate(),)]


@pytest.mark.parametrize(
    ("output_layouts", "placements", "rows"),
    [
        (Replicate(), (Replicate(),), lambda rank: (slice(None), slice(None), slice(None))),
        (Shard(1), (Shard(1),), lambda rank: (slice(None), SEQ_POSITIONS[rank], slice(None))),
        (Shard(-1), (Shard(2),), lambda rank: (slice(None), slice(None), VOCAB_ROWS[rank])),
        (Shard(2), (Shard(2),), lambda rank: (slice(None), slice(None), VOCAB_ROWS[rank])),
    ],
    ids=["replicate", "sequence", "vocabulary_last", "vocabulary_2"],
)
@pytest.mark.parametrize("use_local_output", [False, True], ids=["dtensor", "local"])
def test_the_logits_take_the_output_layouts_as_a_dtensor_or_this_ranks_part(
    output_layouts: Placement,
    placements: tuple[Placement, ...],
    rows: Any,
    use_local_output: bool,
) -> None:
    """This rank's part as a plain tensor, except of the vocabulary: a loss on that slice
    would be silently wrong, so that is refused (at construction for Shard(-1))."""
    case = _Case()
    expected = case.reference()["logits"]
    vocabulary = isinstance(output_layouts, Shard) and output_layouts.dim in (-1, 2)

    def rank_main(rank: int) -> tuple[type, tuple[Placement, ...] | None, torch.Tensor] | str:
        try:
            style = TiedLinearParallel(
                output_layouts=output_layouts, use_local_output=use_local_output
            )
            head, _ = case.parallel_head(style)
            with torch.no_grad():
                logits = head(case.x)
        except ValueError as error:
            return str(error)
        if isinstance(logits, DTensor):
            return type(logits), tuple(logits.placements), logits.to_local()
        return type(logits), None, logits

    results = run_threads(WORLD, rank_main)
    if use_local_output and vocabulary:
        assert len(set(results)) == 1
        message = results[0]
        assert isinstance(message, str)
        assert f"output_layouts={output_layouts!r}" in message
        assert "Keep use_local_output=False" in message
        assert "loss_parallel()" in message
        assert "output_layouts=Replicate()" in message
        return
    for rank, result in enumerate(results):
        assert not isinstance(result, str), result
        kind, got, local = result
        if use_local_output:
            assert kind is torch.Tensor
            assert got is None
        else:
            assert kind is DTensor
            assert got == placements
        torch.testing.assert_close(local, expected[rows(rank)])


def test_flattened_tokens_sharded_on_the_vocabulary_are_refused_as_a_local_tensor() -> None:
    """With a 2-D input the vocabulary is dimension 1: Shard(1) is refused, Shard(0) not."""
    case = _Case()
    tokens = case.x.flatten(0, 1)
    expected = F.linear(tokens, case.emb.weight.detach())

    def rank_main(rank: int) -> tuple[str, torch.Tensor]:
        refused = TiedLinearParallel(output_layouts=Shard(1), use_local_output=True)
        head, _ = case.parallel_head(refused)
        with pytest.raises(
            ValueError, match=r"output_layouts=Shard\(dim=1\)\) would return"
        ) as info:
            head(tokens)
        allowed = TiedLinearParallel(output_layouts=Shard(0), use_local_output=True)
        head, _ = case.parallel_head(allowed)
        with torch.no_grad():
            return str(info.value), head(tokens)

    rows = (slice(0, 6), slice(6, 12))
    for rank, (message, local) in enumerate(run_threads(WORLD, rank_main)):
        assert "loss_parallel()" in message
        torch.testing.assert_close(local, expected[rows[rank]])


def _error_on_each_rank(fn: Any) -> list[str]:
    def rank_main(rank: int) -> str:
        try:
            fn()
        except (RuntimeError, TypeError) as error:
            return f"{type(error).__name__}: {error}"
        return "no error"

    return run_threads(WORLD, rank_main)


def test_a_tied_module_left_unsharded_names_the_cause_and_both_fixes() -> None:
    emb = nn.Embedding(VOCAB, DIM)
    x = torch.randn(BATCH, SEQ, DIM)

    def call() -> None:
        head = TiedLinear(copy.deepcopy(emb))
        parallelize_module(head.linear, init_device_mesh("cpu", (WORLD,)), TiedLinearParallel())
        head(x)

    expected = (
        "RuntimeError: TiedLinearParallel prepared the head's input for tensor parallelism, "
        "but the weight of the tied module is a plain tensor, not sharded on the device mesh: "
        "the tied module was not parallelised. Shard it on the same mesh (RowwiseParallel on "
        "the embedding shards its weight on the vocabulary), or remove TiedLinearParallel "
        "from head.linear."
    )
    assert _error_on_each_rank(call) == [expected] * WORLD


@pytest.mark.parametrize(
    ("module", "type_name"),
    [(nn.Linear(DIM, VOCAB, bias=False), "Linear"), (nn.Embedding(VOCAB, DIM), "Embedding")],
)
def test_the_style_on_another_module_names_its_type_and_the_right_module(
    module: nn.Module, type_name: str
) -> None:
    def apply() -> None:
        mesh = init_device_mesh("cpu", (WORLD,))
        parallelize_module(copy.deepcopy(module), mesh, TiedLinearParallel())

    expected = (
        "TypeError: TiedLinearParallel applies to a TiedLinear's linear module, got "
        f"{type_name}; pass the head's linear module: "
        "parallelize_module(head.linear, tp_mesh, TiedLinearParallel())"
    )
    assert _error_on_each_rank(apply) == [expected] * WORLD


def test_cross_entropy_on_a_weight_sharded_on_its_width_names_the_placements_and_fixes() -> None:
    """A weight sharded on its second dimension (Shard(1)) is not a vocabulary shard: refused.

    The vocabulary-sharded weight (Shard(0)) is computed; see test_cross_entropy_ranks.py.
    """
    case = _Case()
    target = torch.randint(0, VOCAB, (BATCH, SEQ))

    def rank_main(rank: int) -> None:
        mesh = init_device_mesh("cpu", (WORLD,))
        emb = copy.deepcopy(case.emb)
        emb.weight = nn.Parameter(distribute_tensor(emb.weight.detach(), mesh, [Shard(1)]))
        TiedLinear(emb).cross_entropy(case.x, target)

    with pytest.raises(RanksFailedError) as info:
        run_threads(WORLD, rank_main)
    assert type(info.value.__cause__) is RuntimeError
    message = " ".join(str(info.value.__cause__).split())
    # The module, the placements, what is supported, and each fix, in full.
    for fact in (
        "TiedLinear.cross_entropy cannot use the weight of the tied module Embedding(17, 8)",
        "a DTensor with placements (Shard(dim=1),), and the chunked loss needs the whole "
        "vocabulary on every rank, or the vocabulary sharded by tensor parallelism on a 1-D "
        "mesh (Shard(0)).",
        "Under FSDP2, call cross_entropy inside the forward of the unit that holds the tied "
        "module, or register the method that calls it with "
        "torch.distributed.fsdp.register_fsdp_forward_method(model, 'method_name').",
        "Under tensor parallelism, shard the tied module on the vocabulary (RowwiseParallel on "
        "an embedding) on the tensor-parallel mesh, or compute the logits with head(x) and take "
        "F.cross_entropy of them inside torch.distributed.tensor.parallel.loss_parallel().",
    ):
        assert fact in message
