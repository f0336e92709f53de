"""The tied head's chunked loss inside a transformers causal LM's own ``forward(labels=...)``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.nn._tied_linear import TiedLinear


class LossRequest:
    """What the model's forward asks of its tied head: the loss of the head's input.

    transformers' causal LM loss (``ForCausalLMLoss``) shifts the labels by one, ignores
    ``ignore_index``, and sums then divides by ``num_items_in_batch`` when the Trainer gives
    it (its gradient accumulation), or else takes the mean. The head computes that loss from
    its input with ``TiedLinear.cross_entropy``, soft-capped as the model caps its logits,
    and returns the loss, broadcast to ``(..., 1)``, in place of the logits: a tensor that
    the model's own code after the head (a soft-cap, a cast) handles at no cost. The loss is
    read back from that output, so that the hooks FSDP2 puts on a unit's output (which
    unshard its weights for backward, then reduce their gradients) run in backward as they
    do for the logits. ``carrier`` is that output.
    """

    def __init__(
        self,
        target: torch.Tensor,
        ignore_index: int,
        num_items: torch.Tensor | int | None,
        softcap: float | None,
    ) -> None:
        self.target = target
        self.ignore_index = ignore_index
        self.num_items = num_items
        self.softcap = softcap
        self.carrier: torch.Tensor | None = None

    def answer(self, head: TiedLinear, x: torch.Tensor) -> torch.Tensor:
        """The loss of ``x`` through ``head``, as the head's output: ``carrier``."""
        loss = TiedLinear.cross_entropy(
            head,
            x,
            self.target.to(x.device),
            ignore_index=self.ignore_index,
            reduction="mean" if self.num_items is None else "sum",
            softcap=self.softcap,
        )
        if self.num_items is not None:
            num_items = self.num_items
            if isinstance(num_items, torch.Tensor):
                num_items = num_items.to(loss.device)
            loss = loss / num_items
        loss = loss.float()  # transformers' loss is float32, from float32 logits
        # Not a view of the loss: FSDP2 warns of a unit's output that is one, as an in-place
        # operation on it would skip the hook that unshards the weight for backward.
        self.carrier = loss.reshape([1] * x.dim()).expand(*x.shape[:-1], 1).clone()
        return self.carrier


