"""torchtitan's own untied Qwen3 on 4 gloo ranks, pp=2 x dp=2 under ``spmd_types``.

Launched by ``test_torchtitan_distributed.py``: without this package, FSDP2's set-up fails in
torchtitan, which is why the recipe refuses this layout. Prints what happened.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.qwen3.parallelize import parallelize_qwen3

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchtitan_pp.py"
spec = importlib.util.spec_from_file_location("torchtitan_pp", EXAMPLE)
assert spec is not None
assert spec.loader is not None
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

dist.init_process_group("gloo")
example.use_the_cpu()
dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=2, ep=1, world_size=4)
dims.build_mesh()
set_spmd_backend("spmd_types")
parallelism = ParallelismConfig(pipeline_parallel_degree=2, data_parallel_shard_degree=2)
config = example.qwen3_config()  # untied, with nothing of this package
config.update_from_config(config=SimpleNamespace(parallelism=parallelism))
with torch.device("meta"):
    model = config.build()
try:
    pipeline_llm(
        model,
        parallel_dims=dims,
        training=TrainingConfig(local_batch_size=4, seq_len=16),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder=tempfile.gettempdir(),
        device=torch.device("cpu"),
        model_config=config,
        parallelize_fn=parallelize_qwen3,
        loss_fn=CrossEntropyLoss(CrossEntropyLoss.Config()),
    )
except ValueError as error:
    print(f"rank {dist.get_rank()}: FSDP2 set-up failed: {error}", flush=True)
else:
    print(f"rank {dist.get_rank()}: FSDP2 set-up passed", flush=True)
dist.destroy_process_group()
