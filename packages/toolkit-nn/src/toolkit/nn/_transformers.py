"""tie_output_embeddings: a Hugging Face transformers model's LM head as a TiedLinear.

transformers offers no hook to tie a head that owns no weight, nor to take a causal LM's loss
from its decoder's hidden states, so the tie patches the model instance, and only it:

- ``tie_weights``: transformers ties the head to the input embeddings of the moment through a
  mapping that no longer names the head; the patch ties it as well.
- ``init_parallel_plans``: ``post_init()`` rebuilds the plans from the class, which names the
  head; the patch drops it again. ``_tied_weights_keys``, ``all_tied_weights_keys``: set
  without the head's entry, which would name a weight the model no longer has.
- A load_state_dict pre-hook, so that a checkpoint with the head's weight loads.
- A forward pre-hook on the embedding's owner, run by every forward (TRL's fused one too):
  it refuses an adapter around the embedding or the head, whose weights would then differ.
- With ``chunked_loss=True``, ``forward``: a training forward with labels runs the decoder
  and takes the loss with the head's ``cross_entropy``, for the architectures in ``ROUTES``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.nn._common import _Linear
from toolkit.nn._tied_linear import TiedLinear

__all__ = ["tie_output_embeddings"]


class Route(NamedTuple):
    """How a causal LM computes its loss from its decoder's last hidden states."""

    output: str  # its output's class, in transformers.modeling_outputs
    softcap: str | None = None  # the config's name of its logits' soft-cap
    router: bool = False  # whether it adds router_aux_loss_coef * its router's balancing loss


PLAIN, MOE = Route("CausalLMOutputWithPast"), Route("MoeCausalLMOutputWithPast", router=True)
CAPPED = Route("CausalLMOutputWithPast", "final_logit_softcapping")
RECURRENT = Route("CausalLMOutput", "logits_soft_cap")
# By exact class (a subclass may compute its loss otherwise), each with its parity test.
ROUTES = {
    f"transformers.models.{name}.modeling_{name}.{cls}": route
    for name, cls, route in [
        ("llama", "LlamaForCausalLM", PLAIN),
        ("mistral", "MistralForCausalLM", PLAIN),
        ("qwen2", "Qwen2ForCausalLM", PLAIN),
        ("qwen3", "Qwen3ForCausalLM", PLAIN),
        ("gemma", "GemmaForCausalLM", PLAIN),
        ("gemma2", "Gemma2ForCausalLM", CAPPED),
        ("gemma3", "Gemma3ForCausalLM", CAPPED),
        ("gpt2", "GPT2LMHeadModel", Route("CausalLMOutputWithCrossAttentions")),
        ("phi3", "Phi3ForCausalLM", PLAIN),
        ("olmo2", "Olmo2ForCausalLM", PLAIN),
        ("stablelm", "StableLmForCausalLM", PLAIN),
        ("starcoder2", "Starcoder2ForCausalLM", PLAIN),
        ("mixtral", "MixtralForCausalLM", MOE),
        ("qwen2_moe", "Qwen2MoeForCausalLM", MOE),
        ("recurrent_gemma", "RecurrentGemmaForCausalLM", RECURRENT),
    ]
}


