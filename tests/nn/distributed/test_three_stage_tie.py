"""A tie read on three pipeline stages trains as the whole model does in one process.

Three gloo ranks run ``three_stage_checks``: the embedding on stage 0, an auxiliary head on
stage 1 and the main head on stage 2, each reading its stage's copy of the embedding, tied
by one ``PipelineTie`` over the three ranks and clipped by ``pipeline_clip_grad_norm_``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.nn.distributed.three_stage_checks import MAX_NORM, reference_training
from tests.nn.distributed.worlds import Worlds, per_rank


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    return reference_training()


def close(actual: Any, expected: Any) -> bool:
    try:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    except AssertionError:
        return False
    return True


def test_three_copies_train_as_one_model(worlds: Worlds, expected: dict[str, Any]) -> None:
    assert min(expected["norms"]) > MAX_NORM  # clipping scales every step
    results = per_rank(worlds, 3, "three_stages/tied")
    for rank, result in enumerate(results):
        # Each rank holds one copy of the three; the tie sums over all three ranks.
        assert result["copies"] == (
            "PipelineTie(names=['emb'], copies_on_this_rank={emb: 1}, group_size=3)"
        ), rank
        norms = [step["norm"] for step in result["steps"]]
        torch.testing.assert_close(norms, expected["norms"], rtol=1e-5, atol=0.0)
        assert "emb.weight" in result["state"]
        for key, value in result["state"].items():
            torch.testing.assert_close(value, expected["state"][key], rtol=1e-5, atol=1e-6)
    losses = [step["losses"] for step in results[-1]["steps"]]
    torch.testing.assert_close(losses, expected["losses"], rtol=1e-5, atol=0.0)
    assert all(step["losses"] == [] for r in results[:-1] for step in r["steps"])


def test_without_the_sum_or_counting_the_tie_thrice_the_run_differs(
    worlds: Worlds, expected: dict[str, Any]
) -> None:
    # The controls: the same run, breaking the tie's sum, then the clip's counting of it.
    for check in ("three_stages/without_sum", "three_stages/tie_counted_thrice"):
        for result in per_rank(worlds, 3, check):
            norms = [step["norm"] for step in result["steps"]]
            assert not close(norms, expected["norms"]), check
