"""tie_output_embeddings on Hugging Face transformers models, against the stock tied model.

Each test builds tiny models from configs (nothing is downloaded): the stock tied model as
transformers builds it, and a copy whose head ``tie_output_embeddings`` made a TiedLinear.
Whatever transformers does with its tied head must give the same result on both.
"""

from __future__ import annotations

import copy
import functools
import importlib
import re
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    LlamaPreTrainedModel,
    PreTrainedModel,
)
from transformers.distributed.fsdp import _resolve_tied_embed_lm_head_plan

from tests.nn.distributed.tiny_lm import full_state
from tests.nn.hf_models import CAUSAL_LMS, VOCAB, gemma2, gpt2, llama, qwen2
from tests.nn.ranks import process_group, run_processes, run_threads
from toolkit.nn import TiedLinear, tie_output_embeddings

BUILDERS: dict[str, Callable[..., PreTrainedModel]] = {"llama": llama, "gpt2": gpt2}
# The architectures of the tests that check what differs between them: tied heads read
# ``lm_head`` (Llama, Qwen2), ``transformer.wte`` (GPT-2), scale the lookup (Gemma 2).
ARCHITECTURES: dict[str, Callable[..., PreTrainedModel]] = {
    **BUILDERS,
    "qwen2": qwen2,
    "gemma2": gemma2,
}


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


def tokens(rows: int = 2, length: int = 7, vocab: int = VOCAB, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def assert_tied(model: PreTrainedModel, head: TiedLinear) -> None:
    """The model's head is ``head``, reading its input embedding, which owns the one weight."""
    embedding = model.get_input_embeddings()
    assert model.get_output_embeddings() is head
    assert head.tied_module is embedding
    assert head.weight is embedding.weight
    names = [name for name, _ in model.named_parameters()]
    assert not any("lm_head" in name for name in names)
    assert sum(p is embedding.weight for p in model.parameters()) == 1


def test_the_head_becomes_a_tied_linear_that_post_init_tie_weights_and_a_second_call_keep(
    build: Callable,
) -> None:
    stock, model, head = stock_and_tied(build)
    assert isinstance(head, TiedLinear)
    assert_tied(model, head)
    assert set(model.state_dict()) == set(stock.state_dict()) - {"lm_head.weight"}
    # The stock class keeps its mapping: only this model's instance stops naming the head.
    assert "lm_head.weight" in type(model)._tied_weights_keys
    assert model.all_tied_weights_keys == {}
    for keep in (model.post_init, model.tie_weights, lambda: model.tie_weights(False)):
        keep()
        assert_tied(model, head)
    assert tie_output_embeddings(model) is head
    assert_tied(model, head)


def test_tie_weights_after_set_input_embeddings_ties_the_head_to_the_new_one(
    build: Callable,
) -> None:
    stock, model, _ = stock_and_tied(build)
    new = nn.Embedding(VOCAB, stock.get_input_embeddings().embedding_dim)
    for each in (stock, model):
        each.set_input_embeddings(copy.deepcopy(new))
        each.tie_weights()  # the stock model ties its head to the new embedding
    head = model.get_output_embeddings()
    assert isinstance(head, TiedLinear)
    assert_tied(model, head)
    ids = tokens()
    torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=0, atol=0)


def assert_plans_of_the_tied_stock_model(
    model: PreTrainedModel, stock: PreTrainedModel, head: str = "lm_head"
) -> None:
    """Each parallel plan is the stock model's without the head, which is no module now; the
    FSDP plan is the one transformers shards a tied model with: the embedding takes the head's
    rule."""
    for plan in ("tp_plan", "ep_plan", "pp_plan"):
        expected = {key: rule for key, rule in getattr(stock, plan).items() if key != head}
        assert getattr(model, plan) == expected, plan
    resolved = _resolve_tied_embed_lm_head_plan(stock.fsdp_plan, stock)
    assert model.fsdp_plan == {key: rule for key, rule in resolved.items() if key != head}


RETIES: dict[str, Callable[[PreTrainedModel], object]] = {
    "tie_weights": lambda model: model.tie_weights(),
    "post_init": lambda model: model.post_init(),
    "resize_token_embeddings": lambda model: model.resize_token_embeddings(VOCAB + 3),
}


