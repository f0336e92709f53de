"""Train torchtitan's tied Qwen3 debug model with pipeline parallelism, and FSDP2, on CPU ranks.

    torchrun --standalone --nproc-per-node 2 examples/torchtitan_pp.py   # pp=2
    torchrun --standalone --nproc-per-node 4 examples/torchtitan_pp.py   # pp=2 x dp=2

torchtitan refuses weight tying under pipeline parallelism. This script keeps the tie with
``TiedLinear`` and ``PipelineTie`` and uses torchtitan's own pieces for the rest: the Qwen3
debug model built on the meta device, ``pipeline_llm`` to split it into two stages and build
the schedule, ``parallelize_qwen3`` for FSDP2 over the data-parallel ranks, and its loss.
Each stage is initialised on its own, as torchtitan's trainer does; ``PipelineTie`` then
broadcasts the first stage's embedding to the last.

Three steps are trained, with a DCP save after the second and a resume into stages built
afresh. Every rank then checks that the losses, the gradient norms and the weights are those
of torchtitan's own tied model trained in one process, and that the resumed step 3 is step
3, and that torchtitan's own tied model loads the checkpoint; the script exits with status 1
if anything differs. ``--schedule`` picks the schedule (``1F1B``, the default, or
``GPipe``), ``--spmd-backend`` torchtitan's backend (``partial_dtensor``, the default, or
``spmd_types``, with pipeline parallelism alone), ``--fsdp-reshard-after-forward``
torchtitan's FSDP2 policy; ``--no-tie-reduction`` leaves out ``PipelineTie.reduce_grads()``,
to show that the clip then refuses the step on every rank.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import torchtitan.distributed.parallel_dims
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpointer.base import ModelWrapper
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.embedding import Embedding
from torchtitan.models.qwen3 import model_registry
from torchtitan.models.qwen3.parallelize import parallelize_qwen3

from toolkit.nn import PipelineTie, TiedLinear, pipeline_clip_grad_norm_

PP = 2  # pipeline stages, one per rank of the pipeline
LAYERS = 4  # of the debug model's 8, to keep the CPU run short
BATCH, SEQ = 4, 16  # each data-parallel rank's batch: 4 microbatches of one sequence
STEPS = 3
RESHARD = ("default", "always", "never")  # torchtitan's fsdp_reshard_after_forward
BACKENDS = ("partial_dtensor", "spmd_types")  # torchtitan's; its default, spmd_types, is second


# --8<-- [start:model]
def qwen3_config(*, tied: bool = False) -> Any:  # noqa: ANN401 - torchtitan's config
    """The Qwen3 debug model of torchtitan; with ``tied=False``, without torchtitan's tie.

    torchtitan ties by sharing one Parameter and refuses that under pipeline parallelism;
    ``TiedLinear`` ties instead, so the embedding takes the head's initialiser.
    """
    config = model_registry("debugmodel").model
    config.layers = config.layers[:LAYERS]
    for layer in config.layers:  # FlexAttention has no backward on the CPU
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if not tied:
        config.enable_weight_tying = False
        config.tok_embeddings.param_init = config.lm_head.param_init
    return config


class TiedHead(nn.Module):
    """The LM head: a module, so that the split and FSDP2 see it, with no weight of its own."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.tied = TiedLinear(embedding)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The logits of the hidden states ``h``."""
        return self.tied(h)


def build_model(config: Any) -> nn.Module:  # noqa: ANN401 - torchtitan's config
    """The whole model on the meta device, its head reading the token embedding."""
    with torch.device("meta"):
        model = config.build()
    del model.lm_head  # the untied nn.Linear
    model.lm_head = TiedHead(model.tok_embeddings)
    return model


# --8<-- [end:model]


# --8<-- [start:stage]
class HeldEmbedding(Embedding):
    """The last stage's copy of the embedding: it holds the head's weight and looks nothing up.

    The stage's forward calls ``tok_embeddings`` on the hidden states it receives, so this
    passes them on. It stays a torchtitan ``Embedding``, under the embedding's name, so that
    its initialisation, FSDP2 and checkpoints treat it as the embedding.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Pass the hidden states on (named as the embedding's input, for torchtitan)."""
        return input