class ChunkedLossForward:
    """``model.forward`` of a model tied with ``chunked_loss=True``.

    Without ``labels`` (evaluation, ``generate``) it is the model's forward. With them, the
    model's forward runs without them, so that it computes no loss of the logits, and the
    head at ``path``, asked through a ``LossRequest``, computes the loss instead of the
    logits; the output holds the loss and no logits. ``__wrapped__`` makes
    ``inspect.signature`` give the model's forward's, which the Trainer reads (the columns
    it keeps, whether the model takes ``num_items_in_batch``).
    """

    def __init__(self, model: nn.Module, path: str, forward: Callable[..., Any]) -> None:
        self.model = model
        self.path = path
        self.enabled = True
        self.__wrapped__ = forward
        parameters = list(inspect.signature(forward).parameters.values())
        positional = []
        for parameter in parameters:
            if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                break
            positional.append(parameter.name)
        self.positional = tuple(positional)
        self.takes_return_dict = any(
            p.name == "return_dict" or p.kind == p.VAR_KEYWORD for p in parameters
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - the model's
        forward = self.__wrapped__
        named = dict(zip(self.positional, args, strict=False))
        labels = kwargs.get("labels", named.get("labels"))
        if not self.enabled or labels is None:
            return forward(*args, **kwargs)
        if len(args) > len(self.positional) or named.keys() & kwargs.keys():
            return forward(*args, **kwargs)  # which raises the TypeError Python would
        kwargs.update(named)
        model: Any = self.model
        kind = type(model).__name__
        _check_loss_function(model)
        head = model.get_submodule(self.path)
        if not isinstance(head, TiedLinear) or not hasattr(head, "loss_requested"):
            raise _adapted_head_error(kind, self.path, head)
        ignore_index = kwargs.get("ignore_index", -100)
        target = kwargs.get("shift_labels")
        if target is None:  # as transformers shifts: tokens < n predict n
            target = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        config = model.config
        softcap = getattr(config, "final_logit_softcapping", None)
        request = LossRequest(target, ignore_index, kwargs.get("num_items_in_batch"), softcap)
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(config, "return_dict", True)
        if self.takes_return_dict:
            kwargs["return_dict"] = True
        kwargs["labels"] = None
        with head.loss_requested(request):
            output = forward(**kwargs)
        carrier = request.carrier
        if carrier is None:
            raise RuntimeError(
                f"{kind}'s forward did not call its head {self.path!r}, in which "
                "chunked_loss computes the loss; tie it with chunked_loss=False"
            )
        if not torch.compiler.is_compiling():
            _check_logits_untouched(kind, output.logits, carrier, softcap)
        # Read back through the head's output, which FSDP2 hooks for backward; cloned, as
        # FSDP2 wants a unit's outputs to be no views.
        loss = carrier[(0,) * carrier.dim()].clone()
        fields = {k: v for k, v in output.items() if k not in ("loss", "logits")}
        result = type(output)(loss=loss, **fields)
        return result if return_dict else result.to_tuple()


def set_chunked_loss(model: nn.Module, path: str, enabled: bool) -> None:
    """Make ``model.forward`` compute the loss in the head at ``path``, or not.

    The forward is wrapped once, on the instance; later calls switch it. Also where another
    wrapper (accelerate's, say) wraps it since, found through ``__wrapped__``.

    Raises:
        ValueError: If ``enabled`` and the model's loss is not transformers' causal LM loss,
            or its forward takes no ``labels``. Nothing is changed.
    """
    hf: Any = model
    forward = vars(model).get("forward")
    while forward is not None and not isinstance(forward, ChunkedLossForward):
        forward = getattr(forward, "__wrapped__", None)
    if forward is not None:
        if enabled:
            _check_loss_function(model)
        forward.enabled = enabled
        return
    if not enabled:
        return
    _check_loss_function(model)
    if "labels" not in inspect.signature(hf.forward).parameters:
        raise ValueError(
            f"{type(model).__name__}'s forward takes no labels, so it computes no loss; "
            "chunked_loss is for a causal LM, such as a ...ForCausalLM class"
        )
    model.forward = ChunkedLossForward(model, path, hf.forward)


def _check_loss_function(model: Any) -> None:  # noqa: ANN401 - a transformers model
    from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: PLC0415 - a model's

    loss_function = getattr(model, "loss_function", None)
    if loss_function is not ForCausalLMLoss:
        name = getattr(loss_function, "__qualname__", repr(loss_function))
        raise ValueError(
            f"chunked_loss computes transformers' causal LM loss (ForCausalLMLoss), but "
            f"{type(model).__name__}'s loss_function is {name}; keep chunked_loss=False for "
            "another loss"
        )


def _check_logits_untouched(
    kind: str, logits: object, carrier: torch.Tensor, softcap: float | None
) -> None:
    """Refuse a model that changes its head's output before the loss in an unknown way.

    The loss is the head's; a model whose forward scales or shifts the logits before its
    own loss (``logit_scale``, say) has another. The carrier went through that code: it must
    come out as it went in, or soft-capped by the config's ``final_logit_softcapping``.
    """
    expected = carrier if softcap is None else softcap * torch.tanh(carrier / softcap)
    if logits is carrier:
        return
    if (
        isinstance(logits, torch.Tensor)
        and logits.shape == carrier.shape
        and torch.allclose(
            logits.detach().float(), expected.detach().float(), rtol=1e-3, equal_nan=True
        )
    ):
        return
    raise RuntimeError(
        f"{kind}'s forward changes its head's logits before its loss in a way chunked_loss "
        "does not compute (it applies the config's final_logit_softcapping, nothing else), "
        "so the chunked loss would differ from the model's; tie it with chunked_loss=False"
    )


def _adapted_head_error(kind: str, path: str, head: nn.Module) -> RuntimeError:
    cls = type(head)
    return RuntimeError(
        f"{kind}'s head {path!r} is a {cls.__module__}.{cls.__qualname__}, not the tied "
        "head, so chunked_loss cannot compute the loss in it (an adapter on the head, such "
        "as PEFT's LoRA or modules_to_save, computes logits of its own); leave the head out "
        "of the adapter, or tie the model with chunked_loss=False"
    )
