"""clip_grad_norm_ for gradients that live on several device meshes."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import torch

from toolkit.nn._common import _is_dtensor

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip gradients by their total norm, as ``torch.nn.utils.clip_grad_norm_``, over meshes.

    The same arguments, result and in-place scaling as ``torch.nn.utils.clip_grad_norm_``,
    for parameters that need not share one device mesh: plain tensors, DTensors of FSDP2 on
    a ``dp`` mesh and DTensors of FSDP2 with tensor parallelism on a ``(dp, tp)`` mesh, in
    one call. torch's own function stacks the per-parameter norms, which fails for DTensors
    on different meshes (pytorch#180346). Here the gradients are grouped by mesh; each
    group's norm is reduced over its own mesh, the groups' norms are combined as plain
    tensors, and each group is scaled with one foreach call.

    Args:
        parameters: A tensor or an iterable of tensors whose gradients are clipped.
        max_norm: The largest total norm allowed.
        norm_type: The p of the p-norm; ``inf`` for the largest absolute value.
        error_if_nonfinite: Raise if the total norm is ``nan``, ``inf`` or ``-inf``.
        foreach: Use the foreach kernels (``None``: where the device supports them).

    Returns:
        The total norm of the gradients, before clipping: a plain tensor, the same on every
        rank of the meshes.

    Raises:
        RuntimeError: If ``error_if_nonfinite`` is set and the total norm is not finite;
            no gradient is changed.

    Added in version v3.58.0.

    Examples:
        >>> import torch
        >>> from toolkit.nn import clip_grad_norm_
        >>> layer = torch.nn.Linear(2, 1)
        >>> layer(torch.ones(1, 2)).sum().backward()
        >>> clip_grad_norm_(layer.parameters(), max_norm=1.0)
        tensor(1.7321)
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    groups = by_layout(params)
    total = total_norm(groups, norm_type, foreach)
    check_finite(total, norm_type, error_if_nonfinite)
    clip_with_norm(groups, max_norm, total, foreach)
    return total


def by_layout(params: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The parameters with a gradient, grouped by the device mesh of the gradient.

    Every plain tensor is in one group. The groups come in the order their meshes first
    appear.
    """
    groups: dict[Hashable, list[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if grad is not None:
            mesh = grad.device_mesh if _is_dtensor(grad) else None  # type: ignore[attr-defined]
            groups.setdefault(mesh, []).append(param)
    return list(groups.values())


def total_norm(
    groups: list[list[torch.Tensor]], norm_type: float, foreach: bool | None
) -> torch.Tensor:
    """The norm of the groups' gradients as one vector, a plain tensor.

    Each group's norm is reduced over its own mesh, then the groups' norms are combined.
    """
    norms = []
    for group in groups:
        grads = [p.grad for p in group if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
        norms.append(norm.full_tensor() if _is_dtensor(norm) else norm)  # type: ignore[attr-defined]
    if not norms:
        return torch.tensor(0.0)
    device = norms[0].device
    stacked = torch.stack([n.to(device) for n in norms])
    # The 0-"norm" counts the nonzero elements: the groups' counts add.
    return stacked.sum() if norm_type == 0 else torch.linalg.vector_norm(stacked, norm_type)


def check_finite(total: torch.Tensor, norm_type: float, error_if_nonfinite: bool) -> None:
    if error_if_nonfinite and not bool(total.isfinite()):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )


def clip_with_norm(
    groups: list[list[torch.Tensor]], max_norm: float, total: torch.Tensor, foreach: bool | None
) -> None:
    """Scale every group's gradients by ``max_norm / total``, at most 1: one call per mesh."""
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach)
