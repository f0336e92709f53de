"""tie_output_embeddings under accelerate's FSDP2, against the stock tied model.

accelerate is a test dependency only: without it these tests are skipped. On the CPU,
``Accelerator`` runs DDP instead of FSDP, so each gloo rank calls the function that
``Accelerator.prepare`` (and the Trainer) calls for FSDP2, ``fsdp2_prepare_model``, with an
accelerator whose state holds the FSDP2 plugin. It shards the decoder layers, then puts the
final norm, the embedding and, on a tied model, the head that reads its weight in one unit.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaForCausalLM

from tests.nn import hf_models
from tests.nn.distributed.tiny_lm import full_state
from tests.nn.ranks import process_group, run_processes
from toolkit.nn import TiedLinear, tie_output_embeddings

accelerate = pytest.importorskip("accelerate")

VOCAB = 17
STEPS = [
    torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(seed))
    for seed in range(3)
]


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return hf_models.llama(vocab_size=VOCAB)


def prepare(model: torch.nn.Module) -> torch.nn.Module:
    """``Accelerator.prepare``'s FSDP2 path on this rank, as on a GPU."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin  # noqa: PLC0415
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model  # noqa: PLC0415

    accelerator = Accelerator(cpu=True)
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        reshard_after_forward=True,
    )
    return fsdp2_prepare_model(accelerator, model)  # type: ignore[no-any-return]


Result = tuple[list[float], list[dict[str, torch.Tensor]], list[str]]


def train(variant: str) -> Result:
    """One rank's run of the stock tied model, or of it tied by tie_output_embeddings, with
    the chunked loss in its forward (``"lean"``) or without."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    rank = dist.get_rank()
    model = llama()
    tied = variant != "stock"
    if tied:
        head = tie_output_embeddings(model, chunked_loss=variant == "lean")
    model = prepare(model)
    units = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, states = [], []
    for ids in STEPS:
        rows = ids[2 * rank : 2 * rank + 2]
        output = model(rows, labels=rows)
        assert (output.logits is None) == (variant == "lean")
        loss = output.loss
        loss.backward()  # FSDP2 averages the gradients over the ranks
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / 2)
        states.append({k: v for k, v in full_state(model).items() if k != "lm_head.weight"})
    if tied:
        assert model.lm_head is head
        assert head.weight is model.model.embed_tokens.weight
        assert isinstance(head, TiedLinear)
    return losses, states, units


VARIANTS = ("stock", "tied", "lean")


def all_in_a_process() -> dict[str, Result]:
    with process_group():
        return {variant: train(variant) for variant in VARIANTS}


def test_fsdp2_prepare_model_trains_the_tied_model_as_the_stock_model_distributed() -> None:
    stock = llama()
    initial = {k: v.clone() for k, v in stock.state_dict().items() if k != "lm_head.weight"}
    per_rank = run_processes(2, all_in_a_process, timeout=300)
    for result in per_rank:
        expected_losses, expected_states, expected_units = result["stock"]
        for variant, close in (("tied", 1e-6), ("lean", 1e-5)):  # the lean loss: chunked sums
            losses, states, units = result[variant]
            # The same units: the layers, the tail (norm, embedding, head) and the root.
            assert units == expected_units
            assert "lm_head" in units
            torch.testing.assert_close(losses, expected_losses, rtol=close, atol=close)
            for actual, expected in zip(states, expected_states, strict=True):
                assert list(actual) == list(expected) == list(initial)
                torch.testing.assert_close(actual, expected, rtol=close, atol=close)
    # As the stock tied model trains in one process on the whole batches.
    opt = torch.optim.SGD(stock.parameters(), lr=0.5)
    for ids, loss in zip(STEPS, expected_losses, strict=True):
        step = stock(ids, labels=ids).loss
        step.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(step.item(), loss, rtol=1e-5, atol=1e-5)
    embedding = "model.embed_tokens.weight"
    torch.testing.assert_close(stock.state_dict()[embedding], states[-1][embedding])
    assert not torch.equal(states[-1][embedding], initial[embedding])  # it trained


def test_the_head_stays_a_module_of_the_model_without_a_parameter() -> None:
    """What finds the head by name (accelerate's units, PEFT's targets, hooks) finds it."""
    stock = llama()
    model = copy.deepcopy(stock)
    head = tie_output_embeddings(model)
    assert [name for name, _ in model.named_modules()] == [
        name for name, _ in stock.named_modules()
    ]
    assert model.get_submodule("lm_head") is head
    assert list(head.parameters()) == []
    assert list(head.buffers()) == []
    assert "(lm_head): TiedLinear(in_features=16, out_features=17" in repr(model)
