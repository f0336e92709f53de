"""transformers' ModelTesterMixin on Llama, GPT-2, Qwen2 and Gemma 2: stock tied and tied.

Run by ``nox -s transformers_mixin``, which provides the mixin (see ``conftest.py``). Each
architecture has a small tester of this project's own (the sdist ships none) and two test
classes: ``...StockTest`` on the model transformers builds with ``tie_word_embeddings=True``,
and ``...TiedTest`` on the same class whose instances ``tie_output_embeddings`` ties after
construction and after every ``from_pretrained``, as a user would.
"""

from __future__ import annotations

import contextvars
import unittest
from typing import Any

import pytest
import torch

from tests.transformers_mixin.conftest import SDIST_TESTS
from toolkit.nn import tie_output_embeddings

if not SDIST_TESTS:
    pytest.skip("run by nox -s transformers_mixin", allow_module_level=True)

from hf_tests.generation.test_utils import GenerationTesterMixin  # the stand-in
from hf_tests.test_modeling_common import (
    ModelTesterMixin,
    ids_tensor,
    random_attention_mask,
)
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 99
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 37,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
CONFIGS: dict[str, tuple[type, type[PreTrainedModel], dict[str, Any]]] = {
    "Llama": (LlamaConfig, LlamaForCausalLM, COMMON),
    "Qwen2": (Qwen2Config, Qwen2ForCausalLM, COMMON),
    "Gemma2": (Gemma2Config, Gemma2ForCausalLM, {**COMMON, "head_dim": 8, "sliding_window": 4}),
    "GPT2": (
        GPT2Config,
        GPT2LMHeadModel,
        {
            "vocab_size": VOCAB,
            "n_embd": 32,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 64,
            "tie_word_embeddings": True,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
}


class SmallTester:
    """The small tester the mixin reads its configs and inputs from."""

    batch_size = 2
    seq_length = 7
    vocab_size = VOCAB
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 4
    is_training = True

    def __init__(self, parent: unittest.TestCase, config_class: type, options: dict) -> None:
        self.parent = parent
        self.config_class = config_class
        self.options = options

    def get_config(self) -> Any:
        return self.config_class(**self.options)

    def prepare_config_and_inputs_for_common(self) -> tuple[Any, dict[str, torch.Tensor]]:
        shape = [self.batch_size, self.seq_length]
        inputs = {
            "input_ids": ids_tensor(shape, VOCAB),
            "attention_mask": random_attention_mask(shape),
        }
        return self.get_config(), inputs


_LOADING = contextvars.ContextVar("loading", default=False)


def _tie_if_tied(model: PreTrainedModel) -> None:
    """Tie as a user would: a model whose head shares the embedding's weight."""
    output = model.get_output_embeddings()
    if getattr(output, "weight", None) is model.get_input_embeddings().weight:
        tie_output_embeddings(model)


def tied(cls: type[PreTrainedModel]) -> type[PreTrainedModel]:
    """``cls``, under its own name, whose models are tied after construction and loading."""

    class Tied(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if not _LOADING.get():
                _tie_if_tied(self)

        @classmethod
        def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
            token = _LOADING.set(True)  # from_pretrained ties only after loading
            try:
                loaded = super().from_pretrained(*args, **kwargs)
            finally:
                _LOADING.reset(token)
            _tie_if_tied(loaded[0] if isinstance(loaded, tuple) else loaded)
            return loaded

    Tied.__name__, Tied.__qualname__ = cls.__name__, cls.__qualname__
    Tied.__module__ = cls.__module__
    return Tied


def _test_class(arch: str, model_class: type[PreTrainedModel], kind: str) -> type:
    config_class, _, options = CONFIGS[arch]

    def setUp(self: unittest.TestCase) -> None:
        self.model_tester = SmallTester(self, config_class, options)

    return type(
        f"{arch}{kind}Test",
        # The stand-in mixin has no tests; the mixin checks that generative models have it.
        (ModelTesterMixin, GenerationTesterMixin, unittest.TestCase),
        {"all_model_classes": (model_class,), "setUp": setUp, "__module__": __name__},
    )


for _arch, (_, _model_class, _) in CONFIGS.items():
    globals()[f"{_arch}StockTest"] = _test_class(_arch, _model_class, "Stock")
    globals()[f"{_arch}TiedTest"] = _test_class(_arch, tied(_model_class), "Tied")
