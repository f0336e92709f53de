"""tie_output_embeddings under PEFT adapters, against the stock tied model.

PEFT is a test dependency only: without it these tests are skipped. An adapter that leaves
the embedding alone (LoRA on the attention, LoRA on ``lm_head``, ``lm_head`` in
``modules_to_save``) trains as on the stock model; one that wraps the embedding (trainable
tokens, LoRA on it, ``modules_to_save``) would have the lookup and the tied head read
different weights, and is refused whichever comes first, the tie or the adapter; so is
``ensure_weight_tying`` on an adapter of ``lm_head``, which PEFT could not tie.
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


ON_THE_HEAD: dict[str, Callable[[], object]] = {
    "lora": lambda: peft.LoraConfig(
        target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False
    ),
    "modules-to-save": lambda: peft.LoraConfig(
        target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], init_lora_weights=False
    ),
}


@pytest.mark.parametrize("name", list(ON_THE_HEAD))
def test_an_adapter_on_the_head_trains_as_on_the_stock_model(name: str) -> None:
    """LoRA wraps the tied head as it wraps the stock one; ``modules_to_save`` trains a copy
    of the head, untied from the embedding, as on the stock model."""
    stock = llama()
    model = copy.deepcopy(stock)
    head = tie_output_embeddings(model)
    stock_model, peft_model = (
        adapted(stock, ON_THE_HEAD[name]()),
        adapted(model, ON_THE_HEAD[name]()),
    )
    names = trained_names(peft_model)
    assert names == trained_names(stock_model)
    assert any("lm_head" in each for each in names)
    stock_losses, stock_logits = train(stock_model)
    losses, logits = train(peft_model)
    assert losses == pytest.approx(stock_losses, rel=0, abs=1e-6)
    torch.testing.assert_close(logits, stock_logits)
    assert torch.equal(generated(peft_model), generated(stock_model))
    assert model.get_input_embeddings().weight is head.weight  # the tie holds
    torch.testing.assert_close(head.weight, stock.get_input_embeddings().weight)


@pytest.mark.parametrize("name", list(ON_THE_HEAD))
def test_tie_weights_keeps_an_adapter_on_the_head(name: str) -> None:
    stock = llama()
    model = copy.deepcopy(stock)
    tie_output_embeddings(model)
    stock_losses, stock_logits = train(adapted(stock, ON_THE_HEAD[name]()))
    peft_model = adapted(model, ON_THE_HEAD[name]())
    adapter = model.lm_head
    model.tie_weights()
    assert model.lm_head is adapter
    losses, logits = train(peft_model)
    assert losses == pytest.approx(stock_losses, rel=0, abs=1e-6)
    torch.testing.assert_close(logits, stock_logits)


@pytest.mark.parametrize("name", list(ON_THE_HEAD))
def test_ensure_weight_tying_on_the_heads_adapter_is_refused_at_the_first_forward(
    name: str,
) -> None:
    """On the stock model PEFT ties the head's adapter to one on the embedding; it cannot
    see the tied head's tie, and would train the head's adapter alone."""
    config = ON_THE_HEAD[name]()
    config.ensure_weight_tying = True  # type: ignore[attr-defined]
    model = llama()
    tie_output_embeddings(model)
    peft_model = adapted(model, config)
    with pytest.raises(RuntimeError) as info:
        peft_model(input_ids=IDS, labels=IDS)
    assert str(info.value) == (  # the one whole-message check of this error
        "LlamaForCausalLM's head 'lm_head' holds a PEFT adapter, and the adapter's config has "
        "ensure_weight_tying=True, which on the stock model ties it to an adapter on the input "
        "embeddings; the head tie_output_embeddings made is not in the model's tied weights "
        "keys, so PEFT adapted the head alone, untied. Leave ensure_weight_tying off (the "
        "adapter on 'lm_head' then trains untied, as on the stock model), or train the adapter "
        "on the stock model, without tie_output_embeddings"
    )
    # Also where the model's forward is called without its own hooks, as PEFT's LoRA does.
    with pytest.raises(RuntimeError, match="ensure_weight_tying"):
        model.forward(input_ids=IDS)
    # Without an adapter on the head, the flag changes nothing, and nothing is refused.
    model = llama()
    tie_output_embeddings(model)
    quiet = peft.LoraConfig(target_modules=["q_proj"], ensure_weight_tying=True)
    adapted(model, quiet)(input_ids=IDS, labels=IDS)


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
        config = peft.LoraConfig(target_modules=["q_proj", "lm_head"], ensure_weight_tying=True)
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
    widths: list[int] = []
    head.register_forward_hook(lambda module, args, out: widths.append(out.shape[-1]))
    stock_losses, stock_logits = train(adapted(stock, config()))
    losses, logits = train(adapted(model, config()))
    assert widths == [1, 1, 1, VOCAB]  # three losses, then the logits without labels
    assert losses == pytest.approx(stock_losses, rel=0, abs=1e-5)
    torch.testing.assert_close(logits, stock_logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(ON_THE_HEAD))
def test_an_adapter_on_the_head_is_refused_by_the_chunked_loss_naming_the_head(
    name: str,
) -> None:
    """The adapter computes logits of its own, which the tied head's loss would skip."""
    model = llama()
    tie_output_embeddings(model, chunked_loss=True)
    peft_model = adapted(model, ON_THE_HEAD[name]())
    with pytest.raises(RuntimeError, match="'lm_head'") as error:
        peft_model(input_ids=IDS, labels=IDS)
    assert "chunked_loss=False" in str(error.value)
    assert peft_model(input_ids=IDS).logits.shape == (2, 7, VOCAB)  # without labels
