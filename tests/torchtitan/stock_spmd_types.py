"""torchtitan's own untied Qwen3 on 4 gloo ranks, pp=2 x dp=2 under ``spmd_types``.

Launched by ``test_torchtitan_distributed.py``: without this package, FSDP2's set-up fails in
torchtitan, which is why the recipe refuses this layout. Prints what happened.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torchtitan.models.qwen3.parallelize import parallelize_qwen3

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchtitan_pp.py"
spec = importlib.util.spec_from_file_location("torchtitan_pp", EXAMPLE)
assert spec is not None
assert spec.loader is not None
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

dist.init_process_group("gloo")
example.use_the_cpu()
options = SimpleNamespace(
    spmd_backend="spmd_types", schedule="1F1B", fsdp_reshard_after_forward="default"
)


def stock_model(config: object) -> torch.nn.Module:
    """The untied model, with nothing of this package."""
    with torch.device("meta"):
        return config.build()  # type: ignore[attr-defined, no-any-return]


try:
    example.split(2, options, model_of=stock_model, parallelize_fn=parallelize_qwen3)
except ValueError as error:
    print(f"rank {dist.get_rank()}: FSDP2 set-up failed: {error}", flush=True)
else:
    print(f"rank {dist.get_rank()}: FSDP2 set-up passed", flush=True)
dist.destroy_process_group()
