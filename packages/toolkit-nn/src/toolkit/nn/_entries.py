"""Create the entries of a model's ModuleDefaultDicts: from checkpoint keys, or across ranks."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from toolkit.nn._module_default_dict import ModuleDefaultDict

__all__ = ["create_entries", "sync_entries"]


def create_entries(module: nn.Module, keys: Iterable[str], *, prefix: str = "") -> list[str]:
    """Create the ModuleDefaultDict entries that state-dict ``keys`` name, as loading would.

    A ``torch.distributed.checkpoint`` (DCP) resume loads into the state dict of the model
    as it is: ``sd = model.state_dict(); dcp.load(sd, ...); model.load_state_dict(sd)``. A
    freshly built model has no entries yet, so its state dict names none, DCP plans nothing
    for them and the resumed model would have no entries at all. Call this first with the
    checkpoint's keys, ``dcp.FileSystemReader(path).read_metadata().state_dict_metadata``,
    so that the model's state dict names every entry the checkpoint holds.

    Every ModuleDefaultDict with a factory inside ``module`` (``module`` itself and the dicts
    of entries created on the way included) creates the entries that the keys name, through
    the same code as ``load_state_dict``: a new entry follows the dict's device, dtype and
    training mode, and names that cannot be entries are left for the load to report.

    Args:
        module: The model, before it is wrapped by DDP or FSDP.
        keys: Fully qualified state-dict keys, such as ``"heads.alpha.weight"``.
        prefix: Stripped from each key first; keys without it are ignored. A DCP checkpoint
            saved as ``{"model": model_state_dict}`` has keys such as
            ``"model.heads.alpha.weight"``: pass ``prefix="model."``.

    Returns:
        The qualified names of the entries created, such as ``"heads.alpha"`` or
        ``"outer.x.inner.y"``, in key order (an entry before the entries inside it). A second
        call with the same keys creates nothing and returns ``[]``.

    Raises:
        ValueError: If ``prefix`` is not empty and does not end with ``"."``, or if
            ``module`` is already wrapped by DDP or FSDP, whose parameters are fixed when
            they wrap.
        TypeError: If a factory returns something that is not a Module.

    Added in version v3.58.0.

    Examples:
        >>> import functools
        >>> from torch import nn
        >>> from toolkit.nn import ModuleDefaultDict, create_entries
        >>> model = nn.Module()
        >>> model.heads = ModuleDefaultDict(functools.partial(nn.Linear, 4, 2))
        >>> create_entries(model, ["model.heads.a.weight", "model.heads.b.bias"], prefix="model.")
        ['heads.a', 'heads.b']
        >>> create_entries(model, ["model.heads.a.weight"], prefix="model.")
        []
    """
    if prefix and not prefix.endswith("."):
        raise ValueError(
            f"create_entries prefix {prefix!r} must end with '.', as state-dict keys "
            f"separate names with it; pass prefix={prefix + '.'!r}"
        )
    problem = _wrapped(module)
    if problem is not None:
        raise ValueError(f"create_entries: {problem}")
    stripped = [key[len(prefix) :] for key in keys if key.startswith(prefix)]
    created: list[str] = []
    _create_under(module, "", stripped, created)
    # The walk visits dicts in module order; report the entries in the order of the keys. The
    # walk creates an entry before the entries inside it, which share its first key, and the
    # sort is stable, so they stay after it.
    first: dict[str, int] = {}
    for index, key in enumerate(stripped):
        parts = key.split(".")
        for end in range(1, len(parts)):
            first.setdefault(".".join(parts[:end]), index)
    return sorted(created, key=first.__getitem__)


def _create_under(module: nn.Module, path: str, keys: list[str], created: list[str]) -> None:
    if isinstance(module, ModuleDefaultDict):
        created.extend(path + name for name in module._create_entries(keys, path))
    for name, child in module._modules.items():
        if child is not None:
            _create_under(child, f"{path}{name}.", keys, created)


def sync_entries(module: nn.Module, group: dist.ProcessGroup | None = None) -> list[str]:
    """Give every rank the same ModuleDefaultDict entries, in the same order, with equal values.

    With per-rank data, ranks create different entries: rank 0 reads ``heads["a"]`` and
    rank 1 ``heads["b"]``. DDP would then wrap without a word when the shapes match, and
    average the gradients of two different heads. Every rank of ``group`` calls this, before
    wrapping. Afterwards every ModuleDefaultDict in ``module`` holds the union of the entries
    of all ranks, in the same order on every rank (rank 0's entries in its order, then those
    of rank 1 that rank 0 lacked, and so on), and every entry's parameters and buffers equal
    those of the lowest rank that had the entry before the call. Missing entries are
    created by the dict's factory, so they follow its device, dtype and training mode.
    Tensors on the meta device hold no values and are left as they are.

    A miss after wrapping would create an entry that no other rank has and whose gradients
    are never reduced. Neither DDP nor FSDP2 leaves a mark that the dict can see from
    inside: DDP holds the model without changing it, and ``fully_shard`` changes the class of
    the modules it is applied to, usually the model and its blocks, while a dict has no link
    to the modules above it. A miss therefore cannot tell reliably that it is too late, so
    close the dicts instead once the entries are synchronised:
    ``model.heads.default_factory = None``. A miss then raises ``KeyError`` whatever the
    wrapper. (This function and [`create_entries`][toolkit.nn.create_entries] are given the
    model itself, so they do refuse a wrapped one.)

    Args:
        module: The model, before it is wrapped by DDP or FSDP.
        group: The process group whose ranks take part; the default group if None.

    Returns:
        The qualified names of the entries this rank created, in rank order: those it
        took from rank 0 in rank 0's order, then those from rank 1, and so on (across dicts,
        not dict by dict).

    Raises:
        ValueError: On every rank, if ``module`` is wrapped by DDP or FSDP or holds DTensor
            parameters on some rank, or if a tensor is on the meta device on some ranks
            only.
        RuntimeError: On every rank, if creating an entry failed on some rank (its dict has
            no factory there, or the factory raised). The entries created by the call are
            removed again, on every rank.

    Added in version v3.58.0.
    """
    problem = _wrapped(module)
    local = (problem, [name for name, _ in _entries(module)])
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    problems = [f"rank {rank}: {found}" for rank, (found, _) in enumerate(gathered) if found]
    if problems:
        raise ValueError(f"sync_entries: {'; '.join(problems)}")
    owners: dict[str, int] = {}
    for rank, (_, names) in enumerate(gathered):
        for name in names:
            owners.setdefault(name, rank)

    created, error = _create_missing(module, owners)
    # Where creation failed, some entries are missing; the failure is reported instead.
    tensors = {} if error else _owned_tensors(module, owners)
    meta = sorted(name for name, (tensor, _) in tensors.items() if tensor.is_meta)
    outcomes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, (error and repr(error), meta), group=group)
    failures = [f"rank {rank}: {found}" for rank, (found, _) in enumerate(outcomes) if found]
    mixed = sorted(
        set().union(*(other for _, other in outcomes))
        - set.intersection(*(set(other) for _, other in outcomes))
    )
    if failures or mixed:
        for name in reversed(created):
            path, _, key = name.rpartition(".")
            del module.get_submodule(path)._modules[key]
        if failures:
            raise RuntimeError(
                "sync_entries created no entry: creating the missing entries failed on "
                + "; ".join(failures)
            ) from error
        raise ValueError(
            f"sync_entries created no entry: {', '.join(mixed)} are on the meta device on "
            "some ranks only; move or materialise the model alike on every rank"
        )

    _reorder(module, owners)
    with torch.no_grad():
        for _, (tensor, owner) in _owned_tensors(module, owners).items():
            if not tensor.is_meta:
                _broadcast(tensor, owner, group)
    return created


def _wrapped(module: nn.Module) -> str | None:
    """Why entries can no longer be created in ``module``, or None."""
    if not dist.is_available():  # pragma: no cover - builds without torch.distributed
        return None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel  # noqa: PLC0415
    from torch.distributed.tensor import DTensor  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    wrappers = (DistributedDataParallel, FSDPModule, FullyShardedDataParallel)
    for name, sub in module.named_modules():
        if isinstance(sub, wrappers):
            return (
                f"{name or 'the module'} is wrapped by {type(sub).__name__}, which only manages "
                "the parameters that existed when it wrapped; create the entries before wrapping"
            )
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            return (
                f"parameter {name} is a DTensor: the model is already sharded; create the "
                "entries before fully_shard"
            )
    return None


def _entries(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every entry of every ModuleDefaultDict in ``module``, an entry before those inside it."""
    return [
        (f"{path}.{key}" if path else key, entry)
        for path, sub in module.named_modules()
        if isinstance(sub, ModuleDefaultDict)
        for key, entry in sub._modules.items()
        if entry is not None
    ]


