"""The tied head's chunked loss inside a transformers causal LM's own ``forward(labels=...)``."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.nn._tied_linear import TiedLinear

# What the head returns in place of the logits: a value that the transforms a model may make
# before its loss (a scale, a shift, a soft-cap) all move, whatever the loss.
PROBE = 8.0
# The keywords of transformers' causal LM loss that the head's loss takes from the call.
OPTIONS = ("ignore_index", "shift_labels", "num_items_in_batch")


class LossRequest:
    """What the model's forward asks of its tied head: the loss of the head's input.

    transformers' causal LM loss (``ForCausalLMLoss``) shifts the labels by one, ignores
    ``ignore_index``, and sums then divides by ``num_items_in_batch`` when the Trainer gives
    it (its gradient accumulation), or else takes the mean. The head computes that loss from
    its input with ``TiedLinear.cross_entropy``, soft-capped as the model caps its logits,
    keeps it, and returns a probe, ``PROBE`` in the logits' place, shaped ``(..., 1)``. The
    model's code after the head transforms the probe as it would the logits and passes it,
    with its labels, to its ``loss_function``, which ``take`` answers with the loss, after
    checking that the model changed the probe only by the soft-cap and gave the labels and
    options the loss was computed with. What the model adds to its loss (a
    router's auxiliary loss) it adds as on the stock model.
    """

    def __init__(
        self,
        labels: torch.Tensor,
        options: dict[str, Any],
        softcap: float | None,
        kind: str,
    ) -> None:
        self.labels = labels
        self.options = options  # ignore_index, shift_labels, num_items_in_batch, as given
        self.softcap = softcap
        self.kind = kind
        self.answered: tuple[torch.Tensor, torch.Tensor] | None = None  # the loss, the probe
        self.calls = 0  # of the model's loss_function
        compiling = torch.compiler.is_compiling()  # which cannot trace the thread's identity
        self.thread = None if compiling else threading.get_ident()

    def asked_here(self) -> bool:
        """Whether this thread made the request (not checked under ``torch.compile``).

        A model shared with other threads answers only its own: their calls without labels
        get logits.
        """
        return self.thread is None or self.thread == threading.get_ident()

    def answer(self, head: TiedLinear, x: torch.Tensor) -> torch.Tensor:
        """Compute the loss of ``x`` through ``head``; return the probe, in the logits' place."""
        ignore_index = self.options.get("ignore_index", -100)
        target = self.options.get("shift_labels")
        if target is None:  # as transformers shifts: tokens < n predict n
            target = F.pad(self.labels, (0, 1), value=ignore_index)[..., 1:]
        num_items = self.options.get("num_items_in_batch")
        loss = TiedLinear.cross_entropy(
            head,
            x,
            target.to(x.device),
            ignore_index=ignore_index,
            reduction="mean" if num_items is None else "sum",
            softcap=self.softcap,
        )
        if num_items is not None:  # a number, or a 0-d tensor on the loss's device or the CPU
            loss = loss / num_items
        probe = x.new_full((*x.shape[:-1], 1), PROBE, dtype=torch.float32)
        self.answered = (loss.float(), probe)  # transformers' loss is float32
        return probe

    def take(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        **options: Any,  # noqa: ANN401 - transformers' loss keywords
    ) -> torch.Tensor:
        """The model's ``loss_function`` during the call: the loss the head computed."""
        self.calls += 1
        if self.answered is None:
            raise RuntimeError(
                f"{self.kind}'s forward computed its loss before calling its head, in which "
                "chunked_loss computes it; tie it with chunked_loss=False"
            )
        same = labels is self.labels and all(
            options.get(name) is self.options.get(name) for name in OPTIONS
        )
        if not same:
            raise RuntimeError(
                f"{self.kind}'s forward passes its loss other labels or options than it was "
                "given, which the head's loss, computed from those given, would not match; "
                "tie it with chunked_loss=False"
            )
        loss, probe = self.answered
        _check_probe(self.kind, logits, (*labels.shape, 1), probe, self.softcap)
        return loss


class ChunkedLossForward:
    """``model.forward`` of a model tied with ``chunked_loss=True``.

    Without ``labels``, or out of training mode (evaluation, ``generate``), it is the model's
    forward. With labels in training mode, the head at ``path``, asked through a
    ``LossRequest``, computes the loss instead of the logits, the model's ``loss_function``
    returns it, and the output holds the model's loss and no logits. ``__wrapped__`` makes
    ``inspect.signature`` give the model's forward's, which the Trainer reads (the columns
    it keeps, whether the model takes ``num_items_in_batch``). Threads that share the model
    take such calls one at a time (not under ``torch.compile``); calls without labels are
    not held.
    """

    def __init__(self, model: nn.Module, path: str, forward: Callable[..., Any]) -> None:
        self.model = model
        self.path = path
        self.enabled = True
        self.lock = threading.Lock()
        self.__wrapped__ = forward
        parameters = list(inspect.signature(forward).parameters.values())
        positional = []
        for parameter in parameters:
            if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                break
            positional.append(parameter.name)
        self.positional = tuple(positional)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - the model's
        forward = self.__wrapped__
        model: Any = self.model
        named = dict(zip(self.positional, args))  # noqa: B905 - fewer args than names
        labels = kwargs.get("labels", named.get("labels"))
        if not (self.enabled and model.training) or labels is None:
            return forward(*args, **kwargs)
        if len(args) > len(self.positional) or named.keys() & kwargs.keys():
            return forward(*args, **kwargs)  # which raises the TypeError Python would
        kwargs.update(named)
        if torch.compiler.is_compiling():
            return self.lean_forward(kwargs)
        with self.lock:
            return self.lean_forward(kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "lock"}  # a lock does not copy

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state, lock=threading.Lock())

    def lean_forward(self, kwargs: dict[str, Any]) -> Any:  # noqa: ANN401 - the model's
        """The model's forward of ``kwargs`` (labels among them), the loss from the head."""
        model: Any = self.model
        kind = type(model).__name__
        _check_loss_function(model)
        head = model.get_submodule(self.path)
        if not hasattr(head, "loss_requested"):  # the tied head's
            raise _adapted_head_error(kind, self.path, head)
        config = model.config
        softcap = getattr(config.get_text_config(), "final_logit_softcapping", None)
        options = {name: kwargs[name] for name in OPTIONS if name in kwargs}
        request = LossRequest(kwargs["labels"], options, softcap, kind)
        return_dict = kwargs.pop("return_dict", None)  # the output is rebuilt below
        own = vars(model).get("_loss_function")  # a loss_function set on the model
        try:
            with head.loss_requested(request):
                vars(model)["_loss_function"] = request.take
                output = self.__wrapped__(**kwargs)
        except Exception as error:
            if request.answered is None or request.calls:
                raise  # not from the probe in the logits' place
            raise _own_loss_error(kind) from error
        finally:
            if own is None:
                del vars(model)["_loss_function"]
            else:
                vars(model)["_loss_function"] = own
        if request.calls != 1:
            raise _own_loss_error(kind)
        fields = {k: v for k, v in output.items() if k != "logits"}
        result = type(output)(**fields)
        return result.to_tuple() if return_dict is False else result


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
    if enabled:
        _check_loss_function(model)
    if forward is not None:
        forward.enabled = enabled
        return
    if not enabled:
        return
    if "labels" not in inspect.signature(hf.forward).parameters:
        raise ValueError(
            f"{type(model).__name__}'s forward takes no labels, so it computes no loss; "
            "chunked_loss is for a causal LM, such as a ...ForCausalLM class"
        )
    model.forward = ChunkedLossForward(model, path, hf.forward)


