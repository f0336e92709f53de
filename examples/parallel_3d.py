"""Train one tied language model with pipeline, FSDP2 and tensor parallelism on 8 CPU ranks.

    torchrun --standalone --nproc-per-node 8 examples/parallel_3d.py

The ranks form a 2 x 2 x 2 mesh ``(pp, dp, tp)``: two pipeline stages under ``Schedule1F1B``,
each stage sharded by FSDP2 over two data-parallel replicas and by tensor parallelism over
two ranks. Stage 0 looks the tokens up in the embedding; stage 1 holds the per-task adapters
and the head, a ``TiedLinear`` reading its own copy of the embedding, which tensor
parallelism shards on the vocabulary; the loss is the head's ``cross_entropy``, on each
rank's part of the vocabulary. ``PipelineTie`` moves the two copies' gradients into stage
0's copy, ``pipeline_clip_grad_norm_`` clips across all the meshes, counting the tied weight
once, and the tie broadcasts stage 0's copy after the optimizer step.

The model is trained twice, with two tensor-parallel plans (``--plan tp``, ``sp`` or
``both``, the default): the tensor-parallel guide's, where the norms and the adapters stay
unsharded, and the sequence-parallel one, where the activations between the blocks are
sharded on the sequence. After three steps of each (with a DCP save after the second and a
resume into fresh stages) every rank checks that the losses, the gradient norms and the
weights are those of the whole model trained in one process, and the script exits with
status 1 if any differs. ``--report PATH`` writes what each rank measured as JSON.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from toolkit.nn import (
    ModuleDefaultDict,
    PipelineTie,
    TiedLinear,
    pipeline_clip_grad_norm_,
    sync_entries,
)

VOCAB, DIM, SEQ = 17, 8, 6  # 17 rows: split 9 + 8 by tp, then 5 + 4 and 4 + 4 by dp
STEPS, MICROBATCHES, ROWS = 3, 2, 8  # ROWS per step: 2 replicas x 2 microbatches x 2 rows
LR, MAX_NORM = 0.2, 0.5  # MAX_NORM is below every step's norm, so clipping always scales
TASK = "lm"
PLANS = ("tp", "sp")


# --8<-- [start:model]
class Block(nn.Module):
    """A residual MLP block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The block's output: ``h`` plus the MLP of its norm."""
        out: torch.Tensor = h + self.down(torch.tanh(self.up(self.norm(h))))
        return out


class TiedLM(nn.Module):
    """The whole model; a pipeline stage is a copy that keeps only its parts."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm: nn.LayerNorm | None = nn.LayerNorm(DIM)
        self.adapters: ModuleDefaultDict[nn.Linear] | None = ModuleDefaultDict(
            functools.partial(nn.Linear, DIM, DIM)
        )
        self.head = TiedLinear(self.emb)  # not a module: it reads self.emb.weight on each call
        self.first = self.last = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The tokens' (first stage) or the hidden state's way through this copy's parts.

        The last part ends before the head: ``loss`` takes its output.
        """
        h = self.emb(x) if self.first else x
        for block in self.blocks:
            h = block(h)
        if not self.last:
            return h
        assert self.norm is not None
        assert self.adapters is not None
        h = self.norm(h)
        out: torch.Tensor = h + self.adapters[TASK](h)
        return out

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The head's cross entropy of the last hidden state, without the logits."""
        return self.head.cross_entropy(h, targets)


def split(model: TiedLM, stage: int) -> TiedLM:
    """Stage 0 (embedding, block 0) or stage 1 (block 1, adapters, head and the tied copy).

    The copy keeps every name of the whole model, so its checkpoint lines up with the whole
    model's, and the deep copy re-ties the head to the copy's own embedding.
    """
    part = copy.deepcopy(model)
    part.blocks[1 - stage] = nn.Identity()
    part.first, part.last = stage == 0, stage == 1
    if stage == 0:
        part.norm = part.adapters = None
    return part


# --8<-- [end:model]