@pytest.mark.parametrize("retie", list(RETIES))
@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_a_head_set_by_set_output_embeddings_is_tied_again_as_on_the_stock_model(
    architecture: str, retie: str
) -> None:
    """transformers ties whatever head the model then holds; so does the tied model, whose
    plans keep naming only modules it has."""
    stock, model, _ = stock_and_tied(ARCHITECTURES[architecture])
    torch.manual_seed(3)
    new = nn.Linear(stock.get_input_embeddings().embedding_dim, VOCAB, bias=False)
    for each in (stock, model):
        each.set_output_embeddings(copy.deepcopy(new))
        torch.manual_seed(4)  # for what resizing or initialising draws
        RETIES[retie](each)
    assert stock.get_output_embeddings().weight is stock.get_input_embeddings().weight
    head = model.get_output_embeddings()
    assert isinstance(head, TiedLinear)
    assert_tied(model, head)
    ids = tokens()
    torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=0, atol=0)
    assert_plans_of_the_tied_stock_model(model, stock)


def test_tie_weights_passes_its_arguments_to_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    model = llama()
    received = []
    own = type(model).tie_weights

    def recording(self: PreTrainedModel, *args: object, **kwargs: object) -> None:
        received.append((args, kwargs))
        own(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "tie_weights", recording)
    head = tie_output_embeddings(model)
    model.tie_weights(None, recompute_mapping=False)
    assert received == [((None,), {"recompute_mapping": False})]
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


def test_checkpoints_round_trip_with_the_stock_model_in_both_directions(
    build: Callable, tmp_path: Path
) -> None:
    """A stock checkpoint loads, then ties; a tied model saves one copy that a stock loads."""
    stock, _, _ = stock_and_tied(build)
    stock.save_pretrained(tmp_path / "stock")
    model = type(stock).from_pretrained(tmp_path / "stock")
    head = tie_output_embeddings(model)
    assert_tied(model, head)
    expected = {k: v for k, v in stock.state_dict().items() if k != "lm_head.weight"}
    torch.testing.assert_close(model.state_dict(), expected, rtol=0, atol=0)
    ids = tokens()
    torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=0, atol=0)
    with torch.no_grad():
        head.weight.add_(1.0)  # differs from any fresh initialisation
    model.save_pretrained(tmp_path / "tied")
    saved = load_file(tmp_path / "tied" / "model.safetensors")
    assert set(saved) == set(model.state_dict())  # no "lm_head.weight"
    loaded = type(model).from_pretrained(tmp_path / "tied")
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    torch.testing.assert_close(loaded.lm_head.weight, head.weight, rtol=0, atol=0)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


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
    per_token = head.cross_entropy(hidden[:, :-1], labels[:, 1:], reduction="none")
    assert per_token.shape == labels[:, 1:].shape
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


def _set_head(model: PreTrainedModel, head: nn.Module) -> None:
    del model.lm_head
    model.lm_head = head


AFTER_FROM_PRETRAINED = "call tie_output_embeddings after from_pretrained returns"
ADAPTER_FIX = "leave the embedding and the head out of the adapter's modules"


class Adapted(nn.Module):
    """An embedding wrapped as PEFT wraps one: the lookup adds to the rows the wrapped one
    gives, and ``weight`` is the wrapped module's."""

    def __init__(self, original: nn.Embedding) -> None:
        super().__init__()
        self.original_module = original
        self.delta = nn.Parameter(torch.full((original.embedding_dim,), 0.5))

    @property
    def weight(self) -> torch.Tensor:
        return self.original_module.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.original_module(ids) + self.delta


