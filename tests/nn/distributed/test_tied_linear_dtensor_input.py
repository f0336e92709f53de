"""A DTensor input and a DTensor weight on two ranks: the shape error, or the right output."""

from __future__ import annotations

import torch

from tests.nn.distributed.mutation_checks import WORLD_SIZES
from tests.nn.distributed.tiny_lm import DIM, VOCAB
from tests.nn.distributed.worlds import Worlds, per_rank


def test_a_wrong_width_with_both_dtensors_is_the_shape_error_on_every_rank(
    worlds: Worlds,
) -> None:
    for world_size in WORLD_SIZES:
        messages = per_rank(worlds, world_size, "mutation/both_dtensors_wrong_width")
        assert (
            messages
            == [
                f"TiedLinear input has shape (2, {DIM + 1}), but Embedding.weight has shape "
                f"({VOCAB}, {DIM}): the input's last dimension must equal in_features={DIM}; "
                "reshape the input or tie to the right module"
            ]
            * world_size
        )


def test_the_right_width_with_both_dtensors_gives_the_full_product_on_every_rank(
    worlds: Worlds,
) -> None:
    for world_size in WORLD_SIZES:
        for out, expected in per_rank(worlds, world_size, "mutation/both_dtensors_right_width"):
            assert out.shape == (2, VOCAB)
            torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
