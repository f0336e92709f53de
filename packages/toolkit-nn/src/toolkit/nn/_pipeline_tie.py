"""PipelineTie: one tied module whose copies sit on several pipeline stages, kept equal."""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from toolkit.nn._common import _describe, _gather_objects, _is_dtensor
from toolkit.nn._tied_linear import TiedLinear

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["PipelineTie"]


class PipelineTie:
    """The copies of a TiedLinear's tied module on several pipeline stages, kept equal.

    Split by deep copies, a tied language model holds its embedding on the first stage and on
    the last, each copy under the model's qualified name. PipelineTie makes them one weight:
    it broadcasts the first copy at set-up (``broadcast()``), sums the copies' gradients
    after the schedule's ``step`` (``reduce_grads()``, one ``all_reduce`` per step), and
    ``check()`` names the first difference. Every rank of ``group`` constructs it and calls
    its methods; ranks without a copy take part with nothing to add. The
    [pipeline parallelism guide][pipeline-parallelism-with-a-tied-head] shows the training
    loop, checkpoints, data parallelism and the schedules covered.

    Args:
        stages: This rank's stage modules (one, or several for looped and V-shaped
            schedules), as passed to ``PipelineStage``, possibly wrapped by DDP or
            ``fully_shard``.
        group: The pipeline's ranks in stage order (the first copy is the source), or only
            those holding copies: a process group or a 1-D DeviceMesh such as
            ``mesh["pp"]``. Default: the default process group.

    Raises:
        ValueError: On every rank of ``group``, if a stage's TiedLinear reads a module not
            registered in that stage, no TiedLinear is found, the copies differ in shape,
            dtype or local shard shape, two stages of a rank share one weight object, a tied
            module has parameters besides its weight, two ranks hold the same stages (the
            default group under data parallelism: pass the pipeline's group), or a live
            PipelineTie keeps a copy already. On a rank outside ``group``, saying so.

    Added in version v3.58.0.

    Examples:
        On every rank of a two-stage pipeline, ``stage`` its deep copy of the model:

        >>> from toolkit.nn import PipelineTie
        >>> tie = PipelineTie(stage)  # doctest: +SKIP
        >>> schedule.step(inputs, target=targets)  # doctest: +SKIP
        >>> tie.reduce_grads()  # doctest: +SKIP
        >>> optimizer.step()  # doctest: +SKIP
    """

    names: tuple[str, ...]
    """The qualified names of the tied modules, the same in every stage."""

    group: dist.ProcessGroup
    """The process group of the tie: the pipeline's ranks, or only those holding copies."""

    def __init__(
        self,
        stages: nn.Module | Sequence[nn.Module],
        group: dist.ProcessGroup | DeviceMesh | None = None,
    ) -> None:
        modules = [stages] if isinstance(stages, nn.Module) else list(stages)
        modules = [_unwrap(m) for m in modules]
        self.group = _process_group(group)
        self._rank = dist.get_rank(self.group)
        if self._rank < 0:
            raise ValueError(
                f"PipelineTie was set up on global rank {dist.get_rank()}, which is not a rank "
                "of its group; set it up on the ranks of the group only, each with the group of "
                'its own pipeline, such as group=mesh["pp"]'
            )
        problem, local_names = _local_ties(modules)
        gathered = _gather_objects((problem, local_names), self.group)
        for rank, (rank_problem, _) in enumerate(gathered):
            if rank_problem is not None:
                raise ValueError(f"PipelineTie refused group rank {rank}'s stages: {rank_problem}")
        self.names = tuple(sorted({n for _, names in gathered for n in names}))
        problem, layouts = _copies_problem(modules, self.names)
        checks = _gather_objects((problem, layouts, _stages_key(modules)), self.group)
        if not self.names:
            raise ValueError(
                "PipelineTie found no TiedLinear in the stages of any rank of the group; "
                "pass the stage modules that hold the tied module and the TiedLinear head"
            )
        for rank, (rank_problem, _, _) in enumerate(checks):
            if rank_problem is not None:
                raise ValueError(f"PipelineTie refused group rank {rank}'s stages: {rank_problem}")
        _refuse_replicas(checks)
        # Every name is held somewhere: a TiedLinear reads it from a module of its own stage.
        self._holders = {
            name: [rank for rank, (_, held, _) in enumerate(checks) if name in held]
            for name in self.names
        }
        self._layouts: dict[str, _Layout] = {}
        for name, (first, *others) in self._holders.items():
            self._layouts[name] = checks[first][1][name]
            for rank in others:
                _refuse_unlike(name, (first, checks[first][1]), (rank, checks[rank][1]))
        # Each copy with the modules on its path from its stage: an FSDP2 module among them
        # holds the copy's sharded Parameter, which the gradients are added into.
        self._paths = {
            name: [_path(m, name) for m in modules if _holds_copy(m, name)] for name in self.names
        }
        self._copies = {name: [path[-1] for path in paths] for name, paths in self._paths.items()}
        # The weights held by more than one rank are summed in one all_reduce over the group.
        self._shared = [name for name in self.names if len(self._holders[name]) > 1]
        # One buffer for every tied weight: their gradients' common dtype, on this rank's device.
        self._dtype = functools.reduce(
            torch.promote_types, [x.dtype for x in self._layouts.values()]
        )
        weights = [_weight(c) for copies in self._copies.values() for c in copies]
        self._device = _device([*weights, *(p for m in modules for p in m.parameters())])
        # The copies, all but the first, that the last reduce_grads() gave the sum, by id, until
        # a backward on this rank clears them (see reduce_grads).
        self._summed: dict[int, tuple[weakref.ref[nn.Parameter], weakref.ref[torch.Tensor]]] = {}
        self._late_backward = False  # a gradient added into a copy of ``_summed``
        # The tensors that a backward computes a copy's gradient for (the copy's Parameter, or
        # FSDP2's unsharded one) with the hook that clears the summed copies first.
        self._hooked: WeakIdKeyDictionary = WeakIdKeyDictionary()  # each with its hook
        self._watched: WeakIdKeyDictionary = WeakIdKeyDictionary()  # copies with the late check
        self._owners: set[int] = set()  # the FSDP2 modules whose forwards hook the unsharded
        for name in self.names:
            self._gradient_holders(name)  # hooks the FSDP2 modules that hold copies already
            _TIES.update((copy, weakref.ref(self)) for copy in self._copies[name])
        self.broadcast()

    def _weights(self, name: str) -> list[torch.Tensor]:
        return [_local(_weight(module)) for module in self._copies[name]]

    def _source(self, name: str, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """The first copy of the first rank holding one, broadcast into ``tensor`` if shared.

        ``tensor`` is this rank's first copy, or None on a rank without one.
        """
        if name in self._shared:
            layout = self._layouts[name]
            if tensor is None:
                tensor = torch.empty(layout.local_shape, dtype=layout.dtype, device=self._device)
            dist.broadcast(tensor, group=self.group, group_src=self._holders[name][0])
        return tensor

    def broadcast(self) -> None:
        """Make every copy equal to the first copy of the first group rank holding one.

        Called at set-up; call it again after any load that is not a DCP load, such as
        ``load_state_dict`` on one stage or a re-initialisation. Under FSDP2 each rank
        broadcasts its local shard, which covers the same rows on every stage. A rank
        without a copy takes part in the broadcast and keeps nothing.
        """
        with torch.no_grad():
            for name in self.names:
                weights = self._weights(name)
                source = self._source(name, weights[0] if weights else None)
                for weight in weights[1:]:
                    weight.copy_(source)  # type: ignore[arg-type] # weights[0] or its broadcast

    def _is_primary(self, key: tuple[str, int]) -> bool:
        """Whether copy ``key`` is the one whose gradient carries what the copies share."""
        name, index = key
        return index == 0 and self._rank == self._holders[name][0]

    def _gradient_holders(self, name: str) -> list[nn.Parameter]:
        """The Parameters that hold the gradients of ``name``'s copies on this rank.

        FSDP2 adds a copy's gradient into its sharded Parameter. A module it keeps unsharded
        after backward (``set_reshard_after_backward(False)``) shows the unsharded one, so that
        module is resharded first, as it would be after any default backward. The module's
        forwards, after FSDP2 has unsharded it, give the clearing hook (see reduce_grads) to
        the unsharded Parameter, which is read whatever reads it (``TiedLinear.cross_entropy``
        too).
        """
        from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415 - needs distributed

        params = []
        for path in self._paths[name]:
            owner = next((m for m in reversed(path) if isinstance(m, FSDPModule)), None)
            if owner is not None:
                owner.reshard()  # a no-op where it is sharded already
                if id(owner) not in self._owners:
                    hook = functools.partial(_after_unshard, weakref.ref(self))
                    owner.register_forward_pre_hook(hook)  # after FSDP2's, which it prepends
                    self._owners.add(id(owner))
            params.append(_weight(path[-1]))
        return params

    def _holds_sum(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is a copy given the last sum, its gradient the tensor written.

        Not cleared since; a gradient assigned since is the copy's own.
        """
        summed = self._summed.get(id(param))
        return summed is not None and summed[0]() is param and summed[1]() is param.grad

    def _take_back(self) -> None:
        """Clear the copies that the last reduce_grads() gave the sum: the first carries it."""
        for ref, _ in self._summed.values():
            param = ref()
            if param is not None and param.grad is not None:
                _local(param.grad).zero_()
        self._summed.clear()

    def reduce_grads(self) -> None:
        """Sum the copies' gradients, so every copy holds the whole model's gradient.

        Call it on every rank of the group after the schedule's ``step`` (which has run the
        data-parallel reduction) and before clipping and the optimizer step. It makes one
        ``all_reduce`` over the group for all the tied weights that several ranks hold, and
        none when one rank holds every copy; a rank without a copy contributes zeros. A copy
        without a gradient counts as zero and is given the sum; a tied weight whose copies
        all lack a gradient (frozen, or unused this step) keeps ``None`` everywhere.

        It may be called after each of several schedule steps that accumulate into the same
        gradients, or once after the last, or twice: each backward counts once. The first
        copy's gradient carries the sum this method wrote, as the single weight would in one
        process; the other copies hold it for clipping and the optimizer step, until a
        backward on their rank is about to add into a copy, which clears them first, so that
        each then gathers only its own backward passes. Clipping, the optimizer step,
        ``zero_grad`` of any kind and evaluation forwards need no telling; call it after the
        last backward before the step, and before a loss scaler's ``unscale_()``.

        Raises:
            ValueError: On every rank, if a copy's local shape changed since set-up (the
                stages sharded after the tie was built), or if some copies of a tied weight are
                frozen (``requires_grad=False``) and others not, which one Parameter cannot
                be; nothing is changed. When one rank holds every copy of every tied weight,
                the call communicates nothing, and that rank alone raises.
            RuntimeError: On every rank, if a gradient was added into a copy holding the sum
                that no hook of the tie saw coming (a copy under FSDP2 whose module's forward
                did not run since the tie was built), so that the sum could not be cleared
                first. Nothing is changed; zero the gradients and redo the step.
        """
        with torch.no_grad():
            holders = {name: self._gradient_holders(name) for name in self.names}
            sums, present, mixed, problems = self._sums(holders)
            late, changed = problems.tolist()
            if changed:
                raise ValueError(
                    "PipelineTie.reduce_grads() found a copy of a tied weight whose local shape "
                    "is not the one it had when the tie was built: the stages were sharded (by "
                    "fully_shard, say) after it. Build the PipelineTie after wrapping the stages"
                )
            for name in self.names:
                if mixed[name]:
                    raise ValueError(
                        f"PipelineTie.reduce_grads() found copies of the tied weight "
                        f"'{name}.weight' that are frozen (requires_grad=False) beside copies "
                        "that train; in one model the tied weight is one Parameter, frozen or "
                        "trained as a whole. Freeze or unfreeze it in every stage alike, with "
                        f"stage.get_submodule('{name}').weight.requires_grad_(...) on each"
                    )
            if late:
                # Refused once: zeroed and redone, the step counts every copy as its own.
                self._late_backward = False
                self._summed.clear()
                raise RuntimeError(
                    "PipelineTie.reduce_grads() found a gradient added into a tied copy that "
                    "still held the last sum, which could not be cleared first: no hook of the "
                    "tie saw that backward coming (a copy under FSDP2 whose module's forward did "
                    "not run since the tie was built). Zero the gradients and redo this step"
                )
            self._summed.clear()
            for name, total in sums.items():
                if present[name]:  # else frozen, or unused this step: every copy keeps None
                    self._give(name, holders[name], total)

    def _sums(
        self, holders: dict[str, list[nn.Parameter]]
    ) -> tuple[dict[str, torch.Tensor], dict[str, bool], dict[str, bool], torch.Tensor]:
        """The tied weights' sums over the group, in one ``all_reduce``.

        Returns each weight's sum, whether any copy of it had a gradient, whether some of its
        copies are frozen and others not, and how many ranks found a late gradient (see
        reduce_grads) and a copy whose local shape changed.
        """
        sizes = [math.prod(self._layouts[name].local_shape) for name in self._shared]
        # Per shared weight, the ranks with a copy that has a gradient; per weight, those with
        # a frozen copy and those with one that trains, so that every rank that communicates
        # sees a mix anywhere; then the ranks' two problems.
        shared, tied = len(self._shared), len(self.names)
        flat = torch.zeros(
            sum(sizes) + shared + 2 * tied + 2, dtype=self._dtype, device=self._device
        )
        *parts, counts, frozen, trained, problems = torch.split(
            flat, [*sizes, shared, tied, tied, 2]
        )
        changed = False
        sums: dict[str, torch.Tensor] = {}
        present: dict[str, bool] = {}
        kinds: dict[str, tuple[bool, bool]] = {}
        for name in self.names:
            kinds[name] = (
                any(not p.requires_grad for p in holders[name]),
                any(p.requires_grad for p in holders[name]),
            )
            layout = self._layouts[name]
            if name in self._shared:
                sums[name] = parts[self._shared.index(name)].view(layout.local_shape)
            else:
                sums[name] = flat.new_zeros(layout.local_shape)
            present[name] = any(p.grad is not None for p in holders[name])
            for param in holders[name]:
                if param.grad is None:
                    continue
                grad = _local(param.grad)
                changed = changed or grad.shape != layout.local_shape
                # A copy still holding the sum written last adds nothing: the first holds it.
                if grad.shape == layout.local_shape and not self._holds_sum(param):
                    sums[name].add_(grad)
        counts.copy_(counts.new_tensor([float(present[n]) for n in self._shared]))
        frozen.copy_(frozen.new_tensor([float(kinds[n][0]) for n in self.names]))
        trained.copy_(trained.new_tensor([float(kinds[n][1]) for n in self.names]))
        problems.copy_(problems.new_tensor([float(self._late_backward), float(changed)]))
        if self._shared:
            dist.all_reduce(flat, group=self.group)
        counted, froze, trains = counts.tolist(), frozen.tolist(), trained.tolist()
        present.update((name, counted[i] > 0) for i, name in enumerate(self._shared))
        mixed = {name: froze[i] > 0 and trains[i] > 0 for i, name in enumerate(self.names)}
        return sums, present, mixed, problems

    def _give(self, name: str, params: list[nn.Parameter], total: torch.Tensor) -> None:
        """Write ``total`` into the gradient of each of ``name``'s copies ``params``."""
        for index, param in enumerate(params):
            if param.grad is None:
                param.grad = _like(param, total.clone())  # the copies' one dtype, the sum's
            else:
                _local(param.grad).copy_(total)
            self._see(param)
            if not self._is_primary((name, index)):
                self._summed[id(param)] = (weakref.ref(param), weakref.ref(param.grad))
                self._watch(param)

    def _see(self, tensor: torch.Tensor) -> None:
        """Clear the summed copies before autograd computes a gradient for ``tensor``, once.

        A hook on ``tensor`` runs before autograd adds its gradient into ``.grad``, and also
        where ``torch.autograd.grad`` takes it, as the zero-bubble schedules' weight step
        does before adding it in.
        """
        hook = functools.partial(_before_accumulation, weakref.ref(self))
        if _first_hook(self._hooked, tensor, hook):
            tensor.register_hook(hook)  # type: ignore[no-untyped-call]

    def _watch(self, param: nn.Parameter) -> None:
        """Notice a gradient added into ``param`` while it holds the sum, once per Parameter."""
        hook = functools.partial(_after_accumulation, weakref.ref(self))
        if _first_hook(self._watched, param, hook):
            param.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]

    def duplicates(self) -> Iterator[nn.Parameter]:
        """The copies not counted in a norm over the pipeline: all but the first stage's."""
        for name in self.names:
            for index, module in enumerate(self._copies[name]):
                if not self._is_primary((name, index)):
                    yield _weight(module)

    def check(self) -> None:
        """Verify that every copy equals the first stage's, or name the first difference.

        Each rank compares its copies (its local shards under FSDP2) with the first copy of
        the first group rank holding one, broadcast to it; every rank raises the same error.

        Raises:
            RuntimeError: If a copy differs, naming the tied module, the group rank, the
                copy, the first differing element and both values.
        """
        with torch.no_grad():
            found: str | None = None
            for name in self.names:
                weights = self._weights(name)
                reference = self._source(name, weights[0].clone() if weights else None)
                for index, copy in enumerate(weights):
                    if found is None:
                        found = _first_difference(
                            name,
                            (self._rank, self._holders[name][0]),
                            index,
                            copy,
                            reference,  # type: ignore[arg-type] # weights[0] or its broadcast
                        )
            for problem in _gather_objects(found, self.group):
                if problem is not None:
                    raise RuntimeError(problem)

    def __repr__(self) -> str:
        copies = ", ".join(f"{n}: {len(c)}" for n, c in self._copies.items())
        return (
            f"PipelineTie(names={list(self.names)}, copies_on_this_rank={{{copies}}}, "
            f"group_size={dist.get_world_size(self.group)})"
        )