def tie_stage(stage: nn.Module) -> nn.Module:
    """Register the head's embedding in the stage that holds the head, if it is not there.

    torchtitan's split deep-copies the model and sets the modules of other stages to None:
    the last stage keeps a head whose ``TiedLinear`` reads a copy of the embedding that is
    no longer registered, so it would be neither trained, synchronised nor saved.
    """
    if stage.lm_head is not None and stage.tok_embeddings is None:
        embedding = stage.lm_head.tied.tied_module
        embedding.__class__ = HeldEmbedding
        stage.tok_embeddings = embedding
    return stage


def parallelize(stage: nn.Module, **kwargs: Any) -> nn.Module:  # noqa: ANN401
    """Apply torchtitan's ``parallelize_qwen3`` once the tie is registered in the stage."""
    stage = parallelize_qwen3(tie_stage(stage), **kwargs)
    if isinstance(stage.tok_embeddings, HeldEmbedding) and isinstance(
        stage.tok_embeddings, FSDPModule
    ):  # its own FSDP2 unit, run before the head that reads it: keep it unsharded till then
        stage.tok_embeddings.set_reshard_after_forward(False)
    if dist.get_backend() == "gloo":  # gloo has no PREMUL_SUM, which FSDP2 uses by default
        for module in stage.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return stage


# --8<-- [end:stage]


def use_the_cpu() -> None:
    """Build torchtitan's meshes on the CPU; it falls back to CUDA when it finds no accelerator.

    The one private name this script uses: if torchtitan renames it, this fails here.
    """
    module = torchtitan.distributed.parallel_dims
    if getattr(module, "device_type", None) not in ("cuda", "cpu"):
        raise RuntimeError("torchtitan.distributed.parallel_dims.device_type has changed")
    module.device_type = "cpu"


# --8<-- [start:build]
def split(
    dp: int,
    options: argparse.Namespace,
    model_of: Callable[[Any], nn.Module] = build_model,
    parallelize_fn: Callable[..., nn.Module] = parallelize,
) -> tuple[ParallelDims, tuple[Any, list[nn.Module], bool, bool]]:
    """Build torchtitan's meshes and split the model with its ``pipeline_llm``.

    Returns the meshes, and ``pipeline_llm``'s schedule, this rank's stages, and whether
    they hold the first and the last.
    """
    dims = ParallelDims(
        dp_replicate=1,
        dp_shard=dp,
        cp=1,
        tp=1,
        pp=PP,
        ep=1,
        world_size=PP * dp,
        spmd_backend=options.spmd_backend,
    )
    dims.build_mesh()
    set_spmd_backend(options.spmd_backend)  # as torchtitan's trainer does (default spmd_types)
    parallelism = ParallelismConfig(
        pipeline_parallel_degree=PP,
        data_parallel_shard_degree=dp,
        pipeline_parallel_schedule=options.schedule,
        fsdp_reshard_after_forward=options.fsdp_reshard_after_forward,
        spmd_backend=options.spmd_backend,
    )
    config = qwen3_config()
    # torchtitan's trainer does this: it sets the sharding the parallelisms read
    config.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    return dims, pipeline_llm(
        model_of(config),
        parallel_dims=dims,
        training=TrainingConfig(
            local_batch_size=BATCH, seq_len=SEQ, mixed_precision_param="float32"
        ),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder=tempfile.gettempdir(),
        device=torch.device("cpu"),
        model_config=config,
        parallelize_fn=parallelize_fn,
        loss_fn=CrossEntropyLoss(CrossEntropyLoss.Config()),
    )


def build(dp: int, options: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Split, parallelise and initialise this rank's stage; tie it; build its optimizer."""
    dims, (schedule, parts, first, last) = split(dp, options)
    (stage,) = parts  # one stage per rank with GPipe and 1F1B
    torch.manual_seed(seed + dist.get_rank())  # each stage initialised on its own
    stage.to_empty(device="cpu")
    with torch.no_grad():
        stage.init_weights()
    stage.train()
    tie = PipelineTie(stage, group=dims.get_mesh("pp").get_group())  # broadcasts stage 0's
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3, weight_decay=0.1)
    return {
        "schedule": schedule,
        "stage": stage,
        "first": first,
        "last": last,
        "tie": tie,
        "optimizer": optimizer,
        "dp_rank": dims.get_mesh("batch").get_local_rank() if dp > 1 else 0,
    }