def _create_missing(
    module: nn.Module, owners: dict[str, int]
) -> tuple[list[str], Exception | None]:
    """Create the entries of ``owners`` that this rank lacks; stop at the first failure."""
    created: list[str] = []
    for name in owners:
        path, _, key = name.rpartition(".")
        try:
            parent = module.get_submodule(path)
            if key in parent._modules:
                continue
            if not isinstance(parent, ModuleDefaultDict):
                raise TypeError(f"{path!r} is a {type(parent).__name__}, not a ModuleDefaultDict")
            parent[key]
        except Exception as error:  # reported to every rank, then raised
            return created, error
        created.append(name)
    return created, None


def _reorder(module: nn.Module, owners: dict[str, int]) -> None:
    """Put the entries of every dict in the order of ``owners``, the same on every rank."""
    for path, sub in module.named_modules():
        if isinstance(sub, ModuleDefaultDict):
            prefix = f"{path}." if path else ""
            order = [n[len(prefix) :] for n in owners if n.rpartition(".")[0] == path]
            entries = dict(sub._modules)
            sub._modules.clear()
            sub._modules.update((key, entries[key]) for key in order)


def _owned_tensors(
    module: nn.Module, owners: dict[str, int]
) -> dict[str, tuple[torch.Tensor, int]]:
    """Each parameter and buffer of every entry, with the rank whose value it takes.

    A tensor of an entry inside another entry takes its value from the owner of the inner
    entry. The order is the modules' order, the same on every rank after ``_reorder``.
    """
    tensors: dict[str, tuple[torch.Tensor, int]] = {}
    for name, owner in owners.items():
        entry = module.get_submodule(name)
        named = itertools.chain(entry.named_parameters(name), entry.named_buffers(name))
        for qualified, tensor in named:
            tensors[qualified] = (tensor, owner)
    return tensors


def _broadcast(tensor: torch.Tensor, owner: int, group: dist.ProcessGroup | None) -> None:
    data = tensor.detach()
    buffer = data.contiguous()  # data itself when it is contiguous already
    dist.broadcast(buffer, group_src=owner, group=group)
    if buffer is not data:
        data.copy_(buffer)
