"""``tie_output_embeddings(model, chunked_loss=True)``: the model's own ``forward(labels=...)``
takes the tied head's chunked loss, against the stock tied model's loss of the logits.

The reference is written in each test: the stock tied model, built with the same seed, and
``model(ids, labels=labels)``, which computes the logits and transformers' ``ForCausalLMLoss``
of them.
"""

from __future__ import annotations

import copy
import functools
import inspect
import pickle
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from tests.nn.hf_models import VOCAB, bart, cohere, gemma2, gemma4, gpt2, llama, mixtral, qwen2
from toolkit.nn import TiedLinear, tie_output_embeddings

ARCHITECTURES: dict[str, Callable[..., PreTrainedModel]] = {
    "llama": llama,
    "gpt2": gpt2,
    "qwen2": qwen2,
    "gemma2": gemma2,  # soft-caps its logits: final_logit_softcapping=30.0
}


@pytest.fixture(params=list(ARCHITECTURES))
def build(request: pytest.FixtureRequest) -> Callable[..., PreTrainedModel]:
    return ARCHITECTURES[request.param]


def stock_and_lean(
    build: Callable[..., PreTrainedModel],
) -> tuple[PreTrainedModel, PreTrainedModel, TiedLinear]:
    """The stock tied model, and a copy tied with ``chunked_loss=True``."""
    torch.manual_seed(0)
    stock = build()
    model = copy.deepcopy(stock)
    return stock, model, tie_output_embeddings(model, chunked_loss=True)


def batch(rows: int = 2, length: int = 9, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens, and labels that ignore a prompt of 3 tokens in the first row."""
    ids = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def assert_the_stock_loss_and_gradients(
    stock: PreTrainedModel, model: PreTrainedModel, *args: object, **kwargs: object
) -> object:
    """``model(*args, **kwargs)`` gives no logits and the stock model's loss and gradients."""
    expected, actual = stock(*args, **kwargs), model(*args, **kwargs)
    assert type(actual) is type(expected)
    assert actual.logits is None
    assert "logits" not in actual
    assert actual.loss.dtype == expected.loss.dtype == torch.float32
    torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-5, atol=1e-5)
    expected.loss.backward()
    actual.loss.backward()
    assert_same_gradients(model, stock)
    return actual


def gradients(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(model: PreTrainedModel, stock: PreTrainedModel) -> None:
    actual, expected = gradients(model), gradients(stock)
    assert list(actual) == [k for k in expected if k != "lm_head.weight"]
    torch.testing.assert_close(actual, {k: expected[k] for k in actual}, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "loss_kwargs",
    [{}, {"num_items_in_batch": torch.tensor(5)}, {"num_items_in_batch": 7}],
    ids=["mean", "num_items_tensor", "num_items_int"],
)
def test_the_loss_and_gradients_are_the_stock_models_and_no_logits_are_returned(
    build: Callable, loss_kwargs: dict[str, object]
) -> None:
    stock, model, _ = stock_and_lean(build)
    ids, labels = batch()
    assert_the_stock_loss_and_gradients(stock, model, ids, labels=labels, **loss_kwargs)


def test_without_labels_the_forward_and_generate_are_the_stock_models(build: Callable) -> None:
    stock, model, _ = stock_and_lean(build)
    ids, _ = batch()
    torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=0, atol=0)
    options = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    mask = torch.ones_like(ids)
    assert torch.equal(
        model.generate(ids, attention_mask=mask, **options),
        stock.generate(ids, attention_mask=mask, **options),
    )


