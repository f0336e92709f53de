"""Small Hugging Face models, built from configs, that the transformers tests tie.

Nothing is downloaded; each builder takes config overrides.
"""

from __future__ import annotations

from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

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


def qwen2() -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,  # False by default for Qwen2
    )
    return Qwen2ForCausalLM(config)


def gemma2() -> Gemma2ForCausalLM:
    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
    )
    return Gemma2ForCausalLM(config)


def opt() -> OPTForCausalLM:
    """A decoder two levels down (``model.decoder``), which the causal LM calls directly."""
    config = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        word_embed_proj_dim=16,
        ffn_dim=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
    )
    return OPTForCausalLM(config)
