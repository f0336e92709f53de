"""Create the entries of a model's ModuleDefaultDicts: from checkpoint keys, or across ranks."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from toolkit.nn._common import _gather_objects, _is_dtensor
from toolkit.nn._module_default_dict import ModuleDefaultDict, create_from_keys, is_valid_new_key

__all__ = ["create_entries", "sync_entries"]


def create_entries(module: nn.Module, keys: Iterable[str], *, prefix: str = "") -> list[str]:
    """Create the ModuleDefaultDict entries that state-dict ``keys`` name, as loading would.

    A ``torch.distributed.checkpoint`` (DCP) resume loads into the model's state dict as it
    is, which names no entry of a fresh model: call this first with the checkpoint's keys
    (``dcp.FileSystemReader(path).read_metadata().state_dict_metadata``). Every dict with a
    factory inside ``module`` creates its entries as ``load_state_dict`` does. Keys without
    ``prefix`` are ignored; if not one key matches ``module``, the resume would silently
    lose every entry, so the call raises. See
    [training on several ranks][training-on-several-ranks].

    Args:
        module: The model, before it is wrapped by DDP or FSDP.
        keys: Fully qualified state-dict keys, such as ``"heads.alpha.weight"``.
        prefix: Removed from each key first, such as ``"model."`` for a checkpoint saved
            as ``{"model": model_state_dict}``.

    Returns:
        The qualified names of the entries created, in key order (an entry before those
        inside it); ``[]`` when there is nothing to create.

    Raises:
        ValueError: If ``prefix`` is not empty and does not end with ``"."``, if not one of
            the keys matches ``module`` (naming the prefix that would), or if ``module``
            is wrapped by DDP or FSDP or holds DTensors (not seen from inside a wrapper,
            as in ``ddp.module`` or an empty dict of a sharded model). Nothing is created.
        TypeError: If a factory returns something that is not a Module.

    Added in version v3.58.0.

    Examples:
        >>> import functools
        >>> from torch import nn
        >>> from toolkit.nn import ModuleDefaultDict, create_entries
        >>> model = nn.Module()
        >>> model.heads = ModuleDefaultDict(functools.partial(nn.Linear, 4, 2))
        >>> keys = ["model.heads.a.weight", "model.heads.b.bias", "step"]
        >>> create_entries(model, keys, prefix="model.")
        ['heads.a', 'heads.b']
    """
    if prefix and not prefix.endswith("."):
        raise ValueError(
            f"create_entries prefix {prefix!r} must end with '.', as state-dict keys "
            f"separate names with it; pass prefix={prefix + '.'!r}"
        )
    problem = _wrapped(module)
    if problem is not None:
        raise ValueError(f"create_entries: {problem}")
    keys = list(keys)  # read twice
    names = set(module.state_dict())
    stripped = [key[len(prefix) :] for key in keys if key.startswith(prefix)]
    if keys and not any(_matches(module, names, key) for key in stripped):
        raise ValueError(_no_match(module, names, keys, prefix))
    created: list[str] = []
    _create_under(module, "", stripped, created)
    # The walk visits dicts in module order; report the entries in the order of the keys. The
    # walk creates an entry before the entries inside it, which share its first key, and the
    # sort is stable, so they stay after it.
    first: dict[str, int] = {}
    for index, key in enumerate(stripped):
        for name in itertools.accumulate(key.split(".")[:-1], "{}.{}".format):
            first.setdefault(name, index)
    return sorted(created, key=first.__getitem__)


def _matches(module: nn.Module, names: set[str], key: str) -> bool:
    """Whether ``key`` falls under a state-dict name of ``module``, or names an entry.

    An entry is named if one of the dicts of ``module`` has it or could create it.
    """
    parts = key.split(".")
    if any(name in names for name in itertools.accumulate(parts, "{}.{}".format)):
        return True
    parent = module
    for part in parts[:-1]:  # an entry's name has a further part after it
        if (
            isinstance(parent, ModuleDefaultDict)
            and parent.default_factory is not None
            and (part in parent._modules or is_valid_new_key(parent, part))
        ):
            return True
        child = parent._modules.get(part)
        if child is None:
            return False
        parent = child
    return False


def _no_match(module: nn.Module, names: set[str], keys: list[str], prefix: str) -> str:
    """The error for keys of which not one matches ``module`` once ``prefix`` is removed."""
    shared = Counter(p for p in (_prefix_of(module, names, key) for key in keys) if p is not None)
    message = (
        f"create_entries: not one of the {len(keys)} keys, such as {keys[0]!r}, names a "
        f"parameter, buffer or entry of the module once the prefix {prefix!r} is removed, so "
        "a resume would restore nothing of it"
    )
    if not shared:
        return f"{message}; pass the keys of a checkpoint of this model"
    best = max(shared, key=shared.__getitem__)
    return f"{message}; the keys name it under the prefix {best!r}: pass prefix={best!r}"


def _prefix_of(module: nn.Module, names: set[str], key: str) -> str | None:
    """The shortest prefix whose removal makes ``key`` match ``module``, if there is one."""
    ends = (0, *(i + 1 for i, char in enumerate(key) if char == "."))
    return next((key[:end] for end in ends if _matches(module, names, key[end:])), None)


def _create_under(module: nn.Module, path: str, keys: list[str], created: list[str]) -> None:
    if isinstance(module, ModuleDefaultDict):
        created.extend(path + name for name in create_from_keys(module, keys, path))
    for name, child in module._modules.items():
        if child is not None:
            _create_under(child, f"{path}{name}.", keys, created)


def sync_entries(module: nn.Module, group: dist.ProcessGroup | None = None) -> list[str]:
    """Give every rank the same ModuleDefaultDict entries, in the same order, with equal values.

    With per-rank data, ranks create different entries, and DDP would silently average the
    gradients of different heads. Every rank of ``group`` calls this, before wrapping:
    afterwards each dict in ``module`` holds the union of all ranks' entries, in one order
    on every rank, with the values of the lowest rank that had each. Missing entries are
    built by the dict's factory. Close the dicts afterwards
    (``model.heads.default_factory = None``), so that a later miss raises instead of
    creating an entry on one rank. See
    [training on several ranks][training-on-several-ranks].

    Args:
        module: The model, before it is wrapped by DDP or FSDP.
        group: The process group whose ranks take part; the default group if None.

    Returns:
        The qualified names of the entries this rank created, in rank order: those it
        took from rank 0 in rank 0's order, then those from rank 1, and so on (across dicts,
        not dict by dict).

    Raises:
        ValueError: On this rank alone, before any collective, if it is not a rank of
            ``group``. On every rank, with nothing changed: if ``module`` is wrapped by DDP
            or FSDP or holds DTensors on some rank (not seen from inside a wrapper, such as
            ``ddp.module`` or an empty inner dict of a sharded model), an entry is
            registered under two names, an entry differs in parameter or buffer names,
            shapes or dtypes between ranks, or a tensor is on the meta device on some ranks
            only.
        RuntimeError: On every rank, if creating an entry failed on some rank; the entries
            the call created are removed again, on every rank.

    Added in version v3.58.0.

    Examples:
        On every rank, before wrapping the model:

        >>> from toolkit.nn import sync_entries
        >>> created = sync_entries(model)  # doctest: +SKIP
        >>> model.heads.default_factory = None  # doctest: +SKIP
    """
    if dist.get_rank(group) < 0:
        # A rank outside the group must not enter the group's collectives.
        raise ValueError(
            f"sync_entries: this process, rank {dist.get_rank()} of the default group, is not "
            "a rank of the group it was given; call sync_entries on the ranks of the group only"
        )
    problem = _wrapped(module) or _aliased(module)
    local = (problem, _signatures(module, [name for name, _ in _entries(module)]))
    gathered = _gather_objects(local, group)
    problems = [f"rank {rank}: {found}" for rank, (found, _) in enumerate(gathered) if found]
    if problems:
        raise ValueError(f"sync_entries: {'; '.join(problems)}")
    owners: dict[str, int] = {}
    for rank, (_, signatures) in enumerate(gathered):
        for name in signatures:
            owners.setdefault(name, rank)
    expected = {name: gathered[owner][1][name] for name, owner in owners.items()}
    differences = _differences(owners, expected, [signatures for _, signatures in gathered])
    if differences:
        raise ValueError(f"sync_entries: {differences}")

    created, error = _create_missing(module, owners)
    # Where creation failed, some entries are missing; the failure is reported instead.
    tensors = {} if error else _entry_tensors(module, owners)
    meta = sorted(name for name, (tensor, _) in tensors.items() if tensor.is_meta)
    after = _signatures(module, [name for name, _ in _entries(module)])
    made = {name: after[name] for name in created}
    outcomes = _gather_objects((error and repr(error), meta, made), group)
    failures = [f"rank {rank}: {found}" for rank, (found, _, _) in enumerate(outcomes) if found]
    differences = _differences(owners, expected, [made for _, _, made in outcomes])
    mixed = sorted(
        set().union(*(other for _, other, _ in outcomes))
        - set.intersection(*(set(other) for _, other, _ in outcomes))
    )
    if failures or differences or mixed:
        for name in reversed(created):
            path, _, key = name.rpartition(".")
            del module.get_submodule(path)._modules[key]
        if failures:
            raise RuntimeError(
                "sync_entries created no entry: creating the missing entries failed on "
                + "; ".join(failures)
            ) from error
        if differences:
            raise ValueError(f"sync_entries created no entry: {differences}")
        raise ValueError(
            f"sync_entries created no entry: {', '.join(mixed)} are on the meta device on "
            "some ranks only; move or materialise the model alike on every rank"
        )

    _reorder(module, owners)
    with torch.no_grad():
        # In the order of the names, the same on every rank whatever order an entry
        # registered its tensors in.
        for _, (tensor, entry) in sorted(_entry_tensors(module, owners).items()):
            if not tensor.is_meta:
                _broadcast(tensor, owners[entry], group)
    return created


_BUILD_ALIKE = (
    "values cannot be copied between such tensors: build the entries alike on every rank, with "
    "the same factory and the model cast alike before they are created"
)

# An entry's parameters and buffers: name within the entry -> (dtype, shape).
_Signature = dict[str, tuple[str, tuple[int, ...]]]


def _signatures(module: nn.Module, names: Iterable[str]) -> dict[str, _Signature]:
    """The signature of each entry of ``names``, its inner entries' tensors left out."""
    signatures: dict[str, _Signature] = {name: {} for name in names}
    for qualified, (tensor, entry) in _entry_tensors(module, signatures).items():
        signatures[entry][qualified[len(entry) + 1 :]] = (str(tensor.dtype), tuple(tensor.shape))
    return signatures


