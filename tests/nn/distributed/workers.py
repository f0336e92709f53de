"""What each rank runs: build a setup, train it, and send back what the tests compare.

Every function here runs inside a rank started by :func:`tests.nn.ranks.run_processes`,
so the process group is set up from the environment, exactly as under ``torchrun``. One launch
runs many setups one after another, because starting processes and importing torch costs far
more than training the tiny model.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import FlatParameter, FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from tests.nn.distributed.tiny_lm import (
    LR,
    TASKS,
    Block,
    ReferenceTaskLM,
    TaskLM,
    TinyLM,
    batches,
    initial_state,
    loss_fn,
    rank_rows,
)

CPU = torch.device("cpu")  # FSDP1 looks for an accelerator unless it is told the device
FULL = StateDictOptions(full_state_dict=True)
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=30)


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """Join the gloo process group described by the environment, and leave it at the end."""
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()


# Setups: each returns the wrapped model, holding the given full state. ---------------------


def _loaded(model: nn.Module, state: dict[str, Any]) -> nn.Module:
    model.load_state_dict(state)
    return model


def fsdp2_root(state: dict[str, Any]) -> nn.Module:
    """The embedding stays in the root unit, which also calls the head."""
    model = _loaded(TinyLM(), state)
    fully_shard(model)
    return model


def fsdp2_grouped(state: dict[str, Any]) -> nn.Module:
    """The embedding is grouped with the final norm in a unit that stays unsharded."""
    model = _loaded(TinyLM(), state)
    fully_shard([model.emb, model.out.norm], reshard_after_forward=False)
    fully_shard(model)
    return model


def fsdp2_grouped_with_caller(state: dict[str, Any]) -> nn.Module:
    """The embedding is grouped with the module that calls TiedLinear; it reshards after."""
    model = _loaded(TinyLM(), state)
    fully_shard([model.emb, model.out])
    fully_shard(model)
    return model


def fsdp2_caller_own_unit(state: dict[str, Any]) -> nn.Module:
    """The module that calls TiedLinear is its own unit; the embedding stays in the root."""
    model = _loaded(TinyLM(), state)
    fully_shard(model.out)
    fully_shard(model)
    return model


def fsdp2_emb_unsharded(state: dict[str, Any]) -> nn.Module:
    """The embedding is its own unit, but keeps its parameters unsharded after forward."""
    model = _loaded(TinyLM(), state)
    fully_shard(model.emb, reshard_after_forward=False)
    fully_shard(model)
    return model


def fsdp2_blocks(state: dict[str, Any]) -> nn.Module:
    """Each block is its own unit; the embedding stays in the root."""
    model = _loaded(TinyLM(), state)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def fsdp2_meta(state: dict[str, Any]) -> nn.Module:
    """The large-model flow: build on meta, shard, materialise with to_empty, then initialise.

    Initialisation loads a full state dict that rank 0 holds and broadcasts, as when starting
    from a pretrained checkpoint.
    """
    with torch.device("meta"):
        model = TinyLM()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state if dist.get_rank() == 0 else {}, options=options)
    return model


def _fsdp1(state: dict[str, Any], *, use_orig_params: bool) -> nn.Module:
    """FSDP1 with blocks as their own units; on the CPU it must be given the device."""
    return FullyShardedDataParallel(
        _loaded(TinyLM(), state),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=use_orig_params,
        device_id=CPU,
    )


def fsdp1_orig_params(state: dict[str, Any]) -> nn.Module:
    """FSDP1 with ``use_orig_params=True``."""
    return _fsdp1(state, use_orig_params=True)


def fsdp1_flat_params(state: dict[str, Any]) -> nn.Module:
    """FSDP1 with ``use_orig_params=False`` (flat parameters)."""
    return _fsdp1(state, use_orig_params=False)


def ddp(state: dict[str, Any]) -> nn.Module:
    """DistributedDataParallel around the whole model."""
    return DistributedDataParallel(_loaded(TinyLM(), state))


SETUPS: dict[str, Callable[[dict[str, Any]], nn.Module]] = {
    f.__name__: f
    for f in (
        fsdp2_root,
        fsdp2_grouped,
        fsdp2_grouped_with_caller,
        fsdp2_caller_own_unit,
        fsdp2_emb_unsharded,
        fsdp2_blocks,
        fsdp2_meta,
        fsdp1_orig_params,
        fsdp1_flat_params,
        ddp,
    )
}


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=FULL).items()}


def train(model: nn.Module, world_size: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Train on this rank's rows of the global batches; return its losses and the full states."""
    rank = dist.get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, states = [], [_full_state(model)]
    for idx, targets in batches(world_size):
        loss = loss_fn(model(idx[rank_rows(rank)]), targets[rank_rows(rank)])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        states.append(_full_state(model))
    return losses, states


