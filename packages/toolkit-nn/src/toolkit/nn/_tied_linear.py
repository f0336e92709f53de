"""TiedLinear: a bias-free linear layer that reads another module's weight on every call."""

from __future__ import annotations

import torch
from torch import nn

from toolkit.nn._common import _describe, _is_dtensor, _Linear
from toolkit.nn._cross_entropy import VocabShard, linear_cross_entropy
from toolkit.nn._tied_linear_diagnosis import (
    dtensor_cross_entropy_error,
    explain_failure,
    resharded_by_fsdp,
)

__all__ = ["TiedLinear"]


class TiedLinear:
    """A bias-free linear layer whose weight is shared with another module, read live on every call.

    ``head(x)`` is ``F.linear(x, tied_module.weight)``, the weight read on every call, so the
    tie survives what replaces the weight: a new Parameter, ``.to()``, ``to_empty()`` after
    meta-device init, ``load_state_dict(assign=True)``, FSDP2 re-sharding. TiedLinear is not
    an ``nn.Module`` (a Module attribute would register ``tied_module`` twice): the model's
    state dict holds the weight once, under ``tied_module``. Forward hooks go on ``linear``,
    the Module that computes the product. Under FSDP2 the weight must be unsharded when
    read. The [tied LM heads guide][tied-lm-heads-with-tiedlinear] shows a whole model, and
    the [sharded training guide][supported-placements] the FSDP2 layouts.

    Args:
        tied_module: The module whose ``weight`` is shared, such as the token embedding. A
            bias on it is ignored.

    Raises:
        AttributeError: If ``tied_module`` has no ``weight`` (a tensor passed instead of its
            module included), as in torchtune's ``TiedLinear``, which this replaces.
        TypeError: If ``tied_module`` is not a Module, or its ``weight`` is not a tensor.
        ValueError: If ``tied_module.weight`` is not 2-D (a lazy weight is checked when
            used).

    Added in version v3.58.0.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from toolkit.nn import TiedLinear
        >>> embedding = nn.Embedding(100, 16)
        >>> head = TiedLinear(embedding)
        >>> head(torch.randn(4, 16)).shape
        torch.Size([4, 100])
        >>> head.weight is embedding.weight
        True
    """

    tied_module: nn.Module
    linear: nn.Module

    def __init__(self, tied_module: nn.Module) -> None:
        try:
            weight = tied_module.weight
        except AttributeError:
            raise _missing_weight_error(tied_module) from None
        if not isinstance(tied_module, nn.Module):
            raise TypeError(
                f"TiedLinear ties to an nn.Module, got {type(tied_module).__name__}, which has "
                "a 'weight' but is not a Module; pass the nn.Module that owns the weight, such "
                "as the nn.Embedding"
            )
        _check_weight(tied_module, weight)
        self.tied_module = tied_module
        self.linear = _Linear()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the tied linear transform.

        Args:
            x: Input tensor of shape (..., in_features), where in_features matches the
                second dimension of tied_module.weight.

        Returns:
            The output tensor of shape (..., out_features), where out_features matches the
            first dimension of tied_module.weight.

        Raises:
            RuntimeError: If ``x`` cannot be multiplied by the weight, the message gives
                both shapes; if the weight is a sharded DTensor (FSDP2 resharded it before
                the call), it says how to regroup the units; if tensor parallelism sharded
                the weight but ``x`` is a plain tensor, it says how to prepare the input.
            ValueError: If ``tied_module.weight`` is no longer 2-D (``F.linear`` would
                accept a 1-D weight and drop the output's last dimension).
            TypeError: If ``tied_module.weight`` is no longer a tensor.
        """
        # Read as the caller reads it, so that the weight is the attribute's answer whatever
        # the module's class does to attribute lookup: a property, ``__getattr__``, a
        # parametrization, a ``_parameters`` mapping that gathers the weight as it is read.
        module = self.tied_module
        weight = module.weight
        # An uninitialized lazy weight raises torch's own error for it from ``dim()``.
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise _call_weight_error(module, weight)
        try:
            return self.linear(x, weight)  # type: ignore[no-any-return]
        except RuntimeError as error:
            # Diagnose only once the call has failed, so the normal path pays nothing.
            explained = explain_failure(module, x, weight)
            if explained is None:
                raise
            raise explained from error

    @property
    def weight(self) -> torch.Tensor:
        """``tied_module.weight``, read live: the weight the next call will use."""
        return self.tied_module.weight  # type: ignore[return-value]

    @property
    def in_features(self) -> int:
        """The size of the input's last dimension: ``weight.shape[1]``, read live.

        While the weight is an uninitialized lazy parameter it has no shape, and reading
        this raises torch's error for that.
        """
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        """The size of the output's last dimension: ``weight.shape[0]``, read live.

        While the weight is an uninitialized lazy parameter it has no shape, and reading
        this raises torch's error for that.
        """
        return int(self.weight.shape[0])

    @out_features.setter
    def out_features(self, value: int) -> None:
        # transformers sets out_features after resizing the tied embedding; the live value
        # already follows it. Any other value would disagree with the weight.
        if value != self.out_features:
            raise AttributeError(
                f"TiedLinear's out_features is the tied weight's first dimension, "
                f"{self.out_features}, and cannot be set to {value}; resize tied_module instead"
            )

    def requires_grad_(self, requires_grad: bool = True) -> TiedLinear:
        """Set ``requires_grad`` of the tied weight, as ``nn.Module.requires_grad_`` would.

        The weight is ``tied_module``'s, so this freezes or unfreezes it there too: a head
        and an embedding that share one weight are trained or frozen together.

        Args:
            requires_grad: Whether autograd records operations on the weight.

        Returns:
            ``self``.

        Added in version v3.59.0.

        Examples:
            >>> from torch import nn
            >>> from toolkit.nn import TiedLinear
            >>> embedding = nn.Embedding(100, 16)
            >>> head = TiedLinear(embedding).requires_grad_(False)
            >>> embedding.weight.requires_grad
            False
        """
        self.weight.requires_grad_(requires_grad)
        return self

    def __repr__(self) -> str:
        tied = _describe(self.tied_module)
        weight = self.weight
        if nn.parameter.is_lazy(weight):
            features = "in_features=<uninitialized>, out_features=<uninitialized>"
        else:
            features = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"TiedLinear({features}, tied_to={tied}.weight)"

    def cross_entropy(
        self,
        x: torch.Tensor,
        target: torch.Tensor,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: float | None = None,
        chunk_size: int | None = None,
    ) -> torch.Tensor:
        """The cross-entropy of ``self(x)`` against ``target``, without the full logits.

        ``F.cross_entropy(self(x), target, ...)`` over the flattened tokens, and its
        gradients, computed a chunk of tokens at a time (16-bit logits widened to float32);
        hooks on ``linear`` are not called. The [tied LM heads guide][tied-lm-heads-with-tiedlinear]
        covers dtypes, autograd, ``torch.compile``, FSDP2 and tensor parallelism.

        Args:
            x: Input of shape (..., in_features).
            target: Class indices of an integer dtype, with ``x``'s leading shape.
            ignore_index: Target value not counted, as in ``F.cross_entropy``, nor computed.
            reduction: ``"mean"`` over the counted tokens, ``"sum"``, or ``"none"`` (per
                token, 0 where ignored). ``"none"``: Added in version v3.59.0.
            label_smoothing: As in ``F.cross_entropy``.
            z_loss: Adds ``z_loss * logsumexp(logits) ** 2`` per counted token (PaLM).
                Added in version v3.59.0.
            softcap: Logits become ``softcap * tanh(logits / softcap)`` (Gemma 2).
                Added in version v3.59.0.
            chunk_size: Tokens per chunk; None bounds a chunk's logits to 64 MiB (16 tokens+).

        Returns:
            The loss: a scalar, or per token for ``reduction="none"``.

        Raises:
            ValueError: If an argument is invalid, the shapes, or a shard's ranks' arguments differ.
            TypeError: If ``target`` is not integer, or ``x`` not of the weight's dtype.
            IndexError: If a counted target is outside ``[0, out_features)`` (on the CPU).
            RuntimeError: If the weight is a DTensor it cannot take, or under forward-mode AD
                (``torch.func.jvp``); the message says why and what to use.

        Examples:
            >>> import torch
            >>> import torch.nn.functional as F
            >>> from toolkit.nn import TiedLinear
            >>> head = TiedLinear(torch.nn.Embedding(100, 16))
            >>> x, target = torch.randn(8, 16), torch.randint(0, 100, (8,))
            >>> loss = head.cross_entropy(x, target, chunk_size=3)
            >>> torch.allclose(loss, F.cross_entropy(head(x), target))
            True
        """
        weight: torch.Tensor = self.tied_module.weight  # type: ignore[assignment]
        shard = None
        if _is_dtensor(weight):
            # A replicated weight is whole on every rank: its local tensor is the weight, and
            # to_local's backward gives its gradient the same placements.
            replicated = _is_replicated(weight)
            shard = _vocab_shard(weight)  # None for a replicated weight
            if not (replicated or shard) or resharded_by_fsdp(self.tied_module, weight):
                raise dtensor_cross_entropy_error(self.tied_module, weight)
            weight = weight.to_local()  # type: ignore[attr-defined] # a DTensor here
            x = _whole_input(x)
        return linear_cross_entropy(
            x,
            weight,
            target,
            shard=shard,
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            softcap=softcap,
            chunk_size=chunk_size,
        )


def _vocab_shard(weight: torch.Tensor) -> VocabShard | None:
    """This rank's part of a weight sharded on the vocabulary on a 1-D mesh, or None.

    ``Shard(0)`` is how ``RowwiseParallel`` shards an embedding; any other placement gives None.
    """
    from torch.distributed.tensor import Shard  # noqa: PLC0415 - needs distributed

    mesh, placements = weight.device_mesh, tuple(weight.placements)  # type: ignore[attr-defined]
    if mesh.ndim != 1 or placements != (Shard(0),):
        return None
    # Shard(0) splits as torch.chunk does: ceil(V / n) rows a rank, the last ranks fewer.
    vocab = weight.shape[0]
    per_rank = -(-vocab // mesh.size())
    return VocabShard(mesh.get_group(), min(mesh.get_local_rank() * per_rank, vocab), vocab)


def _is_replicated(weight: torch.Tensor) -> bool:
    """Whether a DTensor ``weight`` is replicated on every dimension of its mesh."""
    from torch.distributed.tensor import Replicate  # noqa: PLC0415 - needs distributed

    return all(isinstance(p, Replicate) for p in weight.placements)  # type: ignore[attr-defined]


def _whole_input(x: torch.Tensor) -> torch.Tensor:
    """The whole input on this rank: a DTensor (sharded on the sequence, say) is gathered."""
    if not _is_dtensor(x):
        return x
    from torch.distributed.tensor import Replicate  # noqa: PLC0415 - needs distributed

    ndim = x.device_mesh.ndim  # type: ignore[attr-defined] # a DTensor here
    return x.redistribute(placements=[Replicate()] * ndim).to_local()  # type: ignore[attr-defined,no-any-return]


def _missing_weight_error(tied_module: object) -> AttributeError:
    """The error for a ``tied_module`` without a ``weight``: a tensor gets its own fix."""
    owner = type(tied_module).__name__
    if isinstance(tied_module, torch.Tensor):
        fix = (
            "pass the module that owns this tensor (such as the nn.Embedding), not the "
            "tensor itself"
        )
    else:
        fix = "pass the module that owns the shared weight, such as the token embedding"
    return AttributeError(
        f"TiedLinear needs a module with a 'weight' attribute to tie to, but {owner} has "
        f"none; {fix}"
    )


def _call_weight_error(module: nn.Module, weight: object) -> Exception:
    """The error for a weight that is not a 2-D tensor when TiedLinear is called."""
    owner = type(module).__name__
    if not isinstance(weight, torch.Tensor):
        return TypeError(
            f"TiedLinear needs {owner}.weight to be a 2-D tensor when called, got "
            f"{type(weight).__name__}; a weight assigned to the tied module after TiedLinear "
            "was built must be a 2-D tensor too"
        )
    return ValueError(
        f"TiedLinear needs {owner}.weight to be 2-D (out_features, in_features) when "
        f"called, got shape {tuple(weight.shape)}; a weight assigned to the tied module "
        "after TiedLinear was built must be 2-D too"
    )


def _check_weight(tied_module: nn.Module, weight: object) -> None:
    owner = type(tied_module).__name__
    if not isinstance(weight, torch.Tensor):
        raise TypeError(
            f"TiedLinear needs {owner}.weight to be a 2-D tensor, got "
            f"{type(weight).__name__}; tie to a module whose weight is a tensor"
        )
    if not nn.parameter.is_lazy(weight) and weight.dim() != 2:
        raise ValueError(
            f"TiedLinear needs {owner}.weight to be 2-D (out_features, in_features), got "
            f"shape {tuple(weight.shape)}; tie to a module with a matrix weight, such as "
            "nn.Embedding or nn.Linear"
        )
