"""The sharded-weight diagnosis costs the normal path nothing: it still compiles in one graph."""

from __future__ import annotations

import torch

from tests.nn.distributed.tiny_lm import VOCAB, TinyLM


def test_the_tied_lm_compiles_in_one_graph_with_no_break() -> None:
    torch._dynamo.reset()
    model = TinyLM()
    idx = torch.randint(0, VOCAB, (2, 5))
    explanation = torch._dynamo.explain(model)(idx)
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(idx), model(idx))
