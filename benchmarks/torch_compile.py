"""The tied language model under ``torch.compile``: one graph, no break, and its step time.

The target is one graph and no graph break for the model with a TiedLinear head; it is the
one target the benchmarks enforce (``failures`` in the result). The compiled training step
(forward, cross-entropy, backward) of the tied model is timed against the same model with a
shared Parameter; that ratio has no target.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch.nn.functional as F
from timing import Candidate, interleave, loop, ratio_table, ratios_against
from tiny_lm import TinyLM

__all__ = ["run"]


def run(quick: bool, backend: str = "inductor") -> dict[str, object]:
    """Count graphs and breaks, time the compiled steps, print and return both."""
    torch.manual_seed(0)
    vocab, dim, batch, seq = 512, 64, 8, 32
    tied = TinyLM(vocab, dim, "tied")
    shared = TinyLM(vocab, dim, "shared")
    shared.load_state_dict(tied.state_dict(), strict=False)
    idx = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch * seq,))

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(tied)(idx)
    one_graph = explanation.graph_count == 1 and explanation.graph_break_count == 0
    result: dict[str, object] = {
        "model": f"TinyLM(vocab={vocab}, dim={dim}), input {batch}x{seq}, backend {backend}",
        "graph_count": explanation.graph_count,
        "graph_break_count": explanation.graph_break_count,
        "break_reasons": [str(reason.reason) for reason in explanation.break_reasons],
        "target": "1 graph, 0 breaks",
        "verdict": "met" if one_graph else "MISSED",
        "failures": [] if one_graph else ["the tied LM does not compile to one graph"],
    }

    torch._dynamo.reset()
    steps: dict[str, Candidate] = {}
    logits = []
    started = time.perf_counter()
    for name, model in (("tied (TiedLinear)", tied), ("shared Parameter", shared)):
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        step = _training_step(compiled, idx, targets)
        step()  # compile forward and backward now, outside the timing
        logits.append(compiled(idx).detach())
        steps[name] = loop(step)
    result["compile_seconds_both"] = round(time.perf_counter() - started, 1)
    result["same_logits"] = bool(torch.allclose(logits[0], logits[1]))
    samples = interleave(steps, blocks=21 if quick else 41, block_seconds=0.1 if quick else 0.2)
    ratios = ratios_against(
        samples,
        "tied (TiedLinear)",
        section="torch.compile",
        case="compiled training step (forward, loss, backward)",
    )
    result["ratios"] = [asdict(r) for r in ratios]

    print(ratio_table(ratios))
    print(
        f"\ntorch.compile, {result['model']}: {result['graph_count']} graph(s), "
        f"{result['graph_break_count']} break(s) (target {result['target']}: "
        f"{result['verdict']}); compiling both models took {result['compile_seconds_both']} s; "
        f"both compiled models give the same logits: {result['same_logits']}."
    )
    for reason in explanation.break_reasons:
        print(f"  break: {reason.reason}")
    return result


def _training_step(
    compiled: Callable[[torch.Tensor], torch.Tensor], idx: torch.Tensor, targets: torch.Tensor
) -> Callable[[], None]:
    def step() -> None:
        loss = F.cross_entropy(compiled(idx).flatten(0, 1), targets)
        loss.backward()  # type: ignore[no-untyped-call]

    return step


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks, for a smoke run")
    parser.add_argument(
        "--backend", default="inductor", help="torch.compile backend (default: inductor)"
    )
    args = parser.parse_args()
    run(args.quick, backend=args.backend)
