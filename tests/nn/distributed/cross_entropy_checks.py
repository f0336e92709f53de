"""TiedLinear.cross_entropy on gloo ranks: under FSDP2, and under tensor parallelism.

Under FSDP2 the tiny tied LM of ``tiny_lm`` trains with its loss taken by
``head.cross_entropy``: inside the root's forward, or in a method registered with
``register_fsdp_forward_method``. The test compares the losses and weights with
``tiny_lm.reference_training``, which takes ``F.cross_entropy`` of ``F.linear(h, emb.weight)``
in one process. Under tensor parallelism (the embedding's weight sharded on the vocabulary) each
rank computes the loss from its rows, compared with ``F.cross_entropy`` in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from tests.nn.distributed.tiny_lm import (
    DIM,
    LR,
    VOCAB,
    TinyLM,
    batches,
    initial_state,
    rank_rows,
)
from toolkit.nn import TiedLinear

WORLD_SIZES = (2,)
STEPS = 3
FULL = StateDictOptions(full_state_dict=True)


class LossInForwardLM(TinyLM):
    """The root's forward returns the loss, taken by ``head.cross_entropy``."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.out.head.cross_entropy(self.out.norm(self.features(idx)), targets)


class LossMethodLM(TinyLM):
    """The root's forward returns the final hidden states; ``loss`` takes the cross-entropy."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out.norm(self.features(idx))  # type: ignore[no-any-return]

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.out.head.cross_entropy(h, targets)


def _sharded(model: nn.Module) -> nn.Module:
    model.load_state_dict(initial_state())
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(model)
    return model


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=FULL).items()}


def train(where: str, world_size: int) -> dict[str, Any]:
    """Train for ``STEPS`` steps with the loss taken in the root's forward or a method."""
    rank = dist.get_rank()
    model = _sharded(LossInForwardLM() if where == "forward" else LossMethodLM())
    if where == "method":
        register_fsdp_forward_method(model, "loss")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, states = [], [_full_state(model)]
    for idx, targets in batches(world_size, STEPS):
        rows, wanted = idx[rank_rows(rank)], targets[rank_rows(rank)]
        if where == "forward":
            loss = model(rows, wanted)
        else:
            assert isinstance(model, LossMethodLM)
            loss = model.loss(model(rows), wanted)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        states.append(_full_state(model))
    return {"losses": losses, "states": states}


def _error(call: Callable[[], object]) -> str:
    try:
        call()
    except RuntimeError as error:
        return str(error)
    raise AssertionError("cross_entropy on a sharded weight did not raise")


def sharded_outside_forward() -> str:
    """The error for a call outside any forward, while FSDP2 holds the weight sharded."""
    model = _sharded(TinyLM())
    idx, targets = batches(dist.get_world_size())[0]
    return _error(lambda: model.out.head.cross_entropy(torch.randn(*idx.shape, DIM), targets))


def tensor_parallel_case() -> tuple[nn.Embedding, torch.Tensor, torch.Tensor]:
    """The embedding, input and targets of the tensor-parallel check, the same on every rank
    and in the test's own process."""
    generator = torch.Generator().manual_seed(7)
    embedding = nn.Embedding(VOCAB, DIM)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(VOCAB, DIM, generator=generator))
    x = torch.randn(6, DIM, generator=generator)
    targets = torch.randint(0, VOCAB, (6,), generator=generator)
    targets[2] = -100
    return embedding, x, targets


def tensor_parallel() -> dict[str, Any]:
    """The loss and gradients with the embedding's weight sharded on the vocabulary, and the
    collectives that forward and backward issued, by name, as ``CommDebugMode`` counts them."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    embedding, x, targets = tensor_parallel_case()
    embedding.weight = nn.Parameter(distribute_tensor(embedding.weight.detach(), mesh, [Shard(0)]))
    head = TiedLinear(embedding)
    x.requires_grad_()
    with CommDebugMode() as comm:
        loss = head.cross_entropy(x, targets, label_smoothing=0.1, chunk_size=4)
        loss.backward()
    grad = embedding.weight.grad
    assert isinstance(grad, DTensor)
    return {
        "loss": loss.detach(),
        "x_grad": x.grad,
        "weight_grad": grad.full_tensor(),
        "collectives": {str(op): count for op, count in comm.get_comm_counts().items()},
    }


def checks(world_size: int, checkpoint_dir: Path) -> dict[str, Callable[[], Any]]:
    """The cross-entropy checks at ``world_size``."""
    del checkpoint_dir  # nothing is saved
    if world_size not in WORLD_SIZES:
        return {}
    return {
        "cross_entropy/forward": lambda: train("forward", world_size),
        "cross_entropy/method": lambda: train("method", world_size),
        "cross_entropy/sharded_outside_forward": sharded_outside_forward,
        "cross_entropy/tensor_parallel": tensor_parallel,
    }


def run_alone(world_size: int) -> dict[str, Any]:
    """Run only these checks on a rank (for working on them without the other setups)."""
    out: dict[str, Any] = {}
    dist.init_process_group("gloo")
    try:
        for name, check in checks(world_size, Path()).items():
            out[name] = check()
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return out