# How each model is made wrong, and the facts its error names: the cause, then the fix last.
REFUSED: dict[str, tuple[Callable[[LlamaForCausalLM], object], list[str]]] = {
    "untied": (
        lambda m: m.config.__setattr__("tie_word_embeddings", False),
        ["tie_word_embeddings=False", "build the model with tie_word_embeddings=True to tie it"],
    ),
    # As transformers reads it: only a config that says so ties the word embeddings.
    "config-without-the-flag": (
        lambda m: setattr(m, "config", types.SimpleNamespace()),
        ["build the model with tie_word_embeddings=True to tie it"],
    ),
    "own-weight": (
        lambda m: setattr(m.lm_head, "weight", nn.Parameter(m.lm_head.weight.detach().clone())),
        ["so the model's logits do not come from it", AFTER_FROM_PRETRAINED],
    ),
    "no-weight": (
        lambda m: _set_head(m, nn.Identity()),
        ["do not share the input embeddings", AFTER_FROM_PRETRAINED],
    ),
    "adapted-embedding": (
        lambda m: setattr(m.model, "embed_tokens", Adapted(m.model.embed_tokens)),
        [".Adapted, a module that wraps the tied embedding", "tie_output_embeddings", ADAPTER_FIX],
    ),
    "bias": (
        lambda m: setattr(m.lm_head, "bias", nn.Parameter(torch.zeros(VOCAB))),
        ["has a bias", "would drop"],
    ),
    "tied-elsewhere": (
        lambda m: _set_head(m, TiedLinear(nn.Embedding(VOCAB, 16))),
        ["not tied to the input embeddings"],
    ),
    "tied-to-another-model": (
        lambda m: _set_head(m, tie_output_embeddings(llama())),
        ["not tied to the input embeddings"],
    ),
    "head-outside-the-model": (
        lambda m: setattr(m, "get_output_embeddings", lambda: llama().lm_head),
        ["not one of the model's own", "return the model's own head from get_output_embeddings()"],
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_head_that_cannot_be_tied_is_refused_and_the_model_left_alone(name: str) -> None:
    model = llama()
    change, facts = REFUSED[name]
    change(model)
    head, keys = model.lm_head, dict(model._tied_weights_keys)
    error = RuntimeError if name == "adapted-embedding" else ValueError
    with pytest.raises(error, match=r"^LlamaForCausalLM") as info:  # the model's class
        tie_output_embeddings(model)
    assert all(fact in str(info.value) for fact in facts), str(info.value)
    assert str(info.value).endswith(facts[-1])
    if name == "own-weight":  # the one whole-message check of this error
        assert str(info.value) == (
            "LlamaForCausalLM's output embeddings do not share the input embeddings' weight, "
            "so the model's logits do not come from it and tying would change them: a model "
            "loaded from a checkpoint with two different weights keeps its own head, and while "
            "from_pretrained builds a model (its constructor, post_init) the two are tied only "
            "after loading, so call tie_output_embeddings after from_pretrained returns"
        )
    assert model.lm_head is head
    assert model._tied_weights_keys == keys


def test_a_model_without_an_lm_head_or_not_from_transformers_is_refused() -> None:
    with pytest.raises(ValueError, match="no output embeddings") as info:
        tie_output_embeddings(LlamaModel(llama().config))
    assert str(info.value).endswith("tie a model with an LM head, such as a ...ForCausalLM class")
    with pytest.raises(TypeError, match="PreTrainedModel") as info:
        tie_output_embeddings(nn.Linear(2, 2))  # type: ignore[arg-type]
    assert "TiedLinear(embedding)" in str(info.value)
    with pytest.raises(TypeError, match="got Tensor"):
        tie_output_embeddings(torch.ones(2))  # type: ignore[arg-type]


class TiedInPostInit(LlamaForCausalLM):
    def post_init(self) -> None:
        super().post_init()
        tie_output_embeddings(self)


def test_tying_while_from_pretrained_builds_the_model_is_refused_with_when_to_tie(
    tmp_path: Path,
) -> None:
    llama().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"^TiedInPostInit") as info:
        TiedInPostInit.from_pretrained(tmp_path)
    assert str(info.value).endswith(AFTER_FROM_PRETRAINED)


def test_an_adapter_wrapping_the_embedding_after_the_tie_is_refused_on_every_call() -> None:
    """A wrapper (as PEFT's) looks tokens up with a weight the head does not read."""
    stock, model, head = stock_and_tied(llama)
    embedding = model.model.embed_tokens
    model.model.embed_tokens = Adapted(embedding)
    ids = tokens()
    with pytest.raises(RuntimeError, match=r"^LlamaForCausalLM's input embeddings are a "):
        model(ids)
    hidden = torch.randn(2, 7, 16)
    model.tie_weights()  # ties to a new embedding, but not to a wrapper of the old one
    assert model.get_output_embeddings() is head
    with pytest.raises(RuntimeError, match=ADAPTER_FIX):
        model(ids)
    # Unwrapped again (say, by merging the adapter into it), the head works as before.
    model.model.embed_tokens = embedding
    torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=0, atol=0)
    torch.testing.assert_close(
        head.cross_entropy(hidden, ids),
        stock.lm_head(hidden)
        .flatten(0, 1)
        .log_softmax(-1)
        .gather(1, ids.flatten()[:, None])
        .neg()
        .mean(),
    )