def _differences(
    owners: dict[str, int], expected: dict[str, _Signature], per_rank: list[dict[str, _Signature]]
) -> str:
    """How the signatures of ``per_rank`` differ from the owners', or "" if they do not."""

    def describe(found: tuple[str, tuple[int, ...]] | None) -> str:
        return "missing" if found is None else f"{found[0]} of shape {found[1]}"

    found: list[str] = []
    for name, owner in owners.items():
        want = expected[name]
        for rank, signatures in enumerate(per_rank):
            got = signatures.get(name, want)
            tensors = [t for t in {**want, **got} if want.get(t) != got.get(t)]
            found.extend(
                f"entry {name}: {t} is {describe(want.get(t))} on rank {owner} but "
                f"{describe(got.get(t))} on rank {rank}"
                for t in tensors
            )
    if not found:
        return ""
    return "; ".join(found) + f"; {_BUILD_ALIKE}"


def _wrapped(module: nn.Module) -> str | None:
    """Why entries can no longer be created in ``module``, or None."""
    if not dist.is_available():  # pragma: no cover - builds without torch.distributed
        return None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    wrappers = (DistributedDataParallel, FSDPModule, FullyShardedDataParallel)
    for name, sub in module.named_modules():
        if isinstance(sub, wrappers):
            return (
                f"{name or 'the module'} is wrapped by {type(sub).__name__}, which only manages "
                "the parameters that existed when it wrapped; create the entries before wrapping"
            )
    for name, param in module.named_parameters():
        if _is_dtensor(param):
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