def _after_unshard(tie: weakref.ref[PipelineTie], module: nn.Module, args: object) -> None:
    """A forward pre-hook of an FSDP2 module holding copies: hook their unsharded weights."""
    live = tie()
    if live is not None and not torch.compiler.is_compiling():
        for copies in live._copies.values():
            for copy in copies:
                live._see(_weight(copy))


def _first_hook(table: WeakIdKeyDictionary, tensor: torch.Tensor, hook: object) -> bool:
    """Whether ``tensor`` takes ``hook``: it needs a gradient and has no hook in ``table`` yet.

    The tensor keeps the hook it got first, so a later call registers nothing.
    """
    return tensor.requires_grad and table.setdefault(tensor, hook) is hook  # type: ignore[no-untyped-call]


def _before_accumulation(tie: weakref.ref[PipelineTie], grad: torch.Tensor) -> None:
    """A tensor hook, before autograd adds into a copy: the summed copies are cleared."""
    live = tie()
    if live is not None:
        live._take_back()


def _after_accumulation(tie: weakref.ref[PipelineTie], param: torch.Tensor) -> None:
    """A post-accumulate-grad hook: a backward into a copy that still holds the last sum."""
    live = tie()
    if live is not None and live._holds_sum(param):
        live._late_backward = True


def _path(stage: nn.Module, name: str) -> list[nn.Module]:
    """The modules from ``stage`` down to its submodule ``name``, both included."""
    modules = [stage]
    for part in name.split("."):
        modules.append(modules[-1].get_submodule(part))
    return modules


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


