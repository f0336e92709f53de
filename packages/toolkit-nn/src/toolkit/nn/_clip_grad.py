"""clip_grad_norm_ for gradients on several device meshes, and over a pipeline's stages."""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from toolkit.nn._common import _gather_objects, _is_dtensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from toolkit.nn._pipeline_tie import PipelineTie

__all__ = ["clip_grad_norm_", "pipeline_clip_grad_norm_"]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip gradients by their total norm, as ``torch.nn.utils.clip_grad_norm_``, over meshes.

    The same arguments, result and in-place scaling as torch's, for plain tensors and
    DTensors on any meshes (FSDP2 on ``dp``, FSDP2 with TP on ``(dp, tp)``) in one call,
    which torch's cannot combine (pytorch#180346). A plain tensor's plain gradient is this
    rank's own, as in torch's. Every rank of the default process group calls it: the ranks
    first agree, in one all-reduce, on what they hold. The [sharded training
    guide][clipping-the-gradients] says what each kind of gradient counts for.

    Args:
        parameters: A tensor or an iterable of tensors whose gradients are clipped.
        max_norm: The largest total norm allowed.
        norm_type: The p of the p-norm; ``inf``/``-inf`` for the largest/smallest absolute
            value; ``0`` counts the gradients with a nonzero element, as torch's.
        error_if_nonfinite: Raise if the total norm is ``nan``, ``inf`` or ``-inf``.
        foreach: Use the foreach kernels (``None``: where the device supports them).

    Returns:
        The total norm before clipping, a plain tensor of the gradients' promoted dtype.

    Raises:
        ValueError: On every rank, before any gradient changes, if the ranks of a mesh
            disagree: a DTensor with a gradient on some ranks only, different numbers of a
            mesh's DTensors (a rank passing none included), or a plain tensor's gradient a
            DTensor on some ranks only. The message names the parameter or the ranks.
        RuntimeError: On every rank, before any gradient changes, if ``norm_type`` is
            ``inf`` or ``-inf`` and a gradient has no elements, as torch's; if
            ``error_if_nonfinite`` is set and the norm is not finite; if ``foreach=True``
            where there are no foreach kernels.

    Added in version v3.59.0.

    Examples:
        >>> import torch
        >>> from toolkit.nn import clip_grad_norm_
        >>> layer = torch.nn.Linear(2, 1)
        >>> layer(torch.ones(1, 2)).sum().backward()
        >>> clip_grad_norm_(layer.parameters(), max_norm=1.0)
        tensor(1.7321)
    """
    with torch.no_grad():  # inside, not as a decorator: mutation testing reaches the body
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        groups = by_mesh(params)
        agree(params, groups, norm_type)
        total = total_norm(groups, norm_type, foreach)
        check_finite(total, norm_type, error_if_nonfinite)
        clip_with_norm(groups, max_norm, total, foreach)
    return total


def pipeline_clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    group: dist.ProcessGroup | DeviceMesh | None = None,
    tie: PipelineTie | None = None,
) -> torch.Tensor:
    """Clip the gradients of a pipeline's stages by their total norm, counting a tie once.

    The total norm is the one ``torch.nn.utils.clip_grad_norm_`` gives for the whole model
    in one process: each rank takes its stages' norm as ``toolkit.nn.clip_grad_norm_`` does,
    without ``tie``'s duplicate copies, and the ranks combine theirs in float64. Call it
    after ``PipelineTie.reduce_grads()``, on every rank of the pipeline.

    Args:
        parameters: This rank's parameters (of every stage it holds), tensor or iterable.
        max_norm: The largest total norm allowed.
        norm_type: The p of the p-norm; ``inf``/``-inf`` for the largest/smallest value.
        error_if_nonfinite: Raise if the total norm is ``nan``, ``inf`` or ``-inf``.
            Added in version v3.59.0.
        foreach: Use the foreach kernels (``None``: where the device supports them).
            Added in version v3.59.0.
        group: The process group of one pipeline (every stage, in any order), or a 1-D
            DeviceMesh of it, such as ``mesh["pp"]``. It wins over ``tie``'s group.
        tie: This rank's PipelineTie, whose group is the pipeline's without ``group``.

    Returns:
        The total norm before clipping, the same on every rank: float64 where the rank's
        gradients' norm is, else float32.

    Raises:
        ValueError: If neither ``group`` nor ``tie`` is given and the default process group
            has more than one rank; or, as ``clip_grad_norm_``, for a DTensor with a
            gradient on some ranks only.
        RuntimeError: On every rank of the pipeline, with no gradient changed: if
            ``error_if_nonfinite`` is set and the norm is not finite, or an ``inf`` or
            ``-inf`` norm meets a gradient without elements, as torch's.

    Added in version v3.58.0.

    Examples:
        On every rank of the pipeline, after the tie's reduction:

        >>> from toolkit.nn import pipeline_clip_grad_norm_
        >>> tie.reduce_grads()  # doctest: +SKIP
        >>> norm = pipeline_clip_grad_norm_(stage.parameters(), 1.0, tie=tie)  # doctest: +SKIP
    """
    pipeline = _pipeline_group(group, tie)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    skipped = {id(p) for p in tie.duplicates()} if tie is not None else set()
    # DTensors without a gradient here too: their mesh's ranks agree on which have one.
    counted = by_mesh(p for p in params if id(p) not in skipped)
    has_grads = any(p.grad is not None for group in counted for p in group)
    # An inf or -inf norm over a gradient without elements is refused, as torch refuses it,
    # on every rank: a stage's data-parallel replicas hold the same parameters, and skip alike.
    empty = has_empty(counted, norm_type)
    local = torch.zeros(()) if empty else total_norm(counted, norm_type, foreach)
    # float64 on every rank, whatever each rank's gradients are: the ranks must agree on it.
    total = local.to(torch.float64)
    if dist.get_world_size(pipeline) == 1:
        refuse_empty(empty, norm_type)  # one rank holds the whole pipeline: its norm is the total
    elif math.isinf(norm_type):
        # The largest (inf) or smallest (-inf) of the ranks' norms, which are never negative,
        # is the absolute value of the MAX of the norms signed as norm_type; a rank without
        # gradients takes no part, and no gradient anywhere gives 0, as in torch. gloo's MAX
        # may drop a nan: whether any rank's norm is nan rides beside it.
        signed = total.copysign(norm_type) if has_grads else total.new_tensor(-math.inf)
        flags = total.new_tensor([float(has_grads), float(empty)])
        both = torch.cat([torch.stack([signed, total.isnan()]), flags])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=pipeline)
        refuse_empty(bool(both[3] > 0), norm_type)
        total = torch.where(both[2] > 0, both[0].abs(), 0.0)
        total = torch.where(both[1] > 0, math.nan, total)
    elif norm_type == 0:
        dist.all_reduce(total, group=pipeline)  # the ranks' counts of nonzero elements add
    else:
        total.pow_(norm_type)
        dist.all_reduce(total, group=pipeline)
        total.pow_(1.0 / norm_type)
    total = total.to(torch.promote_types(local.dtype, torch.float32))
    check_finite(total, norm_type, error_if_nonfinite)
    clip_with_norm(by_layout(params), max_norm, total, foreach)
    return total


def _pipeline_group(
    group: dist.ProcessGroup | DeviceMesh | None, tie: PipelineTie | None
) -> dist.ProcessGroup:
    if isinstance(group, dist.ProcessGroup):
        return group
    if group is not None:  # a DeviceMesh
        if group.ndim != 1:
            raise ValueError(
                "pipeline_clip_grad_norm_ needs a 1-D DeviceMesh of the pipeline ranks, got a "
                f'{group.ndim}-D mesh; pass the pipeline dimension, such as mesh["pp"]'
            )
        return group.get_group()
    if tie is not None:
        return tie.group
    size = dist.get_world_size()
    if size > 1:
        raise ValueError(
            "pipeline_clip_grad_norm_ needs the pipeline's process group: the default group "
            f"has {size} ranks, which are one pipeline only without data or tensor "
            'parallelism. Pass group=, such as group=mesh["pp"] (or group=dist.group.WORLD '
            "when every rank is a stage of one pipeline), or the tie= built on that group"
        )
    return dist.group.WORLD  # type: ignore[return-value]


def by_layout(params: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The parameters with a gradient, grouped by the device mesh of the gradient.

    Every plain tensor is in one group. The groups come in the order their meshes first
    appear.
    """
    groups = [[p for p in group if p.grad is not None] for group in by_mesh(params)]
    return [group for group in groups if group]