# --8<-- [start:plans]
def tp_plan(stage: int) -> dict[str, ParallelStyle]:
    """The tensor-parallel guide's plan: the norms and the adapters stay unsharded."""
    return {
        # The embedding sharded on the vocabulary, on both stages: stage 1 never looks a
        # token up in its copy, but the head's cross entropy reads its rows.
        "emb": RowwiseParallel(input_layouts=Replicate()),
        f"blocks.{stage}.up": ColwiseParallel(),
        f"blocks.{stage}.down": RowwiseParallel(),
    }


def sp_plan(stage: int) -> dict[str, ParallelStyle]:
    """The sequence-parallel plan: the activations between the blocks are ``Shard(1)``.

    What runs token by token (the norms, the adapters) runs on this rank's part of the
    sequence, with its weights replicated; each block gathers the sequence before its MLP
    and reduce-scatters it back after.
    """
    plan: dict[str, ParallelStyle] = {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        f"blocks.{stage}.norm": SequenceParallel(),
        f"blocks.{stage}.up": ColwiseParallel(input_layouts=Shard(1)),
        f"blocks.{stage}.down": RowwiseParallel(output_layouts=Shard(1)),
    }
    if stage == 1:
        plan |= {"norm": SequenceParallel(), f"adapters.{TASK}": SequenceParallel()}
    return plan


# --8<-- [end:plans]


def whole_model(seed: int) -> TiedLM:
    """The whole model with the task's adapter, its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    model = TiedLM()
    assert model.adapters is not None
    model.adapters[TASK]
    return model


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's global batch: ``(tokens, targets)`` of ``ROWS`` rows."""
    gen = torch.Generator().manual_seed(1234)
    return [
        (
            torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen),
            torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen),
        )
        for _ in range(STEPS)
    ]


# --8<-- [start:build]
def build(mesh: DeviceMesh, plan: str, seed: int = 0, *, tied: bool = True) -> dict[str, Any]:
    """This rank's stage: split, adapters synchronised, tensor-parallel, FSDP2, scheduled."""
    pp = mesh["pp"].get_local_rank()
    stage = split(whole_model(seed), pp)
    # Each rank creates the task adapters its own data needs; here only replica 0 has seen
    # the task. Every rank of the last stage must hold the same entries before wrapping.
    last_stage = dist.new_group(mesh.mesh[1].flatten().tolist())
    if pp == 1:
        assert stage.adapters is not None
        if mesh["dp"].get_local_rank() != 0:
            del stage.adapters[TASK]
        sync_entries(stage, group=last_stage)
        stage.adapters.default_factory = None  # a miss after wrapping raises KeyError
    # Tensor parallelism over tp, with either plan.
    parallelize_module(stage, mesh["tp"], tp_plan(pp) if plan == "tp" else sp_plan(pp))
    # FSDP2 over dp: the block in a unit of its own, the rest (the embedding, and on the
    # last stage the head that reads it) in the root unit. The loss reads the embedding's
    # weight, so it runs as a forward of the root unit, with the weight unsharded.
    fully_shard(stage.blocks[pp], mesh=mesh["dp"])
    fully_shard(stage, mesh=mesh["dp"])
    register_fsdp_forward_method(stage, "loss")
    # The tie: the copies of emb.weight on the pipeline's two stages.
    tie = PipelineTie(stage, mesh["pp"]) if tied else None
    schedule = Schedule1F1B(
        PipelineStage(stage, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group()),
        n_microbatches=MICROBATCHES,
        loss_fn=stage.loss,
    )
    opt = torch.optim.SGD(stage.parameters(), lr=LR)
    return {"mesh": mesh, "stage": stage, "tie": tie, "schedule": schedule, "opt": opt}


# --8<-- [end:build]


