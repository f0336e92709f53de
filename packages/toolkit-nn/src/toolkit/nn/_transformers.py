"""tie_output_embeddings: a Hugging Face transformers model's LM head as a TiedLinear."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from torch import nn

from toolkit.nn._tied_linear import TiedLinear

__all__ = ["tie_output_embeddings"]


def tie_output_embeddings(model: nn.Module) -> TiedLinear:
    """Make a transformers model's output embeddings a TiedLinear on its input embeddings.

    The LM head that ``model.get_output_embeddings()`` returns is replaced, under the same
    attribute, by ``TiedLinear(model.get_input_embeddings())``, and the model's
    ``_tied_weights_keys`` stop naming the head's weight, which now has one owner. Afterwards
    ``post_init()``, ``tie_weights()``, the forward, ``generate()``, ``save_pretrained()`` (one
    copy of the weight, which a stock model loads), ``resize_token_embeddings()``, meta-device
    init and FSDP2 work as on the stock tied model, and ``head.cross_entropy`` takes the loss
    without the logits. The package does not import transformers; ``model`` is any
    ``PreTrainedModel`` with input and output embeddings. See the
    [Hugging Face transformers guide][hugging-face-transformers].

    Args:
        model: A transformers ``PreTrainedModel`` whose config ties the word embeddings.

    Returns:
        The new head, also ``model.get_output_embeddings()``. A head that already is a
        TiedLinear on the input embeddings is returned unchanged.

    Raises:
        TypeError: If ``model`` is not a transformers model with input and output embeddings.
        ValueError: If ``config.tie_word_embeddings`` is False, the model has no output
            embeddings, or its head is not the bias-free, tied Linear a tied model holds.
            Nothing is changed.

    Added in version v3.58.0.

    Examples:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from toolkit.nn import tie_output_embeddings
        >>> config = LlamaConfig(
        ...     vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...     num_attention_heads=2, tie_word_embeddings=True)
        >>> model = LlamaForCausalLM(config)
        >>> head = tie_output_embeddings(model)
        >>> model.lm_head is head and head.weight is model.model.embed_tokens.weight
        True
    """
    if not all(
        callable(getattr(model, name, None))
        for name in ("get_input_embeddings", "get_output_embeddings")
    ):
        raise TypeError(
            f"tie_output_embeddings takes a transformers PreTrainedModel, got "
            f"{type(model).__name__}; for another model, assign TiedLinear(embedding) as its head"
        )
    kind = type(model).__name__
    hf: Any = model  # its transformers methods are not typed here
    if not getattr(hf.config, "tie_word_embeddings", None):
        raise ValueError(
            f"{kind}'s config has tie_word_embeddings=False: its head has weights of its own, "
            "which tying would discard; build the model with tie_word_embeddings=True to tie it"
        )
    embedding = hf.get_input_embeddings()
    output = hf.get_output_embeddings()
    if output is None:
        raise ValueError(
            f"{kind} has no output embeddings (get_output_embeddings() returns None); tie a "
            "model with an LM head, such as a ...ForCausalLM class"
        )
    if isinstance(output, TiedLinear):
        if output.tied_module is embedding:
            return output
        raise ValueError(f"{kind}'s head already is {output!r}, not tied to the input embeddings")
    if getattr(output, "weight", None) is not embedding.weight:
        raise ValueError(
            f"{kind}'s output embeddings do not share the input embeddings' weight, so the "
            "model's logits do not come from it (was it loaded from a checkpoint with two "
            "different weights?); tying would change them: save and load it tied first"
        )
    if getattr(output, "bias", None) is not None:
        raise ValueError(f"{kind}'s head has a bias, which TiedLinear, bias-free, would drop")
    names = [name for name, module in model.named_modules() if module is output]
    mappings = _untied_mappings(model, f"{names[0]}.weight")
    head = _set_head(model, names[0], embedding)
    for owner, name, mapping in mappings:
        setattr(owner, name, mapping)
    # transformers' tie_weights() ties the head to the input embeddings of the moment, a
    # new one after set_input_embeddings(): the model's own does the same for this head.
    hf.tie_weights = functools.partial(_tie_weights, model, names[0], hf.tie_weights)
    return head


def _set_head(model: nn.Module, path: str, embedding: nn.Module) -> TiedLinear:
    """Put ``TiedLinear(embedding)`` at ``path`` in ``model``, in place of what is there."""
    parent_name, _, attribute = path.rpartition(".")
    parent = model.get_submodule(parent_name)
    head = TiedLinear(embedding)
    delattr(parent, attribute)
    setattr(parent, attribute, head)
    return head


def _tie_weights(
    model: nn.Module, path: str, tie_weights: Callable[..., object], *args: object, **kwargs: object
) -> None:
    """Tie as transformers' ``tie_weights`` does, then the head to the current input embeddings."""
    tie_weights(*args, **kwargs)
    hf: Any = model
    embedding = hf.get_input_embeddings()
    head = hf.get_output_embeddings()
    if isinstance(head, TiedLinear) and head.tied_module is not embedding:
        _set_head(model, path, embedding)


def _untied_mappings(model: nn.Module, key: str) -> list[tuple[nn.Module, str, dict[str, Any]]]:
    """Each tied-weights mapping of ``model`` and its sub-models, without the entry of ``key``.

    transformers keeps ``_tied_weights_keys`` (``{target: source}``, possibly regular
    expressions, read by ``post_init`` and ``tie_weights``) and ``all_tied_weights_keys``
    (expanded, read by ``tie_weights(recompute_mapping=False)`` and loading) on every
    ``PreTrainedModel``, with keys relative to it. The new values are set on the instances.
    """
    found = []
    for prefix, module in model.named_modules():
        start = f"{prefix}." if prefix else ""
        if not key.startswith(start):
            continue  # not an ancestor of the head: its mapping cannot name it
        own = key[len(start) :]
        for name in ("_tied_weights_keys", "all_tied_weights_keys"):
            mapping = getattr(module, name, None)
            if isinstance(mapping, dict):
                # transformers matches a target as the regular expression "^" + target.
                kept = {t: s for t, s in mapping.items() if not re.match(t, own)}
                found.append((module, name, kept))
    return found
