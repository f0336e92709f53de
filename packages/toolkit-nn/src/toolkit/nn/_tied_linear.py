"""TiedLinear: a bias-free linear layer that reads another module's weight on every call."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.nn._cross_entropy import VocabShard, linear_cross_entropy
from toolkit.nn._tied_linear_diagnosis import (
    _describe,
    _dtensor_cross_entropy_error,
    _explain_failure,
    _is_dtensor,
    _resharded_by_fsdp,
)

__all__ = ["TiedLinear"]


class _Linear(nn.Module):
    """The module that performs ``F.linear(x, weight)``, so that hooks can observe it."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


class TiedLinear:
    """A bias-free linear layer whose weight is shared with another module, read live on every call.

    TiedLinear does not copy or cache ``tied_module``'s weight; it reads
    ``tied_module.weight`` on every call. This keeps the two layers tied even if
    ``tied_module`` is later re-wrapped by something like FSDP, which replaces the memory
    backing a weight but not the Module object that owns it. The same live read honours a
    new Parameter assigned to ``tied_module``, ``to_empty`` after meta-device init,
    ``load_state_dict(assign=True)``, ``.to()``, parametrizations and
    ``torch.func.functional_call``. Under FSDP2 the weight must be unsharded when TiedLinear
    reads it: if ``tied_module`` is its own ``fully_shard`` unit that reshards after its
    forward, the call raises a RuntimeError naming the module and the ways to regroup it.
    Under tensor parallelism the same live read takes the tied module's vocabulary-sharded
    weight; ``TiedLinearParallel`` prepares the head's input and logits around it.

    TiedLinear intentionally does not subclass ``torch.nn.Module``.
    ``Module.__setattr__`` auto-registers any Module-valued attribute as a submodule, which
    would cause ``tied_module`` to be registered twice (once under its original owner, once
    under TiedLinear), duplicating its weight in ``state_dict()`` and ``parameters()``. The
    actual ``torch.nn.functional.linear`` call is performed by the ``linear`` attribute,
    a real Module, so forward hooks can still be attached to observe the transform: its
    forward takes ``(x, weight)``.

    The weight is checked when TiedLinear is built and again on every call, so a weight
    assigned to ``tied_module`` later that is not a 2-D tensor raises instead of giving a
    wrongly shaped output.

    Because the weight is owned by ``tied_module`` alone, a model's state dict has one key
    for it and no shared storage, so ``safetensors.torch.save_file`` works, and
    ``copy.deepcopy`` or ``pickle`` of the model re-ties the copy to the copied module.

    Args:
        tied_module: The module whose ``weight`` attribute is shared. Only the weight is
            used; any bias on ``tied_module`` is ignored.

    Raises:
        AttributeError: If ``tied_module`` does not have a ``weight`` attribute. Whatever
            ``tied_module`` is, a tensor passed in place of its module included, this is the
            error, as it is in torchtune's ``TiedLinear``.
        TypeError: If ``tied_module`` has a ``weight`` but is not a Module, or its
            ``weight`` is not a tensor.
        ValueError: If ``tied_module.weight`` is not 2-D. An uninitialized lazy parameter is
            accepted; its shape is checked when it is used.

    Added in version v3.58.0. Native replacement for torchtune's ``TiedLinear``, removing the
    ``torchtune`` dependency.

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
    # The type of ``tied_module`` when built, if it resolves ``weight`` as
    # ``Module.__getattr__`` does (see ``_resolves_weight_plainly``); None otherwise.
    _plain_type: type | None = None

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
        if _resolves_weight_plainly(type(tied_module)):
            self._plain_type = type(tied_module)

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
        # ``tied_module.weight`` falls back to the Python-level ``Module.__getattr__``, 15%
        # of a one-token call, which returns ``_parameters["weight"]`` when it is set.
        # Reading that entry directly gives the same tensor only where nothing comes before
        # the fallback: the type TiedLinear was built with was checked for that, and the
        # instance ``__dict__`` is checked on every call. Everything else (a buffer, a plain
        # attribute, a property, a parametrization, a module whose class changed since) is
        # read through the attribute.
        module = self.tied_module
        weight: object = None
        if type(module) is self._plain_type and "weight" not in module.__dict__:
            weight = module._parameters.get("weight")
        if weight is None:
            weight = module.weight
        # An uninitialized lazy weight raises torch's own error for it from ``dim()``.
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise _call_weight_error(module, weight)
        try:
            return self.linear(x, weight)  # type: ignore[no-any-return]
        except RuntimeError as error:
            # Diagnose only once the call has failed, so the normal path pays nothing.
            explained = _explain_failure(self, x, weight)
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

        Equal to ``F.cross_entropy(self(x), target, ...)`` over the flattened tokens, with
        the logits widened to float32 from bfloat16 and float16, and its gradients, but
        computed a chunk of tokens at a time in two reused buffers (the logits and their
        softmax): at most one chunk's logits exist at once, so a long sequence over a large
        vocabulary needs a fraction of the plain path's memory, in the same matrix
        products. For a mean or a sum the gradients of ``x`` and of the tied weight are
        computed in the forward pass and only scaled by backward, in float32, so a float16
        loss scale is applied before anything is rounded to float16. For
        ``reduction="none"``, and for a backward that builds a graph
        (``create_graph=True``, ``torch.func.grad``, ``jacrev``), backward recomputes the
        chunks; second-order gradients are the plain path's. ``torch.func.vmap`` takes one
        loss per entry; forward-mode AD is not supported. With no gradient needed, only
        the loss is computed.

        The weight is read live, as by ``__call__``, and its gradient flows to
        ``tied_module``, so a tied embedding receives the sum of the lookup and head
        gradients. Hooks on ``linear`` are not called: the logits never exist. The
        products run in the dtype ``self(x)`` runs them in, under autocast too, and
        accumulate in float32 for bfloat16 and float16; the loss is float32 for them and
        has the products' dtype otherwise. It compiles with ``torch.compile(fullgraph=True)``,
        where an out-of-range target fails as an asynchronous assertion (RuntimeError).

        Under FSDP2 the weight must be unsharded when this runs: call it inside the
        forward of the unit that holds ``tied_module`` (such as the root), or register
        the method that calls it with
        ``torch.distributed.fsdp.register_fsdp_forward_method``. Under tensor parallelism,
        with the weight sharded on the vocabulary (``Shard(0)`` on a 1-D mesh, as
        ``RowwiseParallel`` shards an embedding), each rank takes the logits of its own
        rows and the ranks exchange only per-token statistics and x's gradient; ``x`` must
        be the whole input on every rank (a DTensor is gathered first).

        Args:
            x: Input of shape (..., in_features).
            target: Class indices of an integer dtype, with ``x``'s leading shape.
            ignore_index: Target value that is not counted, as in ``F.cross_entropy``.
            reduction: ``"mean"`` over the counted tokens (nan when none is counted, as
                in ``F.cross_entropy``), ``"sum"``, or ``"none"``: each token's loss, in
                ``target``'s shape, 0 where ignored.
            label_smoothing: Amount of smoothing in [0.0, 1.0], as in
                ``F.cross_entropy``.
            z_loss: Adds ``z_loss * logsumexp(logits) ** 2`` per counted token, reduced
                as the loss is (PaLM's z-loss); 0.0 for none.
            softcap: Replaces the logits with ``softcap * tanh(logits / softcap)`` before
                the softmax and the z-loss (Gemma 2's soft-cap); None for none.
            chunk_size: Tokens per chunk, or None to bound each chunk's logits to
                64 MiB (at least 16 tokens); smaller chunks use less memory.

        Returns:
            The loss: a scalar, or per token for ``reduction="none"``.

        Raises:
            ValueError: If ``reduction``, ``label_smoothing``, ``z_loss``, ``softcap`` or
                ``chunk_size`` is invalid, or the shapes of ``x``, ``target`` and the
                weight disagree.
            TypeError: If ``target`` is not an integer tensor, or ``x`` is not a
                floating-point tensor of the weight's dtype (outside autocast).
            IndexError: If a counted target is outside ``[0, out_features)`` (eagerly on
                the CPU; elsewhere the check is asynchronous, as ``F.cross_entropy``'s).
            RuntimeError: If the weight is a DTensor that FSDP2 resharded, or that is
                sharded other than on the vocabulary of a 1-D mesh, or under forward-mode
                AD (``torch.func.jvp``); the message names the fix.

        Added in version v3.58.0.

        Examples:
            >>> import torch
            >>> import torch.nn.functional as F
            >>> from torch import nn
            >>> from toolkit.nn import TiedLinear
            >>> head = TiedLinear(nn.Embedding(100, 16))
            >>> x, target = torch.randn(8, 16), torch.randint(0, 100, (8,))
            >>> loss = head.cross_entropy(x, target, chunk_size=3)
            >>> torch.allclose(loss, F.cross_entropy(head(x), target))
            True
            >>> capped = 30.0 * torch.tanh(head(x) / 30.0)
            >>> per_token = head.cross_entropy(x, target, reduction="none", softcap=30.0)
            >>> torch.allclose(per_token, F.cross_entropy(capped, target, reduction="none"))
            True
        """
        weight: torch.Tensor = self.tied_module.weight  # type: ignore[assignment]
        shard = None
        if _is_dtensor(weight):
            shard = _vocab_shard(weight)
            if shard is None or _resharded_by_fsdp(self.tied_module, weight):
                raise _dtensor_cross_entropy_error(self, weight)
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