def _holds_copy(stage: nn.Module, name: str) -> bool:
    """Whether ``stage`` holds a copy of the tied module ``name``.

    A module under that name is a copy if it has parameters or a TiedLinear of the stage reads
    it; a placeholder that other stages keep under the name, such as ``nn.Identity``, is not.
    """
    try:
        module = stage.get_submodule(name)
    except AttributeError:
        return False
    read = any(head.tied_module is module for _, head in _tied_linears(stage))
    return read or any(True for _ in module.parameters())


def _stages_key(stages: list[nn.Module]) -> list[tuple[list[str], list[str]]]:
    """What tells a rank's stages apart: each stage's parameter names and TiedLinear paths."""
    return [
        (sorted(n for n, _ in stage.named_parameters()), sorted(p for p, _ in _tied_linears(stage)))
        for stage in stages
    ]


def _refuse_replicas(checks: list[Any]) -> None:
    """Refuse two ranks that hold the same copies: data-parallel replicas of one stage.

    Ranks without a copy add nothing to the sum, so stages alike there (middle stages that
    number their layers alike) are no replicas that matter.
    """
    seen: dict[str, int] = {}
    for rank, (_, held, key) in enumerate(checks):
        if not held:
            continue
        first = seen.setdefault(repr(key), rank)
        if first != rank:
            raise ValueError(
                f"PipelineTie found the same stages on group ranks {first} and {rank}: its group "
                "holds replicas of a stage, as the default group (the world) does under data "
                "parallelism, and it would sum their tied gradients as the copies of different "
                "stages. Pass the pipeline's group, one rank per stage, such as "
                'group=mesh["pp"]'
            )


