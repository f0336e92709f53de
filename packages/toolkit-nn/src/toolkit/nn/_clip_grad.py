"""clip_grad_norm_ for gradients on several device meshes, and over a pipeline's stages."""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from toolkit.nn._common import _detail, _gather_objects, _is_dtensor, _process_group

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from toolkit.nn._pipeline_tie import PipelineTie

__all__ = ["clip_grad_norm_", "pipeline_clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip gradients by their total norm, as ``torch.nn.utils.clip_grad_norm_``, over meshes.

    The same arguments, result and in-place scaling as torch's, for plain tensors and
    DTensors on any meshes in one call, which torch's cannot combine (pytorch#180346). A plain
    tensor's plain gradient is this rank's own. Every rank of a mesh calls it: one all-reduce
    per mesh dimension carries the norm and the checks that compare ranks;
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` adds some ([which run when][clipping-the-gradients]).

    Args:
        parameters: A tensor or an iterable of tensors whose gradients are clipped.
        max_norm: The largest total norm allowed.
        norm_type: The p of the p-norm, any float; ``inf``/``-inf`` for the largest/smallest
            absolute value; ``0`` counts the gradients with a nonzero element, as torch's.
        error_if_nonfinite: Raise if the total norm is ``nan``, ``inf`` or ``-inf``.
        foreach: Use the foreach kernels (``None``: where the device supports them).

    Returns:
        The total norm before clipping, a plain tensor of the gradients' promoted dtype.

    Raises:
        ValueError: On every rank of a mesh, before any gradient changes, if its ranks pass
            different numbers of its DTensors, or a DTensor has a gradient on some ranks only
            (told by a 48-bit digest of which have one, and under DETAIL exactly). On every
            rank under DETAIL: a rank passing none of its mesh's DTensors (by default, a
            hang), or a plain tensor's gradient a DTensor on some ranks only.
        RuntimeError: As torch's, on every rank of the meshes, before any gradient
            changes: an ``inf``, ``-inf`` or negative ``norm_type`` over a gradient without
            elements, a norm not finite under ``error_if_nonfinite``, or ``foreach=True``
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
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    groups = by_mesh(params)
    if _detail():
        agree(params, groups)
    total, empty, problem = total_norm(groups, norm_type, foreach)
    if problem is not None:
        raise ValueError(problem)
    refuse_empty(empty, norm_type)
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
    and the ranks combine theirs in float64 in one all-reduce. Call it after
    ``PipelineTie.reduce_grads()``, on every rank of the pipeline.

    Args:
        parameters: This rank's parameters (of every stage it holds), tensor or iterable.
        max_norm: The largest total norm allowed.
        norm_type: The p of the p-norm, as ``clip_grad_norm_``'s.
        error_if_nonfinite: Raise if the total norm is ``nan``, ``inf`` or ``-inf``.
            Added in version v3.59.0.
        foreach: Use the foreach kernels (``None``: where the device supports them).
            Added in version v3.59.0.
        group: The pipeline's process group (every stage, in any order), or a 1-D DeviceMesh
            of it, such as ``mesh["pp"]``. It wins over ``tie``'s group.
        tie: This rank's PipelineTie, whose group is the pipeline's without ``group``.

    Returns:
        The total norm before clipping, the same on every rank: float64 where the rank's
        gradients' norm is, else float32.

    Raises:
        ValueError: If neither ``group`` nor ``tie`` is given and the default group has more
            than one rank; on every rank, if a stage's mesh refuses as ``clip_grad_norm_``.
        RuntimeError: On every rank, with no gradient changed: if a copy of ``tie`` but the
            first holds a gradient (call ``reduce_grads()`` first); if ``error_if_nonfinite``
            and the norm is not finite, or an ``inf``, ``-inf`` or negative norm meets a
            gradient without elements, as torch's.

    Added in version v3.58.0.

    Examples:
        On every rank of the pipeline, after the tie's reduction:

        >>> from toolkit.nn import pipeline_clip_grad_norm_
        >>> tie.reduce_grads()  # doctest: +SKIP
        >>> norm = pipeline_clip_grad_norm_(stage.parameters(), 1.0, tie=tie)  # doctest: +SKIP
    """
    pipeline = _pipeline_group(group, tie)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    # A duplicate copy holds its share of the tied gradient until reduce_grads() moves it.
    early = tie is not None and any(p.grad is not None for p in tie.duplicates())
    # DTensors without a gradient here too: their mesh's ranks compare how many have one.
    counted = by_mesh(params)
    has_grads = any(p.grad is not None for group in counted for p in group)
    local, empty, problem = total_norm(counted, norm_type, foreach)
    total: torch.Tensor | None = local
    # Whether this rank's meshes refused, or it clips before reduce_grads(), rides too, so
    # that every rank raises.
    flags = [has_grads, empty, problem is not None, early]
    if dist.get_world_size(pipeline) > 1:
        from torch.distributed.distributed_c10d import _get_object_coll_device  # noqa: PLC0415

        def reduce(payload: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
            dist.all_reduce(payload, op=op, group=pipeline)

        norm = local if has_grads else None  # a rank without gradients takes no part
        device = _get_object_coll_device(pipeline)  # pragma: no mutate
        total, flags, _ = combine(norm, flags, [], norm_type, device, reduce)
    _, empty, refused, early = flags
    if problem is not None:
        raise ValueError(problem)
    if refused:  # the ranks of another stage refused theirs
        raise ValueError(_OTHER_STAGE)
    if early:
        raise RuntimeError(
            "pipeline_clip_grad_norm_ was called before PipelineTie.reduce_grads(): a copy of "
            "the tied weight but the first still holds its part of the gradient, which the norm "
            "would leave out; call tie.reduce_grads() on every rank first"
        )
    refuse_empty(empty, norm_type)  # on every rank: the flag rode the pipeline's all-reduce
    dtype = torch.promote_types(local.dtype, torch.float32)
    total = torch.zeros((), dtype=dtype) if total is None else total.to(dtype)
    check_finite(total, norm_type, error_if_nonfinite)
    clip_with_norm(by_layout(params), max_norm, total, foreach)
    return total


def _pipeline_group(
    group: dist.ProcessGroup | DeviceMesh | None, tie: PipelineTie | None
) -> dist.ProcessGroup:
    pipeline = _process_group(group, "pipeline_clip_grad_norm_")
    if pipeline is not None:
        return pipeline
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


def agree(params: list[torch.Tensor], groups: list[list[torch.Tensor]]) -> None:
    """Refuse, on every rank, what would leave the ranks of a mesh waiting, or mix its gradients.

    Run under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``. The ranks agree in one all-reduce (MAX)
    over the default group, the one group that every rank knows, even a rank that holds
    nothing on the meshes of the others: ``2 * world_size + 1`` int32. For each rank ``r``
    it carries whether other ranks hold DTensors on a mesh that holds ``r`` and whether ``r``
    holds some, then whether some rank has a plain parameter with a DTensor gradient. Only
    then do the ranks gather the positions of those parameters, which each mesh's ranks must
    have alike (:func:`refuse_mixed`). Every rank raises the same error from what it received.

    Raises:
        ValueError: If a rank holds none of its meshes' DTensors while other ranks of the mesh
            hold some, or from :func:`refuse_mixed`.
    """
    if not dist.is_initialized():
        return  # no DTensor can exist
    from torch.distributed.distributed_c10d import _get_object_coll_device  # noqa: PLC0415

    world, rank = dist.get_world_size(), dist.get_rank()
    # Made on the device where the default group's collectives run.
    with torch.device(_get_object_coll_device()):
        state = torch.zeros(2 * world + 1, dtype=torch.int32)
    parts = [world, world, 1]  # needed of each rank, held by each rank, a flag
    needed, held, flag = torch.split(state, parts)  # views: what they take lands in ``state``
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
    flag[0] = len(mixed)
    dist.all_reduce(state, op=dist.ReduceOp.MAX)
    needed_by, held_by, (any_mixed,) = (part.tolist() for part in torch.split(state, parts))
    if any_mixed:
        refuse_mixed(mixed)
    short = [r for r in range(world) if needed_by[r] > held_by[r]]
    if short:
        raise ValueError(_ABSENT.format(ranks=short))


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
    """Whether a gradient of ``groups`` has no elements and ``norm_type`` refuses one.

    ``inf``, ``-inf`` and a negative p refuse one, as in torch: the largest or smallest
    value, or a sum of negative powers, has no identity to start from. A DTensor gradient
    counts by its whole tensor, which every rank of its mesh knows; an empty shard of a
    nonempty DTensor is not one.
    """
    grads = [p.grad for group in groups for p in group]
    refused = math.isinf(norm_type) or norm_type < 0
    return refused and any(g is not None and not g.numel() for g in grads)


def refuse_empty(empty: bool, norm_type: float) -> None:
    """Raise torch's refusal of an ``inf``, ``-inf`` or negative norm over no elements.

    Call it on every rank with the same ``empty``.

    Raises:
        RuntimeError: If ``empty``.
    """
    if empty:
        raise RuntimeError(_EMPTY.format(norm_type=float(norm_type)))


def total_norm(
    groups: list[list[torch.Tensor]], norm_type: float, foreach: bool | None
) -> tuple[torch.Tensor, bool, str | None]:
    """The norm of the groups' gradients as one vector, a plain tensor; and why it is refused.

    Each mesh's norm is reduced over the mesh's ranks (:func:`mesh_norm`), the plain
    gradients' norm is this rank's, and the groups' norms are combined as torch combines the
    norms of its devices. Whether a gradient without elements makes ``norm_type`` refused
    (:func:`has_empty`) rides every mesh's reduction, so the second value is the same on
    every rank of the meshes. The third value, the error of the first mesh whose ranks
    disagree (:func:`mesh_norm`), is for the caller to raise: every mesh is reduced first,
    so that the ranks of each stay in step.
    """
    empty = has_empty(groups, norm_type)
    norms, problems = [], []
    for group in groups:
        if _is_dtensor(_placed(group[0])):
            norm, empty, problem = mesh_norm(group, norm_type, foreach, empty)
            norms.append(norm)
            problems.append(problem)
        elif not empty:  # torch's norm would raise on this rank alone
            grads = [p.grad for p in group]  # every plain tensor of the group has one
            norms.append(vector_norm(grads, norm_type, foreach))  # type: ignore[arg-type]
    problem = next((problem for problem in problems if problem is not None), None)
    taken = [n for n in norms if n is not None]
    if empty or not taken or problem is not None:
        return torch.tensor(0.0), empty, problem
    device = taken[0].device
    stacked = torch.stack([n.to(device) for n in taken])
    # The 0-"norm" counts the gradients with a nonzero element: the groups' counts add.
    total = stacked.sum() if norm_type == 0 else torch.linalg.vector_norm(stacked, norm_type)
    return total, empty, None


def mesh_norm(
    group: list[torch.Tensor], norm_type: float, foreach: bool | None, empty: bool
) -> tuple[torch.Tensor | None, bool, str | None]:
    """The norm of the gradients of DTensors on one mesh, on every rank; None if none has any.

    Each rank takes the norm of its local shards, counting each replicated shard once and
    leaving out empty shards, and the ranks combine theirs in one all-reduce per mesh
    dimension (:func:`combine`), beside ``empty`` and what every rank must share: the number
    of the mesh's DTensors it passed, the number with a gradient, and the digits of which
    have one (:func:`presence`). The 0-"norm" counts each gradient with a nonzero element
    over the mesh: one all-reduce more. Where the ranks differ in which have a gradient, or
    under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, one more compares them parameter by parameter,
    to name one.

    Returns:
        The norm, whether a rank of the mesh has a gradient without elements that
        ``norm_type`` refuses, and the error to raise where the ranks disagree.
    """
    first = _placed(group[0])
    anchor = first.to_local()  # type: ignore[union-attr]
    mesh = first.device_mesh  # type: ignore[union-attr]
    grads = [p.grad for p in group]
    held = sum(g is not None for g in grads)
    coordinate = mesh.get_coordinate()
    shards = [None if g is None else own_shard(g, coordinate) for g in grads]
    mine = [s for s in shards if s is not None]
    norm = vector_norm(mine, norm_type, foreach) if mine and norm_type != 0 else None
    counts = [len(group), held, *presence(grads)]
    reduce = functools.partial(all_reduce, mesh)
    total, (_, empty), agreed = combine(
        norm, [held > 0, empty], counts, norm_type, anchor.device, reduce
    )
    if not agreed[0]:
        return None, empty, _UNEQUAL  # the flags below would differ in length
    named = _detail() or not all(agreed)  # agreed[0] holds here
    problem = gradient_on_some_ranks(group, mesh) if named else None
    if problem is not None:  # the same on every rank of the mesh: each returns here
        return None, empty, problem
    if total is not None and norm_type == 0:
        # torch's 0-"norm" counts the gradients with a nonzero element: count each over the mesh.
        zero = anchor.new_tensor(False)
        flags = torch.stack([zero if s is None else s.ne(0).any() for s in shards]).int()
        all_reduce(mesh, flags, dist.ReduceOp.MAX)
        total = flags.sum()
    if total is None:
        return None, empty, problem
    # torch's norm has the gradients' dtype: a frozen parameter's does not count.
    dtype = functools.reduce(torch.promote_types, [g.dtype for g in grads if g is not None])
    return total.to(dtype), empty, problem


def presence(grads: list[torch.Tensor | None]) -> list[int]:
    """Which of ``grads`` exist: three 16-bit digits of a 48-bit digest of the pattern.

    The ranks of a mesh compare the digits where they compare their counts (:func:`combine`).
    Two ranks whose gradients exist at different positions give the same digits only where
    BLAKE2b's digests of their patterns agree in 48 bits, 1 chance in 2 ** 48 whatever the
    pattern (a sum weighted by positions misses rank 0 lacking 1 and 4 where rank 1 lacks 2
    and 3; any fixed-size code misses some pattern). Each digit is below 2 ** 16: its square
    summed over fewer than 2 ** 21 ranks is an integer below 2 ** 53, exact in float64.
    """
    pattern = bytes(g is not None for g in grads)
    digest = hashlib.blake2b(pattern, digest_size=6).digest()
    return [int.from_bytes(digest[i : i + 2], "little") for i in range(0, 6, 2)]


def own_shard(grad: torch.Tensor, coordinate: list[int] | None) -> torch.Tensor | None:
    """This rank's part of ``grad`` in the norm: None for a replicated copy or an empty shard.

    A copy is replicated on a mesh dimension where this rank is not the first.
    """
    whole = replicated_partial(grad)
    placements = whole.placements  # type: ignore[attr-defined]
    copy = any(p.is_replicate() and coordinate[i] for i, p in enumerate(placements))  # type: ignore[index]
    local: torch.Tensor = whole.to_local()  # type: ignore[attr-defined]
    return None if copy or not local.numel() else local


def gradient_on_some_ranks(group: list[torch.Tensor], mesh: DeviceMesh) -> str | None:
    """The error for a DTensor of ``group`` with a gradient on some ranks of ``mesh`` only.

    One all-reduce (MAX) per mesh dimension of two flags a parameter: whether a rank has a
    gradient, whether a rank has none. Every rank of the mesh passes as many parameters.
    """
    grads = [p.grad for p in group]
    anchor = _placed(group[0]).to_local()  # type: ignore[union-attr]
    flags = anchor.new_tensor(
        [[int(g is not None) for g in grads], [int(g is None) for g in grads]],
        dtype=torch.int32,
    )
    all_reduce(mesh, flags, dist.ReduceOp.MAX)
    somewhere, nowhere = flags.bool()
    both = somewhere & nowhere
    return _missing(group[int(both.int().argmax())]) if both.any() else None


def combine(
    norm: torch.Tensor | None,
    flags: list[bool],
    counts: list[int],
    norm_type: float,
    device: torch.device | str,
    reduce: Callable[[torch.Tensor, dist.ReduceOp.RedOpType], None],
) -> tuple[torch.Tensor | None, list[bool], list[bool]]:
    """The norm over the ranks of each rank's ``norm``, in the one all-reduce ``reduce``.

    Each rank adds its part, in float64: for a p-norm the p-th power of its norm, to a SUM
    (for the 0-"norm", a count, the count itself); for ``inf`` and ``-inf`` its norm signed as
    ``norm_type``, to a MAX, whose absolute value is then the largest or the smallest norm. A
    rank without a norm adds the reduction's identity, so that it takes no part (``0 ** p``
    is infinite for a negative p). Beside the part ride whether it is nan (gloo's MAX may
    drop one), a one (under SUM, their sum is the number of ranks), ``flags``, the first of
    which says whether the rank has a gradient, and ``counts``, which must be equal on every
    rank: each with its negative under MAX, its square under SUM. Each count is a natural
    number whose square times the number of ranks is below ``2 ** 53``, so that float64 adds
    them exactly.

    Returns:
        The norm (None where no rank has a gradient), for each flag whether some rank set
        it, and for each count whether every rank has the same.
    """
    infinite = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    with torch.device(device):
        part = torch.tensor(-math.inf if infinite else 0.0, dtype=torch.float64)
        if norm is not None:
            part = norm.to(part)
            if infinite:
                part = part.copysign(norm_type)
            elif norm_type != 0:
                part = part.pow(norm_type)
        checks = part.new_tensor(counts)
        spread = -checks if infinite else checks.square()
        head = part.new_tensor([1, *flags])  # a one, whose sum counts the ranks, and the flags
        payload = torch.cat([part[None], part.isnan()[None], head, checks, spread])  # float64
    reduce(payload, op)
    part, nan = payload[:2]
    size, *set_by = payload[2 : 3 + len(flags)].tolist()
    # Each count's sum beside its spread's. The largest equals the smallest; under SUM,
    # size * sum(x ** 2) == sum(x) ** 2, which holds only where every x is the same. Both
    # sides are compared as Python integers: the sums are exact in float64 (the integers are
    # below 2 ** 53), their squares may not be.
    agreed = [
        x == -y if infinite else int(x) ** 2 == int(size) * int(y)
        for x, y in payload[3 + len(flags) :].view(2, -1).T.tolist()
    ]
    some = [bool(x) for x in set_by]
    if not some[0]:
        return None, some, agreed
    total = part.abs() if infinite else part if norm_type == 0 else part.pow(1.0 / norm_type)
    return torch.where(nan > 0, math.nan, total), some, agreed


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
    "(there is no largest or smallest value to take, nor a negative power to add), and "
    "torch.nn.utils.clip_grad_norm_ refuses it too. Leave the parameter out or set its grad "
    "to None, or clip with a positive p-norm such as norm_type=2.0"
)

_OTHER_STAGE = (
    "pipeline_clip_grad_norm_: the ranks of another stage refused their gradients, so no "
    "rank clips; the error on those ranks says which gradient and what to do"
)

_UNEQUAL = (
    "clip_grad_norm_: the ranks of a device mesh passed different numbers of DTensor "
    "parameters on it (a plain parameter with a DTensor gradient counts on its gradient's "
    "mesh). Pass the same parameters on every rank, such as model.parameters(), "
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
