"""TiedLinear.cross_entropy on gloo processes, where ranks' collectives must match in size.

Threaded ranks share one address space; gloo aborts on an all-reduce whose ranks pass tensors
of different sizes, as NCCL would hang. Every case runs in one launch (starting ranks costs
more than the cases) and is compared with ``F.cross_entropy`` in one process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import RowwiseParallel, loss_parallel, parallelize_module

from tests.nn.ranks import process_group, run_processes
from tests.nn.sharded_loss_cases import DIFFERENCES, NAMES, call_with_one_difference
from toolkit.nn import TiedLinear, TiedLinearParallel

# 33,555 rows on 2 ranks: 16,778 and 16,777, whose own default chunks (64 MiB of float32
# logits) would be 999 and 1,000 tokens; 1,001 tokens take two chunks.
CASES = {"large": (33_555, 1_001, 4), "small": (17, 10, 8)}


def _case(name: str) -> list[Tensor]:
    vocab, tokens, width = CASES[name]
    generator = torch.Generator().manual_seed(vocab)
    weight = torch.randn(vocab, width, generator=generator)
    x = torch.randn(tokens, width, generator=generator)
    target = torch.randint(0, vocab, (tokens,), generator=generator)
    target[:2] = torch.tensor([vocab - 1, -(-vocab // 2)])  # the last rank's rows
    target[2] = -100
    return [weight, x, target]


def _reference(weight: Tensor, x: Tensor, target: Tensor) -> list[Tensor]:
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = F.cross_entropy(F.linear(x, weight), target, label_smoothing=0.1)
    loss.backward()
    return [loss.detach(), x.grad, weight.grad]  # type: ignore[list-item]


def losses_in_a_rank() -> dict[str, Any]:
    """In each rank: the loss and gradients on each case's vocabulary shard (default chunk),
    the error for rank-local tokens and for each option that differs between the ranks, and
    the collectives of one chunk."""
    results: dict[str, Any] = {}
    with process_group():
        mesh = init_device_mesh("cpu", (2,))
        rank = mesh.get_local_rank()
        for name in CASES:
            weight, x, target = _case(name)
            emb = nn.Embedding(*weight.shape, _weight=weight.clone())
            parallelize_module(emb, mesh, RowwiseParallel(input_layouts=Replicate()))
            head, leaf = TiedLinear(emb), x.clone().requires_grad_()
            loss = head.cross_entropy(leaf, target, label_smoothing=0.1)
            loss.backward()
            results[name] = [loss.detach(), leaf.grad, emb.weight.grad.full_tensor()]  # type: ignore[union-attr]
            if name == "small":  # each rank its own half of the tokens
                half = slice(rank * 5, rank * 5 + 5)
                try:
                    head.cross_entropy(x[half], target[half])
                except ValueError as error:
                    results["local"] = str(error)
                for case in DIFFERENCES:
                    try:
                        call_with_one_difference(head, x, target, case)
                    except ValueError as error:
                        results[case] = str(error)
                results["collectives"] = _collectives(head, x, target, mesh)
    return results


def _collectives(head: TiedLinear, x: Tensor, target: Tensor, mesh: Any) -> dict[str, int]:
    """The collectives of one chunk's forward and backward, by default and under DETAIL, and
    of torch's alternative: TiedLinearParallel's sharded logits under loss_parallel()."""
    counts = {}
    for level in ("OFF", "DETAIL"):
        torch.distributed.set_debug_level(getattr(torch.distributed.DebugLevel, level))
        for reduction in ("mean", "none"):
            leaf = x.clone().requires_grad_()
            with CommDebugMode() as comm:
                loss = head.cross_entropy(leaf, target, reduction=reduction)
                loss.backward(torch.ones_like(loss))
            counts[f"{reduction} {level}"] = comm.get_total_counts()
    torch.distributed.set_debug_level(torch.distributed.DebugLevel.OFF)
    parallelize_module(head.linear, mesh, TiedLinearParallel())
    with CommDebugMode() as comm, loss_parallel():
        F.cross_entropy(head(x.clone().requires_grad_()), target).backward()
    counts["loss_parallel"] = comm.get_total_counts()
    return counts


def test_uneven_vocabulary_shards_give_one_process_results_distributed() -> None:
    """Uneven vocabularies (17 as 9 + 8 rows, 33,555 as 16,778 + 16,777) with the default
    chunk: every rank takes the same chunks, so the all-reduces match; rank-local tokens, and
    each option that differs between the ranks (some would hang), are refused on every rank.
    One chunk's forward and backward makes 3 collectives (5 under DETAIL), counted with
    CommDebugMode beside loss_parallel()'s."""
    ranks = run_processes(2, losses_in_a_rank, timeout=240.0)
    for name in CASES:
        expected = _reference(*_case(name))
        for result in ranks:
            torch.testing.assert_close(result[name], expected, rtol=1e-4, atol=1e-5)
    for result in ranks:
        assert result["collectives"] == {
            "mean OFF": 3,  # the first chunk's maxima carry the ranks' calls; its sums; x's grad
            "none OFF": 3,  # the same: backward recomputes the chunk from forward's statistics
            "mean DETAIL": 5,  # and the call, then the targets, each in an all-reduce of its own
            "none DETAIL": 5,
            "loss_parallel": 4,
        }
        assert "same tokens and targets on every rank" in result["local"]
        for case, named in DIFFERENCES.items():
            assert [name for name in NAMES if f"{name} (" in result.get(case, "")] == list(named)
