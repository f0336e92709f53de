"""The communication of a tied head under tensor parallelism, counted in one process.

A TiedLinear head reads an embedding weight that ``RowwiseParallel`` shards on the vocabulary,
through ``toolkit.nn.TiedLinearParallel``. ``CommDebugMode`` counts the collectives that the
head, and the head with its loss forward and backward, issue on each path: a replicated
input, a sequence-sharded input, logits left sharded for ``loss_parallel()`` and logits
gathered. The ranks are simulated by torch's fake process group in this one process: its
collectives move no data (so the values computed are meaningless), but every collective that
DTensor issues is still dispatched, and counted, exactly as on real ranks.

Run it with ``python benchmarks/tensor_parallel.py`` (``--quick`` for smaller shapes).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import RowwiseParallel, loss_parallel, parallelize_module
from torch.distributed.tensor.placement_types import Placement
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

from toolkit.nn import TiedLinear, TiedLinearParallel

WORLD_SIZE = 8


def _head(
    mesh: DeviceMesh, vocab: int, dim: int, *, input_layouts: Placement, gathered: bool
) -> TiedLinear:
    embedding = nn.Embedding(vocab, dim)
    parallelize_module(embedding, mesh, RowwiseParallel(input_layouts=Replicate()))
    head = TiedLinear(embedding)
    style = TiedLinearParallel(
        input_layouts=input_layouts,
        output_layouts=Replicate() if gathered else Shard(-1),
        use_local_output=gathered,
    )
    parallelize_module(head.linear, mesh, style)
    return head


def _count(step: Callable[[], object]) -> dict[str, int]:
    with CommDebugMode() as mode:  # type: ignore[no-untyped-call]
        step()
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items() if n}


def _measure(vocab: int, dim: int, batch: int, seq: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    h = torch.randn(batch, seq, dim, requires_grad=True)
    h_seq = torch.randn(batch, seq // WORLD_SIZE, dim, requires_grad=True)
    targets = torch.randint(0, vocab, (batch, seq))

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    sharded = _head(mesh, vocab, dim, input_layouts=Replicate(), gathered=False)
    sequence = _head(mesh, vocab, dim, input_layouts=Shard(1), gathered=False)
    gathered = _head(mesh, vocab, dim, input_layouts=Replicate(), gathered=True)

    def sharded_loss() -> None:
        with loss_parallel():
            loss(sharded(h)).backward()  # type: ignore[no-untyped-call]

    logits = sharded(h)
    local = logits.to_local() if isinstance(logits, DTensor) else logits
    return {
        "collectives": {
            "head, replicated input, Shard(-1) logits": _count(lambda: sharded(h)),
            "head, Shard(1) input (sequence parallel)": _count(lambda: sequence(h_seq)),
            "head, gathered logits": _count(lambda: gathered(h)),
            "head + loss fwd/bwd, loss_parallel": _count(sharded_loss),
            "head + loss fwd/bwd, gathered logits": _count(
                lambda: loss(gathered(h)).backward()  # type: ignore[no-untyped-call]
            ),
        },
        "logits elements per rank": {
            "loss_parallel": local.numel(),
            "gathered": gathered(h).numel(),
        },
    }


def run(quick: bool) -> dict[str, object]:
    """Count the collectives of each path on a simulated world of WORLD_SIZE ranks."""
    vocab, dim, batch, seq = (1_001, 16, 2, 16) if quick else (151_936, 64, 1, 128)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)
    try:
        measured = _measure(vocab, dim, batch, seq)
    finally:
        dist.destroy_process_group()
    result: dict[str, object] = {
        "world_size": WORLD_SIZE,
        "vocab": vocab,
        "dim": dim,
        "tokens": batch * seq,
        **measured,
    }
    print(f"Tied head under tensor parallelism: {WORLD_SIZE} simulated ranks, vocabulary {vocab}")
    for path, counts in measured["collectives"].items():
        text = ", ".join(f"{n} {op}" for op, n in sorted(counts.items())) or "none"
        print(f"  {path:<45} {text}")
    elements = measured["logits elements per rank"]
    ratio = elements["gathered"] / elements["loss_parallel"]
    print(f"  logits held per rank: gathered / loss_parallel = {ratio:.2f}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    print(json.dumps(run(parser.parse_args().quick), indent=2))
