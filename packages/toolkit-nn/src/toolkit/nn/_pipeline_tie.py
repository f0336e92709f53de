"""PipelineTie: one tied module whose copies sit on several pipeline stages, kept equal."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from toolkit.nn._tied_linear import TiedLinear
from toolkit.nn._tied_linear_diagnosis import _describe, _is_dtensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["PipelineTie", "pipeline_clip_grad_norm_"]


class PipelineTie:
    """The copies of a TiedLinear's tied module on several pipeline stages, kept equal.

    A tied language model needs its embedding on the first pipeline stage, for the lookup,
    and on the last, for the head. Splitting the model the usual way (a deep copy per stage,
    with the modules of other stages removed) gives each of those stages its own registered
    copy of the embedding under the same qualified name as in the whole model, and the deep
    copy re-ties the last stage's TiedLinear to that stage's copy. PipelineTie keeps those
    copies one weight:

    * At set-up it refuses a stage whose TiedLinear reads a module that is not registered
      in that stage (such a weight would be in neither ``parameters()`` nor
      ``state_dict()``: never trained, synchronised or saved), and makes the copies equal
      by broadcasting the first one (``broadcast()``).
    * ``reduce_grads()``, called after the pipeline schedule's ``step`` and before
      clipping and the optimizer step, sums the copies' gradients, so that every copy holds
      the gradient of the single-process model and takes the same update: one
      ``all_reduce`` per tied weight per step, none when one rank holds every copy (looped
      and V-shaped schedules put several stages on one rank).
    * ``check()`` verifies the copies agree and names the first difference.

    The sum comes after the data-parallel reduction, which the schedule's ``step`` already
    ran: DDP all-reduces (averages) each copy's gradient within its own replica group and
    FSDP2 reduce-scatters it. Summing averaged gradients over the stages is the average of
    the sums, so the order does not change the result under DDP. Under FSDP2 each copy's
    gradient is a DTensor sharded over the same data-parallel mesh with the same shape, so
    the local shard on the first stage and the one on the last stage cover the same rows,
    and their sum is the right shard. (Megatron-LM#844 went wrong exactly here: its
    reduce-scatter split one flat buffer per stage, so the two copies' shards covered
    different parts of the weight.)

    The copy used as the source of ``broadcast()`` and counted by
    ``pipeline_clip_grad_norm_`` is the first copy of group rank 0: list the ranks of
    ``group`` in stage order so that it is the first stage's. Only the module's ``weight``
    is tied, as TiedLinear reads only the weight, so a tied module with other parameters is
    refused: their copies would differ and a checkpoint would keep one of them.

    A DCP checkpoint stores the tied weight once: every copy has the same qualified name, and
    DCP keeps one of the identical entries that several ranks write. Loading it restores
    every copy. After any other load (``load_state_dict``, re-initialisation), call
    ``broadcast()`` again.

    Args:
        stages: This rank's stage modules that hold a copy of the tied module (one, or
            several for looped and V-shaped schedules): the modules passed to
            ``PipelineStage``, possibly wrapped by DDP or ``fully_shard``. The names of the
            tied modules are found from the TiedLinear attributes of any of the stages in
            ``group``.
        group: The process group of the ranks holding the copies, in stage order, or a 1-D
            DeviceMesh of them (such as ``mesh["pp"]`` for two stages). The default is the
            default process group. Every rank of the group must construct the PipelineTie.

    Raises:
        ValueError: If a stage's TiedLinear reads a module not registered in that stage, if
            no TiedLinear is found on any rank, if a stage on this rank lacks a tied module
            that the group ties, if the copies' weights differ in shape, or if a tied module
            has parameters other than its weight. Every rank of the group raises the same
            error.

    Added in version v3.58.0.

    Examples:
        On every rank of a two-stage pipeline, where ``stage`` is the rank's deep copy of
        the whole model (see the pipeline-parallel guide for the whole script):

        >>> from toolkit.nn import PipelineTie
        >>> tie = PipelineTie(stage)  # doctest: +SKIP
        >>> schedule.step(inputs, target=targets)  # doctest: +SKIP
        >>> tie.reduce_grads()  # doctest: +SKIP
        >>> optimizer.step()  # doctest: +SKIP
    """

    names: tuple[str, ...]
    """The qualified names of the tied modules, the same in every stage."""

    group: dist.ProcessGroup
    """The process group of the ranks that hold the copies."""

    def __init__(
        self,
        stages: nn.Module | Sequence[nn.Module],
        group: dist.ProcessGroup | DeviceMesh | None = None,
    ) -> None:
        modules = [stages] if isinstance(stages, nn.Module) else list(stages)
        modules = [_unwrap(m) for m in modules]
        self.group = _process_group(group)
        problem, local_names = _local_ties(modules)
        # all_gather_object fills every slot of these lists.
        size = dist.get_world_size(self.group)
        gathered: list[tuple[str | None, list[str]]] = [None] * size  # type: ignore[list-item]
        dist.all_gather_object(gathered, (problem, local_names), group=self.group)
        for rank, (rank_problem, _) in enumerate(gathered):
            if rank_problem is not None:
                raise ValueError(f"PipelineTie refused group rank {rank}'s stages: {rank_problem}")
        self.names = tuple(sorted({n for _, names in gathered for n in names}))
        problem, shapes = _copies_problem(modules, self.names)
        checks: list[tuple[str | None, dict[str, tuple[int, ...]]]] = [None] * size  # type: ignore[list-item]
        dist.all_gather_object(checks, (problem, shapes), group=self.group)
        if not self.names:
            raise ValueError(
                "PipelineTie found no TiedLinear in the stages of any rank of the group; "
                "pass the stage modules that hold the tied module and the TiedLinear head"
            )
        for rank, (rank_problem, rank_shapes) in enumerate(checks):
            if rank_problem is not None:
                raise ValueError(f"PipelineTie refused group rank {rank}'s stages: {rank_problem}")
            if rank_shapes != checks[0][1]:
                raise ValueError(
                    f"PipelineTie needs every copy of the tied weights to have one shape, but "
                    f"group rank 0 has {checks[0][1]} and group rank {rank} has {rank_shapes}; "
                    "build every stage from the same model"
                )
        self._copies = {
            name: [m.get_submodule(name) for m in modules if _has_module(m, name)]
            for name in self.names
        }
        self.broadcast()

    def _weights(self, name: str) -> list[torch.Tensor]:
        return [_local(_weight(module)) for module in self._copies[name]]

    @torch.no_grad()
    def broadcast(self) -> None:
        """Make every copy equal to the first copy of group rank 0, the first stage's.

        Called at set-up; call it again after any load that is not a DCP load, such as
        ``load_state_dict`` on one stage or a re-initialisation. Under FSDP2 each rank
        broadcasts its local shard, which covers the same rows on every stage.
        """
        for name in self.names:
            first, *others = self._weights(name)
            if dist.get_world_size(self.group) > 1:
                dist.broadcast(first, group=self.group, group_src=0)
            for other in others:
                other.copy_(first)

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Sum the copies' gradients, so every copy holds the whole model's gradient.

        Call it once per step, after the schedule's ``step`` (which has run the
        data-parallel reduction) and before clipping and the optimizer step. It makes one
        ``all_reduce`` per tied weight over the group, and none when the group has one rank.
        A copy without a gradient counts as zero.
        """
        for name in self.names:
            copies = [_weight(module) for module in self._copies[name]]
            grads = [_local(w.grad) if w.grad is not None else None for w in copies]
            present = [g for g in grads if g is not None]
            total = present[0] if present else torch.zeros_like(_local(copies[0]))
            for other in present[1:]:
                total.add_(other)
            if dist.get_world_size(self.group) > 1:
                dist.all_reduce(total, group=self.group)
            for weight, local in zip(copies, grads, strict=True):
                if local is None:
                    weight.grad = _like(weight, total.clone())
                elif local is not total:
                    local.copy_(total)

    def duplicates(self) -> Iterator[nn.Parameter]:
        """The copies not counted in a norm over the pipeline: all but group rank 0's first."""
        first = dist.get_rank(self.group) == 0
        for name in self.names:
            copies = self._copies[name]
            for module in copies[1:] if first else copies:
                yield _weight(module)

    @torch.no_grad()
    def check(self) -> None:
        """Verify that every copy equals the first stage's, or name the first difference.

        Each rank compares its copies (its local shards under FSDP2) with group rank 0's
        first copy, broadcast to it; every rank raises the same error.

        Raises:
            RuntimeError: If a copy differs, naming the tied module, the group rank, the
                copy, the first differing element and both values.
        """
        rank = dist.get_rank(self.group)
        found: str | None = None
        for name in self.names:
            first, *others = self._weights(name)
            reference = first.clone()
            if dist.get_world_size(self.group) > 1:
                dist.broadcast(reference, group=self.group, group_src=0)
            for index, copy in enumerate([first, *others]):
                if found is None:
                    found = _first_difference(name, rank, index, copy, reference)
        problems: list[str | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(problems, found, group=self.group)
        for problem in problems:
            if problem is not None:
                raise RuntimeError(problem)

    def __repr__(self) -> str:
        copies = ", ".join(f"{n}: {len(c)}" for n, c in self._copies.items())
        return (
            f"PipelineTie(names={list(self.names)}, copies_on_this_rank={{{copies}}}, "
            f"group_size={dist.get_world_size(self.group)})"
        )


def pipeline_clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    group: dist.ProcessGroup | DeviceMesh | None = None,
    tie: PipelineTie | None = None,
) -> torch.Tensor:
    """Clip the gradients of a pipeline's stages by their total norm, counting a tie once.

    The total norm is the one ``torch.nn.utils.clip_grad_norm_`` gives for the whole model
    in one process: each rank takes the norm of its stages' gradients (the full gradients
    of DTensor parameters, as ``clip_grad_norm_`` does), leaving out the duplicate copies of
    ``tie`` (``PipelineTie.duplicates()``), and the ranks of the pipeline combine theirs.
    Call it after ``PipelineTie.reduce_grads()``, on every rank of the pipeline, including
    the stages without a copy (they pass ``tie=None``).

    Args:
        parameters: This rank's parameters, of every stage it holds.
        max_norm: The largest total norm allowed.
        norm_type: The p of the p-norm; ``inf`` for the largest absolute value.
        group: The process group of one pipeline (every stage, in any order), or a 1-D
            DeviceMesh of it. The default is the default process group.
        tie: The PipelineTie of this rank, if it holds a copy of a tied module.

    Returns:
        The total norm of the gradients, before clipping.

    Added in version v3.58.0.
    """
    params = [p for p in parameters if p.grad is not None]
    skipped = {id(p) for p in tie.duplicates()} if tie is not None else set()
    grads = [p.grad for p in params if id(p) not in skipped and p.grad is not None]
    # Without gradients the norm is tensor(0.0), as for clip_grad_norm_.
    local = torch.nn.utils.get_total_norm(grads, norm_type)
    if _is_dtensor(local):
        local = local.full_tensor()  # type: ignore[attr-defined]
    total = local.detach().to(torch.float32).clone()
    pipeline = _process_group(group)
    if dist.get_world_size(pipeline) == 1:
        pass  # one rank holds the whole pipeline: its norm is the total
    elif math.isinf(norm_type):
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pipeline)
    else:
        total.pow_(norm_type)
        dist.all_reduce(total, group=pipeline)
        total.pow_(1.0 / norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _unwrap(module: nn.Module) -> nn.Module:
    """The module inside DDP, whose qualified names are the whole model's."""
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415 - needs distributed

    return module.module if isinstance(module, DistributedDataParallel) else module


def _process_group(group: dist.ProcessGroup | DeviceMesh | None) -> dist.ProcessGroup:
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415 - needs distributed

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"PipelineTie needs a 1-D DeviceMesh of the pipeline ranks, got a {group.ndim}-D "
                'mesh; pass the pipeline dimension, such as mesh["pp"]'
            )
        return group.get_group()
    return group if group is not None else dist.group.WORLD  # type: ignore[return-value]