def by_mesh(params: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The parameters grouped by device mesh, DTensors with or without a gradient.

    A DTensor is on the mesh of the parameter (or of its gradient); the plain tensors with a
    gradient are in one group. The groups come in the order their meshes first appear, the
    same on every rank that holds the same parameters, whichever have a gradient here.
    """
    groups: dict[Hashable, list[torch.Tensor]] = {}
    for param in params:
        sharded = _placed(param)
        if sharded is not None:
            mesh = sharded.device_mesh if _is_dtensor(sharded) else None  # type: ignore[attr-defined]
            groups.setdefault(mesh, []).append(param)
    return list(groups.values())


def _placed(param: torch.Tensor) -> torch.Tensor | None:
    """What places ``param`` on a mesh: the parameter if a DTensor, else its gradient."""
    return param if _is_dtensor(param) else param.grad


def agree(params: list[torch.Tensor], groups: list[list[torch.Tensor]], norm_type: float) -> None:
    """Refuse, on every rank, what would hang the ranks of a mesh or what torch refuses.

    Under a process group, the ranks first agree in one all-reduce (MAX)
    over the default group, the one group that every rank knows, even a rank that holds
    nothing on the meshes of the others: ``2 * world_size + 2`` int32. For each rank ``r``
    it carries whether other ranks hold DTensors on a mesh that holds ``r`` and whether ``r``
    holds some, then whether some rank has a gradient without elements under an ``inf`` or
    ``-inf`` norm, and whether some rank has a plain parameter with a DTensor gradient. Only
    then do the ranks gather the positions of those parameters, which each mesh's ranks must
    have alike (:func:`refuse_mixed`). Every rank raises the same error from what it received.

    Raises:
        ValueError: If a rank holds none of its meshes' DTensors while other ranks of the mesh
            hold some, or from :func:`refuse_mixed`.
        RuntimeError: From :func:`refuse_empty`, for a gradient without elements.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return  # no DTensor can exist; torch's own norm refuses an inf one over no elements
    from torch.distributed.distributed_c10d import _get_object_coll_device  # noqa: PLC0415

    world, rank = dist.get_world_size(), dist.get_rank()
    # Made on the device where the default group's collectives run.
    with torch.device(_get_object_coll_device()):
        state = torch.zeros(2 * world + 2, dtype=torch.int32)
    parts = [world, world, 2]  # needed of each rank, held by each rank, two flags
    needed, held, flags = torch.split(state, parts)  # views: what they take lands in ``state``
    for group in groups:
        placed = _placed(group[0])
        if _is_dtensor(placed):
            needed[placed.device_mesh.mesh.flatten()] = True  # type: ignore[union-attr]
            held[rank] = True
    mixed = [
        (i, tuple(p.grad.device_mesh.mesh.flatten().tolist()))  # type: ignore[union-attr]
        for i, p in enumerate(params)
        if not _is_dtensor(p) and _is_dtensor(p.grad)
    ]
    flags[0] = has_empty(groups, norm_type)
    flags[1] = len(mixed)
    dist.all_reduce(state, op=dist.ReduceOp.MAX)
    needed_by, held_by, (empty, any_mixed) = (part.tolist() for part in torch.split(state, parts))
    if any_mixed:
        refuse_mixed(mixed)
    short = [r for r in range(world) if needed_by[r] > held_by[r]]
    if short:
        raise ValueError(_ABSENT.format(ranks=short))
    refuse_empty(bool(empty), norm_type)


def refuse_mixed(mine: list[tuple[int, tuple[int, ...]]]) -> None:
    """Refuse, on every rank, a plain parameter whose gradient is a DTensor on some ranks only.

    ``mine`` holds, for each plain parameter of this rank with a DTensor gradient, its
    position in ``params`` and its gradient's mesh as the ranks it holds. Every rank of that
    mesh must have the same at that position; one all-gather over the default group shows
    each rank what the others have. The error names the first position where they differ.

    Raises:
        ValueError: If a rank of such a mesh has something else at such a position: a plain
            gradient, None, a DTensor on another mesh, or a DTensor parameter.
    """
    held = [set(entries) for entries in _gather_objects(mine, None)]
    missing = sorted(
        (index, rank)
        for entries in held
        for index, ranks in entries
        for rank in ranks
        if (index, ranks) not in held[rank]
    )
    if missing:
        index = missing[0][0]
        ranks = sorted({rank for i, rank in missing if i == index})
        raise ValueError(_MIXED.format(index=index, ranks=ranks))


def has_empty(groups: list[list[torch.Tensor]], norm_type: float) -> bool:
    """Whether ``norm_type`` is ``inf`` or ``-inf`` and a gradient of ``groups`` has no elements.

    A DTensor gradient counts by its whole tensor, which every rank of its mesh knows; an
    empty shard of a nonempty DTensor is not one.
    """
    grads = [p.grad for group in groups for p in group]
    return math.isinf(norm_type) and any(g is not None and not g.numel() for g in grads)


def refuse_empty(empty: bool, norm_type: float) -> None:
    """Raise torch's refusal of an ``inf`` or ``-inf`` norm over a gradient without elements.

    ``torch.nn.utils.get_total_norm`` refuses one, as the largest and smallest absolute
    value of no elements are undefined; call it on every rank with the same ``empty``.

    Raises:
        RuntimeError: If ``empty``.
    """
    if empty:
        raise RuntimeError(_EMPTY.format(norm_type=float(norm_type)))


def total_norm(
    groups: list[list[torch.Tensor]], norm_type: float, foreach: bool | None
) -> torch.Tensor:
    """The norm of the groups' gradients as one vector, a plain tensor.

    Each group's norm is reduced over its own mesh, then the groups' norms are combined.
    """
    norms = []
    for group in groups:
        if _is_dtensor(_placed(group[0])):
            norm = mesh_norm(group, norm_type, foreach)
            if norm is not None:
                norms.append(norm)
        else:
            grads = [p.grad for p in group]  # every plain tensor of the group has one
            norms.append(vector_norm(grads, norm_type, foreach))  # type: ignore[arg-type]
    if not norms:
        return torch.tensor(0.0)
    device = norms[0].device
    stacked = torch.stack([n.to(device) for n in norms])
    # The 0-"norm" counts the gradients with a nonzero element: the groups' counts add.
    return stacked.sum() if norm_type == 0 else torch.linalg.vector_norm(stacked, norm_type)


def mesh_norm(
    group: list[torch.Tensor], norm_type: float, foreach: bool | None
) -> torch.Tensor | None:
    """The norm of the gradients of DTensors on one mesh, on every rank; None if none has any.

    First the ranks agree on which parameters have a gradient (one all-reduce per mesh
    dimension), and a gradient that some ranks have and others lack is refused on every rank.
    Then each rank takes the norm of its local shards, counting each replicated shard once and
    leaving out empty shards (which have no largest or smallest element), and the ranks'
    parts are combined (one more all-reduce per mesh dimension).
    """
    first = _placed(group[0])
    anchor = first.to_local()  # type: ignore[union-attr]
    mesh = first.device_mesh  # type: ignore[union-attr]
    grads = [p.grad for p in group]
    counts = anchor.new_tensor([len(group), -len(group)], dtype=torch.int64)
    all_reduce(mesh, counts, dist.ReduceOp.MAX)
    if counts[0] != -counts[1]:
        raise ValueError(_UNEQUAL)
    flags = anchor.new_tensor(
        [[int(g is not None) for g in grads], [int(g is None) for g in grads]]
    )
    all_reduce(mesh, flags, dist.ReduceOp.MAX)
    somewhere, nowhere = flags.bool()
    if (somewhere & nowhere).any():
        raise ValueError(_missing(group[int((somewhere & nowhere).int().argmax())]))
    if not somewhere.any():
        return None
    coordinate = mesh.get_coordinate()
    shards = []  # this rank's part of each gradient: None for a copy or an empty shard
    for grad in grads:
        shard = None
        if grad is not None:
            whole = replicated_partial(grad)
            # A copy: replicated on a mesh dimension where this rank is not the first.
            copy = any(p.is_replicate() and coordinate[i] for i, p in enumerate(whole.placements))  # type: ignore[attr-defined]
            local = whole.to_local()  # type: ignore[attr-defined]
            shard = None if copy or not local.numel() else local
        shards.append(shard)
    mine = [s for s in shards if s is not None]
    infinite = math.isinf(norm_type)
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in group])
    wide = torch.promote_types(dtype, torch.float32)  # a float16 part's square overflows
    if norm_type == 0:
        # torch's 0-"norm" counts the gradients with a nonzero element: count each over the mesh.
        zero = anchor.new_tensor(False)
        values = torch.stack([zero if s is None else s.ne(0).any() for s in shards])
    elif infinite:
        # The largest (inf) or smallest (-inf) absolute value is the absolute value of the MAX
        # of the parts signed as norm_type; a rank without elements takes no part. gloo's MAX
        # may drop a nan: whether any part is nan rides beside it.
        part = vector_norm(mine, norm_type, foreach)
        values = (part.copysign(norm_type) if mine else part.new_tensor(-math.inf))[None]
    else:
        values = vector_norm(mine, norm_type, foreach).to(wide).pow(norm_type)[None]  # sums add
    parts = anchor.new_zeros(len(values) + 1, dtype=wide)
    parts.copy_(torch.cat([values, values.isnan().any()[None]]))
    all_reduce(mesh, parts, dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM)
    if norm_type == 0:
        norm = (parts[:-1] > 0).sum()  # a count, given the gradients' dtype below
    elif infinite:
        norm = parts[0].abs()
    else:
        norm = parts[0].pow(1.0 / norm_type)
    return torch.where(parts[-1] > 0, math.nan, norm).to(dtype)