def _checkpoint_round_trip(name: str, model: nn.Module, checkpoint_dir: Path) -> dict[str, Any]:
    """Save the sharded model with DCP, load it into a differently initialised copy."""
    path = checkpoint_dir / name
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    fresh = SETUPS[name](initial_state(seed=1))
    before = _full_state(fresh)
    loaded = get_model_state_dict(fresh)
    dcp.load(loaded, checkpoint_id=path)
    set_model_state_dict(fresh, loaded)
    idx, _ = batches(dist.get_world_size())[0]
    with torch.no_grad():
        return {
            "before": before,
            "after": _full_state(fresh),
            "logits": fresh(idx).detach(),
            "trained_logits": model(idx).detach(),
        }


def _original_parameter_names(model: nn.Module) -> list[str] | None:
    """The wrapped model's parameter names without the wrappers' prefixes; None if flattened."""
    if any(isinstance(p, FlatParameter) for p in model.parameters()):
        return None
    names = [n for n, _ in model.named_parameters()]
    if isinstance(model, DistributedDataParallel):
        names = [n.removeprefix("module.") for n in names]
    return [n.replace("_fsdp_wrapped_module.", "") for n in names]


def run_setup(name: str, world_size: int, checkpoint_dir: Path) -> dict[str, Any]:
    """Build, train and checkpoint one setup; record what the tests compare."""
    state = initial_state()
    model = SETUPS[name](state)
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    losses, states = train(model, world_size)
    return {
        "losses": losses,
        "states": states,
        "unwrapped_parameter_names": [n for n, _ in TinyLM().named_parameters()],
        "wrapped_parameter_names": _original_parameter_names(model),
        "wrapped_state_keys": list(get_model_state_dict(model, options=FULL)),
        "head_tied_to_the_wrapped_embedding": inner.out.head.tied_module is inner.emb,
        "checkpoint": _checkpoint_round_trip(name, model, checkpoint_dir),
    }


def unsupported(placement: str) -> str:
    """A unit holding the embedding reshards before the head runs: return the error raised.

    ``own_unit`` makes the embedding its own unit; ``grouped_resharding`` groups it with the
    final norm, which runs before the head, in a unit that reshards after its forward.
    """
    model = _loaded(TinyLM(), initial_state())
    fully_shard(model.emb if placement == "own_unit" else [model.emb, model.out.norm])
    fully_shard(model)
    idx, _ = batches(dist.get_world_size())[0]
    try:
        model(idx)
    except RuntimeError as error:
        cause = error.__cause__
        return f"{type(error).__name__}: {error}\nCAUSE {type(cause).__name__}: {cause}"
    raise AssertionError("the unsupported setup did not raise")


# ModuleDefaultDict ------------------------------------------------------------------------


def _wrap(kind: str, model: nn.Module) -> nn.Module:
    if kind == "ddp":
        return DistributedDataParallel(model)
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(model)
    return model


def mdd_created_before_wrapping(kind: str, recipe: str, world_size: int) -> dict[str, Any]:
    """Create the adapters before wrapping, by one recipe or the other, then train."""
    state = initial_state(ReferenceTaskLM)
    model = TaskLM()
    if recipe == "iterate_keys":
        for task in TASKS:
            model.adapters[task]
        model.load_state_dict(state)
    else:  # "restore_checkpoint": loading creates the entries it names
        model.load_state_dict(state)
    keys = list(model.adapters)
    wrapped = _wrap(kind, model)
    losses, states = train(wrapped, world_size)
    return {"keys_before_wrapping": keys, "losses": losses, "states": states}