def _aliased(module: nn.Module) -> str | None:
    """Which entry is registered under several names in ``module``, or None."""
    entries = {id(entry) for _, entry in _entries(module)}
    names: dict[int, list[str]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        if id(sub) in entries:
            names.setdefault(id(sub), []).append(name)
    for shared in names.values():
        if len(shared) > 1:
            return (
                f"{' and '.join(shared)} are one module; the ranks that lack it would create "
                "a separate module for each name: register each entry under one name"
            )
    return None


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


def _entry_tensors(module: nn.Module, names: Iterable[str]) -> dict[str, tuple[torch.Tensor, str]]:
    """Each parameter and buffer of the entries ``names``, with the innermost entry holding it.

    ``names`` lists an entry before the entries inside it, as ``_entries`` and the owners do.
    """
    tensors: dict[str, tuple[torch.Tensor, str]] = {}
    for name in names:
        entry = module.get_submodule(name)
        named = itertools.chain(entry.named_parameters(name), entry.named_buffers(name))
        for qualified, tensor in named:
            tensors[qualified] = (tensor, name)
    return tensors


def _broadcast(tensor: torch.Tensor, owner: int, group: dist.ProcessGroup | None) -> None:
    data = tensor.detach()
    buffer = data.contiguous()  # data itself when it is contiguous already
    dist.broadcast(buffer, group_src=owner, group=group)
    if buffer is not data:
        data.copy_(buffer)