def test_a_new_input_embedding_without_tie_weights_leaves_the_head_on_the_old_one(
    build: Callable,
) -> None:
    """As on the stock model, whose head keeps the old weight until tie_weights()."""
    stock, model, _ = stock_and_tied(build)
    new = nn.Embedding(VOCAB, stock.get_input_embeddings().embedding_dim)
    for each in (stock, model):
        each.set_input_embeddings(copy.deepcopy(new))
    ids = tokens()
    torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["bias", "adapted-embedding"])
def test_tie_weights_refuses_a_new_head_it_cannot_tie_and_leaves_it_untied(name: str) -> None:
    """A bias, which the stock model keeps beside the tied weight, a TiedLinear cannot hold; a
    wrapped embedding's lookup (a PEFT adapter's) would not use the weight the head reads."""
    _, model, _ = stock_and_tied(llama)
    new = nn.Linear(16, VOCAB, bias=name == "bias")
    if name == "adapted-embedding":
        model.model.embed_tokens = Adapted(model.model.embed_tokens)
    model.set_output_embeddings(new)
    with pytest.raises(ValueError if name == "bias" else RuntimeError) as info:
        model.tie_weights()
    assert model.get_output_embeddings() is new
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert str(info.value) == REFUSED_HEADS[name]  # the one whole-message check of each


REFUSED_HEADS = {
    "bias": (
        "LlamaForCausalLM's output embeddings, a Linear set after tie_output_embeddings, have a "
        "bias, which its tied head, a bias-free TiedLinear, would drop; set a head without a "
        "bias, such as nn.Linear(hidden_size, vocab_size, bias=False), which tie_weights() ties "
        "to the input embeddings"
    ),
    "adapted-embedding": (
        f"LlamaForCausalLM's input embeddings are a {__name__}.Adapted, a module that wraps the "
        "tied embedding or head (a PEFT adapter such as LoRA, trainable tokens or "
        "modules_to_save), so the lookup and the head would not use the same weight; train "
        "such an adapter on the stock model, without tie_output_embeddings, or leave the "
        "embedding and the head out of the adapter's modules"
    ),
}


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_copy_of_the_model_keeps_its_head_on_its_own_embedding(training: bool) -> None:
    _stock, model, head = stock_and_tied(llama)
    model.train(training)
    copied = copy.deepcopy(model)
    twin = copied.get_output_embeddings()
    assert type(twin) is type(head)
    assert twin.weight is copied.get_input_embeddings().weight
    assert twin.weight is not head.weight
    assert twin.training is training
    ids = tokens()
    torch.testing.assert_close(copied(ids).logits, model(ids).logits, rtol=0, atol=0)
    # The copy checks its own model's lookup: an adapter there is refused, not here.
    copied.model.embed_tokens = Adapted(copied.model.embed_tokens)
    with pytest.raises(RuntimeError):
        copied(ids)
    model(ids)


@pytest.mark.parametrize("name", list(CAUSAL_LMS))
@pytest.mark.parametrize("call", ["post_init", "init_weights", "initialize_weights"])
def test_initialising_the_weights_after_the_tie_changes_what_it_changes_on_the_stock_model(
    name: str, call: str
) -> None:
    """The head is no ``nn.Linear``, whose weight transformers' initialisation draws anew."""
    stock, model, head = stock_and_tied(CAUSAL_LMS[name])
    getattr(stock, call)()
    getattr(model, call)()
    expected = {k: v for k, v in stock.state_dict().items() if k != "lm_head.weight"}
    torch.testing.assert_close(model.state_dict(), expected, rtol=0, atol=0)
    assert_tied(model, head)


