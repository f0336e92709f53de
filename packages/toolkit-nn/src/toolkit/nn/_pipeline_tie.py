"""PipelineTie: one tied module whose copies sit on several pipeline stages, kept equal."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from toolkit.nn._common import _describe, _gather_objects, _is_dtensor, _process_group
from toolkit.nn._tied_linear import TiedLinear

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["PipelineTie"]


class PipelineTie:
    """The copies of a TiedLinear's tied module on several pipeline stages, kept one weight.

    The first copy is the weight: ``reduce_grads()`` moves every copy's gradient into it, the
    optimizer steps it (the others hold no gradient, so no optimizer state), and ``broadcast()``
    copies it to the others. Every rank of ``group`` constructs the tie and calls its methods.
    The [pipeline parallelism guide][pipeline-parallelism-with-a-tied-head] shows the loop.

    Args:
        stages: This rank's stage modules (one, or several for looped and V-shaped
            schedules), as passed to ``PipelineStage``, possibly wrapped by DDP,
            ``torch.compile`` or ``fully_shard``, before their first forward.
        group: The pipeline's ranks in stage order (the first copy is the source), or only
            those holding copies: a process group or a 1-D DeviceMesh such as
            ``mesh["pp"]``. Default: the default process group.

    Raises:
        ValueError: On every rank of ``group``, naming the fix, if a copy cannot be kept (not
            registered, unsharded, with other parameters, shared, unlike the others), there is
            no TiedLinear, or two ranks hold the same stages; on a rank outside it, saying so.

    Added in version v3.58.0.

    Examples:
        On every rank of a pipeline, ``stage`` its deep copy of the model:

        >>> from toolkit.nn import PipelineTie
        >>> tie = PipelineTie(stage)  # doctest: +SKIP
        >>> schedule.step(inputs, target=targets)  # doctest: +SKIP
        >>> tie.reduce_grads()  # doctest: +SKIP
        >>> optimizer.step()  # doctest: +SKIP
        >>> tie.broadcast()  # doctest: +SKIP
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
        modules = [_unwrap(m) for m in ([stages] if isinstance(stages, nn.Module) else stages)]
        self.group = _process_group(group, "PipelineTie") or dist.group.WORLD  # type: ignore[assignment]
        self._rank = dist.get_rank(self.group)
        if self._rank < 0:
            raise ValueError(
                f"PipelineTie was set up on global rank {dist.get_rank()}, which is not a rank "
                "of its group; set it up on the ranks of the group only, each with the group of "
                'its own pipeline, such as group=mesh["pp"]'
            )
        gathered = _gather_objects(_local_ties(modules), self.group)
        _refuse_problems(gathered)
        self.names = tuple(sorted({n for _, names in gathered for n in names}))
        # Each copy's path; under fully_shard its Parameter now is the sharded one, which trains.
        self._paths = {n: [_path(m, n) for m in modules if _holds_copy(m, n)] for n in self.names}
        problem, layouts = _copies_problem(self._paths)
        key = [
            (sorted(dict(m.named_parameters())), sorted(dict(_tied_linears(m)))) for m in modules
        ]
        checks = _gather_objects((problem, layouts, key), self.group)
        if not self.names:
            raise ValueError(
                "PipelineTie found no TiedLinear in the stages of any rank of the group; "
                "pass the stage modules that hold the tied module and the TiedLinear head"
            )
        _refuse_problems(checks)
        _refuse_replicas(checks)
        # Per name, every copy's group rank and layout in group-rank order; the first is the weight.
        copies = {
            n: [(r, x) for r, (_, held, _) in enumerate(checks) for x in held.get(n, ())]
            for n in self.names
        }
        _refuse_unlike(copies)
        self._first = {n: held[0][0] for n, held in copies.items()}
        self._layouts = {n: held[0][1] for n, held in copies.items()}
        self._copies = {n: [len(h.get(n, ())) for _, h, _ in checks] for n in self.names}
        self._shared = {n for n, held in copies.items() if held[-1][0] != self._first[n]}
        self._params = {
            n: [p[-1].get_parameter("weight") for p in ps] for n, ps in self._paths.items()
        }
        dtype = functools.reduce(torch.promote_types, [x.dtype for x in self._layouts.values()])
        # The buffer of reduce_grads() also carries checksum bytes, 0 to 255, which float8 rounds.
        self._dtype = torch.float32 if dtype.itemsize == 1 else dtype
        params = [p for m in modules for p in m.parameters()]
        self._device = params[0].device if params else torch.get_default_device()
        self.broadcast()
        self._late = False  # whether a copy but the first held a gradient at broadcast()

    def _source(self, name: str, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """The weight's local value: ``tensor``, this rank's first copy or None, broadcast to."""
        if name in self._shared:
            copy = self._layouts[name]  # the first copy's
            if tensor is None:
                tensor = torch.empty(copy.local_shard_shape, dtype=copy.dtype, device=self._device)
            dist.broadcast(tensor, group=self.group, group_src=self._first[name])
        return tensor

    @torch.no_grad()
    def broadcast(self) -> None:
        """Make every copy equal to the first: on every rank, after each ``optimizer.step()``.

        Also after a loss scaler's skipped step and any load other than with DCP; before
        ``zero_grad()``, so that the next ``reduce_grads()`` can tell a gradient it missed. One
        ``broadcast`` per tied weight that several ranks hold (its local shard under FSDP2).
        """
        self._late = any(p.grad is not None for p in self.duplicates())
        for name in self.names:
            weights = [_local(p) for p in self._params[name]]
            source = self._source(name, weights[0] if weights else None)
            for weight in weights[1:]:
                weight.copy_(source)  # type: ignore[arg-type] # weights[0] or its broadcast

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Move every copy's gradient into the first copy, which then holds their sum.

        On every rank after the schedule's ``step``, before unscaling, clipping and the optimizer;
        after each step that accumulates, once, or twice: nothing moves twice. One ``all_reduce``
        (none when one rank holds every copy): the gradients' local shards and checks.

        Raises:
            ValueError: On every rank, if a copy's Parameter was replaced since set-up, or a
                tied weight is frozen in some copies only.
            RuntimeError: On every rank, if the copies differ (no ``broadcast()`` after a step
                or load), or a copy but the first held a gradient at ``broadcast()``.
                Nothing is changed; where one rank holds every copy, it alone raises.
        """
        # One buffer: the gradients several ranks hold, each name's flags and checksums, 2 more.
        shared = [n for n in self.names if n in self._shared]
        shapes = [self._layouts[n].local_shard_shape for n in shared]
        checks = {n: 3 + 8 * sum(self._copies[n]) for n in self.names}
        grads = [math.prod(shape) for shape in shapes]
        size = sum(grads) + sum(checks.values()) + 2
        flat = torch.zeros(size, dtype=self._dtype, device=self._device)
        *parts, problems = torch.split(flat, [*grads, *checks.values(), 2])
        totals = {n: p.view(shape) for n, p, shape in zip(shared, parts, shapes, strict=False)}
        replaced = False
        for name, check in zip(self.names, parts[len(shared) :], strict=True):
            params = self._params[name]
            trains = [p.requires_grad for p in params]
            held = any(p.grad is not None for p in params)
            check[:3] = check.new_tensor([held, not all(trains), any(trains)])
            start = 3 + 8 * sum(self._copies[name][: self._rank])
            for path, param in zip(self._paths[name], params, strict=True):
                replaced = replaced or _replaced(path, param)
                check[start : start + 8] = _checksum(_local(param))
                start += 8
                if param.grad is not None and name in totals:
                    totals[name].add_(_local(param.grad).to(self._dtype))  # float8 as well
                elif param.grad is not None:  # held here alone: no buffer on other ranks
                    totals[name] = _local(param.grad).to(self._dtype, copy=True)
        problems.copy_(problems.new_tensor([replaced, self._late]))
        if shared:
            dist.all_reduce(flat, group=self.group)
        found = iter(flat[sum(grads) :].tolist())  # the one host sync
        checked = {name: list(itertools.islice(found, n)) for name, n in checks.items()}
        self._refuse(checked, *found)  # and whether a copy was replaced, or late
        for name, (counted, *_) in checked.items():
            if not counted:  # no rank has a gradient: every copy keeps None
                continue
            params = self._params[name]
            keeps = self._rank == self._first[name]  # this rank's first copy is the weight
            for param in params[1:] if keeps else params:
                param.grad = None
            if keeps and params[0].grad is None:
                params[0].grad = torch.zeros_like(params[0])  # a DTensor as the weight is
            if keeps:
                _local(params[0].grad).copy_(totals[name])  # type: ignore[arg-type]

    def _refuse(self, checked: dict[str, list[float]], replaced: float, late: float) -> None:
        """Raise the first problem that the ranks found, the same on every rank."""
        if replaced:
            raise ValueError(
                "PipelineTie.reduce_grads() found a tied copy whose Parameter is not the one the "
                "tie was built with (fully_shard after it, say); build it after wrapping the stages"
            )
        for name, (_, frozen, trained, *sums) in checked.items():
            if frozen and trained:
                raise ValueError(
                    f"PipelineTie.reduce_grads() found copies of the tied weight '{name}.weight' "
                    "frozen beside copies that train; one Parameter in one model, it is frozen "
                    f"or not: call stage.get_submodule('{name}').weight.requires_grad_(...) on "
                    "every stage alike"
                )
            if any(sums[i : i + 8] != sums[:8] for i in range(8, len(sums), 8)):
                raise RuntimeError(
                    f"PipelineTie.reduce_grads() found the copies of '{name}.weight' unequal: "
                    "call tie.broadcast() after every optimizer.step() and non-DCP load; this "
                    "step read an old copy, so zero the gradients, broadcast and redo it"
                )
        if late:
            self._late = False  # told once: the step redone is right
            raise RuntimeError(
                "PipelineTie.reduce_grads() found that a copy of a tied weight but the first "
                "held a gradient at the last broadcast(): a backward ran after reduce_grads(), "
                "or none was called, so the optimizer step missed that part of the tied "
                "gradient; call reduce_grads() after the last backward and broadcast() right "
                "after optimizer.step(), and redo that step"
            )

    def duplicates(self) -> Iterator[nn.Parameter]:
        """The copies not counted in a norm over the pipeline: all but the first stage's."""
        for name, params in self._params.items():
            yield from params[1:] if self._rank == self._first[name] else params

    @torch.no_grad()
    def check(self) -> None:
        """Verify that every copy (its local shard) equals the first, on every rank.

        Raises:
            RuntimeError: On every rank, if a copy differs, naming the weight, the group rank,
                the copy, the first differing element and both values.
        """
        found: list[str] = []
        for name in self.names:
            weights = [_local(p) for p in self._params[name]]
            first = self._source(name, weights[0].clone() if weights else None)
            if first is None:  # no copy here, nor shared: nothing to compare
                continue
            for index, copy in enumerate(weights):
                differs = (copy != first).nonzero()
                if len(differs) and not found:
                    at = tuple(differs[0].tolist())
                    found.append(
                        f"the copies of the tied weight '{name}.weight' differ: copy {index} "
                        f"on group rank {self._rank} has {copy[at].item()!r} at index {at}, "
                        f"where the first copy on group rank {self._first[name]} has "
                        f"{first[at].item()!r} ({len(differs)} of {copy.numel()} elements "
                        "differ). Call PipelineTie.broadcast() after every optimizer step and "
                        "after loading a state dict other than with DCP"
                    )
        for problems in _gather_objects(found, self.group):
            if problems:
                raise RuntimeError(problems[0])

    def __repr__(self) -> str:
        copies = ", ".join(f"{n}: {len(c)}" for n, c in self._params.items())
        return (
            f"PipelineTie(names={list(self.names)}, copies_on_this_rank={{{copies}}}, "
            f"group_size={dist.get_world_size(self.group)})"
        )


def _path(stage: nn.Module, name: str) -> list[nn.Module]:
    """The modules from ``stage`` down to its submodule ``name``, both included."""
    parts = itertools.accumulate(name.split("."), lambda a, b: f"{a}.{b}")
    return [stage, *map(stage.get_submodule, parts)]


def _unwrap(module: nn.Module) -> nn.Module:
    """The module inside DDP and ``torch.compile``, whose qualified names are the whole model's."""
    from torch._dynamo.eval_frame import OptimizedModule  # noqa: PLC0415 - loads the compiler
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415 - needs distributed

    while isinstance(module, DistributedDataParallel | OptimizedModule):
        module = module.module if isinstance(module, DistributedDataParallel) else module._orig_mod
    return module


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
            if "_orig_mod" in name.split("."):
                return (
                    f"its stage {index} holds its tied module as '{name}', inside a wrapper of "
                    "torch.compile, under a name that the other stages' copies do not have; "
                    "compile that module in place with its .compile(), or the whole stage",
                    [],
                )
            names.append(name)
    return None, names


def _refuse_problems(gathered: list[Any]) -> None:
    """Raise the first group rank's problem, the first item of what each rank gathered."""
    for rank, (problem, *_) in enumerate(gathered):
        if problem is not None:
            raise ValueError(f"PipelineTie refused group rank {rank}'s stages: {problem}")


def _holds_copy(stage: nn.Module, name: str) -> bool:
    """Whether ``stage`` holds a copy of ``name``, not a placeholder such as ``nn.Identity``."""
    try:
        module = stage.get_submodule(name)
    except AttributeError:
        return False
    read = any(head.tied_module is module for _, head in _tied_linears(stage))
    return read or any(True for _ in module.parameters())


def _refuse_replicas(checks: list[Any]) -> None:
    """Refuse two ranks with copies whose stages have the same parameters and TiedLinears."""
    seen: dict[str, int] = {}
    for rank, (_, held, key) in enumerate(checks):
        first = seen.setdefault(repr(key), rank) if held else rank
        if first != rank:
            raise ValueError(
                f"PipelineTie found the same stages on group ranks {first} and {rank}: its group "
                "holds replicas of a stage, as the default group (the world) does under data "
                "parallelism, and it would sum their tied gradients as the copies of different "
                'stages. Pass the pipeline\'s group, one rank per stage, such as group=mesh["pp"]'
            )


_UNLIKE = {  # a _Layout's field and the fix
    "shape": "build every stage from the same model",
    "dtype": "give every stage's copy one dtype, such as with stage.to(dtype)",
    "local_shard_shape": "shard every stage's copy alike over the same data-parallel mesh, as "
    'fully_shard(stage, mesh=mesh["dp"]) does, and pass the pipeline\'s group, such as '
    'group=mesh["pp"]',
}


def _refuse_unlike(copies: dict[str, list[tuple[int, _Layout]]]) -> None:
    """Refuse copies of a name (group rank, layout) that differ in shape, dtype or shard."""
    for name, ((rank0, first), *others) in copies.items():
        for (field, fix), (rank, layout) in itertools.product(_UNLIKE.items(), others):
            want, got = getattr(first, field), getattr(layout, field)
            if got != want:
                raise ValueError(
                    f"PipelineTie needs every copy of the tied weight '{name}.weight' to have one "
                    f"{field.replace('_', ' ')}, but group rank {rank0} has {want} and group rank "
                    f"{rank} has {got}; {fix}"
                )


class _Layout(NamedTuple):
    """A copy of a tied weight as a rank holds it: its shape, local shard and dtype."""

    shape: tuple[int, ...]
    local_shard_shape: tuple[int, ...]
    dtype: torch.dtype


def _copies_problem(
    paths_by_name: dict[str, list[list[nn.Module]]],
) -> tuple[str | None, dict[str, list[_Layout]]]:
    """The first problem with this rank's copies, and the layout of each copy it holds."""
    layouts: dict[str, list[_Layout]] = {}
    for name, paths in paths_by_name.items():
        for problem in filter(None, (_copy_problem(name, path) for path in paths)):
            return problem, {}
        weights = [path[-1].get_parameter("weight") for path in paths]
        if len({id(w) for w in weights}) < len(weights):
            return (
                f"two of its stages share one weight object as the tied module '{name}', so "
                "its gradient would be summed twice and left out of the clipping norm; give "
                "each stage its own copy (copy.deepcopy of the whole model, one per stage)",
                {},
            )
        if weights:
            layouts[name] = [
                _Layout(tuple(w.shape), tuple(_local(w).shape), w.dtype) for w in weights
            ]
    return None, layouts


def _copy_problem(name: str, path: list[nn.Module]) -> str | None:
    """What makes the copy at the end of ``path`` one that the tie cannot keep, or None."""
    copy = path[-1]
    described = f"its tied module '{name}' ({_describe(copy)})"
    if others := sorted(n for n, _ in copy.named_parameters() if n != "weight"):
        return (
            f"{described} has parameters other than its weight: {others}; only the weight is "
            "shared between stages, so tie to a module whose only parameter is the weight"
        )
    weight = getattr(copy, "weight", None)
    if not isinstance(weight, nn.Parameter):
        return (
            f"{described} has a weight that is not a Parameter but a {type(weight).__name__}; "
            "the stages share a trained weight, so tie to a module whose weight is a "
            "registered Parameter"
        )
    if _sharded(path) and not _is_dtensor(weight):
        return (
            f"{described} is under fully_shard but unsharded, as a forward leaves it; build "
            "the PipelineTie after fully_shard and before the stages' first forward"
        )
    return None


def _sharded(path: list[nn.Module]) -> bool:
    """Whether a module of ``path`` is under ``fully_shard``, which shards the copy's weight."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415 - needs distributed

    return any(isinstance(module, FSDPModule) for module in path)


def _replaced(path: list[nn.Module], param: nn.Parameter) -> bool:
    """Whether ``param``, the copy's Parameter at set-up, is no longer the one that trains."""
    # Under fully_shard the module shows the unsharded one between its forward and reshard.
    return not _is_dtensor(param) if _sharded(path) else path[-1].weight is not param


def _checksum(tensor: torch.Tensor) -> torch.Tensor:
    """The int64 sum of ``tensor``'s elements as integers, in 8 bytes: exact in any sum."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.itemsize]
    total = tensor.detach().view(bits).sum()  # any strides and storage offset; int64
    return (total >> torch.arange(0, 64, 8, device=tensor.device)) & 255


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]