def _tied_linears(stage: nn.Module) -> Iterator[tuple[str, TiedLinear]]:
    """Every TiedLinear held as an attribute of a module of ``stage``, with its path."""
    for prefix, module in stage.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, TiedLinear):
                yield (f"{prefix}.{attr}" if prefix else attr), value


def _local_ties(stages: list[nn.Module]) -> tuple[str | None, list[str]]:
    """The names of the modules this rank's TiedLinears read, or the first problem found."""
    names: list[str] = []
    for index, stage in enumerate(stages):
        registered = {id(m): n for n, m in stage.named_modules()}
        for path, head in _tied_linears(stage):
            name = registered.get(id(head.tied_module))
            if name is None:
                return (
                    f"its stage {index} has a TiedLinear at '{path}' that reads "
                    f"{_describe(head.tied_module)}, a module not registered in that stage, "
                    "so its weight would be neither trained, synchronised nor saved. Keep the "
                    "tied module in the stage under its name in the whole model (do not set it "
                    "to None or replace it) and let the TiedLinear read that copy, as a deep "
                    "copy of the whole model does",
                    [],
                )
            names.append(name)
    return None, names


def _has_module(stage: nn.Module, name: str) -> bool:
    try:
        stage.get_submodule(name)
    except AttributeError:
        return False
    return True