def tie_output_embeddings(model: nn.Module, *, chunked_loss: bool = False) -> TiedLinear:
    """Make a transformers model's output embeddings a TiedLinear on its input embeddings.

    The head that ``model.get_output_embeddings()`` returns is replaced, under its name, by a
    TiedLinear module on ``model.get_input_embeddings()`` that owns no parameter: the state
    dict holds the weight once, and the model works as the stock tied model. Call it after
    ``from_pretrained`` returns; see the [transformers guide][hugging-face-transformers].

    Args:
        model: A transformers ``PreTrainedModel`` whose config ties the word embeddings.
        chunked_loss: Whether a training forward with labels takes the loss with the head's
            ``cross_entropy`` and returns no logits, for the architectures the guide lists. A
            later call switches it. Added in version v3.59.0.

    Returns:
        The head, also ``model.get_output_embeddings()``; an existing tied one is kept.

    Raises:
        TypeError: If ``model`` is not a transformers model with input and output embeddings.
        ValueError: If ``config.tie_word_embeddings`` is False, or the head is not the
            model's own bias-free, tied Linear; with ``chunked_loss``, if the class is
            not listed, or another wrapper replaced ``model.forward``. Nothing is changed.
        RuntimeError: If an adapter (PEFT's) wraps the embedding; so does every forward once
            one wraps the embedding or the head.

    Added in version v3.59.0.

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
    if isinstance(output, TiedLinear) and not (
        isinstance(output, _ModelHead) and output.tied_module is embedding
    ):
        raise ValueError(f"{kind}'s head already is {output!r}, not tied to the input embeddings")
    modules = dict(model.named_modules())
    path = next((name for name, module in modules.items() if module is output), None)
    if path is None:
        raise ValueError(
            f"{kind}'s get_output_embeddings() returns a module that is not one of the "
            "model's own, so tying could not replace it: return the model's own head from "
            "get_output_embeddings()"
        )
    if isinstance(output, _ModelHead):  # tied by an earlier call: only the loss is set again
        _set_chunked_loss(model, chunked_loss, path)
        return output
    if _wraps_a_weight(embedding):
        raise _adapter_error(kind, embedding)
    if getattr(output, "weight", None) is not embedding.weight:
        raise ValueError(
            f"{kind}'s output embeddings do not share the input embeddings' weight, so the "
            "model's logits do not come from it and tying would change them: a model loaded "
            "from a checkpoint with two different weights keeps its own head, and while "
            "from_pretrained builds a model (its constructor, post_init) the two are tied only "
            "after loading, so call tie_output_embeddings after from_pretrained returns"
        )
    if getattr(output, "bias", None) is not None:
        raise ValueError(f"{kind}'s head has a bias, which TiedLinear, bias-free, would drop")
    if chunked_loss:
        _set_chunked_loss(model, True, path)  # first: it may refuse the model
    source = next(name for name, module in modules.items() if module is embedding)
    tie_weights = functools.partial(_tie_weights, model, path, hf.tie_weights)
    init_plans = functools.partial(
        _init_parallel_plans, model, path, source, hf.init_parallel_plans
    )
    head = _set_head(model, path, embedding)
    _untie_mappings(model, f"{path}.weight")
    _drop_from_plans(model, path, source)
    hf.tie_weights, hf.init_parallel_plans = tie_weights, init_plans
    load_head = functools.partial(_load_head_key, f"{path}.weight", f"{source}.weight")
    owner = model.get_submodule(source.rpartition(".")[0])
    owner.register_forward_pre_hook(functools.partial(_check_adapters, model, path, source))
    model.register_load_state_dict_pre_hook(load_head)  # type: ignore[no-untyped-call]
    return head


class _ModelHead(nn.Module, TiedLinear):
    """The TiedLinear a model's head becomes: a module that owns no parameter.

    ``tied_module`` and ``linear`` are attributes, not submodules: the model registers the
    embedding once. Not an ``nn.Linear``, whose weight transformers' initialisation draws anew.
    """

    bias = None  # bias-free, as the stock head; TRL's fused loss reads it

    def __init__(self, tied_module: nn.Module) -> None:
        super().__init__()
        vars(self).update(tied_module=tied_module, linear=_Linear())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TiedLinear.__call__(self, x)

    def requires_grad_(self, requires_grad: bool = True) -> _ModelHead:
        """Set ``requires_grad`` of the tied weight, as the stock head's shared weight."""
        TiedLinear.requires_grad_(self, requires_grad)
        return self

    def _replicate_for_data_parallel(self) -> nn.Module:
        raise RuntimeError(
            "nn.DataParallel replicates the model but not the tie: a replica's head would read "
            "the original embedding. Train the tied model with DistributedDataParallel (torchrun "
            "or accelerate launch; the Trainer uses it under either), or on one device"
        )

    __repr__ = TiedLinear.__repr__