def _refuse_unlike(
    name: str, first: tuple[int, dict[str, _Layout]], other: tuple[int, dict[str, _Layout]]
) -> None:
    """Refuse two ranks' copies of ``name`` that differ in shape, dtype or local shard."""
    (rank0, layouts0), (rank1, layouts1) = first, other
    for field, what, fix in (
        ("shape", "shape", "build every stage from the same model"),
        ("dtype", "dtype", "give every stage's copy one dtype, such as with stage.to(dtype)"),
        (
            "local_shape",
            "local shard shape",
            "shard every stage's copy alike over the same data-parallel mesh, as "
            'fully_shard(stage, mesh=mesh["dp"]) does, and pass the pipeline\'s group, such as '
            'group=mesh["pp"]',
        ),
    ):
        if getattr(layouts0[name], field) != getattr(layouts1[name], field):
            raise ValueError(
                f"PipelineTie needs every copy of the tied weights to have one {what}, but "
                f"group rank {rank0} has {_field(layouts0, field)} and group rank {rank1} has "
                f"{_field(layouts1, field)}; {fix}"
            )


class _Layout(NamedTuple):
    """A tied weight as one rank holds it: its global shape, its local shard, its dtype."""

    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: torch.dtype


# The live PipelineTie of each tied copy: a second tie would sum its gradient again.
_TIES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _field(layouts: dict[str, _Layout], field: str) -> dict[str, Any]:
    return {name: getattr(layout, field) for name, layout in layouts.items()}