def test_data_parallel_replication_is_refused_naming_ddp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica's head would read the original embedding, not the replica's. torch's
    replicate, which nn.DataParallel calls, with its copies to the GPUs made on the CPU."""
    # The module, which torch.nn.parallel's function of the same name hides.
    replicating = importlib.import_module("torch.nn.parallel.replicate")

    def copies(tensors: list[torch.Tensor], devices: list[int], detach: bool) -> list[list]:
        return [[t.detach().clone() for t in tensors] for _ in devices]

    monkeypatch.setattr(replicating, "_get_device_index", lambda device, optional: 0)
    monkeypatch.setattr(replicating, "_broadcast_coalesced_reshape", copies)
    stock, model, _ = stock_and_tied(llama)
    assert len(replicating.replicate(stock, [0, 1])) == 2  # the stock model replicates
    with pytest.raises(RuntimeError, match="DistributedDataParallel") as info:
        replicating.replicate(model, [0, 1])
    assert str(info.value) == (  # the one whole-message check of this error
        "nn.DataParallel replicates the model but not the tie: a replica's head would read "
        "the original embedding. Train the tied model with DistributedDataParallel (torchrun "
        "or accelerate launch; the Trainer uses it under either), or on one device"
    )


def test_the_heads_requires_grad_freezes_the_shared_weight_as_the_stock_heads() -> None:
    _, model, head = stock_and_tied(llama)
    weight = model.get_input_embeddings().weight
    assert head.requires_grad_(False) is head
    assert not weight.requires_grad
    assert head.requires_grad_() is head
    assert weight.requires_grad


def test_get_and_set_output_embeddings_round_trip(build: Callable) -> None:
    stock, model, head = stock_and_tied(build)
    model.set_output_embeddings(model.get_output_embeddings())
    assert_tied(model, head)
    ids = tokens()
    torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("strict", [True, False])
def test_load_state_dict_takes_a_head_weight_as_the_stock_model_does(
    build: Callable, strict: bool
) -> None:
    """Equal to the embedding's: dropped; alone: the embedding's; different: refused."""
    stock, model, head = stock_and_tied(build)
    source = next(name for name, p in model.named_parameters() if p is head.weight)
    with torch.no_grad():
        stock.get_input_embeddings().weight.add_(1.0)
    ids = tokens()
    checkpoint = stock.state_dict()  # with "lm_head.weight", equal to the embedding's
    assert "lm_head.weight" in checkpoint
    assert model.load_state_dict(checkpoint, strict=strict) is not None
    assert_tied(model, head)
    torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=0, atol=0)
    alone = {k: v for k, v in checkpoint.items() if k != source}
    with torch.no_grad():
        model.get_input_embeddings().weight.zero_()
    model.load_state_dict(alone, strict=strict)
    assert_tied(model, head)
    torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=0, atol=0)
    differing = {**checkpoint, "lm_head.weight": checkpoint["lm_head.weight"] + 1}
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(
        ValueError, match=re.escape(f"'lm_head.weight' differs from its '{source}'")
    ) as info:
        model.load_state_dict(differing, strict=strict)
    assert str(info.value).endswith(
        "load it into a model built with tie_word_embeddings=False, not tied"
    )
    assert type(model).__name__ in str(info.value)
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)


def test_load_state_dict_compares_the_head_weight_in_the_embeddings_dtype(build: Callable) -> None:
    """A head saved in another dtype, or on meta (no values, as for assign=True), is dropped."""
    stock, model, head = stock_and_tied(build)
    checkpoint = stock.state_dict()
    # float64 values that differ from the embedding's by less than float32 can hold
    checkpoint["lm_head.weight"] = checkpoint["lm_head.weight"].to(torch.float64) * (1 + 1e-12)
    assert not torch.equal(checkpoint["lm_head.weight"], stock.lm_head.weight)
    model.load_state_dict(checkpoint)
    assert_tied(model, head)
    meta = {
        key: torch.empty_like(value, device="meta") for key, value in stock.state_dict().items()
    }
    model.load_state_dict(meta, assign=True)
    assert_tied(model, head)
    assert head.weight.is_meta
    model.load_state_dict(
        {**stock.state_dict(), "lm_head.weight": meta["lm_head.weight"]}, assign=True
    )
    assert_tied(model, head)
    assert not head.weight.is_meta
    shorter = {**meta, "lm_head.weight": meta["lm_head.weight"][:-1]}
    with pytest.raises(ValueError, match="differs"):
        model.load_state_dict(shorter, assign=True)


def test_an_adapter_wrapping_the_embedding_of_a_sub_model_is_refused() -> None:
    model = Wrapped(llama().config)
    tie_output_embeddings(model)
    model.lm.model.embed_tokens = Adapted(model.lm.model.embed_tokens)
    with pytest.raises(RuntimeError, match=ADAPTER_FIX):
        model(tokens())


def test_a_head_in_a_sub_model_takes_its_prefixed_checkpoint_key() -> None:
    torch.manual_seed(0)
    stock = Wrapped(llama().config)
    model = copy.deepcopy(stock)
    tie_output_embeddings(model)
    with torch.no_grad():
        stock.get_input_embeddings().weight.add_(1.0)
    checkpoint = stock.state_dict()
    assert "lm.lm_head.weight" in checkpoint
    model.load_state_dict(checkpoint)
    ids = tokens()
    torch.testing.assert_close(model(ids), stock(ids), rtol=0, atol=0)
    checkpoint["lm.lm_head.weight"] = checkpoint["lm.lm_head.weight"] + 1
    with pytest.raises(ValueError, match=r"'lm\.lm_head\.weight' differs"):
        model.load_state_dict(checkpoint)
    # Loaded as part of a larger module, the keys carry its prefix.
    outer = nn.ModuleDict({"inner": model})
    with pytest.raises(ValueError, match=r"'inner\.lm\.lm_head\.weight' differs"):
        outer.load_state_dict({f"inner.{key}": value for key, value in checkpoint.items()})


def test_from_pretrained_of_a_checkpoint_with_the_head_weight_ties_only_equal_weights(
    tmp_path: Path,
) -> None:
    """Equal: loaded tied, as the stock model loads it; different: untied, so refused."""
    stock = llama()
    stock.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    embedding = saved["model.embed_tokens.weight"]
    ids = tokens()
    for head_weight in (embedding.clone(), embedding + 1):
        save_file({**saved, "lm_head.weight": head_weight}, tmp_path / "model.safetensors")
        model = LlamaForCausalLM.from_pretrained(tmp_path)
        if torch.equal(head_weight, embedding):
            head = tie_output_embeddings(model)
            assert_tied(model, head)
            torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=0, atol=0)
            continue
        with pytest.raises(ValueError, match="a checkpoint with two different weights") as info:
            tie_output_embeddings(model)
        assert str(info.value).endswith(AFTER_FROM_PRETRAINED)
        assert isinstance(model.lm_head, nn.Linear)


def test_an_embedding_with_sub_modules_of_its_own_is_tied() -> None:
    """Only an embedding that holds no weight but wraps one is refused."""
    stock, model, _ = stock_and_tied(llama)
    model = copy.deepcopy(stock)
    model.model.embed_tokens.norm = nn.LayerNorm(16)  # unused here, but a weight of its own
    head = tie_output_embeddings(model)
    assert head.tied_module is model.model.embed_tokens
    ids = tokens()
    torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=0, atol=0)


def test_the_parallel_plans_no_longer_name_the_head() -> None:
    """transformers' plans name only modules and parameters the model has."""
    stock, model, _ = stock_and_tied(llama)
    assert stock.tp_plan["lm_head"] == "colwise_gather_output"
    assert "lm_head" in stock.pp_plan
    assert stock.fsdp_plan["lm_head"] == "keep_full_weight"
    assert_plans_of_the_tied_stock_model(model, stock)
    model.post_init()  # rebuilds the plans from the class
    assert_plans_of_the_tied_stock_model(model, stock)
    torch.manual_seed(0)
    stock = Wrapped(llama().config)
    assert "lm.lm_head" in stock.tp_plan
    assert "lm_head" in stock.lm.tp_plan
    model = copy.deepcopy(stock)
    tie_output_embeddings(model)
    for _ in range(2):  # as tied, then after post_init() rebuilt them from the sub-model's
        assert_plans_of_the_tied_stock_model(model, stock, "lm.lm_head")
        assert_plans_of_the_tied_stock_model(model.lm, stock.lm)  # keys relative to it
        model.post_init()