def _set_head(model: nn.Module, path: str, embedding: nn.Module) -> _ModelHead:
    """Put a tied head on ``embedding`` at ``path`` in ``model``, in place of what is there."""
    parent_name, _, attribute = path.rpartition(".")
    parent = model.get_submodule(parent_name)
    head = _ModelHead(embedding)
    delattr(parent, attribute)
    setattr(parent, attribute, head)
    return head


def _wraps_a_weight(module: nn.Module) -> bool:
    """Whether ``module`` owns no weight but holds a module that does (as PEFT's adapters)."""
    inner = (m for m in module.modules() if m is not module)
    return "weight" not in module._parameters and any("weight" in m._parameters for m in inner)


def _adapter_error(kind: str, module: nn.Module, what: str = "input embeddings") -> RuntimeError:
    cls = type(module)
    return RuntimeError(
        f"{kind}'s {what} are a {cls.__module__}.{cls.__qualname__}, a module that wraps the "
        "tied embedding or head (a PEFT adapter such as LoRA, trainable tokens or "
        "modules_to_save), so the lookup and the head would not use the same weight; train "
        "such an adapter on the stock model, without tie_output_embeddings, or leave the "
        "embedding and the head out of the adapter's modules"
    )


def _check_adapters(model: nn.Module, path: str, source: str, *args: object) -> None:
    """Refuse an adapter that wraps the embedding or the tied head (a forward pre-hook)."""
    embedding, head = model.get_submodule(source), model.get_submodule(path)
    if _wraps_a_weight(embedding):
        raise _adapter_error(type(model).__name__, embedding)
    if not isinstance(head, _ModelHead) and any(isinstance(m, _ModelHead) for m in head.modules()):
        raise _adapter_error(type(model).__name__, head, "output embeddings")


def _load_head_key(
    head_key: str,
    embedding_key: str,
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    *args: object,
) -> None:
    """Take a checkpoint's head weight as the stock tied model: as the embedding's, or refuse."""
    head_key, embedding_key = prefix + head_key, prefix + embedding_key
    if head_key not in state_dict:
        return
    if embedding_key not in state_dict:
        state_dict[embedding_key] = state_dict.pop(head_key)
        return
    head, embedding = state_dict[head_key], state_dict[embedding_key]
    if head.is_meta or embedding.is_meta:  # which hold no values
        same = head.shape == embedding.shape
    else:
        same = torch.equal(head.to(embedding.dtype), embedding)
    if same:
        del state_dict[head_key]
    else:
        raise ValueError(
            f"The state dict's {head_key!r} differs from its {embedding_key!r}, but "
            f"{type(module).__name__}'s head is tied to its input embeddings, which hold one "
            "weight; load it into a model built with tie_word_embeddings=False, not tied"
        )


def _tie_weights(
    model: nn.Module, path: str, tie_weights: Callable[..., object], *args: object, **kwargs: object
) -> None:
    """Tie as transformers does, then the head (a new one too) to the current input embeddings."""
    tie_weights(*args, **kwargs)
    hf: Any = model
    embedding, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    wrapped = _wraps_a_weight(embedding)  # by an adapter, which the forward refuses
    if isinstance(head, nn.Module) and any(
        isinstance(m, _ModelHead) and (wrapped or m.tied_module is embedding)
        for m in head.modules()
    ):
        return
    kind = type(model).__name__
    if wrapped:
        raise _adapter_error(kind, embedding)
    if getattr(head, "bias", None) is not None:
        raise ValueError(
            f"{kind}'s output embeddings, a {type(head).__name__} set after "
            "tie_output_embeddings, have a bias, which its tied head, a bias-free TiedLinear, "
            "would drop; set a head without a bias, such as nn.Linear(hidden_size, vocab_size, "
            "bias=False), which tie_weights() ties to the input embeddings"
        )
    _set_head(model, path, embedding)