# --8<-- [start:step]
def train_step(run: dict[str, Any], idx: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """One step on this replica's rows: the losses of its microbatches and the total norm."""
    mesh, stage, tie = run["mesh"], run["stage"], run["tie"]
    replica = mesh["dp"].get_local_rank()
    rows = slice(replica * ROWS // 2, (replica + 1) * ROWS // 2)
    losses: list[torch.Tensor] = []
    if mesh["pp"].get_local_rank() == 0:
        run["schedule"].step(idx[rows])
    else:
        run["schedule"].step(target=targets[rows], losses=losses)
    if tie is not None:
        tie.reduce_grads()  # one all_reduce over pp: the local shards, into stage 0's copy
    norm = pipeline_clip_grad_norm_(stage.parameters(), MAX_NORM, group=mesh["pp"], tie=tie)
    run["opt"].step()
    if tie is not None:
        tie.broadcast()  # stage 0's stepped copy to stage 1's, which holds no gradient
    run["opt"].zero_grad()
    return {"losses": [_full(loss).item() for loss in losses], "norm": norm.item()}


# --8<-- [end:step]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_state(stage: nn.Module) -> dict[str, torch.Tensor]:
    """The stage's state with every sharded tensor gathered whole."""
    state = get_model_state_dict(stage, options=StateDictOptions(full_state_dict=True))
    return {key: torch.as_tensor(value).detach().clone() for key, value in state.items()}


class _NoModules:
    """A module tracker that tracks nothing: every collective is counted under "Global"."""

    name, is_bw, activation_checkpointing = "Global", False, False
    module_parents_dict: dict[str, set[str]] = {"Global": set()}  # noqa: RUF012 - read only

    def __enter__(self) -> None:
        pass

    def __exit__(self, *args: object) -> None:
        pass


class CollectiveCount(CommDebugMode):  # type: ignore[no-untyped-call]
    """CommDebugMode's count of collectives, and the size of each c10d all_reduce.

    The tracker's hooks cannot follow a pipeline stage's forward calls (it loses its
    parents) nor its autograd.grad backward, so it is replaced; the count is the same.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.advanced_module_tracker = _NoModules()  # type: ignore[assignment]
        self.all_reduce_sizes: list[int] = []

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> object:
        if getattr(func, "_overloadpacket", None) is torch.ops.c10d.allreduce_:
            self.all_reduce_sizes.append(sum(t.numel() for t in args[0]))
        return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[no-untyped-call]

    def counts(self) -> dict[str, Any]:
        """The count of each collective, and the sizes of the c10d all_reduces."""
        counts: dict[str, Any] = {str(op): n for op, n in self.get_comm_counts().items()}
        return {**counts, "all_reduce_sizes": sorted(self.all_reduce_sizes)}


def counted_step(run: dict[str, Any], batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """The collectives of one training step that CommDebugMode sees, by name."""
    comm = CollectiveCount()
    with comm:
        train_step(run, *batch)
    return comm.counts()


def reference() -> dict[str, Any]:
    """The whole model in one process, as the pipeline should train it (with either plan)."""
    model = whole_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for idx, targets in batches():
        chunks = 2 * MICROBATCHES  # replica-major, as the replicas' losses are gathered
        h_of = functools.partial(_reference_forward, model)
        losses = [
            F.cross_entropy(h_of(i).flatten(0, 1), t.flatten())
            for i, t in zip(idx.chunk(chunks), targets.chunk(chunks), strict=True)
        ]
        torch.autograd.backward(torch.stack(losses).mean())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        steps.append({"losses": [loss.item() for loss in losses], "norm": norm.item()})
    return {"steps": steps, "state": model.state_dict()}


def _reference_forward(model: TiedLM, idx: torch.Tensor) -> torch.Tensor:
    """The logits, with the head written out: ``F.linear`` on the embedding's weight."""
    return F.linear(model(idx), model.emb.weight)


def train(mesh: DeviceMesh, plan: str, expected: dict[str, Any]) -> dict[str, Any]:
    """Train with ``plan``, resume, and compare with one process: what this rank measured."""
    rank = dist.get_rank()
    data = batches()

    # The communication of the second step (the first also infers the pipeline's shapes),
    # untied here and tied below.
    untied = build(mesh, plan, tied=False)
    train_step(untied, *data[0])
    counts = {"untied": counted_step(untied, data[1])}

    run = build(mesh, plan)
    steps = []
    for number, batch in enumerate(data, 1):
        if number == 2:
            comm = CollectiveCount()
            with comm:
                steps.append(train_step(run, *batch))
            counts["tied"] = comm.counts()
        else:
            steps.append(train_step(run, *batch))
        if rank == 4:  # the last stage's first rank holds the losses
            mean = sum(steps[-1]["losses"]) / MICROBATCHES
            print(f"{plan} step {number}: loss {mean:.4f} (replica 0)", flush=True)
        if number == STEPS - 1:
            folder = [tempfile.mkdtemp(prefix="parallel-3d-") if rank == 0 else ""]
            dist.broadcast_object_list(folder, src=0)
            to_save = get_model_state_dict(run["stage"])
            dcp.save(to_save, checkpoint_id=folder[0])  # type: ignore[attr-defined]
    state = full_state(run["stage"])

    # Resume after step 2 into stages built afresh from other weights.
    fresh = build(mesh, plan, seed=1)
    loaded = get_model_state_dict(fresh["stage"])
    dcp.load(loaded, checkpoint_id=folder[0])  # type: ignore[attr-defined]
    set_model_state_dict(fresh["stage"], loaded)
    resumed = train_step(fresh, *data[-1])
    resumed_state = full_state(fresh["stage"])

    problems = []
    last = mesh["pp"].get_local_rank() == 1
    for number, (got, want) in enumerate(zip(steps, expected["steps"], strict=True), 1):
        replica = mesh["dp"].get_local_rank()
        want_losses = want["losses"][replica * MICROBATCHES : (replica + 1) * MICROBATCHES]
        if not torch.allclose(torch.tensor(got["norm"]), torch.tensor(want["norm"]), rtol=1e-5):
            problems.append(f"{plan} step {number}: norm {got['norm']} != {want['norm']}")
        if last and not torch.allclose(torch.tensor(got["losses"]), torch.tensor(want_losses)):
            problems.append(f"{plan} step {number}: losses {got['losses']} != {want_losses}")
    for key, value in state.items():
        if not torch.allclose(value, expected["state"][key], rtol=1e-5, atol=1e-6):
            problems.append(f"{plan}: weight {key} differs from the one-process model's")
        if not torch.equal(resumed_state[key], value):
            problems.append(f"{plan}: weight {key} after the resumed step 3 differs")
    if resumed != steps[-1]:
        problems.append(f"{plan}: resumed step 3 {resumed} != uninterrupted {steps[-1]}")
    return {
        "steps": steps,
        "resumed": resumed,
        "keys": sorted(state),
        "counts": counts,
        "shard": _local(run["stage"].emb.weight).numel(),  # what the tie reduces
        "meshes": {
            name: list(param.device_mesh.mesh_dim_names or ())
            for name, param in run["stage"].named_parameters()
        },
        "problems": problems,
    }


def main() -> int:
    """Train with each plan, resume, check against one process; 1 if anything differs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", choices=[*PLANS, "both"], default="both")
    parser.add_argument("--report", help="write each rank's measurements to this JSON file")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    rank = dist.get_rank()
    expected = reference()
    plans = PLANS if args.plan == "both" else (args.plan,)
    result = {
        "rank": rank,
        "coords": [mesh[name].get_local_rank() for name in ("pp", "dp", "tp")],
        "expected": expected["steps"],
        "plans": {plan: train(mesh, plan, expected) for plan in plans},
    }
    results: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    failed = [
        f"rank {r['rank']}: {p}"
        for r in results
        for run in r["plans"].values()
        for p in run["problems"]
    ]
    if rank == 0:
        if args.report:
            with open(args.report, "w") as file:
                json.dump(results, file)
        checked = " and ".join(plans)
        print(
            "\n".join(failed)
            or f"parity with one process ({checked}): losses, norms and weights match"
        )
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
