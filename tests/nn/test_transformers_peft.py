"""tie_output_embeddings under PEFT adapters, against the stock tied model.

PEFT is a test dependency only: without it these tests are skipped. An adapter that leaves
the embedding alone (LoRA on the attention) trains as on the stock model; one that wraps the
embedding (trainable tokens, LoRA on it, ``modules_to_save``) would have the lookup and the
tied head read different weights, and is refused whichever comes first, the tie or the
adapter.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from toolkit.nn import tie_output_embeddings

peft = pytest.importorskip("peft")

VOCAB = 61


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


IDS = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


def adapted(model: LlamaForCausalLM, config: object) -> torch.nn.Module:
    torch.manual_seed(2)  # the same adapter weights on every model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's advice on tied embeddings
        return peft.get_peft_model(model, config)


def train(model: torch.nn.Module, steps: int = 3) -> tuple[list[float], torch.Tensor]:
    """Losses of ``steps`` SGD steps, then the logits."""
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trained, lr=1.0)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model(input_ids=IDS).logits


def test_lora_on_the_attention_trains_as_on_the_stock_model() -> None:
    def config() -> object:
        return peft.LoraConfig(target_modules=["q_proj", "v_proj"], init_lora_weights=False)

    stock = llama()
    model = copy.deepcopy(stock)
    tie_output_embeddings(model)
    stock_losses, stock_logits = train(adapted(stock, config()))
    losses, logits = train(adapted(model, config()))
    assert losses == pytest.approx(stock_losses, rel=0, abs=1e-6)
    assert stock_losses[-1] < stock_losses[0]
    torch.testing.assert_close(logits, stock_logits)


ON_THE_EMBEDDING: dict[str, Callable[[], object]] = {
    "trainable-token-indices": lambda: peft.LoraConfig(
        target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [1, 2, 3]}
    ),
    "trainable-tokens": lambda: peft.TrainableTokensConfig(
        target_modules=["embed_tokens"], token_indices=[1, 2, 3]
    ),
    "lora": lambda: peft.LoraConfig(target_modules=["embed_tokens", "q_proj"]),
    "lora-ensure-weight-tying": lambda: peft.LoraConfig(
        target_modules=["embed_tokens", "q_proj"], ensure_weight_tying=True
    ),
    "modules-to-save": lambda: peft.LoraConfig(
        target_modules=["q_proj"], modules_to_save=["embed_tokens"]
    ),
    "modules-to-save-ensure-weight-tying": lambda: peft.LoraConfig(
        target_modules=["q_proj"], modules_to_save=["embed_tokens"], ensure_weight_tying=True
    ),
}
FIX = "train such an adapter on the stock model, without tie_output_embeddings"


@pytest.mark.parametrize("name", list(ON_THE_EMBEDDING))
def test_an_adapter_on_the_embedding_after_the_tie_is_refused_at_the_first_call(
    name: str,
) -> None:
    model = llama()
    head = tie_output_embeddings(model)
    peft_model = adapted(model, ON_THE_EMBEDDING[name]())
    model.tie_weights()  # leaves the head on the embedding it reads
    with pytest.raises(RuntimeError, match=FIX):
        peft_model(input_ids=IDS, labels=IDS)
    hidden = torch.randn(2, 7, 16)
    with pytest.raises(RuntimeError, match=FIX):
        head.cross_entropy(hidden, IDS)


@pytest.mark.parametrize("name", list(ON_THE_EMBEDDING))
def test_tying_a_model_whose_embedding_has_an_adapter_is_refused(name: str) -> None:
    peft_model = adapted(llama(), ON_THE_EMBEDDING[name]())
    model = peft_model.get_base_model()
    head = model.lm_head
    with pytest.raises(RuntimeError, match=FIX):
        tie_output_embeddings(model)
    assert model.lm_head is head