# What a plain Module resolves attributes with: taken once, so that a later patch of either
# counts as an override.
_OBJECT_GETATTRIBUTE: object = object.__getattribute__
_MODULE_GETATTR: object = nn.Module.__getattr__


def _resolves_weight_plainly(cls: type[nn.Module]) -> bool:
    """Whether ``module.weight`` is ``Module.__getattr__``'s answer for instances of ``cls``.

    ``module.weight`` looks in the type's MRO first (a property, any other descriptor or a
    class attribute named ``weight`` wins), then in the instance ``__dict__``, and only then
    calls ``__getattr__``, which ``Module`` implements by reading ``_parameters``,
    ``_buffers`` and ``_modules``. A type that overrides ``__getattribute__`` or
    ``__getattr__`` may return anything. A parametrization swaps the module's class for a
    generated one with a ``weight`` property, so it is seen here too. The instance
    ``__dict__`` can change at any time, so the caller checks it on every call.

    TiedLinear asks once, for the type it is built with; a module whose class changes later
    (``fully_shard``, a parametrization) is read through the attribute from then on. A class
    that is itself changed afterwards (a ``weight`` property set on the class, say) is not
    examined again.
    """
    return (
        cls.__getattribute__ is _OBJECT_GETATTRIBUTE
        and cls.__getattr__ is _MODULE_GETATTR  # every Module class has one
        and not any("weight" in vars(base) for base in cls.__mro__)
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
