"""tie_output_embeddings on Hugging Face transformers models, against the stock tied model.

Each test builds tiny models from configs (nothing is downloaded): the stock tied model as
transformers builds it, and a copy whose head ``tie_output_embeddings`` made a TiedLinear.
Whatever transformers does with its tied head must give the same result on both.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    LlamaPreTrainedModel,
    PreTrainedModel,
)

from toolkit.nn import TiedLinear, tie_output_embeddings

VOCAB = 61


def llama(**overrides: object) -> LlamaForCausalLM:
    options: dict[str, object] = {
        "vocab_size": VOCAB,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 64,
        "tie_word_embeddings": True,  # False by default for Llama
    }
    config = LlamaConfig(**{**options, **overrides})
    return LlamaForCausalLM(config)


def gpt2(**overrides: object) -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,  # no dropout, so that two models in training mode agree
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **overrides,
    )
    return GPT2LMHeadModel(config)


BUILDERS: dict[str, Callable[..., PreTrainedModel]] = {"llama": llama, "gpt2": gpt2}


@pytest.fixture(params=list(BUILDERS))
def build(request: pytest.FixtureRequest) -> Callable[..., PreTrainedModel]:
    return BUILDERS[request.param]


def stock_and_tied(
    build: Callable[..., PreTrainedModel],
) -> tuple[PreTrainedModel, PreTrainedModel, TiedLinear]:
    """The stock tied model, and a copy of it with a TiedLinear head."""
    torch.manual_seed(0)
    stock = build()
    model = copy.deepcopy(stock)
    return stock, model, tie_output_embeddings(model)


def tokens(rows: int = 2, length: int = 7, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(1))


def assert_tied(model: PreTrainedModel, head: TiedLinear) -> None:
    """The model's head is ``head``, reading its input embedding, which owns the one weight."""
    embedding = model.get_input_embeddings()
    assert model.get_output_embeddings() is head
    assert head.tied_module is embedding
    assert head.weight is embedding.weight
    names = [name for name, _ in model.named_parameters()]
    assert not any("lm_head" in name for name in names)
    assert sum(p is embedding.weight for p in model.parameters()) == 1


def test_the_head_becomes_a_tied_linear_on_the_input_embeddings(build: Callable) -> None:
    stock, model, head = stock_and_tied(build)
    assert isinstance(head, TiedLinear)
    assert_tied(model, head)
    keys = set(model.state_dict())
    assert keys == set(stock.state_dict()) - {"lm_head.weight"}
    # The stock class keeps its mapping: only this model's instance stops naming the head.
    assert "lm_head.weight" in type(model)._tied_weights_keys
    assert model.all_tied_weights_keys == {}


def test_post_init_and_tie_weights_keep_the_head(build: Callable) -> None:
    _, model, head = stock_and_tied(build)
    model.post_init()
    assert_tied(model, head)
    model.tie_weights()
    assert_tied(model, head)
    model.tie_weights(recompute_mapping=False)
    assert_tied(model, head)


def test_forward_gives_the_stock_logits_loss_and_gradient(build: Callable) -> None:
    stock, model, _ = stock_and_tied(build)
    ids = tokens()
    labels = ids.clone()
    labels[0, 3] = -100
    expected = stock(ids, labels=labels)
    actual = model(ids, labels=labels)
    torch.testing.assert_close(actual.logits, expected.logits, rtol=0, atol=0)
    torch.testing.assert_close(actual.loss, expected.loss, rtol=0, atol=0)
    expected.loss.backward()
    actual.loss.backward()
    # The embedding's gradient sums the lookup's and the head's, as on the stock tied weight.
    stock_grad = stock.get_input_embeddings().weight.grad
    torch.testing.assert_close(model.get_input_embeddings().weight.grad, stock_grad)


def test_generate_gives_the_stock_tokens(build: Callable) -> None:
    stock, model, _ = stock_and_tied(build)
    ids = tokens(length=4)
    options = {
        "attention_mask": torch.ones_like(ids),
        "max_new_tokens": 6,
        "do_sample": False,
        "pad_token_id": 0,
    }
    expected = stock.generate(ids, **options)
    assert torch.equal(model.generate(ids, **options), expected)
    assert expected.shape == (2, 10)


