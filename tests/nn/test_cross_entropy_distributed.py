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
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from tests.nn.ranks import process_group, run_processes
from tests.nn.sharded_loss_cases import DIFFERENCES, NAMES, call_with_one_difference
from toolkit.nn import TiedLinear

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
    the error for rank-local tokens, and for each option that differs between the ranks."""
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
    return results


def test_uneven_vocabulary_shards_give_one_process_results_distributed() -> None:
    """Uneven vocabularies (17 as 9 + 8 rows, 33,555 as 16,778 + 16,777) with the default
    chunk: every rank takes the same chunks, so the all-reduces match; rank-local tokens, and
    each option that differs between the ranks (some would hang), are refused on every rank."""
    ranks = run_processes(2, losses_in_a_rank, timeout=240.0)
    for name in CASES:
        expected = _reference(*_case(name))
        for result in ranks:
            torch.testing.assert_close(result[name], expected, rtol=1e-4, atol=1e-5)
    for result in ranks:
        assert "same tokens and targets on every rank" in result["local"]
        for case, named in DIFFERENCES.items():
            assert [name for name in NAMES if f"{name} (" in result.get(case, "")] == list(named)