def _init_parallel_plans(
    model: nn.Module, path: str, source: str, init_parallel_plans: Callable[[], object]
) -> None:
    """Build the plans as transformers does, then drop the head, which owns no weight now."""
    init_parallel_plans()
    _drop_from_plans(model, path, source)


def _drop_from_plans(model: nn.Module, path: str, source: str) -> None:
    """Drop the head at ``path`` from the ``_<kind>_plan`` dicts of each model on its way.

    In an FSDP plan the embedding at ``source`` takes the head's rule, as transformers folds it
    for a tied model: ``keep_full_weight`` if the head or the embedding had it, or else none.
    """
    keep = "keep_full_weight"
    names = path.split(".")
    for depth in range(len(names)):
        prefix = ".".join(names[:depth])
        module = model.get_submodule(prefix)
        start = f"{prefix}." if prefix else ""
        head = path[len(start) :]
        for name, plan in list(vars(module).items()):
            if not (re.fullmatch(r"_[a-z]+_plan", name) and isinstance(plan, dict)):
                continue
            kept = {key: rule for key, rule in plan.items() if key != head}
            if name == "_fsdp_plan" and source.startswith(start):
                embedding = source[len(start) :]
                if keep in (plan.get(head), plan.get(embedding)):
                    kept[embedding] = keep
                else:
                    kept.pop(embedding, None)
            setattr(module, name, kept)


def _untie_mappings(model: nn.Module, key: str) -> None:
    """Drop ``key``'s entry from the tied-weights mappings of the models on the way to it."""
    for prefix, module in model.named_modules():
        start = f"{prefix}." if prefix else ""
        if not key.startswith(start):
            continue  # not an ancestor of the head: its mapping cannot name it
        own = key[len(start) :]
        for name in ("_tied_weights_keys", "all_tied_weights_keys"):
            mapping = getattr(module, name, None)
            if isinstance(mapping, dict):
                # transformers matches a target as the regular expression "^" + target.
                setattr(module, name, {t: s for t, s in mapping.items() if not re.match(t, own)})


