"""A transformers model tied by tie_output_embeddings, trained under FSDP2 on gloo ranks.

Each decoder layer is its own ``fully_shard`` unit, and so is the embedding, kept unsharded
after its forward (a placement that docs/sharded-training.md supports); the root holds the
rest. The loss is transformers' own, from the logits, or ``head.cross_entropy`` in a method
registered with ``register_fsdp_forward_method``. ``test_transformers_fsdp.py`` compares the
losses and weights with ``reference_training``: the stock tied model in one process.

transformers is imported by the functions, not by this module, so that the launches of
other world sizes, which import it to read ``WORLD_SIZES``, do not pay for it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

from toolkit.nn import tie_output_embeddings

WORLD_SIZES = (2,)
VOCAB = 17  # not divided by the ranks: the embedding's shards are uneven
ROWS_PER_RANK = 2
SEQ = 6
STEPS = 3
LR = 0.5
FULL = StateDictOptions(full_state_dict=True)


def build_llama() -> nn.Module:
    """The tiny tied Llama, with the same initial weights on every call."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    class ChunkedLossLlama(LlamaForCausalLM):
        def chunked_loss(self, ids: torch.Tensor) -> torch.Tensor:
            hidden = self.model(ids).last_hidden_state
            return self.lm_head.cross_entropy(hidden[:, :-1], ids[:, 1:])

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return ChunkedLossLlama(config)


def batches(world_size: int) -> list[torch.Tensor]:
    """The global batch of each step; rank ``r`` trains on its rows ``rank_rows(r)``."""
    gen = torch.Generator().manual_seed(7)
    return [
        torch.randint(0, VOCAB, (ROWS_PER_RANK * world_size, SEQ), generator=gen)
        for _ in range(STEPS)
    ]


def rank_rows(rank: int) -> slice:
    return slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict without the stock model's head, whose weight is the embedding's."""
    state = get_model_state_dict(model, options=FULL) if dist.is_initialized() else None
    items = (state or model.state_dict()).items()
    return {k: v.detach().clone() for k, v in items if k != "lm_head.weight"}


def reference_training(world_size: int) -> dict[str, Any]:
    """The stock tied model trained in one process on the global batches."""
    model = build_llama()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, states = [], [_state(model)]
    for ids in batches(world_size):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        states.append(_state(model))
    return {"losses": losses, "states": states}


def train(loss_path: str, world_size: int) -> dict[str, Any]:
    """Tie, shard and train; the global loss of each step and the full states."""
    rank = dist.get_rank()
    model: Any = build_llama()
    head = tie_output_embeddings(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.model.embed_tokens, reshard_after_forward=False)
    fully_shard(model)
    register_fsdp_forward_method(model, "chunked_loss")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, states = [], [_state(model)]
    for ids in batches(world_size):
        rows = ids[rank_rows(rank)]
        logits_path = loss_path == "logits"
        loss = model(rows, labels=rows).loss if logits_path else model.chunked_loss(rows)
        loss.backward()  # FSDP2 averages the gradients over the ranks
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # every rank counts as many tokens: the mean of the means
        losses.append(total.item() / world_size)
        states.append(_state(model))
    return {
        "losses": losses,
        "states": states,
        "tied": head.tied_module is model.model.embed_tokens and model.lm_head is head,
    }


def checks(world_size: int, checkpoint_dir: Path) -> dict[str, Callable[[], Any]]:
    """The transformers checks at ``world_size``."""
    del checkpoint_dir  # nothing is saved
    if world_size not in WORLD_SIZES:
        return {}
    return {
        "hf/fsdp2_logits": lambda: train("logits", world_size),
        "hf/fsdp2_chunked_loss": lambda: train("chunked_loss", world_size),
    }