class FreeHead(LlamaForCausalLM):
    """A model whose FSDP plan reshards the head after its forward, as the embedding."""

    _fsdp_plan = {"lm_head": "free_full_weight"}  # noqa: RUF012 - as transformers declares it


class Split(LlamaPreTrainedModel):
    """A model whose head, in a sub-model, reads an embedding outside that sub-model."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lm = LlamaForCausalLM(config)
        self.post_init()
        self.lm.lm_head.weight = self.embed.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.lm.get_output_embeddings()


def test_the_fsdp_plan_shards_the_embedding_with_the_root_where_the_head_was_resharded() -> None:
    """As transformers shards a tied model: no unit of its own, which would reshard it."""
    stock, model, _ = stock_and_tied(lambda: FreeHead(llama().config))
    assert stock.fsdp_plan["model.embed_tokens"] == "free_full_weight"
    assert_plans_of_the_tied_stock_model(model, stock)
    assert "model.embed_tokens" not in model.fsdp_plan


def test_a_sub_model_keeps_the_fsdp_rule_of_an_embedding_its_head_does_not_read() -> None:
    stock, model, _ = stock_and_tied(lambda: Split(llama().config))
    assert_plans_of_the_tied_stock_model(model, stock, "lm.lm_head")
    assert model.fsdp_plan["embed"] == "keep_full_weight"
    plan = stock.lm.fsdp_plan
    assert model.lm.fsdp_plan == {k: v for k, v in plan.items() if k != "lm_head"}


class Contained(LlamaPreTrainedModel):
    """A model whose head sits two levels down, under a container without a plan."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.outer = nn.ModuleDict({"lm": LlamaForCausalLM(config)})
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.outer.lm.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.outer.lm.get_output_embeddings()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.outer.lm(ids).logits