# --8<-- [end:build]


# --8<-- [start:step]
def train_step(
    run: dict[str, Any], tokens: torch.Tensor, labels: torch.Tensor, *, reduce: bool = True
) -> dict[str, Any]:
    """One optimizer step over this data-parallel rank's part of the batch."""
    stage, optimizer = run["stage"], run["optimizer"]
    optimizer.zero_grad()
    part = slice(run["dp_rank"] * BATCH, (run["dp_rank"] + 1) * BATCH)
    losses: list[torch.Tensor] = []
    # torchtitan's loss is a sum over the tokens, divided by the whole batch's count.
    kwargs = {"losses": losses, "loss_kwargs": {"global_valid_tokens": labels.numel()}}
    if run["first"]:
        run["schedule"].step(tokens[part], return_outputs=False, **kwargs)
    elif run["last"]:
        run["schedule"].step(target=labels[part], return_outputs=False, **kwargs)
    if reduce:
        run["tie"].reduce_grads()  # moves the two copies' gradients into stage 0's, on every rank
    norm = pipeline_clip_grad_norm_(stage.parameters(), max_norm=1.0, tie=run["tie"])
    optimizer.step()
    run["tie"].broadcast()  # stage 0's stepped copy to the last stage's
    return {"norm": norm.item(), "losses": [loss.item() for loss in losses]}


# --8<-- [end:step]


def batches(dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same batches on every rank: tokens and their labels, for all replicas."""
    generator = torch.Generator().manual_seed(0)
    vocab = qwen3_config().vocab_size
    return [
        (
            torch.randint(0, vocab, (dp * BATCH, SEQ), generator=generator),
            torch.randint(0, vocab, (dp * BATCH, SEQ), generator=generator),
        )
        for _ in range(STEPS)
    ]


def full_state(stage: nn.Module) -> dict[str, torch.Tensor]:
    """The stage's weights, each whole, by its name in the whole model."""
    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        for name, value in stage.state_dict().items()
    }


def reference(start: dict[str, torch.Tensor], dp: int) -> dict[str, Any]:
    """Train torchtitan's own tied model in one process, from the pipeline's starting weights."""
    model = qwen3_config(tied=True).build()
    model.load_state_dict({**start, "lm_head.weight": start["tok_embeddings.weight"]})
    model.lm_head.weight = model.tok_embeddings.weight  # torchtitan's tie: one Parameter
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    steps = []
    for tokens, labels in batches(dp):
        optimizer.zero_grad()
        losses = []
        for x, y in zip(tokens.split(1), labels.split(1), strict=True):  # the microbatches
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
            (loss / labels.numel()).backward()
            losses.append(loss.item() / labels.numel())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        steps.append({"norm": norm.item(), "losses": losses})
    return {"steps": steps, "state": {k: v.detach() for k, v in model.state_dict().items()}}


def gathered_state(stage: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights, from every rank's stage."""
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, full_state(stage))
    return {name: value for state in states for name, value in state.items()}


# --8<-- [start:checkpoint]
def checkpoint(run: dict[str, Any]) -> dict[str, Any]:
    """What DCP saves and loads: the stage, by torchtitan's names, and its optimizer.

    torchtitan's ``ModelWrapper`` gives the stage's state dict under the whole model's names
    (the fused attention projection split as in Hugging Face checkpoints), and loads it back.
    Both stages save the tied weight under one name, ``tok_embeddings.weight``; DCP keeps one
    copy, and both load it.
    """
    return {
        "model": ModelWrapper(run["stage"]),
        "optimizer": get_optimizer_state_dict(run["stage"], run["optimizer"]),
    }


def torchtitan_tied_model(folder: str) -> nn.Module:
    """Load the pipeline's checkpoint into torchtitan's own tied model, in one process.

    The checkpoint holds the tied weight once, as ``tok_embeddings.weight``; in torchtitan's
    tied model ``lm_head.weight`` is that same Parameter, so it is left out of the load.
    """
    model = qwen3_config(tied=True).build()
    wrapper = ModelWrapper(model)
    state = {k: v for k, v in wrapper.state_dict().items() if k != "lm_head.weight"}
    dcp.load({"model": state}, checkpoint_id=folder)
    wrapper.load_state_dict(state)
    return model


