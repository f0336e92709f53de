"""The tied head's loss under tensor parallelism, on 2 gloo ranks: time and peak memory.

The embedding's weight is sharded on the vocabulary by ``RowwiseParallel`` (``Shard(0)``), and
each variant takes the mean cross-entropy of the tied head, forward and backward, in float32,
from the same hidden states on every rank:

- ``tp_loss_parallel``: the head under ``TiedLinearParallel`` gives logits sharded on the
  vocabulary, and ``F.cross_entropy`` of them runs, with its backward, under
  ``loss_parallel()``: each rank holds its slice of the full logits;
- ``tp_toolkit``: ``head.cross_entropy(h, t)`` on the vocabulary shard, a chunk of tokens at
  a time, exchanging per-token statistics.

``in_ranks`` starts the ranks with ``torchrun --standalone`` (which picks a free port), one
torch thread each, so the two ranks use two cores as a one-process variant with two threads
does. Each rank measures as ``cross_entropy.measure`` does (warm-up on a small shape, peak
resident set over the baseline of the allocated inputs), starting every step together after
a barrier; the run reports the slowest rank's median step and the largest rank's peak.
``cross_entropy.py`` runs these variants beside its one-process ones.

Each rank also counts, with ``CommDebugMode``, the collectives of one more step, untimed, and
of another under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (set with ``dist.set_debug_level``), where
``tp_toolkit`` compares the ranks' calls in all-reduces of their own. Run alone (not under
``torchrun``) the script prints one variant's result::

    python benchmarks/cross_entropy_parallel.py tp_toolkit 4096,512,32000 --steps 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from process_memory import MB, rss_bytes
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import RowwiseParallel, loss_parallel, parallelize_module

from toolkit.nn import TiedLinear, TiedLinearParallel

VARIANTS = ("tp_loss_parallel", "tp_toolkit")
WORLD_SIZE = 2
# The standard deviation of the logits of ``inputs``.
LOGIT_STD = 2.0
WARMUP_SHAPE = (256, 64, 1000)
RESULT = "RESULT "


def inputs(tokens: int, hidden: int, vocab: int) -> tuple[nn.Embedding, torch.Tensor, torch.Tensor]:
    """An embedding, hidden states and targets, the same in every process.

    The embedding's weight has unit variance (``nn.Embedding``'s initialization) and the
    hidden states ``LOGIT_STD / sqrt(hidden)``, so that the logits have a standard deviation
    of ``LOGIT_STD``, as a language model's do. Unit-variance hidden states would give logits
    of ``sqrt(hidden)`` (23 at 512 features), a quarter of whose exponentials are subnormal,
    slow on the CPU.
    """
    generator = torch.Generator().manual_seed(0)
    embedding = nn.Embedding(vocab, hidden)
    h = torch.randn(tokens, hidden, generator=generator) * (LOGIT_STD / hidden**0.5)
    t = torch.randint(0, vocab, (tokens,), generator=generator)
    return embedding, h.requires_grad_(), t


def _inputs(
    variant: str, mesh: DeviceMesh, tokens: int, hidden: int, vocab: int
) -> tuple[nn.Embedding, TiedLinear, torch.Tensor, torch.Tensor]:
    """The same embedding, hidden states and targets on every rank; the weight then sharded."""
    embedding, h, t = inputs(tokens, hidden, vocab)
    parallelize_module(embedding, mesh, RowwiseParallel(input_layouts=Replicate()))
    head = TiedLinear(embedding)
    if variant == "tp_loss_parallel":
        parallelize_module(head.linear, mesh, TiedLinearParallel())
    return embedding, head, h, t


def _step(variant: str, head: TiedLinear, h: torch.Tensor, t: torch.Tensor) -> None:
    """One forward and backward of ``variant``; the gradients stay in ``.grad``."""
    if variant == "tp_loss_parallel":
        with loss_parallel():
            F.cross_entropy(head(h), t).backward()  # type: ignore[no-untyped-call]
    elif variant == "tp_toolkit":
        head.cross_entropy(h, t).backward()  # type: ignore[no-untyped-call]
    else:
        raise ValueError(f"unknown variant {variant!r}")


def measure_rank(variant: str, shape: tuple[int, int, int], steps: int) -> dict[str, float]:
    """On this rank: warm up, time ``steps`` steps, take the peak; gather over the ranks."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    _, head, h, t = _inputs(variant, mesh, *WARMUP_SHAPE)
    for _ in range(2):
        _step(variant, head, h, t)
    embedding, head, h, t = _inputs(variant, mesh, *shape)
    del _
    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    baseline = rss_bytes("VmRSS")
    times = []
    for _ in range(steps):
        embedding.weight.grad = None
        h.grad = None
        dist.barrier()
        start = time.perf_counter()
        _step(variant, head, h, t)
        times.append(time.perf_counter() - start)
    mine = (statistics.median(times), (rss_bytes("VmHWM") - baseline) / MB)
    ranks: list[tuple[float, float]] = [(0.0, 0.0)] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    collectives = {}
    for level in (dist.DebugLevel.OFF, dist.DebugLevel.DETAIL):  # untimed: CommDebugMode is slow
        dist.set_debug_level(level)
        with CommDebugMode() as comm:
            _step(variant, head, h, t)
        collectives[level] = comm.get_total_counts()
    dist.set_debug_level(dist.DebugLevel.OFF)
    return {
        "seconds": max(seconds for seconds, _ in ranks),
        "peak_mb": max(peak for _, peak in ranks),
        "collectives": collectives[dist.DebugLevel.OFF],
        "collectives_detail": collectives[dist.DebugLevel.DETAIL],
    }


def in_ranks(variant: str, shape: tuple[int, int, int], steps: int) -> dict[str, float]:
    """Measure ``variant`` on ``WORLD_SIZE`` gloo ranks started by ``torchrun --standalone``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(WORLD_SIZE), __file__, variant, ",".join(map(str, shape))]
    command += ["--steps", str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    names = {name for _, name in socket.if_nameindex()}
    if "lo" in names and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # every rank is local: keep gloo on the loopback
    out = subprocess.run(command, check=False, capture_output=True, text=True, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith(RESULT)]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} on {WORLD_SIZE} ranks failed:\n{out.stdout}{out.stderr}")
    result: dict[str, float] = json.loads(lines[-1].removeprefix(RESULT))
    return result


def main(argv: list[str] | None = None) -> None:
    """One rank of ``in_ranks``: rank 0 prints the gathered result; alone, run ``in_ranks``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=VARIANTS)
    parser.add_argument("shape", help="TOKENS,HIDDEN,VOCAB")
    parser.add_argument("--steps", type=int, default=1, help="timed steps")
    args = parser.parse_args(argv)
    tokens, hidden, vocab = (int(n) for n in args.shape.split(","))
    if "RANK" not in os.environ:  # not started by torchrun: start the ranks
        print(json.dumps(in_ranks(args.variant, (tokens, hidden, vocab), args.steps)))
        return
    dist.init_process_group("gloo")
    try:
        result = measure_rank(args.variant, (tokens, hidden, vocab), args.steps)
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        print(RESULT + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
