"""tie_output_embeddings: a Hugging Face transformers model's LM head as a TiedLinear."""

from __future__ import annotations

import contextlib
import copy
import functools
import re
from collections.abc import Callable, Iterator
from typing import Any, Self

import torch
from torch import nn

from toolkit.nn._causal_lm_loss import LossRequest, set_chunked_loss
from toolkit.nn._common import _Linear
from toolkit.nn._tied_linear import TiedLinear

__all__ = ["tie_output_embeddings"]


def tie_output_embeddings(model: nn.Module, *, chunked_loss: bool = False) -> TiedLinear:
    """Make a transformers model's output embeddings a TiedLinear on its input embeddings.

    The LM head that ``model.get_output_embeddings()`` returns is replaced, under the same
    attribute, by a TiedLinear on ``model.get_input_embeddings()``: an ``nn.Linear`` that owns
    no parameter, so the state dict holds the weight once, and what finds the head by name
    (PEFT, accelerate's FSDP2, hooks) finds it. The model works as the stock tied model. Call
    it after ``from_pretrained`` returns; see the [transformers guide][hugging-face-transformers].

    Args:
        model: A transformers ``PreTrainedModel`` whose config ties the word embeddings.
        chunked_loss: Whether ``model(..., labels=...)`` takes transformers' causal LM loss
            from the head's ``cross_entropy`` and returns no logits; without labels the
            forward gives them. A later call switches it. Added in version v3.59.0.

    Returns:
        The head, also ``model.get_output_embeddings()``; an existing tied one is kept.

    Raises:
        TypeError: If ``model`` is not a transformers model with input and output embeddings.
        ValueError: If ``config.tie_word_embeddings`` is False, or the head is not the
            bias-free, tied Linear a tied model holds; with ``chunked_loss``, if the loss is
            not ``ForCausalLMLoss``. Nothing is changed.
        RuntimeError: If the input embeddings wrap the embedding (a PEFT adapter), whose
            lookup the head would not follow; so does a later call. With ``chunked_loss``,
            so does a forward with labels if an adapter replaced the head, or the logits
            change before the loss otherwise than by ``final_logit_softcapping``.

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
    if isinstance(output, TiedLinear):
        if output.tied_module is embedding:
            path = next(name for name, module in model.named_modules() if module is output)
            set_chunked_loss(model, path, chunked_loss)
            return output
        raise ValueError(f"{kind}'s head already is {output!r}, not tied to the input embeddings")
    if _wraps_an_embedding(embedding):
        raise _adapted_embedding_error(kind, embedding)
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
    modules = dict(model.named_modules())
    path = next(name for name, module in modules.items() if module is output)
    source = next(name for name, module in modules.items() if module is embedding)
    set_chunked_loss(model, path, chunked_loss)  # first: it may refuse the model
    # transformers' tie_weights() ties the head to the input embeddings of the moment, a
    # new one after set_input_embeddings(): the model's own does the same for this head.
    tie_weights = functools.partial(_tie_weights, model, path, hf.tie_weights)
    # post_init() rebuilds the parallel plans from the class, which names the head.
    init_plans = functools.partial(
        _init_parallel_plans, model, path, source, hf.init_parallel_plans
    )
    mappings = _untied_mappings(model, f"{path}.weight")
    head = _set_head(model, path, embedding)
    for owner, name, mapping in mappings:
        setattr(owner, name, mapping)
    _drop_from_plans(model, path, source)
    hf.tie_weights, hf.init_parallel_plans = tie_weights, init_plans
    load_head = functools.partial(_load_head_key, f"{path}.weight", f"{source}.weight")
    # The decoder that holds the embedding runs in every forward, also where an adapter
    # library calls the model's forward method without its hooks.
    owner = model.get_submodule(source.rpartition(".")[0])
    owner.register_forward_pre_hook(functools.partial(_check_tying_adapters, model, path))
    model.register_load_state_dict_pre_hook(load_head)  # type: ignore[no-untyped-call]
    return head


class _ModelHead(nn.Linear, TiedLinear):
    """The TiedLinear a model's head becomes: a module of the model, owning no parameter.

    It stays where the stock model's head is, so that what finds the head by name (``print``,
    ``named_modules()``, hooks, PEFT's targets, accelerate's FSDP2 units) finds it, and it is an
    ``nn.Linear`` whose ``weight`` is ``tied_module.weight``, read live, as the stock head's is
    the embedding's, so that a PEFT LoRA layer wraps it as it wraps the stock head. The state
    dict holds the weight once, under the embedding. ``tied_module`` and ``linear`` are kept
    off the module tree, which registers the embedding once, where the model has it.

    The model must still look tokens up in ``tied_module``, not in a wrapper of it (a PEFT
    adapter, say), whose lookup would use a weight the head does not read: every call checks.
    """

    _owner: nn.Module  # the module that holds the embedding as ``_name``
    _name: str
    _request: LossRequest | None = None  # set for one call by the model's forward

    def __init__(self, tied_module: nn.Module, owner: nn.Module, name: str) -> None:
        nn.Module.__init__(self)  # nn.Linear's would make a weight of its own
        self.register_parameter("bias", None)  # as on the stock, bias-free head
        # In __dict__, not _modules: attributes of the head, not modules of the model.
        vars(self).update(tied_module=tied_module, linear=_Linear(), _owner=owner, _name=name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_lookup()
        request = self._request
        # The first call of the forward answers; a second one, or another thread's, gives logits.
        if request is None or request.answered is not None or not request.asked_here():
            return TiedLinear.__call__(self, x)
        return request.answer(self, x)

    @contextlib.contextmanager
    def loss_requested(self, request: LossRequest) -> Iterator[None]:
        """Within the block, the head's next call answers ``request`` instead of the logits."""
        yield from self._answering(request)

    def _answering(self, request: LossRequest) -> Iterator[None]:
        # Apart from the decorated method, which mutation testing leaves out.
        self._request = request
        try:
            yield
        finally:
            self._request = None

    def cross_entropy(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: ANN401 - passed on
        self._check_lookup()
        return super().cross_entropy(*args, **kwargs)

    def requires_grad_(self, requires_grad: bool = True) -> Self:
        """Set ``requires_grad`` of the tied weight, as the stock head's shared weight."""
        TiedLinear.requires_grad_(self, requires_grad)
        return self

    def __repr__(self) -> str:
        return TiedLinear.__repr__(self)

    def __setattr__(self, name: str, value: Any) -> None:  # noqa: ANN401 - as Module's
        self._set_attribute(name, value)

    def _set_attribute(self, name: str, value: Any) -> None:  # noqa: ANN401 - as Module's
        # Apart from __setattr__, which mutation testing leaves out.
        if name == "weight":  # nn.Module's would say the attribute already exists
            raise AttributeError(
                "the tied head's weight is the input embeddings' weight, read live, and cannot "
                "be set: the head owns no weight. To train a head with a weight of its own, "
                "use the stock model, without tie_output_embeddings"
            )
        super().__setattr__(name, value)

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        """A copy tied to the copy of the embedding, or alone, a Linear with a copy of the weight.

        Within a copy of the model (``copy.deepcopy`` was called on something that holds the
        head, so ``memo`` is not empty) the copy is the head's, whose attributes read the
        copied embedding and model. A copy of the head alone (PEFT's ``modules_to_save``) is
        what the stock head's copy is: an ``nn.Linear`` that owns a copy of the weight.
        """
        if memo:
            twin = object.__new__(type(self))
            memo[id(self)] = twin
            twin.__dict__.update(copy.deepcopy(self.__dict__, memo))
            return twin
        alone: nn.Linear = torch.nn.utils.skip_init(  # type: ignore[no-untyped-call]
            nn.Linear, self.in_features, self.out_features
        )
        alone.register_parameter("bias", None)  # bias-free, as the head
        alone.weight = copy.deepcopy(self.weight)
        alone.train(self.training)
        return alone

    def _check_lookup(self) -> None:
        current = self._owner._modules.get(self._name)
        if (
            current is not self.tied_module
            and current is not None
            and any(module is self.tied_module for module in current.modules())
        ):
            raise _adapted_embedding_error(type(self._owner).__name__, current)


def _set_head(model: nn.Module, path: str, embedding: nn.Module) -> TiedLinear:
    """Put a TiedLinear on ``embedding`` at ``path`` in ``model``, in place of what is there."""
    parent_name, _, attribute = path.rpartition(".")
    parent = model.get_submodule(parent_name)
    source = next(name for name, module in model.named_modules() if module is embedding)
    owner_name, _, name = source.rpartition(".")
    head = _ModelHead(embedding, model.get_submodule(owner_name), name)
    delattr(parent, attribute)
    setattr(parent, attribute, head)
    return head


def _wraps_an_embedding(embedding: nn.Module) -> bool:
    """Whether ``embedding`` holds no weight of its own but wraps a module that does."""
    return "weight" not in embedding._parameters and any(
        "weight" in module._parameters for module in embedding.modules() if module is not embedding
    )


def _adapted_embedding_error(kind: str, embedding: nn.Module) -> RuntimeError:
    cls = type(embedding)
    return RuntimeError(
        f"{kind}'s input embeddings are a {cls.__module__}.{cls.__qualname__}, a module that "
        "wraps the embedding the tied head reads (a PEFT adapter on the embedding, such as "
        "LoRA, trainable tokens or modules_to_save), so the lookup and the head would not use "
        "the same weight; "
        "train such an adapter on the stock model, without tie_output_embeddings, or leave "
        "the embedding out of the adapter's modules"
    )


def _check_tying_adapters(model: nn.Module, path: str, *args: object) -> None:
    """Refuse an adapter on the head that PEFT's ``ensure_weight_tying`` would tie.

    PEFT finds the modules tied to the embedding in ``_tied_weights_keys``, which no longer
    name the head, so with ``ensure_weight_tying`` it would adapt the head alone, untied from
    the embedding's adapter that the stock model ties it to.
    """
    configs = vars(model).get("peft_config")  # what PEFT sets on the model it adapts
    if not isinstance(configs, dict) or not any(
        vars(config).get("ensure_weight_tying") is True for config in configs.values()
    ):
        return
    if isinstance(model.get_submodule(path), _ModelHead):
        return  # no adapter on the head
    raise RuntimeError(
        f"{type(model).__name__}'s head {path!r} holds a PEFT adapter, and the adapter's "
        "config has ensure_weight_tying=True, which on the stock model ties it to an adapter "
        "on the input embeddings; the head tie_output_embeddings made is not in the model's "
        "tied weights keys, so PEFT adapted the head alone, untied. Leave ensure_weight_tying "
        f"off (the adapter on {path!r} then trains untied, as on the stock model), or train "
        "the adapter on the stock model, without tie_output_embeddings"
    )


def _load_head_key(
    head_key: str,
    embedding_key: str,
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    *args: object,
) -> None:
    """Take a state dict's head weight as the stock tied model would, or refuse it.

    A checkpoint of the stock model may hold the head's weight beside the embedding's: the
    same values are dropped, a head weight alone becomes the embedding's, two different
    weights raise (the tied model has one).
    """
    head_key, embedding_key = prefix + head_key, prefix + embedding_key
    if head_key not in state_dict:
        return
    if embedding_key not in state_dict:
        state_dict[embedding_key] = state_dict.pop(head_key)
    elif _same_values(state_dict[head_key], state_dict[embedding_key]):
        del state_dict[head_key]
    else:
        raise ValueError(
            f"The state dict's {head_key!r} differs from its {embedding_key!r}, but "
            f"{type(module).__name__}'s head is tied to its input embeddings, which hold one "
            "weight; load it into a model built with tie_word_embeddings=False, not tied"
        )


def _same_values(head: torch.Tensor, embedding: torch.Tensor) -> bool:
    """Whether ``head`` holds ``embedding``'s values, in its dtype; meta tensors hold none."""
    if head.is_meta or embedding.is_meta:
        return head.shape == embedding.shape
    return torch.equal(head.to(embedding.dtype), embedding)


def _tie_weights(
    model: nn.Module, path: str, tie_weights: Callable[..., object], *args: object, **kwargs: object
) -> None:
    """Tie as transformers' ``tie_weights`` does, then the head to the current input embeddings.

    transformers ties the head's weight to the input embeddings of the moment: a new embedding
    after ``set_input_embeddings()``, a new head after ``set_output_embeddings()``. Its mapping
    no longer names the head, so the head is tied here: whatever ``get_output_embeddings()``
    returns, unless it already is a TiedLinear on the input embeddings, becomes one at ``path``.

    Raises:
        ValueError: If the head has a bias, which the stock model keeps beside the tied weight
            but a TiedLinear cannot hold. The head is left as it is.
        RuntimeError: If the head is a new module and the input embeddings wrap the embedding
            that holds the weight (a PEFT adapter), whose lookup a head would not follow.
    """
    tie_weights(*args, **kwargs)
    hf: Any = model
    embedding = hf.get_input_embeddings()
    head = hf.get_output_embeddings()
    wrapped = _wraps_an_embedding(embedding)
    if isinstance(head, TiedLinear) and (head.tied_module is embedding or wrapped):
        return  # tied, or on a wrapper (a PEFT adapter) that the head refuses on its next call
    if isinstance(head, nn.Module) and any(
        isinstance(module, _ModelHead) and module.tied_module is embedding
        for module in head.modules()
    ):
        return  # an adapter (PEFT's) on the tied head, which the stock model keeps as well
    kind = type(model).__name__
    if wrapped:
        raise _adapted_embedding_error(kind, embedding)
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
    """Drop the head at ``path`` from every parallel plan of ``model`` and its sub-models.

    transformers keeps its plans (``_tp_plan``, ``_ep_plan``, ``_pp_plan``, ``_fsdp_plan``: each
    ``_<kind>_plan`` that ``post_init`` sets on the instance) on each ``PreTrainedModel``, with
    keys relative to it, so each sub-model on the way to the head holds the head's entries.
    Once the head is no module, an entry for it names nothing, which FSDP would look up as a
    submodule. In an FSDP plan, the embedding at ``source`` takes the head's rule, as
    transformers folds it for a tied model when it shards: the head reads the embedding's
    weight after the embedding's forward, so the embedding keeps it unsharded
    (``keep_full_weight``) if the head or the embedding did, or else joins its parent's unit.
    Dropping again changes nothing.
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