def test_labels_given_by_position_shift_labels_and_ignore_index_are_the_stock_models() -> None:
    stock, model, _ = stock_and_lean(llama)
    ids, labels = batch()
    # labels is the forward's sixth parameter (input_ids, attention_mask, position_ids,
    # past_key_values, inputs_embeds, labels).
    expected = stock(ids, None, None, None, None, labels)
    actual = model(ids, None, None, None, None, labels)
    assert actual.logits is None
    torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-5, atol=1e-5)
    every = (ids, None, None, None, None, labels, False, 0)  # every parameter, by position
    assert model(*every).logits is None
    torch.testing.assert_close(model(*every).loss, expected.loss, rtol=1e-5, atol=1e-5)
    shifted = torch.roll(labels, -1, dims=1)  # given already shifted: no shift inside
    expected = stock(ids, labels=labels, shift_labels=shifted)
    actual = model(ids, labels=labels, shift_labels=shifted)
    torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-5, atol=1e-5)
    marked = labels.masked_fill(labels == -100, 7)  # token 7 ignored instead of -100
    expected = stock(ids, labels=marked, ignore_index=7)
    actual = model(ids, labels=marked, ignore_index=7)
    torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-5, atol=1e-5)


def test_arguments_the_forward_does_not_take_raise_its_type_error() -> None:
    stock, model, _ = stock_and_lean(llama)
    ids, labels = batch()
    for call in (
        lambda m: m(ids, None, None, None, None, labels, labels=labels),  # labels twice
        lambda m: m(ids, None, None, None, None, labels, False, 0, None),  # one too many
    ):
        with pytest.raises(TypeError):
            call(stock)
        with pytest.raises(TypeError):
            call(model)


def test_an_error_of_the_model_before_its_head_keeps_its_type() -> None:
    stock, model, _ = stock_and_lean(llama)
    ids, labels = batch()
    ids[0, 0] = VOCAB  # no such token
    with pytest.raises(IndexError):
        stock(ids, labels=labels)
    with pytest.raises(IndexError):
        model(ids, labels=labels)


def test_labels_on_another_device_than_the_model_are_moved_as_on_the_stock_model() -> None:
    """transformers' loss moves the labels to the logits' device, and the head's to its
    input's: labels on the meta device, which cannot be copied to the CPU model, raise the
    stock model's error, of the same type."""
    stock, model, _ = stock_and_lean(llama)
    ids, labels = batch()
    with pytest.raises(NotImplementedError) as expected:
        stock(ids, labels=labels.to("meta"))
    with pytest.raises(NotImplementedError) as actual:
        model(ids, labels=labels.to("meta"))
    assert type(actual.value) is type(expected.value)  # exactly, not a subclass
    assert str(actual.value) == str(expected.value)


def refusal_of(cls: type, **attributes: object) -> str:
    """The message of the RuntimeError that a tied ``cls``'s forward with labels raises, which
    names the class and the fix."""
    torch.manual_seed(0)
    model = cls(llama().config)
    vars(model).update(attributes)
    tie_output_embeddings(model, chunked_loss=True)
    ids, labels = batch()
    with pytest.raises(RuntimeError, match="chunked_loss=False") as error:
        model(ids, labels=labels)
    assert cls.__name__ in str(error.value)
    return str(error.value)


class OwnLogits(type(llama())):  # type: ignore[misc]
    """A causal LM whose forward computes the logits without its head, then their loss."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: object) -> object:
        hidden = self.model(input_ids).last_hidden_state
        logits = hidden @ self.model.embed_tokens.weight.T
        return self.loss_function(logits, labels, self.config.vocab_size)


def test_a_model_that_computes_its_loss_without_its_head_is_refused() -> None:
    refusal_of(OwnLogits)


class Passes(type(llama())):  # type: ignore[misc]
    """A causal LM whose forward gives its loss other labels or options than it was given."""

    change = ""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: object) -> object:
        output = self.model(input_ids)
        logits = self.lm_head(output.last_hidden_state)
        options = dict(kwargs)
        if self.change == "labels":
            labels = labels.clone()
        else:
            options[self.change] = {"ignore_index": -1, "num_items_in_batch": 3}.get(
                self.change, torch.roll(labels, -1, dims=1)
            )
        loss = self.loss_function(logits, labels, self.config.vocab_size, **options)
        return type(output)(last_hidden_state=loss)


@pytest.mark.parametrize("change", ["labels", "ignore_index", "num_items_in_batch", "shift_labels"])
def test_a_model_that_gives_its_loss_other_labels_or_options_is_refused(change: str) -> None:
    refusal_of(Passes, change=change)


class Slices(type(llama())):  # type: ignore[misc]
    """A causal LM whose forward takes the loss of some positions' logits only."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: object) -> object:
        output = self.model(input_ids)
        logits = self.lm_head(output.last_hidden_state)[:, 1:]
        loss = self.loss_function(logits, labels, self.config.vocab_size)
        return type(output)(last_hidden_state=loss)


