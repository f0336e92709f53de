"""tie_output_embeddings under PEFT adapters, against the stock tied model.

PEFT is a test dependency only: without it these tests are skipped. An adapter that leaves
the embedding and the head alone (LoRA on the attention) trains as on the stock model; one
that wraps the embedding (trainable tokens, LoRA on it, ``modules_to_save``) or the head would
have the lookup and the tied head read different weights, and is refused whichever comes
first, the tie or the adapter.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.nn import hf_models
from toolkit.nn import tie_output_embeddings

peft = pytest.importorskip("peft")

VOCAB = 61


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return hf_models.llama(vocab_size=VOCAB)


IDS = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


def adapted(model: LlamaForCausalLM, config: object) -> torch.nn.Module:
    torch.manual_seed(2)  # the same adapter weights on every model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's advice on tied embeddings
        return peft.get_peft_model(model, config)


def trained_names(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def generated(model: torch.nn.Module) -> torch.Tensor:
    prompt = IDS[:1, :3]
    return model.generate(  # type: ignore[no-any-return, operator]
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=6,
        do_sample=False,
    )


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
    assert model.lm_head is head


@pytest.mark.parametrize("name", list(ON_THE_EMBEDDING))
def test_tying_a_model_whose_embedding_has_an_adapter_is_refused(name: str) -> None:
    peft_model = adapted(llama(), ON_THE_EMBEDDING[name]())
    model = peft_model.get_base_model()
    head = model.lm_head
    with pytest.raises(RuntimeError, match=FIX):
        tie_output_embeddings(model)
    assert model.lm_head is head


@pytest.mark.parametrize("chunked_loss", [False, True])
def test_an_adapter_on_the_head_is_refused(chunked_loss: bool) -> None:
    """The tied head is no ``nn.Linear``, so PEFT refuses LoRA on it; ``modules_to_save``
    would train a copy of the head that reads a copy of the embedding no optimizer holds:
    the first forward refuses it."""
    model = llama()
    tie_output_embeddings(model, chunked_loss=chunked_loss)
    with pytest.raises(ValueError, match=r"TiedLinear.* is not supported"):  # PEFT's refusal
        adapted(model, peft.LoraConfig(target_modules=["q_proj", "lm_head"]))
    model = llama()
    tie_output_embeddings(model, chunked_loss=chunked_loss)
    config = peft.LoraConfig(target_modules=["q_proj"], modules_to_save=["lm_head"])
    peft_model = adapted(model, config)
    with pytest.raises(RuntimeError, match=FIX) as error:
        peft_model(input_ids=IDS, labels=IDS)
    assert "LlamaForCausalLM's output embeddings are a peft." in str(error.value)
    with pytest.raises(RuntimeError, match=FIX):  # where PEFT calls the forward without hooks
        model.forward(input_ids=IDS)


def test_the_refusal_of_lora_on_the_embedding_names_peft_s_class() -> None:
    model = llama()
    tie_output_embeddings(model)
    peft_model = adapted(model, ON_THE_EMBEDDING["lora"]())
    with pytest.raises(RuntimeError, match=r"are a peft\.tuners\.lora\.layer\.Embedding, a module"):
        peft_model(input_ids=IDS, labels=IDS)


@pytest.mark.parametrize("on", ["embedding", "head"])
def test_the_refusals_hold_where_the_causal_lm_calls_a_nested_decoder(on: str) -> None:
    """OPT keeps its embedding in ``model.decoder``, which its causal LM calls directly, past
    ``model``: the checks sit on the module that holds the embedding."""
    torch.manual_seed(0)
    model = hf_models.opt()
    tie_output_embeddings(model)
    if on == "embedding":
        config = peft.LoraConfig(target_modules=["embed_tokens", "q_proj"])
    else:
        config = peft.LoraConfig(target_modules=["q_proj"], modules_to_save=["lm_head"])
    peft_model = adapted(model, config)
    with pytest.raises(RuntimeError, match="without tie_output_embeddings"):
        peft_model(input_ids=IDS, labels=IDS)


def test_lora_on_the_attention_trains_with_the_chunked_loss_as_on_the_stock_model() -> None:
    """PEFT's model calls the base model's forward, which takes the tied head's loss."""

    def config() -> object:
        return peft.LoraConfig(target_modules=["q_proj", "v_proj"], init_lora_weights=False)

    stock = llama()
    model = copy.deepcopy(stock)
    head = tie_output_embeddings(model, chunked_loss=True)
    widths: list[int] = []  # of the head's logits, call by call
    head.register_forward_hook(lambda module, args, out: widths.append(out.shape[-1]))
    stock_losses, stock_logits = train(adapted(stock, config()))
    losses, logits = train(adapted(model, config()))
    assert widths == [VOCAB]  # three losses without logits, then the logits without labels
    assert losses == pytest.approx(stock_losses, rel=0, abs=1e-5)
    torch.testing.assert_close(logits, stock_logits, rtol=1e-4, atol=1e-5)
