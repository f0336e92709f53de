"""TiedLinear.cross_entropy on 2 gloo ranks: FSDP2 parity, and the refusals of a sharded weight.

The checks run in ``cross_entropy_checks``; the expected losses and weights come from
``tiny_lm.reference_training``, which takes ``F.cross_entropy`` of ``F.linear(h, emb.weight)``
in one process on the global batches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.nn.distributed.cross_entropy_checks import STEPS
from tests.nn.distributed.tiny_lm import reference_training
from tests.nn.distributed.worlds import Worlds, per_rank

WORLD = 2
FIXES = (
    "Under FSDP2, call cross_entropy inside the forward of the unit that holds the tied module, "
    "or register the method that calls it with "
    "torch.distributed.fsdp.register_fsdp_forward_method(model, 'method_name'). Under tensor "
    "parallelism, compute the logits with head(x) and take F.cross_entropy of them inside "
    "torch.distributed.tensor.parallel.loss_parallel()."
)


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


@pytest.mark.parametrize("check", ["sharded_outside_forward", "tensor_parallel"])
def test_a_weight_sharded_on_the_vocabulary_is_refused_with_the_fixes(
    worlds: Worlds, check: str
) -> None:
    for message in per_rank(worlds, WORLD, f"cross_entropy/{check}"):
        assert message == (
            "TiedLinear.cross_entropy cannot use the weight of the tied module Embedding(17, 8): "
            "it is a DTensor with placements (Shard(dim=0),), and the chunked loss needs the "
            f"whole vocabulary on every rank. {FIXES}"
        )