def _set_chunked_loss(model: nn.Module, enabled: bool, path: str) -> None:
    """Switch the chunked loss, or refuse a class not listed, or another wrapper's forward."""
    forward = vars(model).get("forward")
    if isinstance(forward, _ChunkedLossForward):
        forward.enabled = enabled  # its class was checked when it was made
        return
    cls, listed = type(model), _name(type(model)) in ROUTES
    if enabled and not listed:
        raise ValueError(
            "chunked_loss computes the loss of the architectures listed in the transformers "
            "guide (docs/transformers.md, 'Architectures of the chunked loss'), by exact "
            f"class, and {_name(cls)} is not among them; tie it with chunked_loss=False (the "
            "stock loss of the logits), or train it with TRL's SFTTrainer, whose own chunked "
            "loss reads the tied head's weight"
        )
    if forward is not None and (enabled or listed):  # switched on, or maybe on under it
        # Where it was defined: functools.wraps gives a wrapper the wrapped one's names.
        function = getattr(forward, "__func__", forward)
        name = _name(type(function))
        if hasattr(function, "__code__"):
            name = f"{function.__globals__['__name__']}.{function.__code__.co_qualname}"
        raise ValueError(
            f"{cls.__name__}'s forward is already replaced by {name} (TRL's SFTTrainer puts "
            "its fused loss there, accelerate its mixed precision), under which "
            "tie_output_embeddings cannot switch the chunked loss: switch it before the "
            "wrapper is made (before building the trainer), or keep chunked_loss=False; under "
            "SFTTrainer, TRL's own chunked loss runs either way"
        )
    if enabled:
        model.forward = _ChunkedLossForward(model, path)


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class _ChunkedLossForward:
    """``model.forward`` with ``chunked_loss=True``: a training call with labels runs lean.

    ``__wrapped__`` gives ``inspect.signature`` the model's forward's, which the Trainer reads.
    """

    def __init__(self, model: nn.Module, path: str) -> None:
        # The class's name now: FSDP2's fully_shard later makes the model a subclass.
        self.model, self.path, self.kind, self.enabled = model, path, _name(type(model)), True
        self.__wrapped__ = model.forward
        parameters = inspect.signature(self.__wrapped__).parameters.values()
        self.positional = tuple(
            p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - the model's
        model: Any = self.model
        named = dict(zip(self.positional, args))  # noqa: B905 - fewer args than names
        if len(args) > len(self.positional) or named.keys() & kwargs.keys():
            return self.__wrapped__(*args, **kwargs)  # which raises the TypeError Python would
        kwargs.update(named)
        keep = kwargs.get("logits_to_keep", 0)
        lean = isinstance(keep, int) and keep == 0 and kwargs.get("labels") is not None
        if not (self.enabled and model.training and lean):
            return self.__wrapped__(**kwargs)
        return _lean_forward(model, self.path, self.kind, kwargs)


def _lean_forward(model: Any, path: str, kind: str, kwargs: dict[str, Any]) -> Any:  # noqa: ANN401
    """The listed model's forward of ``kwargs``, with the loss from its head's input."""
    from transformers import modeling_outputs  # noqa: PLC0415 - the model's library
    from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: PLC0415

    config, route = model.config, ROUTES[kind]
    labels = kwargs.pop("labels")
    return_dict = kwargs.pop("return_dict", None)
    if route.router and kwargs.get("output_router_logits") is None:
        kwargs["output_router_logits"] = config.output_router_logits
    outputs = model.base_model(**kwargs)  # as the model's forward calls it
    head = model.get_submodule(path)
    if not isinstance(head, _ModelHead) or model.loss_function is not ForCausalLMLoss:
        raise RuntimeError(
            f"{type(model).__name__}'s head or loss_function was replaced after the tie, so the "
            "chunked loss would not be the model's; tie it with chunked_loss=False"
        )
    hidden = outputs.last_hidden_state
    ignore_index = kwargs.get("ignore_index", -100)
    target = kwargs.get("shift_labels")
    if target is None:  # as transformers shifts: tokens < n predict n
        target = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = target.to(hidden.device)  # pragma: no mutate
    num_items = kwargs.get("num_items_in_batch")
    if torch.is_tensor(num_items):  # pragma: no mutate block
        num_items = num_items.to(hidden.device)
    loss = head.cross_entropy(
        hidden,
        target,
        ignore_index=ignore_index,
        reduction="mean" if num_items is None else "sum",
        softcap=None if route.softcap is None else getattr(config, route.softcap),
    ).float()  # transformers' loss is float32
    if num_items is not None:
        loss = loss / num_items
    fields = {name: value for name, value in outputs.items() if name != "last_hidden_state"}
    if route.router and kwargs["output_router_logits"]:
        balance = sys.modules[kind.rpartition(".")[0]].load_balancing_loss_func
        experts = (model.num_experts, model.num_experts_per_tok)
        aux = balance(outputs.router_logits, *experts, kwargs.get("attention_mask"))
        on_loss = aux.to(loss.device)  # pragma: no mutate
        loss = loss + model.router_aux_loss_coef * on_loss
        fields["aux_loss"] = aux
    result = getattr(modeling_outputs, route.output)(loss=loss, **fields)
    if return_dict is False:  # the stock model's to_tuple(): its values but None, and the logits
        values = [(f.name, getattr(result, f.name)) for f in dataclasses.fields(result)]
        return tuple(value for name, value in values if value is not None or name == "logits")
    return result