def _copies_problem(
    stages: list[nn.Module], names: tuple[str, ...]
) -> tuple[str | None, dict[str, _Layout]]:
    """The first problem with this rank's copies, and the layout of each tied weight it holds."""
    layouts: dict[str, _Layout] = {}
    for name in names:
        copies = [stage.get_submodule(name) for stage in stages if _holds_copy(stage, name)]
        for copy in copies:
            kept = _TIES.get(copy)  # type: ignore[no-untyped-call]
            if kept is not None and kept() is not None:
                return (
                    f"its tied module '{name}' ({_describe(copy)}) is kept by another "
                    "PipelineTie already, which sums its gradient too, so it would be counted "
                    "twice; keep using that one, or delete it before building another",
                    {},
                )
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
        weights = [_weight(copy) for copy in copies]
        if len({id(w) for w in weights}) < len(weights):
            return (
                f"two of its stages share one weight object as the tied module '{name}', so "
                "its gradient would be summed twice and left out of the clipping norm; give "
                "each stage its own copy (copy.deepcopy of the whole model, one per stage)",
                {},
            )
        if any(w.shape != weights[0].shape for w in weights[1:]):
            return (
                f"its copies of '{name}' differ in shape; build every stage from the same model",
                {},
            )
        if weights:
            local = _local(weights[0])
            layouts[name] = _Layout(tuple(weights[0].shape), tuple(local.shape), local.dtype)
    return None, layouts


def _device(tensors: Iterable[torch.Tensor]) -> torch.device:
    """The device of the first of ``tensors``; the CPU if there is none."""
    for tensor in tensors:
        return tensor.device
    return torch.device("cpu")


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
            shape=weight.shape,
            stride=weight.stride(),
        )
    return local


def _first_difference(
    name: str, ranks: tuple[int, int], index: int, copy: torch.Tensor, reference: torch.Tensor
) -> str | None:
    """Where ``copy`` first differs from ``reference``, described, or None if nowhere.

    ``copy`` is copy ``index`` on group rank ``ranks[0]``; ``reference`` the first copy on
    group rank ``ranks[1]``.
    """
    differs = (copy != reference).nonzero()
    if len(differs) == 0:
        return None
    at = tuple(int(i) for i in differs[0])
    rank, source = ranks
    return (
        f"the copies of the tied weight '{name}.weight' differ: copy {index} on group rank "
        f"{rank} has {copy[at].item()!r} at index {at}, where the first copy on group rank "
        f"{source} has {reference[at].item()!r} ({len(differs)} of {copy.numel()} elements "
        "differ). Call PipelineTie.reduce_grads() after the schedule's step and before "
        "the optimizer step, and broadcast() after loading a state dict other than with DCP"
    )