def test_save_pretrained_writes_one_copy_that_a_stock_model_loads(
    build: Callable, tmp_path: Path
) -> None:
    _, model, head = stock_and_tied(build)
    with torch.no_grad():
        head.weight.add_(1.0)  # differs from any fresh initialisation
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    embedding_key = next(k for k in model.state_dict() if k.endswith("wte.weight") or "embed" in k)
    assert "lm_head.weight" not in saved
    assert set(saved) == set(model.state_dict())
    loaded = type(model).from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    torch.testing.assert_close(loaded.lm_head.weight, saved[embedding_key], rtol=0, atol=0)
    ids = tokens()
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_a_stock_checkpoint_loads_then_ties_with_the_same_weights(
    build: Callable, tmp_path: Path
) -> None:
    stock, _, _ = stock_and_tied(build)
    stock.save_pretrained(tmp_path)
    model = type(stock).from_pretrained(tmp_path)
    head = tie_output_embeddings(model)
    assert_tied(model, head)
    expected = stock.state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)
    ids = tokens()
    torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("size", [VOCAB + 3, VOCAB - 5])
def test_resize_token_embeddings_resizes_the_head(build: Callable, size: int) -> None:
    stock, model, head = stock_and_tied(build)
    torch.manual_seed(2)
    stock.resize_token_embeddings(size)
    torch.manual_seed(2)
    model.resize_token_embeddings(size)
    assert model.config.vocab_size == size
    assert head.out_features == size
    assert_tied(model, head)
    ids = tokens(vocab=min(size, VOCAB))
    logits = model(ids).logits
    assert logits.shape == (2, 7, size)
    torch.testing.assert_close(logits, stock(ids).logits, rtol=0, atol=0)


def test_meta_device_construction_then_to_empty_and_a_load_stays_tied(build: Callable) -> None:
    stock, _, _ = stock_and_tied(build)
    with torch.device("meta"):
        model = build()
    head = tie_output_embeddings(model)
    model.to_empty(device="cpu")
    model.init_weights()  # the buffers that no state dict holds, such as Llama's rotary one
    state = {k: v for k, v in stock.state_dict().items() if k != "lm_head.weight"}
    model.load_state_dict(state)
    assert_tied(model, head)
    assert head.weight.device == torch.device("cpu")
    ids = tokens()
    torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=0, atol=0)


def test_cross_entropy_gives_the_model_loss_without_the_logits(build: Callable) -> None:
    stock, model, head = stock_and_tied(build)
    ids = tokens()
    labels = ids.clone()
    labels[1, 2:4] = -100
    expected = stock(ids, labels=labels).loss
    expected.backward()
    seen: list[object] = []
    hook = head.linear.register_forward_hook(lambda *args: seen.append(args))
    hidden = model.base_model(ids).last_hidden_state
    loss = head.cross_entropy(hidden[:, :-1], labels[:, 1:], chunk_size=5)
    hook.remove()
    assert seen == []  # the linear never ran: no logits were made
    torch.testing.assert_close(loss, expected)
    loss.backward()
    stock_grad = stock.get_input_embeddings().weight.grad
    torch.testing.assert_close(model.get_input_embeddings().weight.grad, stock_grad)


