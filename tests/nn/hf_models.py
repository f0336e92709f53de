"""Small Hugging Face models, built from configs, that the transformers tests tie.

Nothing is downloaded; each builder takes config overrides.
"""

from __future__ import annotations

from transformers import (
    BartConfig,
    BartForCausalLM,
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 61


def decoder(**changes: object) -> dict[str, object]:
    """The sizes of a small decoder, which the Llama-like configs share, with ``changes``."""
    sizes: dict[str, object] = {
        "vocab_size": VOCAB,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 64,
    }
    return {**sizes, **changes}


def llama(**overrides: object) -> LlamaForCausalLM:
    # tie_word_embeddings is False by default for Llama
    config = LlamaConfig(**{**decoder(tie_word_embeddings=True), **overrides})
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
    config = Qwen2Config(**decoder(tie_word_embeddings=True))  # False by default for Qwen2
    return Qwen2ForCausalLM(config)


def gemma2() -> Gemma2ForCausalLM:
    config = Gemma2Config(**decoder(head_dim=8))
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


def cohere() -> CohereForCausalLM:
    """Multiplies its logits by ``config.logit_scale`` before its loss."""
    config = CohereConfig(**decoder(num_hidden_layers=1, logit_scale=0.25))
    return CohereForCausalLM(config)


def mixtral() -> MixtralForCausalLM:
    """A mixture of experts that adds its router's loss to its loss."""
    config = MixtralConfig(
        **decoder(
            num_hidden_layers=1,
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=True,
            output_router_logits=True,
            router_aux_loss_coef=0.5,
        )
    )
    return MixtralForCausalLM(config)


def bart() -> BartForCausalLM:
    """Takes its own unshifted cross-entropy of the logits, without ``loss_function``."""
    config = BartConfig(
        vocab_size=VOCAB,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
        dropout=0.0,
        tie_word_embeddings=True,
    )
    return BartForCausalLM(config)


def gemma4() -> Gemma4ForConditionalGeneration:
    """A model whose soft-cap is in its text config, not at the top of its config."""
    # A small soft-cap, so that it changes the loss much.
    text = Gemma4TextConfig(**decoder(head_dim=8, final_logit_softcapping=3.0))
    return Gemma4ForConditionalGeneration(
        Gemma4Config(text_config=text, vision_config=None, audio_config=None)
    )
