"""``tie_output_embeddings(model, chunked_loss=True)``: a training forward with labels takes the
tied head's chunked loss from the decoder's last hidden states, against the stock tied model.

The reference is the stock tied model, built with the same seed: ``model(ids, labels=labels)``
computes the logits and transformers' ``ForCausalLMLoss`` of them. Each architecture that
chunked_loss lists has its parity case in ``CAUSAL_LMS``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedModel

from tests.nn.hf_models import (
    CAUSAL_LMS,
    TRAINING,
    VOCAB,
    bamba,
    cohere,
    llama,
    mixtral,
    opt,
)
from toolkit.nn import tie_output_embeddings
from toolkit.nn._transformers import ROUTES


@pytest.fixture(params=list(CAUSAL_LMS))
def build(request: pytest.FixtureRequest) -> Callable[[], PreTrainedModel]:
    return CAUSAL_LMS[request.param]


def stock_and_lean(build: Callable[[], PreTrainedModel]) -> tuple[PreTrainedModel, PreTrainedModel]:
    """The stock tied model, in training mode, and a copy tied with ``chunked_loss=True``."""
    torch.manual_seed(0)
    stock = build().train()
    model = copy.deepcopy(stock)
    tie_output_embeddings(model, chunked_loss=True)
    return stock, model


def batch(rows: int = 2, length: int = 9, seed: int = 1, ignored: str = "some") -> tuple:
    """Tokens, and labels that ignore none, a prompt of 3 tokens in the first row, or all."""
    ids = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, : {"none": 0, "some": 3, "all": length}[ignored]] = -100
    if ignored == "all":
        labels[:] = -100
    return ids, labels


def gradients(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(model: PreTrainedModel, stock: PreTrainedModel, rtol: float) -> None:
    actual, expected = gradients(model), gradients(stock)
    assert list(actual) == [k for k in expected if k != "lm_head.weight"]
    expected = {k: expected[k] for k in actual}
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=1e-6, equal_nan=True)


def assert_the_stock_loss_and_gradients(
    stock: PreTrainedModel, model: PreTrainedModel, *args: object, **kwargs: object
) -> object:
    """``model(*args, **kwargs)`` gives no logits, the stock loss to 1e-6 and gradients to 1e-5."""
    expected, actual = stock(*args, **kwargs), model(*args, **kwargs)
    assert type(actual) is type(expected)
    assert actual.logits is None
    assert actual.loss.dtype == expected.loss.dtype == torch.float32
    torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-6, atol=0, equal_nan=True)
    assert actual.keys() == expected.keys() - {"logits"}
    for name in actual.keys() - {"loss", "past_key_values"}:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-6, atol=1e-7)
    expected.loss.backward()
    actual.loss.backward()
    assert_same_gradients(model, stock, rtol=1e-5)
    return actual


def test_every_listed_architecture_has_a_parity_case() -> None:
    classes = {
        f"{type(m).__module__}.{type(m).__qualname__}"
        for m in map(lambda b: b(), CAUSAL_LMS.values())
    }
    assert classes == set(ROUTES)


@pytest.mark.parametrize("ignored", ["none", "some", "all"])
@pytest.mark.parametrize(
    "loss_kwargs",
    [{}, {"num_items_in_batch": torch.tensor(5)}, {"num_items_in_batch": 7}],
    ids=["mean", "num_items_tensor", "num_items_int"],
)
def test_the_loss_and_gradients_are_the_stock_models_and_no_logits_are_returned(
    build: Callable, ignored: str, loss_kwargs: dict[str, object]
) -> None:
    """Mean, or a sum over ``num_items_in_batch`` (the Trainer's gradient accumulation); the
    soft-cap by the config's name (Gemma 2 and 3, RecurrentGemma), the router's loss (Mixtral,
    Qwen2-MoE); a batch whose labels are all ignored gives the stock NaN, or 0."""
    stock, model = stock_and_lean(build)
    ids, labels = batch(ignored=ignored)
    assert_the_stock_loss_and_gradients(stock, model, ids, labels=labels, **loss_kwargs)


def test_logits_to_keep_0_takes_the_chunked_loss_and_another_value_the_stock_forward(
    build: Callable,
) -> None:
    """0, every position's logits, is the forward's default; any other value asks for logits,
    here the last 9 positions, all of them: the stock forward gives them, and its loss."""
    stock, model = stock_and_lean(build)
    ids, labels = batch()
    assert_the_stock_loss_and_gradients(stock, model, ids, labels=labels, logits_to_keep=0)
    expected = stock(ids, labels=labels, logits_to_keep=9)
    actual = model(ids, labels=labels, logits_to_keep=9)
    assert actual.logits.shape == (2, 9, VOCAB)
    torch.testing.assert_close(actual.logits, expected.logits, rtol=0, atol=0)
    torch.testing.assert_close(actual.loss, expected.loss, rtol=0, atol=0)


def test_every_argument_passed_by_position_takes_the_chunked_loss(build: Callable) -> None:
    stock, model = stock_and_lean(build)
    ids, labels = batch()
    given = {"input_ids": ids, "labels": labels}
    parameters = inspect.signature(stock.forward).parameters.values()
    args = [given.get(p.name, p.default) for p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert_the_stock_loss_and_gradients(stock, model, *args)


def test_padding_under_activation_checkpointing_gives_the_stock_loss_and_gradients(
    build: Callable,
) -> None:
    """A padded batch (its mask reaches the decoder and a router's loss) with the decoder's
    activations recomputed in the backward, as a fine-tuning run sets them."""
    stock, model = stock_and_lean(build)
    ids, labels = batch()
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a left-padded second row
    labels[1, :4] = -100
    for each in (stock, model):
        each.activation_checkpointing_enable()
    assert_the_stock_loss_and_gradients(stock, model, ids, labels=labels, attention_mask=mask)


def test_the_returned_tuple_keeps_the_stock_positions_with_none_for_the_logits(
    build: Callable,
) -> None:
    stock, model = stock_and_lean(build)
    ids, labels = batch()
    expected = stock(ids, labels=labels, return_dict=False)
    actual = model(ids, labels=labels, return_dict=False)
    assert type(actual) is tuple
    assert len(actual) == len(expected)
    logits = next(i for i, value in enumerate(expected) if value.shape == (2, 9, VOCAB))
    assert actual[logits] is None
    assert [type(v) for i, v in enumerate(actual) if i != logits] == [
        type(v) for i, v in enumerate(expected) if i != logits
    ]
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-6, atol=0)


def test_without_labels_or_out_of_training_mode_the_forward_is_the_stock_models(
    build: Callable,
) -> None:
    stock, model = stock_and_lean(build)
    ids, labels = batch()
    torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=0, atol=0)
    stock.eval()
    model.eval()
    expected, actual = stock(ids, labels=labels), model(ids, labels=labels)
    torch.testing.assert_close(actual.logits, expected.logits, rtol=0, atol=0)
    torch.testing.assert_close(actual.loss, expected.loss, rtol=0, atol=0)
    options = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    mask = torch.ones_like(ids)
    assert torch.equal(
        model.generate(ids, attention_mask=mask, **options),
        stock.generate(ids, attention_mask=mask, **options),
    )


def test_bfloat16_gives_the_stock_loss_within_the_stock_models_own_bfloat16_distance(
    build: Callable,
) -> None:
    """Against the float32 model: the chunked loss in bfloat16 weights, and under autocast, is
    no further from it than the stock model in bfloat16 (Gemma 2 soft-caps the bfloat16
    logits, the chunked loss the float32 ones), with a bfloat16 rounding of margin."""
    stock, model = stock_and_lean(build)
    ids, labels = batch()
    exact = stock(ids, labels=labels).loss.item()
    margin = 2**-8 * abs(exact)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, actual = stock(ids, labels=labels).loss, model(ids, labels=labels).loss
    assert abs(actual.item() - exact) <= abs(expected.item() - exact) + margin
    stock, model = stock.to(torch.bfloat16), model.to(torch.bfloat16)
    expected, actual = stock(ids, labels=labels).loss, model(ids, labels=labels).loss
    assert actual.dtype == expected.dtype == torch.float32
    assert abs(actual.item() - exact) <= abs(expected.item() - exact) + margin


def test_labels_by_position_shift_labels_and_ignore_index_are_the_stock_models() -> None:
    stock, model = stock_and_lean(llama)
    ids, labels = batch()
    # labels is the forward's sixth parameter (input_ids, attention_mask, position_ids,
    # past_key_values, inputs_embeds, labels).
    assert_the_stock_loss_and_gradients(stock, model, ids, None, None, None, None, labels)
    shifted = torch.roll(labels, -1, dims=1)  # given already shifted: no shift inside
    assert_the_stock_loss_and_gradients(stock, model, ids, labels=labels, shift_labels=shifted)
    marked = labels.masked_fill(labels == -100, 7)  # token 7 ignored instead of -100
    assert_the_stock_loss_and_gradients(stock, model, ids, labels=marked, ignore_index=7)
    for call in (
        lambda m: m(ids, None, None, None, None, labels, labels=labels),  # labels twice
        lambda m: m(ids, None, None, None, None, labels, False, 0, None),  # one too many
    ):
        with pytest.raises(TypeError):
            call(stock)
        with pytest.raises(TypeError):
            call(model)


def test_a_router_loss_left_off_by_the_call_is_left_off_as_on_the_stock_model() -> None:
    stock, model = stock_and_lean(mixtral)
    ids, labels = batch()
    actual = assert_the_stock_loss_and_gradients(
        stock, model, ids, labels=labels, output_router_logits=False
    )
    assert actual.aux_loss is None  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "build",
    [
        lambda: type("Subclass", (LlamaForCausalLM,), {})(llama().config),  # a subclass
        bamba,  # adds a z-loss of its logits
        cohere,  # scales its logits
        opt,
    ],
    ids=["subclass", "bamba", "cohere", "opt"],
)
def test_a_class_not_listed_is_refused_naming_it_the_list_and_the_fixes(build: Callable) -> None:
    torch.manual_seed(0)
    model = build()
    head = model.get_output_embeddings()
    with pytest.raises(ValueError, match=r"docs/transformers\.md") as error:
        tie_output_embeddings(model, chunked_loss=True)
    assert type(model).__qualname__ in str(error.value)
    assert "chunked_loss=False" in str(error.value)
    assert "SFTTrainer" in str(error.value)
    if type(model).__qualname__ == "OPTForCausalLM":  # the one whole-message check of this error
        assert str(error.value) == (
            "chunked_loss computes the loss of the architectures listed in the transformers guide "
            "(docs/transformers.md, 'Architectures of the chunked loss'), by exact class, and "
            "transformers.models.opt.modeling_opt.OPTForCausalLM is not among them; tie it with "
            "chunked_loss=False (the stock loss of the logits), or train it with TRL's "
            "SFTTrainer, whose own chunked loss reads the tied head's weight"
        )
    assert model.get_output_embeddings() is head  # left alone
    assert "forward" not in vars(model)
    tied = tie_output_embeddings(model)  # the plain tie stays open
    with pytest.raises(ValueError, match="SFTTrainer"):
        tie_output_embeddings(model, chunked_loss=True)
    assert model.get_output_embeddings() is tied
    assert "forward" not in vars(model)


def test_a_second_call_switches_the_chunked_loss_off_and_on() -> None:
    stock, model = stock_and_lean(llama)
    head = model.get_output_embeddings()
    ids, labels = batch()
    assert tie_output_embeddings(model, chunked_loss=False) is head
    torch.testing.assert_close(model(ids, labels=labels).logits, stock(ids).logits)
    assert tie_output_embeddings(model, chunked_loss=True) is head
    assert model(ids, labels=labels).logits is None
    plain = copy.deepcopy(stock)
    tie_output_embeddings(plain)  # tied without it, then switched on
    tie_output_embeddings(plain, chunked_loss=True)
    assert plain(ids, labels=labels).logits is None


@pytest.mark.parametrize("enabled", [False, True])
def test_switching_under_another_forward_wrapper_is_refused_naming_it(enabled: bool) -> None:
    """What wraps ``model.forward`` since (TRL's SFTTrainer, accelerate's mixed precision)
    hides the chunked loss, on or off: the switch is refused, never ignored."""
    _, model = stock_and_lean(llama)
    inner = model.forward

    def outer(*args: object, **kwargs: object) -> object:
        return inner(*args, **kwargs)

    model.forward = outer
    with pytest.raises(ValueError, match="outer") as error:
        tie_output_embeddings(model, chunked_loss=enabled)
    assert "chunked_loss=False" in str(error.value)
    if enabled:  # the one whole-message check of this error
        assert str(error.value) == (
            f"LlamaForCausalLM's forward is already replaced by {__name__}.{outer.__qualname__} "
            "(TRL's SFTTrainer puts its fused loss there, accelerate its mixed precision), under "
            "which tie_output_embeddings cannot switch the chunked loss: switch it before the "
            "wrapper is made (before building the trainer), or keep chunked_loss=False; under "
            "SFTTrainer, TRL's own chunked loss runs either way"
        )
    assert model.forward is outer
    ids, labels = batch()
    assert model(ids, labels=labels).logits is None  # as it was


@pytest.mark.parametrize("kind", ["partial", "staticmethod"])
def test_a_wrapper_that_is_not_a_function_is_named_by_its_class_or_the_function_it_holds(
    kind: str,
) -> None:
    _, model = stock_and_lean(llama)
    inner = model.forward

    def outer(*args: object, **kwargs: object) -> object:
        return inner(*args, **kwargs)

    if kind == "partial":
        model.forward = functools.partial(outer)
        named = "functools.partial"
    else:
        model.forward = staticmethod(outer)
        named = f"{__name__}.{outer.__qualname__}"
    with pytest.raises(ValueError, match="chunked_loss=False") as error:
        tie_output_embeddings(model, chunked_loss=True)
    assert f"already replaced by {named} (" in str(error.value)


def test_a_head_or_loss_function_replaced_after_the_tie_is_refused_at_the_forward() -> None:
    _, model = stock_and_lean(llama)
    ids, labels = batch()
    model.loss_type = "ForMaskedLM"
    with pytest.raises(RuntimeError, match="chunked_loss=False") as error:
        model(ids, labels=labels)
    assert str(error.value) == (  # the one whole-message check of this error
        "LlamaForCausalLM's head or loss_function was replaced after the tie, so the chunked "
        "loss would not be the model's; tie it with chunked_loss=False"
    )
    model.loss_type = "ForCausalLM"
    model.lm_head = torch.nn.Linear(16, VOCAB, bias=False)  # untied, as set_output_embeddings
    with pytest.raises(RuntimeError, match="chunked_loss=False"):
        model(ids, labels=labels)
    assert model(ids).logits.shape == (2, 9, VOCAB)  # without labels, the model's forward


def test_the_forwards_signature_is_the_models_for_the_trainers_checks(build: Callable) -> None:
    stock, model = stock_and_lean(build)
    assert inspect.signature(model.forward) == inspect.signature(stock.forward)


def test_gradient_accumulation_with_num_items_in_batch_as_the_trainer_passes_it() -> None:
    stock, model = stock_and_lean(llama)
    micro = [batch(seed=seed) for seed in (1, 2)]
    num_items = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro)
    for ids, labels in micro:
        stock(ids, labels=labels, num_items_in_batch=num_items).loss.backward()
        model(ids, labels=labels, num_items_in_batch=num_items).loss.backward()
    assert_same_gradients(model, stock, rtol=1e-5)


def test_the_trainer_runs_it_unchanged_with_gradient_accumulation(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments  # noqa: PLC0415

    rows = [batch(rows=1, seed=seed) for seed in range(8)]
    data = [{"input_ids": ids[0], "labels": labels[0]} for ids, labels in rows]
    calls: list[int] = []  # of the head, which the chunked loss does not call

    def train(chunked_loss: bool | None) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = llama()
        if chunked_loss is not None:
            tie_output_embeddings(model, chunked_loss=chunked_loss)
            model.lm_head.register_forward_hook(lambda *_: calls.append(1))
        args = TrainingArguments(output_dir=str(tmp_path / str(chunked_loss)), **TRAINING)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        return losses, state

    expected_losses, expected_state = train(None)
    losses, state = train(True)
    assert calls == []
    assert len(losses) == 2
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-5)
    # AdamW's first steps move each weight by about the learning rate, whatever the size
    # of its gradient: a tiny gradient's rounding shows at the learning rate's scale.
    torch.testing.assert_close(state, expected_state, rtol=1e-4, atol=1e-5)


def test_a_copy_or_a_pickle_of_the_model_computes_the_loss_in_its_own_head() -> None:
    stock, model = stock_and_lean(llama)
    ids, labels = batch()
    expected = stock(ids, labels=labels).loss
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(2.0)  # the original changes, not the twin
        actual = twin(ids, labels=labels)
        assert actual.logits is None
        torch.testing.assert_close(actual.loss, expected, rtol=1e-6, atol=0)
        twin.zero_grad()
        actual.loss.backward()
        assert twin.get_input_embeddings().weight.grad is not None
        assert model.get_input_embeddings().weight.grad is None


# Dynamo builds the autograd context of a custom Function through a deprecated path, and warns.
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
def test_compiled_with_fullgraph_it_gives_the_stock_loss_and_gradients() -> None:
    stock, model = stock_and_lean(llama)
    ids, labels = batch()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    expected, actual = stock(ids, labels=labels), compiled(ids, labels=labels)
    assert actual.logits is None
    torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-6, atol=0)
    expected.loss.backward()
    actual.loss.backward()
    assert_same_gradients(model, stock, rtol=1e-5)


def test_a_frozen_tied_weight_under_weight_decay_stays_and_the_rest_trains_as_stock() -> None:
    stock, model = stock_and_lean(llama)
    model.get_output_embeddings().requires_grad_(False)  # the embedding's weight: the same one
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
    stock, model = stock_and_lean(llama)
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