def test_a_head_under_a_container_without_a_plan_is_dropped_from_its_sub_models_plan() -> None:
    torch.manual_seed(0)
    stock = Contained(llama().config)
    assert "lm_head" in stock.outer.lm.tp_plan
    model = copy.deepcopy(stock)
    head = tie_output_embeddings(model)
    assert model.outer.lm.lm_head is head
    plan = stock.outer.lm.tp_plan
    assert model.outer.lm.tp_plan == {k: v for k, v in plan.items() if k != "lm_head"}
    ids = tokens()
    torch.testing.assert_close(model(ids), stock(ids), rtol=0, atol=0)


# Under FSDP2 on two ranks: threads, and gloo processes -------------------------------------


class ChunkedLossLlama(LlamaForCausalLM):
    def chunked_loss(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model(ids).last_hidden_state
        return self.lm_head.cross_entropy(hidden[:, :-1], ids[:, 1:])  # type: ignore[no-any-return]


STEPS = [tokens(rows=4, length=6, vocab=17, seed=seed) for seed in range(3)]


def fsdp2_training(
    model: ChunkedLossLlama, loss_path: str
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One rank's run: each decoder layer a unit, and the embedding (vocabulary 17, split 9
    and 8), kept unsharded after its forward; the loss is transformers' own from the logits,
    or ``head.cross_entropy`` in a method registered with ``register_fsdp_forward_method``.
    With ``lean``, the model's forward takes the head's chunked loss (``chunked_loss=True``)."""
    rank = dist.get_rank()
    if loss_path == "lean":  # chunked_loss takes the listed class itself, not a subclass
        listed = LlamaForCausalLM(model.config)
        listed.load_state_dict(model.state_dict())
        model = listed  # type: ignore[assignment]
    head = tie_output_embeddings(model, chunked_loss=loss_path == "lean")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.model.embed_tokens, reshard_after_forward=False)
    fully_shard(model)
    if loss_path == "chunked_loss":
        register_fsdp_forward_method(model, "chunked_loss")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, states = [], []
    for ids in STEPS:
        rows = ids[2 * rank : 2 * rank + 2]
        if loss_path == "chunked_loss":
            loss = model.chunked_loss(rows)
        else:
            output = model(rows, labels=rows)
            assert (output.logits is None) == (loss_path == "lean")
            loss = output.loss
        loss.backward()  # FSDP2 averages the gradients over the ranks
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # every rank counts as many tokens: the mean of the means
        losses.append(total.item() / 2)
        states.append(full_state(model))
    assert head.tied_module is model.model.embed_tokens
    assert model.lm_head is head
    return losses, states


def stock_llama() -> ChunkedLossLlama:
    torch.manual_seed(0)
    return ChunkedLossLlama(llama(vocab_size=17).config)


LOSS_PATHS = ("logits", "chunked_loss", "lean")
Result = tuple[list[float], list[dict[str, torch.Tensor]]]


def fsdp2_training_in_a_process() -> dict[str, Result]:
    """In each gloo rank: both loss paths, one after the other (one launch for both)."""
    with process_group():
        return {path: fsdp2_training(stock_llama(), path) for path in LOSS_PATHS}


# Threads for the mutation pass; gloo processes ("distributed", which the slow pass runs) as
# the proof with real collectives.
@pytest.mark.parametrize("ranks", ["threads", "distributed"])
def test_fsdp2_training_matches_the_stock_model_in_one_process(ranks: str) -> None:
    stock = stock_llama()
    models = {path: [copy.deepcopy(stock) for _ in range(2)] for path in LOSS_PATHS}
    initial = stock.model.embed_tokens.weight.detach().clone()
    opt = torch.optim.SGD(stock.parameters(), lr=0.5)
    expected_losses, expected_states = [], []
    for ids in STEPS:  # the stock tied model, in one process, on the global batches
        loss = stock(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected_losses.append(loss.item())
        expected_states.append(
            {k: v for k, v in full_state(stock).items() if k != "lm_head.weight"}
        )
    if ranks == "threads":
        per_rank = run_threads(
            2, lambda rank: {path: fsdp2_training(models[path][rank], path) for path in LOSS_PATHS}
        )
    else:  # real processes, as torchrun starts them
        per_rank = run_processes(2, fsdp2_training_in_a_process, timeout=300)
    by_path = {path: [result[path] for result in per_rank] for path in LOSS_PATHS}
    close = {"rtol": 1e-5, "atol": 1e-5}
    for path, results in by_path.items():

        def named(message: str, path: str = path) -> str:
            return f"{path}: {message}"

        for losses, states in results:
            torch.testing.assert_close(losses, expected_losses, **close, msg=named)
            for actual, expected in zip(states, expected_states, strict=True):
                assert list(actual) == list(expected), path
                torch.testing.assert_close(actual, expected, **close, msg=named)
    # The weights moved, so the parity is not that of an untrained model.
    assert not torch.allclose(expected_states[-1]["model.embed_tokens.weight"], initial)


def test_setting_the_tied_heads_weight_is_refused_and_leaves_the_tie() -> None:
    # The stock idiom that unties a head, lm_head.weight = Parameter(...), has nothing to
    # assign to: the head owns no weight.
    model = llama()
    head = tie_output_embeddings(model)
    weight = model.get_input_embeddings().weight
    with pytest.raises(KeyError, match="'weight' already exists"):  # nn.Module's refusal
        model.lm_head.weight = nn.Parameter(weight.detach().clone())
    with pytest.raises(AttributeError):  # the weight is read live, from the embedding
        model.lm_head.weight = weight.detach().clone()
    assert head.weight is weight
    assert list(head.parameters()) == []
    head.note = "other attributes are set as on any module"
    assert head.note == "other attributes are set as on any module"


def test_what_refers_to_the_head_in_its_own_state_refers_to_the_copy_in_a_copy() -> None:
    # A hook that holds the head (a bound method, a partial) is copied with it, as Python's
    # deepcopy of a module does: it then holds the copy, not the original, nor a third head.
    _, model, head = stock_and_tied(llama)
    seen: list[nn.Module] = []

    def record(owner: nn.Module, module: nn.Module, args: object, output: object) -> None:
        seen.append(owner)

    head.register_forward_hook(functools.partial(record, head))
    copied = copy.deepcopy(model)
    copied(tokens())
    assert seen == [copied.get_output_embeddings()]


class _WeightOnlyHead(nn.Module):
    """A head with a weight and no ``bias`` attribute at all."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


def test_a_head_without_a_bias_attribute_is_tied_again_as_on_the_stock_model() -> None:
    stock, model, _ = stock_and_tied(llama)
    new = _WeightOnlyHead(VOCAB, stock.get_input_embeddings().embedding_dim)
    for each in (stock, model):
        each.set_output_embeddings(copy.deepcopy(new))
        each.tie_weights()
    assert stock.get_output_embeddings().weight is stock.get_input_embeddings().weight
    head = model.get_output_embeddings()
    assert isinstance(head, TiedLinear)
    assert_tied(model, head)
    ids = tokens()
    assert torch.equal(model(ids).logits, stock(ids).logits)
