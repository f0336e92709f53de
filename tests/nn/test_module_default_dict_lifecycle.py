"""ModuleDefaultDict through a training run: late entries follow the dict, and the fixes of
repr, TorchScript, construction, load pre-hooks, ``setdefault`` and ``pop``.

The expected placement of a late entry is that of an entry that existed all along: the same
factory, seeded alike, built before the conversion and converted by torch itself.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tests.nn.models import Counter, CountingFactory
from toolkit.nn import ModuleDefaultDict
from toolkit.nn._entry_placement import EntryPlacement


class Head(nn.Module):
    """A head with a floating parameter, an integer buffer, a bool buffer and a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 2)
        self.norm = nn.LayerNorm(2)
        self.register_buffer("steps", torch.tensor([7], dtype=torch.long))
        self.register_buffer("mask", torch.tensor([True, False]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


class Model(nn.Module):
    def __init__(self, factory: Callable[[], nn.Module] | None = Head) -> None:
        super().__init__()
        self.trunk = nn.Linear(3, 3)
        self.heads = ModuleDefaultDict(factory)

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        return self.heads[task](self.trunk(x))  # type: ignore[no-any-return]


def _placement(module: nn.Module) -> dict[str, tuple[torch.dtype, torch.device]]:
    return {name: (t.dtype, t.device) for name, t in module.state_dict().items()}


def _half_then_float(m: nn.Module) -> None:
    m.half()
    m.float()


def _meta_then_to_empty(m: nn.Module) -> None:
    m.to("meta")
    m.to_empty(device="cpu")


CONVERSIONS: dict[str, Callable[[nn.Module], Any]] = {
    "to-float64": lambda m: m.to(torch.float64),
    "to-device-and-dtype": lambda m: m.to("cpu", torch.bfloat16),
    "double": lambda m: m.double(),
    "half": lambda m: m.half(),
    "bfloat16": lambda m: m.bfloat16(),
    "type-float64": lambda m: m.type(torch.float64),
    "to-meta": lambda m: m.to("meta"),
    "half-then-float": _half_then_float,
    "meta-then-to_empty": _meta_then_to_empty,
}


@pytest.mark.parametrize("on", ["model", "dict"])
@pytest.mark.parametrize("conversion", sorted(CONVERSIONS))
def test_a_late_entry_is_placed_as_an_entry_that_existed_all_along(
    conversion: str, on: str
) -> None:
    convert = CONVERSIONS[conversion]
    torch.manual_seed(0)
    existing = Model()
    existing.heads["a"]  # built before the conversion; torch converts it
    convert(existing if on == "model" else existing.heads)

    torch.manual_seed(0)
    late = Model()
    convert(late if on == "model" else late.heads)
    entry = late.heads["a"]  # built after the conversion

    assert _placement(entry) == _placement(existing.heads["a"])
    if conversion in ("meta-then-to_empty", "half-then-float"):
        # Only the net effect counts: to_empty leaves memory uninitialised and a round trip
        # through float16 rounds, but a late entry keeps the factory's values.
        torch.manual_seed(0)
        Model()
        expected = Head()  # what the late entry's factory call builds
        for name, tensor in expected.state_dict().items():
            assert torch.equal(entry.state_dict()[name], tensor)
    elif conversion != "to-meta":
        for name, tensor in existing.heads["a"].state_dict().items():
            assert torch.equal(entry.state_dict()[name], tensor), name


def test_a_conversion_that_does_not_recurse_leaves_new_entries_alone() -> None:
    model = Model()
    model.heads.to_empty(device="meta", recurse=False)
    model.to_empty(device="meta", recurse=False)
    assert model.heads["a"].proj.weight.device == torch.device("cpu")


def test_a_conversion_that_does_not_recurse_leaves_the_entries_alone() -> None:
    model = Model()
    entry = model.heads["a"]
    model.heads.to_empty(device="meta", recurse=False)
    assert model.heads["a"] is entry
    assert {t.device for t in entry.state_dict().values()} == {torch.device("cpu")}


def test_integer_and_bool_buffers_keep_their_dtype() -> None:
    model = Model().to(torch.float64)
    entry = model.heads["a"]
    assert entry.proj.weight.dtype == torch.float64
    assert entry.steps.dtype == torch.long
    assert entry.mask.dtype == torch.bool


def test_a_dict_never_moved_leaves_the_factory_result_untouched() -> None:
    model = Model(functools.partial(nn.Linear, 2, 2, dtype=torch.float64))
    model.trunk.float()  # a sibling's conversion does not reach the dict
    model.heads["a"]
    assert model.heads["a"].weight.dtype == torch.float64


def test_a_move_without_a_cast_keeps_the_factory_dtype() -> None:
    model = Model(functools.partial(nn.Linear, 2, 2, dtype=torch.float64))
    model.to("meta")
    entry = model.heads["a"]
    assert (entry.weight.dtype, entry.weight.device) == (torch.float64, torch.device("meta"))


def test_a_cast_without_a_move_keeps_the_factory_device() -> None:
    model = Model(functools.partial(nn.Linear, 2, 2, device="meta"))
    model.half()
    entry = model.heads["a"]
    assert (entry.weight.dtype, entry.weight.device) == (torch.float16, torch.device("meta"))


def test_the_last_cast_wins_and_a_later_move_keeps_it() -> None:
    model = Model()
    model.half()
    model.bfloat16()
    model.to("meta")
    entry = model.heads["a"]
    assert (entry.proj.weight.dtype, entry.proj.weight.device) == (
        torch.bfloat16,
        torch.device("meta"),
    )


def test_a_cast_after_a_move_to_meta_keeps_new_entries_on_meta() -> None:
    """The cast is learnt on the device the dict was moved to, not the default device."""
    model = Model()
    model.to("meta")
    model.double()
    entry = model.heads["a"]
    assert (entry.proj.weight.dtype, entry.proj.weight.device) == (
        torch.float64,
        torch.device("meta"),
    )


def test_a_conversion_that_treats_dtypes_apart_is_learnt_from_a_float32_tensor() -> None:
    """A conversion that moves only float32 tensors sets the device; one that moves only
    float16 tensors does not; a cast of float32 alone sets no dtype."""

    def move_float32(t: torch.Tensor) -> torch.Tensor:
        return t.to("meta") if t.dtype == torch.float32 else t

    def move_float16(t: torch.Tensor) -> torch.Tensor:
        return t.to("meta") if t.dtype == torch.float16 else t

    def cast_float32(t: torch.Tensor) -> torch.Tensor:
        return t.double() if t.dtype == torch.float32 else t

    meta = torch.device("meta")
    assert EntryPlacement().after(move_float32) == EntryPlacement(device=meta)
    assert EntryPlacement().after(move_float16) == EntryPlacement()
    assert EntryPlacement().after(cast_float32) == EntryPlacement()


def test_a_conversion_that_fails_changes_where_entries_go_in_no_way() -> None:
    model = Model()
    model.to("meta")
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        model.to("cpu")
    assert model.heads["a"].proj.weight.device == torch.device("meta")


@pytest.mark.parametrize(
    ("then", "dtype"), [("cpu", torch.float32), (torch.float64, torch.float64)], ids=str
)
def test_an_empty_dict_moved_to_meta_and_back_creates_entries_off_meta(
    then: Any, dtype: torch.dtype
) -> None:
    """nn.ModuleDict survives .to("cpu") from meta when it holds no tensors; so does the dict,
    and its new entries are where .to puts a tensor with data."""
    heads = ModuleDefaultDict(Head)
    heads.to("meta").to("cpu") if then == "cpu" else heads.to("meta").to("cpu", then)
    entry = heads["a"]
    assert (entry.proj.weight.device, entry.proj.weight.dtype) == (torch.device("cpu"), dtype)
    assert entry.steps.dtype == torch.long


def test_a_conversion_that_needs_data_is_learnt_on_the_cpu_from_meta() -> None:
    meta, cpu = torch.device("meta"), torch.device("cpu")
    on_meta = EntryPlacement(device=meta, dtype=torch.float16)
    assert on_meta.after(lambda t: t.to("cpu")) == EntryPlacement(cpu, torch.float16)
    assert on_meta.after(lambda t: t.to("cpu", torch.float64)) == EntryPlacement(
        cpu, torch.float64, torch.float64
    )
    # It needs data, so it cannot leave a tensor on meta: the CPU probe's device is taken.
    assert on_meta.after(lambda t: t.clone() if t.sum() > 0 else t) == EntryPlacement(
        cpu, torch.float16
    )


def test_under_a_meta_default_device_a_move_to_the_cpu_is_learnt_on_the_cpu() -> None:
    """The first probe is on the default device, meta; the second on the CPU itself."""
    with torch.device("meta"):
        heads = ModuleDefaultDict(Head)
        heads.to("cpu")
    assert heads["a"].proj.weight.device == torch.device("cpu")


def test_a_conversion_of_the_values_is_learnt_from_probes_with_values() -> None:
    """Empty probes made t / t.abs().max() raise; it keeps floating dtypes, makes ints float."""
    normalise = EntryPlacement().after(lambda t: t / t.abs().max())
    assert normalise == EntryPlacement(other_dtype=torch.float32)


@pytest.mark.parametrize("start", ["cpu", "meta"])
def test_a_conversion_that_fails_on_the_probes_runs_and_then_a_miss_raises(start: str) -> None:
    """The probes hold one element: a reshape to two fails on them, not on the entry."""
    heads = ModuleDefaultDict(Head).to(start)
    heads["kept"] = nn.Linear(2, 1, bias=False).to(start)
    assert heads._apply(lambda t: t.reshape(2)) is heads
    assert heads["kept"].weight.shape == (2,)
    heads.to(start)  # a conversion afterwards cannot tell where entries would be either
    with pytest.raises(RuntimeError, match=r"^ModuleDefaultDict cannot place a new entry") as info:
        heads["a"]
    assert "(RuntimeError: shape '[2]' is invalid" in str(info.value)
    assert "Create the entries before such a conversion" in str(info.value)
    assert list(heads) == ["kept"]
    heads["b"] = Head()  # inserting a module is unaffected
    assert list(heads) == ["kept", "b"]


def test_a_late_entry_after_a_cast_runs_in_the_forward() -> None:
    model = Model().to(torch.float64)
    out = model(torch.randn(4, 3, dtype=torch.float64), "new")
    assert out.dtype == torch.float64


@pytest.mark.parametrize("on", ["model", "dict"])
def test_a_late_entry_takes_the_training_mode_of_the_dict(on: str) -> None:
    model = Model()
    (model if on == "model" else model.heads).eval()
    entry = model.heads["a"]
    assert [m.training for m in entry.modules()] == [False, False, False]
    (model if on == "model" else model.heads).train()
    assert all(m.training for m in model.heads["b"].modules())


def test_an_eval_factory_result_is_switched_to_the_dict_mode() -> None:
    model = Model(lambda: Head().eval())
    assert all(m.training for m in model.heads["a"].modules())


def test_loading_after_a_cast_creates_the_entries_cast() -> None:
    trained = Model()
    trained.heads["a"]
    fresh = Model().to(torch.float64)
    fresh.load_state_dict(trained.state_dict(), strict=True)
    assert fresh.heads["a"].proj.weight.dtype == torch.float64
    assert torch.equal(fresh.heads["a"].proj.weight, trained.heads["a"].proj.weight.double())
    assert fresh(torch.randn(2, 3, dtype=torch.float64), "a").dtype == torch.float64


def test_copies_keep_where_entries_go() -> None:
    import copy  # noqa: PLC0415
    import pickle  # noqa: PLC0415

    model = Model().to(torch.float64)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone.heads["a"].proj.weight.dtype == torch.float64


# Fix: repr --------------------------------------------------------------------------------


class SelfBuilding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = ModuleDefaultDict(self.new_head)

    def new_head(self) -> nn.Module:
        return nn.Identity()


def test_repr_of_a_factory_that_shows_the_dict_shows_dots_inside() -> None:
    model = SelfBuilding()
    model.heads["x"]
    assert repr(model) == (
        "SelfBuilding(\n"
        "  (heads): ModuleDefaultDict(\n"
        "    default_factory=<bound method SelfBuilding.new_head of SelfBuilding(\n"
        "      (heads): ModuleDefaultDict(\n"
        "        default_factory=...\n"
        "        (x): Identity()\n"
        "      )\n"
        "    )>\n"
        "    (x): Identity()\n"
        "  )\n"
        ")"
    )
    assert repr(model.heads).startswith("ModuleDefaultDict(\n  default_factory=<bound method")


# Fix: TorchScript -------------------------------------------------------------------------


class Scripted(nn.Module):
    def __init__(self, heads: nn.ModuleDict) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads["a"](x) + self.heads["b"](x)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("factory", [None, Counter], ids=["no-factory", "factory"])
def test_scripts_and_runs_as_a_module_dict(factory: Callable[[], nn.Module] | None) -> None:
    torch.manual_seed(0)
    entries = {"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)}
    plain = torch.jit.script(Scripted(nn.ModuleDict(entries)))
    ours = torch.jit.script(Scripted(ModuleDefaultDict(factory, entries)))
    x = torch.randn(3, 2)
    assert torch.equal(ours(x), plain(x))
    assert list(ours.state_dict()) == list(plain.state_dict())


# Fix: construction ------------------------------------------------------------------------


def test_none_as_the_initial_mapping_is_an_empty_dict_like_module_dict() -> None:
    d: ModuleDefaultDict[nn.Module] = ModuleDefaultDict(None, None)
    assert list(d) == list(nn.ModuleDict(None)) == []
    assert d.default_factory is None
    assert list(ModuleDefaultDict(Counter, None, a=Counter())) == ["a"]


@pytest.mark.parametrize(
    ("mapping", "type_name"),
    [
        (nn.ModuleDict({"a": Counter()}), "ModuleDict"),
        (ModuleDefaultDict(Counter, {"a": Counter()}), "ModuleDefaultDict"),
        ({"a": Counter()}, "dict"),
        (OrderedDict(a=Counter()), "OrderedDict"),
    ],
)
def test_a_mapping_as_the_factory_is_a_type_error_naming_the_fix(
    mapping: Any, type_name: str
) -> None:
    message = (
        f"ModuleDefaultDict.default_factory must build a new Module, got a {type_name}; "
        "to start from a mapping's entries, pass it second: ModuleDefaultDict(None, mapping) "
        "or ModuleDefaultDict(factory, mapping)"
    )
    with pytest.raises(TypeError) as info:
        ModuleDefaultDict(mapping)
    assert str(info.value) == message
    d = ModuleDefaultDict(Counter)
    d["x"]
    with pytest.raises(TypeError) as info:
        d.default_factory = mapping
    assert str(info.value) == message
    assert d.default_factory is Counter
    assert list(d) == ["x"]
    assert list(mapping) == ["a"]


# Fix: load pre-hooks run before the keys name entries --------------------------------------


def _rename_old_keys(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: object
) -> None:
    for key in list(state_dict):
        if key.startswith(prefix + "old_"):
            state_dict[prefix + key[len(prefix) + 4 :]] = state_dict.pop(key)


def test_the_dict_own_load_pre_hooks_run_before_entries_are_named() -> None:
    old = {"heads.old_a.weight": torch.ones(2, 2), "heads.old_a.bias": torch.zeros(2)}
    model = nn.Module()
    model.heads = ModuleDefaultDict(functools.partial(nn.Linear, 2, 2))
    model.heads.register_load_state_dict_pre_hook(_rename_old_keys)
    result = model.load_state_dict(old, strict=True)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    assert list(model.heads) == ["a"]
    assert torch.equal(model.heads["a"].weight, torch.ones(2, 2))
    assert len(model.heads._load_state_dict_pre_hooks) == 1  # only the user's hook stays


# setdefault and pop(key, default) ----------------------------------------------------------


def test_setdefault_returns_the_entry_or_inserts_the_given_module() -> None:
    factory = CountingFactory()
    d = ModuleDefaultDict(factory)
    first, other = Counter(), Counter()
    assert d.setdefault("a", first) is first
    assert d.setdefault("a", other) is first
    assert list(d.items()) == [("a", first)]
    assert factory.calls == 0


@pytest.mark.parametrize(
    ("key", "module", "error"),
    [("training", Counter(), KeyError), ("a.b", Counter(), KeyError), ("k", 3, TypeError)],
)
def test_setdefault_rejects_what_setitem_rejects_and_changes_nothing(
    key: str, module: Any, error: type[Exception]
) -> None:
    d = ModuleDefaultDict(CountingFactory())
    plain = nn.ModuleDict()
    with pytest.raises(error) as expected:
        plain[key] = module
    with pytest.raises(error) as ours:
        d.setdefault(key, module)
    assert str(ours.value) == str(expected.value)
    assert list(d) == []


def test_pop_with_a_default_never_calls_the_factory() -> None:
    factory = CountingFactory()
    d = ModuleDefaultDict(factory)
    kept = Counter()
    d["a"] = kept
    assert d.pop("missing", None) is None
    sentinel = object()
    assert d.pop("missing", sentinel) is sentinel
    assert d.pop("a", None) is kept
    assert list(d) == []
    with pytest.raises(KeyError) as info:
        d.pop("a")
    assert info.value.args == ("a",)
    assert factory.calls == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "move",
    [lambda m: m.cuda(), lambda m: m.to("cuda"), lambda m: m.to("cuda", torch.bfloat16)],
    ids=["cuda", "to-cuda", "to-cuda-bfloat16"],
)
def test_a_late_entry_follows_a_move_to_cuda(move: Callable[[nn.Module], Any]) -> None:
    torch.manual_seed(0)
    existing = Model()
    existing.heads["a"]
    move(existing)
    late = Model()
    move(late)
    assert _placement(late.heads["a"]) == _placement(existing.heads["a"])
    assert late.heads["a"].proj.weight.device.type == "cuda"