def vector_norm(
    tensors: torch.Tensor | list[torch.Tensor], norm_type: float, foreach: bool | None
) -> torch.Tensor:
    return torch.nn.utils.get_total_norm(tensors, norm_type, foreach=foreach)


def replicated_partial(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with its partial sums over mesh dimensions reduced, so its shards hold values."""
    placements = grad.placements  # type: ignore[attr-defined]
    if not any(p.is_partial() for p in placements):
        return grad
    from torch.distributed.tensor import Replicate  # noqa: PLC0415 - a DTensor exists

    whole: torch.Tensor = grad.redistribute(  # type: ignore[attr-defined]
        placements=[Replicate() if p.is_partial() else p for p in placements]
    )
    return whole


def all_reduce(mesh: DeviceMesh, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
    """All-reduce ``tensor`` over every rank of ``mesh``: one all-reduce per dimension."""
    for dim in range(mesh.ndim):
        dist.all_reduce(tensor, op=op, group=mesh.get_group(dim))


def _missing(param: torch.Tensor) -> str:
    return (
        f"clip_grad_norm_: a DTensor parameter of shape {tuple(param.shape)} has a gradient "
        "on some ranks of its device mesh and None on others, so its gradient is neither "
        "whole nor absent. Give it a gradient on every rank (zeros where a rank has none: "
        "param.grad = torch.zeros_like(param)) or on none (param.grad = None)"
    )


_MIXED = (
    "clip_grad_norm_: parameters[{index}], a plain tensor, has a DTensor gradient on some "
    "ranks but not on rank(s) {ranks} of that gradient's device mesh (which have a plain "
    "gradient, None, or a DTensor of another mesh there), so the gradient is neither one "
    "DTensor nor each rank's own. Give it one "
    "kind of gradient on every rank: a DTensor on the mesh everywhere "
    "(DTensor.from_local(grad, mesh, placements)) or a plain tensor everywhere "
    "(grad.full_tensor()). list(model.named_parameters())[{index}] names it when "
    "model.parameters() was passed"
)

_ABSENT = (
    "clip_grad_norm_: rank(s) {ranks} passed no DTensor of a device mesh they belong to, "
    "while other ranks of that mesh passed some and would wait for them. Pass the same "
    "parameters on every rank, such as model.parameters(), not a list filtered by "
    "p.grad is not None"
)

_EMPTY = (
    "clip_grad_norm_: the {norm_type} norm of a gradient without elements is undefined "
    "(there is no largest or smallest value to take), and torch.nn.utils.clip_grad_norm_ "
    "refuses it too. Leave the parameter out or set its grad to None, or clip with a "
    "p-norm such as norm_type=2.0"
)

_UNEQUAL = (
    "clip_grad_norm_: the ranks of a device mesh passed different numbers of DTensor "
    "parameters on it. Pass the same parameters on every rank, such as model.parameters(), "
    "not a list filtered by p.grad is not None"
)


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
