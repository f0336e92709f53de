"""tie_output_embeddings under FSDP2 on 2 gloo ranks: parity with the stock model in one process.

The checks run in ``hf_checks``: a tiny transformers Llama with a vocabulary of 17, tied by
``tie_output_embeddings``, each decoder layer and the embedding (unsharded after its forward)
``fully_shard`` units. The expected losses and weights are the stock tied model's, trained in
this process on the global batches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.nn.distributed.hf_checks import STEPS, reference_training
from tests.nn.distributed.worlds import Worlds, per_rank

WORLD = 2


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return reference_training(WORLD)


@pytest.mark.parametrize("loss_path", ["logits", "chunked_loss"])
def test_fsdp2_training_matches_the_stock_model_in_one_process(
    worlds: Worlds, reference: dict[str, Any], loss_path: str
) -> None:
    for result in per_rank(worlds, WORLD, f"hf/fsdp2_{loss_path}"):
        assert result["tied"]
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-5)
        assert len(result["states"]) == len(reference["states"]) == STEPS + 1
        for actual, expected in zip(result["states"], reference["states"], strict=True):
            assert list(actual) == list(expected)
            for key, value in expected.items():
                torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=1e-5, msg=key)
        # The weights moved, so the parity is not that of an untrained model.
        first, last = result["states"][0], result["states"][-1]
        key = "model.embed_tokens.weight"
        assert not torch.allclose(first[key], last[key])