# --8<-- [end:checkpoint]


def train(dp: int, options: argparse.Namespace) -> list[str]:
    """Train, resume and compare with one process; what differs, as seen from this rank."""
    reduce = not options.no_tie_reduction
    run = build(dp, options, seed=0)
    expected = reference(gathered_state(run["stage"]), dp)
    data = batches(dp)
    steps = []
    for number, (tokens, labels) in enumerate(data, 1):
        steps.append(train_step(run, tokens, labels, reduce=reduce))
        if number == STEPS - 1:
            folder = [tempfile.mkdtemp(prefix="torchtitan-pp-") if dist.get_rank() == 0 else ""]
            dist.broadcast_object_list(folder, src=0)
            dcp.save(checkpoint(run), checkpoint_id=folder[0])
            saved_state = gathered_state(run["stage"])
    state = gathered_state(run["stage"])

    # Resume after step 2 into stages built afresh from other weights.
    fresh = build(dp, options, seed=1)
    loaded = checkpoint(fresh)
    dcp.load(loaded, checkpoint_id=folder[0])
    set_optimizer_state_dict(fresh["stage"], fresh["optimizer"], loaded["optimizer"])
    resumed = train_step(fresh, *data[-1], reduce=reduce)

    problems = []
    for name, value in torchtitan_tied_model(folder[0]).state_dict().items():
        if not torch.equal(value, saved_state[name.replace("lm_head.", "tok_embeddings.")]):
            problems.append(f"torchtitan's tied model loads {name} other than saved")
    replica = slice(run["dp_rank"] * BATCH, (run["dp_rank"] + 1) * BATCH)
    for number, (got, want) in enumerate(zip(steps, expected["steps"], strict=True), 1):
        # float32 norms of the whole model differ in their last digits with the order of
        # the sums (torch's own clip and a float64 sum differ by about 3e-5 here)
        if abs(got["norm"] - want["norm"]) > 1e-4 * want["norm"]:
            problems.append(f"step {number}: norm {got['norm']} != {want['norm']}")
        want_losses = want["losses"][replica]
        if run["last"] and not torch.allclose(
            torch.tensor(got["losses"]), torch.tensor(want_losses), rtol=1e-5
        ):
            problems.append(f"step {number}: losses {got['losses']} != {want_losses}")
    for name, value in state.items():
        if not torch.allclose(value, expected["state"][name], rtol=1e-4, atol=1e-5):
            problems.append(f"weight {name} differs from the one-process model's")
    if resumed["losses"] != steps[-1]["losses"] or resumed["norm"] != steps[-1]["norm"]:
        problems.append(f"resumed step 3 {resumed} != uninterrupted {steps[-1]}")
    for name, value in gathered_state(fresh["stage"]).items():
        if not torch.equal(value, state[name]):
            problems.append(f"weight {name} after the resumed step 3 differs")
    return problems


def main() -> int:
    """Train, resume and check against one process; 1 if anything differs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedule", choices=["1F1B", "GPipe"], default="1F1B")
    parser.add_argument("--spmd-backend", choices=BACKENDS, default=BACKENDS[0])
    parser.add_argument("--fsdp-reshard-after-forward", choices=RESHARD, default=RESHARD[0])
    parser.add_argument("--no-tie-reduction", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    use_the_cpu()
    world = dist.get_world_size()
    if world % PP:
        raise SystemExit(f"run on a multiple of {PP} processes, not {world}")
    dp = world // PP
    if dp > 1 and args.spmd_backend == "spmd_types":
        raise SystemExit("torchtitan's FSDP2 set-up fails under spmd_types: see the guide")
    problems = train(dp, args)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, problems)
    failed = [f"rank {rank}: {p}" for rank, found in enumerate(gathered) for p in found]
    if dist.get_rank() == 0:
        layout = f"pp={PP} x dp={dp}, {args.schedule}, {args.spmd_backend}"
        print("\n".join(failed) or f"parity with one process ({layout}): all match", flush=True)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
