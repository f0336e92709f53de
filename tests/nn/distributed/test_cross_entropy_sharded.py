"""TiedLinear.cross_entropy on 2 gloo ranks: FSDP2 and tensor-parallel parity, and a refusal.

The checks run in ``cross_entropy_checks``; the expected losses and weights come from
``tiny_lm.reference_training``, which takes ``F.cross_entropy`` of ``F.linear(h, emb.weight)``
in one process on the global batches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.nn.distributed.cross_entropy_checks import STEPS, tensor_parallel_case
from tests.nn.distributed.tiny_lm import reference_training
from tests.nn.distributed.worlds import Worlds, per_rank

WORLD = 2


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return reference_training(WORLD)


@pytest.mark.parametrize("where", ["forward", "method"])
def test_fsdp2_training_matches_the_single_process_reference(
    worlds: Worlds, reference: dict[str, Any], where: str
) -> None:
    """The loss in the root's forward, or in a method registered with FSDP2."""
    for rank, result in enumerate(per_rank(worlds, WORLD, f"cross_entropy/{where}")):
        expected_losses = [step[rank] for step in reference["losses"][:STEPS]]
        torch.testing.assert_close(result["losses"], expected_losses, rtol=1e-5, atol=1e-5)
        assert len(result["states"]) == STEPS + 1
        for actual, expected in zip(result["states"], reference["states"], strict=False):
            assert list(actual) == list(expected)
            for key, value in expected.items():
                torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=1e-5, msg=key)
        # The weights moved, so the parity is not that of an untrained model.
        assert not torch.allclose(
            result["states"][-1]["emb.weight"], result["states"][0]["emb.weight"]
        )


def test_a_weight_resharded_by_fsdp2_is_refused_with_the_fixes(worlds: Worlds) -> None:
    for message in per_rank(worlds, WORLD, "cross_entropy/sharded_outside_forward"):
        assert message.startswith(
            "TiedLinear.cross_entropy cannot use the weight of the tied module Embedding(17, 8)"
        )
        assert "(Shard(dim=0),)" in message
        assert "register_fsdp_forward_method" in message
        assert "loss_parallel()" in message


def test_a_weight_sharded_on_the_vocabulary_by_tensor_parallelism_gives_the_whole_loss(
    worlds: Worlds,
) -> None:
    """Vocabulary 17 over 2 gloo processes: 9 rows and 8. Forward and backward issue only
    all-reduces of per-token statistics and of x's gradient: no all-gather of the weight or
    of the logits."""
    embedding, x, targets = tensor_parallel_case()
    x.requires_grad_()
    expected = F.cross_entropy(F.linear(x, embedding.weight), targets, label_smoothing=0.1)
    expected.backward()
    for result in per_rank(worlds, WORLD, "cross_entropy/tensor_parallel"):
        torch.testing.assert_close(result["loss"], expected.detach())
        torch.testing.assert_close(result["x_grad"], x.grad)
        torch.testing.assert_close(result["weight_grad"], embedding.weight.grad)
        collectives = result["collectives"]
        assert [op for op in collectives if "gather" in op] == []
        assert collectives, "the ranks must reduce their statistics"
        assert all("allreduce" in op or "all_reduce" in op for op in collectives), collectives