class OwnLoss(type(llama())):  # type: ignore[misc]
    """A causal LM whose forward takes a loss of its own from the logits."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: object) -> object:
        output = self.model(input_ids)
        logits = self.lm_head(output.last_hidden_state)
        return type(output)(last_hidden_state=logits.square().mean())


class Twice(type(llama())):  # type: ignore[misc]
    """A causal LM whose forward takes transformers' loss of its logits twice."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: object) -> object:
        output = self.model(input_ids)
        logits = self.lm_head(output.last_hidden_state)
        first = self.loss_function(logits, labels, self.config.vocab_size)
        second = self.loss_function(logits, labels, self.config.vocab_size)
        return type(output)(last_hidden_state=first + second)


@pytest.mark.parametrize("cls", [OwnLoss, Twice])
def test_a_model_that_takes_its_loss_otherwise_than_once_through_loss_function_is_refused(
    cls: type,
) -> None:
    assert "loss_function" in refusal_of(cls)


def test_a_model_that_takes_the_loss_of_a_slice_of_the_logits_is_refused() -> None:
    refusal_of(Slices)


class NoLabels(type(llama())):  # type: ignore[misc]
    """A causal LM class whose forward takes no labels."""

    def forward(self, input_ids: torch.Tensor, **kwargs: object) -> object:
        return super().forward(input_ids)


class HeadAdapter(torch.nn.Module):
    """What an adapter library puts in the head's place: a module around the head."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base_layer = base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + 1.0  # type: ignore[no-any-return]


FIX = "tie it with chunked_loss=False"
CHANGED = (
    "{}'s forward changes its head's logits before its loss in a way chunked_loss does not "
    "compute (it applies the config's final_logit_softcapping, nothing else), so the chunked "
    f"loss would differ from the model's; {FIX}"
)


def _scaled() -> None:
    model = cohere()  # multiplies the logits by config.logit_scale before its loss
    tie_output_embeddings(model, chunked_loss=True)
    ids, labels = batch()
    model(ids, labels=labels)


def _other_loss() -> None:
    model = llama()
    model.loss_type = "ForMaskedLM"
    tie_output_embeddings(model, chunked_loss=True)


def _adapted() -> None:
    _, model, _ = stock_and_lean(llama)
    model.lm_head = HeadAdapter(model.lm_head)
    ids, labels = batch()
    model(ids, labels=labels)


def _refused(case: str) -> str:
    """The message of the error that the case's model raises, at the tie or at its forward."""
    torch.manual_seed(0)
    refused = {"own_logits": (OwnLogits, {}), "passes": (Passes, {"change": "labels"})}
    refused |= {"twice": (Twice, {}), "slices": (Slices, {})}
    if case in refused:
        cls, attributes = refused[case]
        return refusal_of(cls, **attributes)
    act = {"scaled": _scaled, "other_loss": _other_loss, "adapter": _adapted}.get(
        case, lambda: tie_output_embeddings(NoLabels(llama().config), chunked_loss=True)
    )
    with pytest.raises((RuntimeError, ValueError)) as error:
        act()
    return str(error.value)