class Wrapped(LlamaPreTrainedModel):
    """A model whose head sits in a sub-model, after another child: ``lm.lm_head``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.scale = nn.Identity()
        self.lm = LlamaForCausalLM(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.lm.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm.get_output_embeddings()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(self.scale(ids)).logits


def test_a_head_inside_a_sub_model_is_tied_where_it_is() -> None:
    torch.manual_seed(0)
    stock = Wrapped(llama().config)
    assert stock.all_tied_weights_keys == {"lm.lm_head.weight": "lm.model.embed_tokens.weight"}
    model = copy.deepcopy(stock)
    head = tie_output_embeddings(model)
    assert model.lm.lm_head is head
    assert model.all_tied_weights_keys == model.lm.all_tied_weights_keys == {}
    model.post_init()
    model.tie_weights()
    assert_tied(model, head)
    ids = tokens()
    torch.testing.assert_close(model(ids), stock(ids), rtol=0, atol=0)


def test_a_second_call_returns_the_same_head() -> None:
    _, model, head = stock_and_tied(llama)
    assert tie_output_embeddings(model) is head
    assert_tied(model, head)


def test_untied_config_is_refused_and_the_model_left_alone(build: Callable) -> None:
    model = build(tie_word_embeddings=False)
    head = model.lm_head
    with pytest.raises(ValueError, match="tie_word_embeddings=False: its head has") as info:
        tie_output_embeddings(model)
    assert type(model).__name__ in str(info.value)
    assert str(info.value).endswith("build the model with tie_word_embeddings=True to tie it")
    assert model.lm_head is head


def test_a_config_without_tie_word_embeddings_counts_as_untied() -> None:
    # As transformers reads it: only a config that says so ties the word embeddings.
    model = llama()
    model.config = types.SimpleNamespace()
    with pytest.raises(ValueError, match="tie_word_embeddings=True"):
        tie_output_embeddings(model)
    assert isinstance(model.lm_head, nn.Linear)


def test_a_model_without_output_embeddings_is_refused() -> None:
    model = LlamaModel(llama().config)
    with pytest.raises(ValueError, match="no output embeddings") as info:
        tie_output_embeddings(model)
    assert str(info.value).endswith("tie a model with an LM head, such as a ...ForCausalLM class")


def test_a_module_that_is_not_a_transformers_model_is_refused() -> None:
    with pytest.raises(TypeError, match="PreTrainedModel") as info:
        tie_output_embeddings(nn.Linear(2, 2))  # type: ignore[arg-type]
    assert "TiedLinear(embedding)" in str(info.value)
    with pytest.raises(TypeError, match="got Tensor"):
        tie_output_embeddings(torch.ones(2))  # type: ignore[arg-type]


def test_a_head_with_weights_of_its_own_is_refused() -> None:
    model = llama()
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    linear = model.lm_head
    with pytest.raises(ValueError, match="so the model's logits do not come from it") as info:
        tie_output_embeddings(model)
    assert str(info.value).endswith("tying would change them: save and load it tied first")
    assert model.lm_head is linear
    assert model._tied_weights_keys == {"lm_head.weight": "model.embed_tokens.weight"}


def test_a_head_without_a_weight_is_refused() -> None:
    model = llama()
    del model.lm_head
    model.lm_head = nn.Identity()
    with pytest.raises(ValueError, match="do not share the input embeddings' weight"):
        tie_output_embeddings(model)
    assert isinstance(model.lm_head, nn.Identity)


class BiasFreeHead(nn.Module):
    """A head module of its own, without a ``bias`` attribute, on the embedding's weight."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


def test_a_head_module_without_a_bias_attribute_is_tied() -> None:
    stock, _, _ = stock_and_tied(llama)
    model = copy.deepcopy(stock)
    del model.lm_head
    model.lm_head = BiasFreeHead(model.model.embed_tokens.weight)
    head = tie_output_embeddings(model)
    assert_tied(model, head)
    ids = tokens()
    torch.testing.assert_close(model(ids).logits, stock(ids).logits)


def test_a_head_with_a_bias_is_refused() -> None:
    model = llama()
    model.lm_head.bias = nn.Parameter(torch.zeros(VOCAB))
    with pytest.raises(ValueError, match="has a bias"):
        tie_output_embeddings(model)
    assert isinstance(model.lm_head, nn.Linear)


def test_a_head_tied_elsewhere_is_refused() -> None:
    model = llama()
    other = TiedLinear(nn.Embedding(VOCAB, 16))
    del model.lm_head
    model.lm_head = other
    with pytest.raises(ValueError, match="not tied to the input embeddings"):
        tie_output_embeddings(model)
    assert model.lm_head is other


def test_importing_the_package_does_not_import_transformers() -> None:
    code = "import sys, toolkit.nn; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
