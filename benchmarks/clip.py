"""The collectives of one gradient clipping call, counted: toolkit's beside torch's.

Four gloo ranks, started by torch's elastic launcher as ``torchrun`` starts them, each count
with ``CommDebugMode`` the collectives of one call, by default and under
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (set with ``torch.distributed.set_debug_level``, which is
what the clip reads):

- ``clip_grad_norm_`` and ``torch.nn.utils.clip_grad_norm_`` on the gradients of a model
  under FSDP2 on a ``dp`` mesh of 4, and of one under FSDP2 with tensor parallelism on a
  ``(dp, tp)`` mesh of 2 x 2 whose LayerNorm sits on ``dp`` alone: two meshes, which torch's
  cannot combine (pytorch#180346);
- ``pipeline_clip_grad_norm_`` on a pipeline of 2 stages, each under FSDP2 on a ``dp`` mesh
  of 2 (a ``(pp, dp)`` mesh of 2 x 2).

Counts do not depend on the machine, so they are exact, not timed.

Run it with ``python benchmarks/clip.py`` where toolkit-nn is installed.
"""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from toolkit.nn import clip_grad_norm_, pipeline_clip_grad_norm_

LEVELS = ("OFF", "DETAIL")


def _model(norm: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
    return model.append(nn.LayerNorm(16)) if norm else model


def _backward(model: nn.Module) -> list[nn.Parameter]:
    model(torch.randn(8, 16, generator=torch.Generator().manual_seed(1))).sum().backward()
    return list(model.parameters())


def _count(call: Callable[[], object]) -> int:
    with CommDebugMode() as mode:  # type: ignore[no-untyped-call]
        call()
    return int(mode.get_total_counts())


def _rank() -> dict[str, dict[str, int | None]]:
    """One rank: each call's collectives, by debug level."""
    dist.init_process_group("gloo")
    try:
        dp = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        pp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))

        def fsdp() -> list[nn.Parameter]:
            model = _model()
            fully_shard(model, mesh=dp)
            return _backward(model)

        def fsdp_tp(norm: bool = True) -> list[nn.Parameter]:
            model = _model(norm)  # without the LayerNorm, every parameter is on (dp, tp)
            parallelize_module(
                model, tp_mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
            )
            fully_shard(model, mesh=tp_mesh["dp"])
            return _backward(model)

        def stage() -> list[nn.Parameter]:
            model = _model()  # each stage a copy of the model: the counts are the same
            fully_shard(model, mesh=pp_mesh["dp"])
            return _backward(model)

        calls: dict[str, Callable[[], Callable[[], object]] | None] = {
            "FSDP2 (dp=4), torch.nn.utils.clip_grad_norm_": lambda: _bind(
                torch.nn.utils.clip_grad_norm_, fsdp()
            ),
            "FSDP2 (dp=4), clip_grad_norm_": lambda: _bind(clip_grad_norm_, fsdp()),
            "FSDP2 (dp=4), clip_grad_norm_, norm_type=0": lambda: _bind(
                clip_grad_norm_, fsdp(), 0.0
            ),
            "FSDP2 (dp=4), torch.nn.utils.clip_grad_norm_, norm_type=0": lambda: _bind(
                torch.nn.utils.clip_grad_norm_, fsdp(), 0.0
            ),
            "FSDP2 + TP (dp=2, tp=2), one mesh, torch.nn.utils.clip_grad_norm_": lambda: _bind(
                torch.nn.utils.clip_grad_norm_, fsdp_tp(norm=False)
            ),
            "FSDP2 + TP (dp=2, tp=2), one mesh, clip_grad_norm_": lambda: _bind(
                clip_grad_norm_, fsdp_tp(norm=False)
            ),
            # The LayerNorm on dp alone: two meshes, which torch's refuses.
            "FSDP2 + TP (dp=2, tp=2) and dp, torch.nn.utils.clip_grad_norm_": None,
            "FSDP2 + TP (dp=2, tp=2) and dp, clip_grad_norm_": lambda: _bind(
                clip_grad_norm_, fsdp_tp()
            ),
            "pipeline (pp=2) of FSDP2 stages (dp=2), pipeline_clip_grad_norm_": lambda: _bind(
                pipeline_clip_grad_norm_, stage(), group=pp_mesh["pp"]
            ),
        }
        default = dist.get_debug_level()
        found: dict[str, dict[str, int | None]] = {name: {} for name in calls}
        for level in LEVELS:
            dist.set_debug_level(getattr(dist.DebugLevel, level))
            try:
                for name, make in calls.items():
                    found[name][level] = None if make is None else _count(make())
            finally:
                dist.set_debug_level(default)
        return found
    finally:
        dist.destroy_process_group()


def _bind(
    clip: Callable[..., object], params: list[nn.Parameter], *args: float, **kwargs: object
) -> Callable[[], object]:
    """The call to count: ``clip`` of ``params`` to a norm of 1e-3."""
    return lambda: clip(params, 1e-3, *args, **kwargs)


def run(quick: bool) -> dict[str, object]:
    """Count the collectives of each call on 4 ranks; print a table and return the counts."""
    del quick  # counts: one call is exact
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=4,
        run_id=f"clip-{uuid.uuid4().hex}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # port 0: the system picks a free one
        max_restarts=0,
        local_addr="127.0.0.1",
    )
    ranks = elastic_launch(config, _rank)()
    counts = ranks[0]
    same = all(result == counts for result in ranks.values())
    print("collectives of one call (all-reduces), 4 gloo ranks:")
    print(f"  {'call':<72} {'default':>8} {'DETAIL':>8}")
    for name, by_level in counts.items():
        cells = ["-" if by_level[level] is None else str(by_level[level]) for level in LEVELS]
        print(f"  {name:<72} {cells[0]:>8} {cells[1]:>8}")
    print(f"  the same on every rank: {same}")
    return {"counts": counts, "same_on_every_rank": same}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="accepted; the counts are exact")
    args = parser.parse_args()
    print(json.dumps(run(args.quick), indent=2))