REFUSALS = {
    "own_logits": "OwnLogits's forward computed its loss before calling its head, in which "
    f"chunked_loss computes it; {FIX}",
    "passes": "Passes's forward passes its loss other labels or options than it was given, "
    f"which the head's loss, computed from those given, would not match; {FIX}",
    "twice": "Twice's forward computes its loss without transformers' loss_function (or not "
    f"from its head's logits), where chunked_loss puts the head's loss; {FIX}",
    "slices": CHANGED.format("Slices"),
    "scaled": CHANGED.format("CohereForCausalLM"),
    "other_loss": "chunked_loss computes transformers' causal LM loss (ForCausalLMLoss), but "
    "LlamaForCausalLM's loss_function is ForMaskedLMLoss; keep chunked_loss=False for another "
    "loss",
    "adapter": "LlamaForCausalLM's head 'lm_head' is a "
    f"{HeadAdapter.__module__}.{HeadAdapter.__qualname__}, not the tied head, so chunked_loss "
    "cannot compute the loss in it (an adapter on the head, such as PEFT's LoRA or "
    "modules_to_save, computes logits of its own); leave the head out of the adapter, or tie "
    "the model with chunked_loss=False",
    "no_labels": "NoLabels's forward takes no labels, so it computes no loss; chunked_loss is "
    "for a causal LM, such as a ...ForCausalLM class",
}


@pytest.mark.parametrize("case", REFUSALS)
def test_each_refusal_is_one_whole_message(case: str) -> None:
    """The one whole-message check of each refusal: the model, what it does that the chunked
    loss cannot follow, and the fix. The other tests check the facts only."""
    assert _refused(case) == REFUSALS[case]


def test_switching_finds_the_wrapper_under_another_wrapper_of_the_forward() -> None:
    """accelerate wraps ``model.forward`` (autocast, outputs to float32) with functools.wraps."""
    _, model, _ = stock_and_lean(llama)
    inner = model.forward

    @functools.wraps(inner)
    def outer(*args: object, **kwargs: object) -> object:
        return inner(*args, **kwargs)

    model.forward = outer
    ids, labels = batch()
    assert model(ids, labels=labels).logits is None
    tie_output_embeddings(model, chunked_loss=False)
    assert model(ids, labels=labels).logits.shape == (2, 9, VOCAB)
    assert model.forward is outer


def test_a_forward_wrapped_before_the_tie_is_wrapped_in_turn() -> None:
    """accelerate's ``prepare`` before the tie: the chunked loss wraps the instance's forward,
    the wrapper with the model's own under it, and gives the stock loss."""
    torch.manual_seed(0)
    stock = llama()
    model = copy.deepcopy(stock)
    tie_output_embeddings(stock)
    inner = model.forward

    @functools.wraps(inner)
    def outer(*args: object, **kwargs: object) -> object:
        return inner(*args, **kwargs)

    model.forward = outer
    tie_output_embeddings(model, chunked_loss=True)
    assert model.forward.__wrapped__ is outer
    ids, labels = batch()
    assert_the_stock_loss_and_gradients(stock, model, ids, labels=labels)


def test_return_dict_false_gives_the_stock_tuple_without_the_logits(build: Callable) -> None:
    stock, model, _ = stock_and_lean(build)
    ids, labels = batch()
    expected = stock(ids, labels=labels, return_dict=False)
    actual = model(ids, labels=labels, return_dict=False)
    assert type(actual) is tuple
    assert len(actual) == len(expected) - 1  # the logits, left out
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-5, atol=1e-5)


def test_gradient_accumulation_with_num_items_in_batch_as_the_trainer_passes_it() -> None:
    stock, model, _ = stock_and_lean(llama)
    micro = [batch(seed=seed) for seed in (1, 2)]
    num_items = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro)
    for ids, labels in micro:
        stock(ids, labels=labels, num_items_in_batch=num_items).loss.backward()
        model(ids, labels=labels, num_items_in_batch=num_items).loss.backward()
    assert_same_gradients(model, stock)


