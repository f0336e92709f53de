"""Small Hugging Face models, built from configs, that the transformers tests tie.

Nothing is downloaded; each builder takes config overrides.
"""

from __future__ import annotations

import transformers
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
# Two optimizer steps of two accumulated batches, on the CPU: the Trainer's and TRL's arguments.
TRAINING: dict[str, object] = {
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "max_steps": 2,
    "learning_rate": 1e-2,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": [],
    "use_cpu": True,
    "seed": 0,
    "dataloader_drop_last": True,
}


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


def gemma2(**overrides: object) -> Gemma2ForCausalLM:
    config = Gemma2Config(**{**decoder(head_dim=8), **overrides})
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


def build(config: str, model: str, **sizes: object) -> transformers.PreTrainedModel:
    """``transformers.<model>`` of ``transformers.<config>(**sizes)``."""
    return getattr(transformers, model)(getattr(transformers, config)(**sizes))  # type: ignore[no-any-return]


# The architectures that chunked_loss lists, each a tied model without dropout; a soft-cap of
# 3.0, which changes the loss much, where the architecture has one.
TIED = {"tie_word_embeddings": True}
CAUSAL_LMS = {
    "llama": llama,
    "mistral": lambda: build("MistralConfig", "MistralForCausalLM", **decoder(**TIED)),
    "qwen2": qwen2,
    "qwen3": lambda: build("Qwen3Config", "Qwen3ForCausalLM", **decoder(head_dim=8, **TIED)),
    "gemma": lambda: build("GemmaConfig", "GemmaForCausalLM", **decoder(head_dim=8)),
    "gemma2": lambda: gemma2(final_logit_softcapping=3.0),
    "gemma3": lambda: build(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        **decoder(head_dim=8, final_logit_softcapping=3.0, sliding_window=4),
    ),
    "gpt2": gpt2,
    "phi3": lambda: build(
        "Phi3Config",
        "Phi3ForCausalLM",
        **decoder(pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, **TIED),
    ),
    "olmo2": lambda: build("Olmo2Config", "Olmo2ForCausalLM", **decoder(pad_token_id=0, **TIED)),
    "stablelm": lambda: build(
        "StableLmConfig", "StableLmForCausalLM", **decoder(hidden_dropout=0.0, **TIED)
    ),
    "starcoder2": lambda: build(
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        **decoder(residual_dropout=0.0, embedding_dropout=0.0, **TIED),
    ),
    "mixtral": mixtral,
    "qwen2_moe": lambda: build(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        **decoder(
            num_hidden_layers=1,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            output_router_logits=True,
            router_aux_loss_coef=0.5,
            **TIED,
        ),
    ),
    "recurrent_gemma": lambda: build(
        "RecurrentGemmaConfig",
        "RecurrentGemmaForCausalLM",
        **decoder(
            lru_width=16,
            attention_window_size=8,
            conv1d_width=2,
            logits_soft_cap=3.0,
            block_types=["recurrent", "attention"],
            pad_token_id=0,
        ),
    ),
}


def bamba() -> transformers.PreTrainedModel:
    """Adds a z-loss of its logits, ``z_loss_coefficient``, to its loss."""
    return build(
        "BambaConfig",
        "BambaForCausalLM",
        **decoder(
            mamba_n_heads=2,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_chunk_size=4,
            attn_layer_indices=[1],
            z_loss_coefficient=0.1,
            **TIED,
        ),
    )