def _check_loss_function(model: Any) -> None:  # noqa: ANN401 - a transformers model
    """Refuse a model whose ``loss_function`` is not transformers' causal LM loss."""
    from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: PLC0415 - a model's

    loss_function = model.loss_function
    if loss_function is not ForCausalLMLoss:
        name = getattr(loss_function, "__qualname__", type(loss_function).__qualname__)
        raise ValueError(
            f"chunked_loss computes transformers' causal LM loss (ForCausalLMLoss), but "
            f"{type(model).__name__}'s loss_function is {name}; keep chunked_loss=False for "
            "another loss"
        )


def _check_probe(
    kind: str,
    logits: object,
    shape: tuple[int, ...],
    probe: torch.Tensor,
    softcap: float | None,
) -> None:
    """Refuse a model that changes its head's output before the loss in an unknown way.

    The probe must come to the loss with the labels' shape (one value a label), as it went
    in or soft-capped by the config's ``final_logit_softcapping``; a model that scales or
    shifts its logits (``logit_scale``, say) has another loss. Under ``torch.compile`` the
    comparison is an asynchronous assertion, as ``F.cross_entropy``'s checks of its targets
    are on an accelerator.
    """
    if not isinstance(logits, torch.Tensor) or logits.shape != shape:
        raise _changed_logits_error(kind)
    expected = probe if softcap is None else torch.tanh(probe / softcap) * softcap
    close = torch.isclose(logits.detach().float(), expected).all()
    if torch.compiler.is_compiling():
        torch._assert_async(close, str(_changed_logits_error(kind)))
    elif not close:
        raise _changed_logits_error(kind)


def _changed_logits_error(kind: str) -> RuntimeError:
    return RuntimeError(
        f"{kind}'s forward changes its head's logits before its loss in a way chunked_loss "
        "does not compute (it applies the config's final_logit_softcapping, nothing else), "
        "so the chunked loss would differ from the model's; tie it with chunked_loss=False"
    )


def _own_loss_error(kind: str) -> RuntimeError:
    return RuntimeError(
        f"{kind}'s forward computes its loss without transformers' loss_function (or not "
        "from its head's logits), where chunked_loss puts the head's loss; tie it with "
        "chunked_loss=False"
    )


def _adapted_head_error(kind: str, path: str, head: nn.Module) -> RuntimeError:
    cls = type(head)
    return RuntimeError(
        f"{kind}'s head {path!r} is a {cls.__module__}.{cls.__qualname__}, not the tied "
        "head, so chunked_loss cannot compute the loss in it (an adapter on the head, such "
        "as PEFT's LoRA or modules_to_save, computes logits of its own); leave the head out "
        "of the adapter, or tie the model with chunked_loss=False"
    )