def test_bfloat16_weights_and_autocast_give_the_stock_loss_to_its_precision() -> None:
    stock, model, _ = stock_and_lean(gemma2)
    ids, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, actual = stock(ids, labels=labels).loss, model(ids, labels=labels).loss
    torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2)
    stock, model = stock.to(torch.bfloat16), model.to(torch.bfloat16)
    expected, actual = stock(ids, labels=labels).loss, model(ids, labels=labels).loss
    assert actual.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2)


def test_the_trainer_runs_it_unchanged_with_gradient_accumulation(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments  # noqa: PLC0415

    rows = [batch(rows=1, seed=seed) for seed in range(8)]
    data = [{"input_ids": ids[0], "labels": labels[0]} for ids, labels in rows]

    widths: list[int] = []  # the last dimension of what the head returned, call by call

    def train(chunked_loss: bool | None) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = llama()
        if chunked_loss is not None:
            tie_output_embeddings(model, chunked_loss=chunked_loss)
            model.lm_head.register_forward_hook(lambda m, a, out: widths.append(out.shape[-1]))
        args = TrainingArguments(
            output_dir=str(tmp_path / str(chunked_loss)),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=2,
            learning_rate=1e-2,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=0,
            dataloader_drop_last=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        return losses, state

    expected_losses, expected_state = train(None)
    losses, state = train(True)
    assert widths == [1] * 4  # 2 steps of 2 micro-batches: the loss, never the logits
    assert len(losses) == 2
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-5)
    # AdamW's first steps move each weight by about the learning rate, whatever the size
    # of its gradient: a tiny gradient's rounding shows at the learning rate's scale.
    torch.testing.assert_close(state, expected_state, rtol=1e-4, atol=1e-5)


def test_the_forwards_signature_is_the_models_for_the_trainers_checks(build: Callable) -> None:
    stock, model, _ = stock_and_lean(build)
    assert inspect.signature(model.forward) == inspect.signature(stock.forward)


def test_a_second_call_switches_the_chunked_loss_off_and_on() -> None:
    stock, model, head = stock_and_lean(llama)
    ids, labels = batch()
    assert tie_output_embeddings(model, chunked_loss=False) is head
    torch.testing.assert_close(model(ids, labels=labels).logits, stock(ids).logits)
    assert tie_output_embeddings(model, chunked_loss=True) is head
    assert model(ids, labels=labels).logits is None
    plain = copy.deepcopy(stock)
    tie_output_embeddings(plain)  # tied without it, then switched on
    tie_output_embeddings(plain, chunked_loss=True)
    assert plain(ids, labels=labels).logits is None


def test_a_copy_or_a_pickle_of_the_model_computes_the_loss_in_its_own_head() -> None:
    stock, model, _ = stock_and_lean(llama)
    ids, labels = batch()
    expected = stock(ids, labels=labels).loss
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(2.0)  # the original changes, not the twin
        actual = twin(ids, labels=labels)
        assert actual.logits is None
        torch.testing.assert_close(actual.loss, expected, rtol=1e-5, atol=1e-5)
        twin.zero_grad()
        actual.loss.backward()
        assert twin.get_input_embeddings().weight.grad is not None
        assert model.get_input_embeddings().weight.grad is None


def test_a_model_that_scales_its_logits_before_the_loss_is_refused_at_the_forward() -> None:
    torch.manual_seed(0)
    model = cohere()  # multiplies the logits by config.logit_scale before its loss
    head = tie_output_embeddings(model, chunked_loss=True)
    ids, labels = batch()
    with pytest.raises(RuntimeError, match="chunked_loss=False") as error:
        model(ids, labels=labels)
    assert "CohereForCausalLM" in str(error.value)
    assert head._request is None  # the next call computes logits again
    assert tie_output_embeddings(model, chunked_loss=False) is head
    assert model(ids, labels=labels).logits.shape == (2, 9, VOCAB)


def test_a_model_with_another_loss_is_refused_at_the_tie_and_left_alone() -> None:
    torch.manual_seed(0)
    model = llama()
    model.loss_type = "ForMaskedLM"  # transformers' masked LM loss: no shift
    with pytest.raises(ValueError, match="ForCausalLMLoss") as error:
        tie_output_embeddings(model, chunked_loss=True)
    assert "loss_function is ForMaskedLMLoss" in str(error.value)
    assert "LlamaForCausalLM" in str(error.value)
    assert type(model.lm_head) is torch.nn.Linear
    assert "forward" not in vars(model)


def test_a_loss_function_set_after_the_tie_is_refused_at_the_forward() -> None:
    _, model, _ = stock_and_lean(llama)
    ids, labels = batch()
    model.loss_type = "ForMaskedLM"
    with pytest.raises(ValueError, match="ForCausalLMLoss"):
        model(ids, labels=labels)
    from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: PLC0415

    model.loss_function = functools.partial(ForCausalLMLoss)  # a callable without a name
    with pytest.raises(ValueError, match="loss_function is partial"):
        model(ids, labels=labels)
    assert model(ids).logits.shape == (2, 9, VOCAB)  # without labels, as before


def test_a_head_replaced_by_another_module_is_refused_with_labels() -> None:
    _, model, _ = stock_and_lean(llama)
    ids, labels = batch()

    class Adapter(torch.nn.Module):  # what an adapter library puts in the head's place
        def __init__(self, base: torch.nn.Module) -> None:
            super().__init__()
            self.base_layer = base

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base_layer(x) + 1.0  # type: ignore[no-any-return]

    model.lm_head = Adapter(model.lm_head)
    with pytest.raises(RuntimeError, match="'lm_head'") as error:
        model(ids, labels=labels)
    assert "LlamaForCausalLM" in str(error.value)
    assert "Adapter" in str(error.value)
    assert model(ids).logits.shape == (2, 9, VOCAB)


def test_a_mixture_of_experts_adds_its_routers_loss_as_on_the_stock_model() -> None:
    """The model adds ``router_aux_loss_coef * aux_loss`` to what its loss_function returns."""
    stock, model, _ = stock_and_lean(mixtral)
    ids, labels = batch()
    actual = assert_the_stock_loss_and_gradients(stock, model, ids, labels=labels)
    assert actual.aux_loss is not None  # type: ignore[attr-defined]


def test_out_of_training_mode_the_forward_gives_the_logits_and_their_loss(build: Callable) -> None:
    """Evaluation (the Trainer's, with metrics of the logits) gets what the stock model gives."""
    stock, model, _ = stock_and_lean(build)
    stock.eval()
    model.eval()
    ids, labels = batch()
    expected, actual = stock(ids, labels=labels), model(ids, labels=labels)
    torch.testing.assert_close(actual.logits, expected.logits, rtol=0, atol=0)
    torch.testing.assert_close(actual.loss, expected.loss, rtol=0, atol=0)
    model.train()
    assert model(ids, labels=labels).logits is None


def test_a_model_that_computes_its_loss_without_loss_function_is_refused_at_the_forward() -> None:
    """BartForCausalLM takes its own unshifted cross-entropy of the logits, which the
    chunked loss, transformers' shifted one, is not."""
    torch.manual_seed(0)
    model = bart()
    tie_output_embeddings(model, chunked_loss=True)
    ids, labels = batch()
    with pytest.raises(RuntimeError, match="loss_function") as error:
        model(ids, labels=labels)
    assert "chunked_loss=False" in str(error.value)
    assert "BartForCausalLM" in str(error.value)
    assert "_loss_function" not in vars(model)  # the model's own loss_function is back
    tie_output_embeddings(model, chunked_loss=False)
    assert model(ids, labels=labels).logits.shape == (2, 9, VOCAB)


def test_a_model_shared_by_threads_answers_each_threads_call() -> None:
    """A forward without labels on one thread, while another takes the loss, gets logits."""
    stock, model, _ = stock_and_lean(llama)
    ids, labels = batch(rows=4, length=24)
    expected_loss, expected_logits = stock(ids, labels=labels).loss, stock(ids).logits
    results: dict[str, list[torch.Tensor]] = {"loss": [], "logits": []}

    def work(labelled: bool) -> None:
        for _ in range(10):
            if labelled:
                results["loss"].append(model(ids, labels=labels).loss.detach())
            else:
                results["logits"].append(model(ids).logits.detach())

    threads = [threading.Thread(target=work, args=(i % 2 == 0,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results["loss"]) == len(results["logits"]) == 20
    for loss in results["loss"]:
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    for logits in results["logits"]:
        torch.testing.assert_close(logits, expected_logits)


# Dynamo builds the autograd context of a custom Function through a deprecated path, and warns.
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
def test_compiled_with_fullgraph_it_gives_the_stock_loss_and_refuses_a_scaled_model() -> None:
    stock, model, _ = stock_and_lean(llama)
    ids, labels = batch()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    expected, actual = stock(ids, labels=labels), compiled(ids, labels=labels)
    assert actual.logits is None
    torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-5, atol=1e-5)
    expected.loss.backward()
    actual.loss.backward()
    assert_same_gradients(model, stock)
    torch.manual_seed(0)
    scaled = cohere()
    tie_output_embeddings(scaled, chunked_loss=True)
    with pytest.raises(RuntimeError, match="chunked_loss=False") as error:
        torch.compile(scaled, fullgraph=True, backend="aot_eager")(ids, labels=labels)
    assert "CohereForCausalLM" in str(error.value)


def test_a_soft_cap_in_the_text_config_is_applied_as_on_the_stock_model() -> None:
    stock, model, _ = stock_and_lean(gemma4)
    assert getattr(model.config, "final_logit_softcapping", None) is None
    ids, labels = batch()
    assert_the_stock_loss_and_gradients(stock, model, ids, labels=labels)


def test_a_loss_function_set_on_the_model_is_kept_after_the_call() -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: PLC0415

    stock, model, _ = stock_and_lean(llama)
    model.loss_function = ForCausalLMLoss  # transformers' own, set on the instance
    ids, labels = batch()
    actual = model(ids, labels=labels)
    torch.testing.assert_close(actual.loss, stock(ids, labels=labels).loss, rtol=1e-5, atol=1e-5)
    assert vars(model)["_loss_function"] is ForCausalLMLoss


def test_a_frozen_tied_weight_under_weight_decay_stays_and_the_rest_trains_as_stock() -> None:
    stock, model, head = stock_and_lean(llama)
    head.requires_grad_(False)  # freezes the embedding's weight: the head's is the same one
    stock.get_input_embeddings().weight.requires_grad_(False)
    frozen = model.get_input_embeddings().weight.detach().clone()
    ids, labels = batch()
    optimizers = [
        torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (stock, model)
    ]
    for _ in range(2):
        assert_the_stock_loss_and_gradients(stock, model, ids, labels=labels)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert torch.equal(model.get_input_embeddings().weight, frozen)
    torch.testing.assert_close(
        dict(model.named_parameters()), dict(stock.named_parameters()), rtol=1e-4, atol=1e-5
    )


def test_float16_with_a_loss_scale_gives_the_stock_scaled_gradients() -> None:
    """As GradScaler does: the loss times 65536, then backward, in float16 weights."""
    stock, model, _ = stock_and_lean(llama)
    stock, model = stock.to(torch.float16), model.to(torch.float16)
    ids, labels = batch()
    expected, actual = stock(ids, labels=labels), model(ids, labels=labels)
    assert actual.loss.dtype == expected.loss.dtype == torch.float32
    torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-3, atol=1e-3)
    (expected.loss * 65536.0).backward()
    (actual.loss * 65536.0).backward()
    for grad in gradients(model).values():
        assert torch.isfinite(grad).all()
    torch.testing.assert_close(
        gradients(model),
        {k: v for k, v in gradients(stock).items() if k != "lm_head.weight"},
        rtol=2e-2,
        atol=2.0,
    )