def _copies_problem(
    stages: list[nn.Module], names: tuple[str, ...]
) -> tuple[str | None, dict[str, tuple[int, ...]]]:
    """The first problem with this rank's copies, and the global shape of each tied weight."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name in names:
        copies = [stage.get_submodule(name) for stage in stages if _has_module(stage, name)]
        if not copies:
            return (
                f"none of its {len(stages)} stage(s) has a module '{name}', which the group "
                "ties; keep the tied module registered under its name in the whole model in "
                "every stage that holds a copy, and leave ranks without a copy out of the group",
                {},
            )
        for copy in copies:
            others = sorted(n for n, _ in copy.named_parameters() if n != "weight")
            if others:
                return (
                    f"its tied module '{name}' ({_describe(copy)}) has parameters other than "
                    f"its weight: {others}; only the weight is shared between stages, so tie "
                    "to a module whose only parameter is the weight",
                    {},
                )
            weight = getattr(copy, "weight", None)
            if not isinstance(weight, nn.Parameter):
                return (
                    f"its tied module '{name}' ({_describe(copy)}) has a weight that is not a "
                    f"Parameter but a {type(weight).__name__}; the stages share a trained "
                    "weight, so tie to a module whose weight is a registered Parameter",
                    {},
                )
        shapes[name] = tuple(_weight(copies[0]).shape)
        for copy in copies[1:]:
            if tuple(_weight(copy).shape) != shapes[name]:
                return (
                    f"its copies of '{name}' differ in shape; build every stage from the same "
                    "model",
                    {},
                )
    return None, shapes


def _weight(module: nn.Module) -> nn.Parameter:
    """``module.weight``, read live: FSDP2 swaps the Parameter between its states."""
    weight = module.weight
    assert isinstance(weight, nn.Parameter)  # checked at set-up
    return weight


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def _like(weight: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient for ``weight``: a DTensor laid out as ``weight`` if it is one."""
    if _is_dtensor(weight):
        from torch.distributed.tensor import DTensor  # noqa: PLC0415 - needs distributed

        return DTensor.from_local(
            local,
            weight.device_mesh,  # type: ignore[attr-defined]
            weight.placements,  # type: ignore[attr-defined]
            run_check=False,
            shape=weight.shape,
            stride=weight.stride(),
        )
    return local


def _first_difference(
    name: str, rank: int, index: int, copy: torch.Tensor, reference: torch.Tensor
) -> str | None:
    differs = (copy != reference).nonzero()
    if len(differs) == 0:
        return None
    at = tuple(int(i) for i in differs[0])
    return (
        f"the copies of the tied weight '{name}.weight' differ: copy {index} on group rank "
        f"{rank} has {copy[at].item()!r} at index {at}, where the first copy on group rank 0 "
        f"has {reference[at].item()!r} ({len(differs)} of {copy.numel()} elements differ). "
        "Call PipelineTie.reduce_grads() after every backward and before the optimizer step, "
        "and broadcast() after loading a state dict other than with DCP"
    )