def mdd_created_after_wrapping(world_size: int) -> dict[str, torch.Tensor]:
    """Read adapter "b" only after DDP wrapped the model; return the state after one step."""
    state = initial_state(ReferenceTaskLM)
    b_state = {
        k.removeprefix("adapters.b."): v for k, v in state.items() if k.startswith("adapters.b.")
    }
    model = TaskLM()
    model.adapters["a"]
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith("adapters.b.")})
    wrapped = DistributedDataParallel(model)
    model.adapters["b"].load_state_dict(b_state)  # created after wrapping, identical on all ranks
    rank = dist.get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    idx, targets = batches(world_size)[0]
    loss = loss_fn(wrapped(idx[rank_rows(rank)]), targets[rank_rows(rank)])
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def mdd_created_after_fully_shard() -> dict[str, bool]:
    """Whether each adapter's weight is sharded when "b" is read only after fully_shard."""
    model = TaskLM()
    model.adapters["a"]
    fully_shard(model)
    model.adapters["b"]
    return {task: isinstance(model.adapters[task].weight, DTensor) for task in TASKS}


def fsdp1_without_device_id() -> str:
    """What FSDP1 raises on a CPU-only machine when it is not told the device."""
    try:
        FullyShardedDataParallel(TinyLM())
    except RuntimeError as error:
        return str(error)
    raise AssertionError("FSDP1 wrapped a CPU model without device_id")


# Entry points: one launch each. -----------------------------------------------------------

# Further modules whose checks every launch runs, after the ones above. Each defines
# ``checks(world_size: int, checkpoint_dir: Path) -> dict[str, Callable[[], Any]]``, returning
# the checks it runs at that world size under names prefixed by its own subject
# (``"tp/..."``), and ``WORLD_SIZES``, the world sizes at which it has any.
CHECK_MODULES: tuple[str, ...] = (
    "tests.nn.distributed.tp_checks",
    "tests.nn.distributed.entries_checks",
    "tests.nn.distributed.pipeline_checks",
    "tests.nn.distributed.mutation_checks",
    "tests.nn.distributed.hf_checks",
    "tests.nn.distributed.three_stage_checks",
)


def extra_checks(world_size: int, checkpoint_dir: Path) -> dict[str, Callable[[], Any]]:
    """The checks that the modules of :data:`CHECK_MODULES` run at ``world_size``."""
    checks: dict[str, Callable[[], Any]] = {}
    for name in CHECK_MODULES:
        module = importlib.import_module(name)
        if world_size in module.WORLD_SIZES:
            checks.update(module.checks(world_size, checkpoint_dir))
    return checks


def main(world_size: int, setups: list[str], checkpoint_dir: str) -> dict[str, Any]:
    """Run the named setups, the unsupported setup, the ModuleDefaultDict and further checks.

    A check that raises is recorded as its traceback, so one failure does not hide the rest.
    """
    out: dict[str, Any] = {}
    checks: dict[str, Callable[[], Any]] = {
        **{
            f"setup/{name}": (lambda name=name: run_setup(name, world_size, Path(checkpoint_dir)))
            for name in setups
        },
        **{
            f"unsupported/{placement}": (lambda placement=placement: unsupported(placement))
            for placement in ("own_unit", "grouped_resharding")
            if setups
        },
    }
    if world_size == 2:
        checks.update(
            {
                f"mdd/{kind}/{recipe}": (
                    lambda kind=kind, recipe=recipe: mdd_created_before_wrapping(
                        kind, recipe, world_size
                    )
                )
                for kind in ("ddp", "fsdp2")
                for recipe in ("iterate_keys", "restore_checkpoint")
            }
        )
        checks["mdd/after_wrapping"] = lambda: mdd_created_after_wrapping(world_size)
        checks["mdd/after_fully_shard"] = mdd_created_after_fully_shard
        checks["fsdp1/without_device_id"] = fsdp1_without_device_id
    checks.update(extra_checks(world_size, Path(checkpoint_dir)))
    with process_group():
        for name, check in checks.items():
            try:
                out[name] = check()
            except Exception:
                out[name] = RuntimeError(traceback.format_exc())
            dist.barrier()
    return out


def run_script(sources: list[tuple[int, str]], filename: str) -> dict[str, object]:
    """Run a page's code blocks in order in one namespace, as one ``torchrun`` script.

    Each block is padded to its line on the page, so tracebacks point at the page. Returns the
    namespace's picklable values, for the tests to inspect.
    """
    namespace: dict[str, object] = {"__name__": "__main__"}
    for line, source in sources:
        exec(compile("\n" * (line - 1) + source, filename, "exec"), namespace)
    return {
        name: value
        for name, value in namespace.items()
        if isinstance(value, (str, int, float, list, tuple)) and not name.startswith("__")
    }
