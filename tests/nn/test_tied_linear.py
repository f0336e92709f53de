"""Example tests for TiedLinear: construction, errors, live reads, hooks, copies and compile."""

from __future__ import annotations

import copy
import pickle
from types import SimpleNamespace
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from benchmarks.torchtune_reference import load_tied_linear
from tests.nn.models import TiedPair
from toolkit.nn import TiedLinear

# Construction and errors -------------------------------------------------------------------


def test_is_not_a_module_and_adds_nothing_to_its_parent() -> None:
    plain = nn.Module()
    plain.emb = nn.Embedding(7, 3)
    tied = nn.Module()
    tied.emb = nn.Embedding(7, 3)
    tied.head = TiedLinear(tied.emb)

    assert not isinstance(tied.head, nn.Module)
    assert isinstance(tied.head.linear, nn.Module)
    assert [n for n, _ in tied.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(tied.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in tied.named_modules()] == [n for n, _ in plain.named_modules()]
    assert len(list(tied.parameters())) == 1


def test_missing_weight_is_an_attribute_error_naming_the_type() -> None:
    with pytest.raises(AttributeError, match=r"ReLU has none.*token embedding"):
        TiedLinear(nn.ReLU())


@pytest.mark.parametrize(
    ("module", "error", "match"),
    [
        (nn.LayerNorm(4, elementwise_affine=False), TypeError, r"LayerNorm\.weight .*got NoneType"),
        (nn.LayerNorm(4), ValueError, r"LayerNorm\.weight to be 2-D .*shape \(4,\)"),
        (nn.Conv1d(2, 3, 5), ValueError, r"Conv1d\.weight to be 2-D .*shape \(3, 2, 5\)"),
    ],
)
def test_a_weight_that_cannot_work_is_rejected_clearly(
    module: nn.Module, error: type[Exception], match: str
) -> None:
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(error, match=match):
        TiedLinear(module)
    after = module.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert not module._forward_hooks
    assert not module._forward_pre_hooks


@pytest.mark.parametrize(
    "not_a_module", [SimpleNamespace(weight=torch.randn(7, 3)), TiedLinear(nn.Embedding(7, 3))]
)
def test_something_with_a_weight_that_is_not_a_module_is_a_type_error(
    not_a_module: object,
) -> None:
    name = type(not_a_module).__name__
    with pytest.raises(TypeError) as info:
        TiedLinear(not_a_module)  # type: ignore[arg-type]
    assert str(info.value) == (
        f"TiedLinear ties to an nn.Module, got {name}, which has a 'weight' but is not a "
        "Module; pass the nn.Module that owns the weight, such as the nn.Embedding"
    )


def test_an_uninitialized_lazy_weight_is_accepted_and_read_once_initialized() -> None:
    lazy = nn.LazyLinear(5, bias=False)
    head = TiedLinear(lazy)
    assert "uninitialized" in repr(head)
    with pytest.raises(RuntimeError, match="uninitialized parameter"):
        head.in_features  # noqa: B018 - the read is what is tested
    lazy(torch.randn(2, 3))  # materializes a (5, 3) weight
    x = torch.randn(4, 3)
    assert torch.equal(head(x), F.linear(x, lazy.weight))
    assert (head.in_features, head.out_features) == (3, 5)


@pytest.mark.parametrize("shape", [(2, 4), (4,), (3, 2, 5)])
def test_a_wrong_input_width_names_both_shapes(shape: tuple[int, ...]) -> None:
    emb = nn.Embedding(7, 3)
    before = emb.weight.detach().clone()
    with pytest.raises(
        RuntimeError, match=rf"input has shape \({shape[0]},.*\(7, 3\).*in_features=3"
    ):
        TiedLinear(emb)(torch.randn(shape))
    assert torch.equal(emb.weight, before)


def test_a_zero_dim_input_is_explained() -> None:
    with pytest.raises(RuntimeError, match=r"input has shape \(\).*in_features=3"):
        TiedLinear(nn.Embedding(7, 3))(torch.tensor(1.0))


def test_other_failures_keep_torchs_own_error() -> None:
    head = TiedLinear(nn.Embedding(7, 3))
    with pytest.raises(RuntimeError, match="dtype") as info:
        head(torch.randn(2, 3, dtype=torch.float64))
    assert "TiedLinear" not in str(info.value)


# Live reads --------------------------------------------------------------------------------


def test_a_new_parameter_on_the_tied_module_is_used() -> None:
    emb = nn.Embedding(7, 3)
    head = TiedLinear(emb)
    emb.weight = nn.Parameter(torch.ones(7, 3))
    assert torch.equal(head(torch.ones(3)), torch.full((7,), 3.0))


def test_meta_init_then_to_empty_is_used() -> None:
    model = TiedPair(7, 3, device="meta")
    assert model.head(torch.empty(3, device="meta")).device.type == "meta"
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.emb.weight.copy_(torch.eye(7, 3))
    x = torch.randn(2, 3)
    assert torch.equal(model.head(x), x @ torch.eye(7, 3).T)


def test_load_state_dict_with_assign_is_used() -> None:
    model = TiedPair(7, 3, device="meta")
    weight = torch.randn(7, 3)
    model.load_state_dict({"emb.weight": weight}, assign=True)
    x = torch.randn(2, 3)
    assert torch.equal(model.head(x), F.linear(x, weight))


def test_to_dtype_is_used() -> None:
    model = TiedPair(7, 3).to(torch.float64)
    out = model.head(torch.randn(2, 3, dtype=torch.float64))
    assert out.dtype == torch.float64


def test_to_device_is_used() -> None:
    model = TiedPair(7, 3).to("meta")
    assert model.head.weight.device.type == "meta"
    assert model.head(torch.empty(2, 3, device="meta")).device.type == "meta"


class _Scale(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


def test_a_parametrized_weight_is_used() -> None:
    emb = nn.Embedding(7, 3)
    raw = emb.weight.detach().clone()
    parametrize.register_parametrization(emb, "weight", _Scale())
    head = TiedLinear(emb)
    x = torch.randn(2, 3)
    assert torch.equal(head(x), F.linear(x, 2 * raw))


def test_functional_call_on_the_parent_is_used() -> None:
    model = TiedPair(7, 3)
    other = torch.randn(7, 3)
    idx = torch.tensor([0, 4])
    out = torch.func.functional_call(model, {"emb.weight": other}, (idx,))
    assert torch.equal(out, F.linear(F.embedding(idx, other), other))
    assert not torch.equal(model.emb.weight, other)


def test_weight_and_features_are_live_and_read_only() -> None:
    emb = nn.Embedding(7, 3)
    head = TiedLinear(emb)
    assert head.weight is emb.weight
    assert (head.in_features, head.out_features) == (3, 7)
    emb.weight = nn.Parameter(torch.zeros(9, 4))
    assert head.weight is emb.weight
    assert (head.in_features, head.out_features) == (4, 9)
    for name in ("weight", "in_features", "out_features"):
        with pytest.raises(AttributeError):
            setattr(head, name, None)
    assert head.weight is emb.weight


def test_out_features_may_be_set_only_to_the_live_value() -> None:
    # transformers sets it after resizing the tied embedding, which the live read follows.
    emb = nn.Embedding(7, 3)
    head = TiedLinear(emb)
    emb.weight = nn.Parameter(torch.zeros(9, 3))
    head.out_features = 9
    assert head.out_features == 9
    with pytest.raises(AttributeError, match=r"first dimension, 9.*set to 8.*resize tied_module"):
        head.out_features = 8
    assert head.out_features == 9
    assert emb.weight.shape == (9, 3)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_requires_grad_sets_the_tied_weight_as_a_module_would(requires_grad: bool) -> None:
    emb = nn.Embedding(7, 3)
    emb.weight.requires_grad_(not requires_grad)
    linear = nn.Linear(3, 7, bias=False)
    linear.weight.requires_grad_(not requires_grad)
    head = TiedLinear(emb)
    assert head.requires_grad_(requires_grad) is head
    assert linear.requires_grad_(requires_grad) is linear
    assert emb.weight.requires_grad is linear.weight.requires_grad is requires_grad
    # With no argument it unfreezes, as Module.requires_grad_ does.
    emb.weight.requires_grad_(False)
    head.requires_grad_()
    assert emb.weight.requires_grad


def test_repr_says_what_it_is_tied_to() -> None:
    head = TiedLinear(nn.Embedding(7, 3))
    assert repr(head) == "TiedLinear(in_features=3, out_features=7, tied_to=Embedding(7, 3).weight)"


# Hooks -------------------------------------------------------------------------------------


def test_hooks_on_linear_see_input_weight_and_output_once_per_call() -> None:
    emb = nn.Embedding(7, 3)
    head = TiedLinear(emb)
    seen: list[tuple[str, Any]] = []
    head.linear.register_forward_pre_hook(lambda _m, args: seen.append(("pre", args)))
    head.linear.register_forward_hook(lambda _m, args, out: seen.append(("post", out)))
    x = torch.randn(2, 3)

    out = head(x)

    assert [kind for kind, _ in seen] == ["pre", "post"]
    pre_x, pre_weight = seen[0][1]
    assert pre_x is x
    assert pre_weight is emb.weight
    assert seen[1][1] is out
    head(x)
    assert [kind for kind, _ in seen] == ["pre", "post", "pre", "post"]


def test_a_forward_hook_can_replace_the_output() -> None:
    head = TiedLinear(nn.Embedding(7, 3))
    head.linear.register_forward_hook(lambda _m, _args, out: torch.zeros_like(out))
    assert torch.equal(head(torch.randn(2, 3)), torch.zeros(2, 7))


# Drop-in for torchtune -----------------------------------------------------------------------


def test_is_a_drop_in_for_torchtunes_tied_linear() -> None:
    reference, _ = load_tied_linear()
    emb = nn.Embedding(11, 4)
    ours, theirs = TiedLinear(emb), reference(emb)
    assert ours.tied_module is theirs.tied_module is emb
    assert isinstance(ours.linear, nn.Module)
    assert isinstance(theirs.linear, nn.Module)
    for x in (torch.randn(4), torch.randn(3, 4), torch.randn(2, 0, 4)):
        assert torch.equal(ours(x), theirs(x))
    with pytest.raises(AttributeError):
        reference(nn.ReLU())
    with pytest.raises(AttributeError):
        TiedLinear(nn.ReLU())


# Copies and checkpoints --------------------------------------------------------------------


def _pickle_with(protocol: int) -> Any:
    return lambda m: pickle.loads(pickle.dumps(m, protocol=protocol))


@pytest.mark.parametrize(
    "clone",
    [copy.deepcopy, *(_pickle_with(p) for p in range(pickle.HIGHEST_PROTOCOL + 1))],
    ids=["deepcopy", *(f"pickle{p}" for p in range(pickle.HIGHEST_PROTOCOL + 1))],
)
def test_copies_retie_to_the_copied_module(clone: Any) -> None:
    model = TiedPair(7, 3)
    copied = clone(model)
    assert copied.head.tied_module is copied.emb
    assert copied.emb is not model.emb
    with torch.no_grad():
        copied.emb.weight.zero_()
    assert torch.equal(copied.head(torch.ones(3)), torch.zeros(7))
    assert not torch.equal(model.head(torch.ones(3)), torch.zeros(7))


def test_safetensors_saves_the_state_dict_where_parameter_sharing_cannot(tmp_path: Any) -> None:
    model = TiedPair(7, 3)
    safetensors.torch.save_file(model.state_dict(), tmp_path / "tied.safetensors")
    loaded = safetensors.torch.load_file(tmp_path / "tied.safetensors")
    assert list(loaded) == ["emb.weight"]
    assert torch.equal(loaded["emb.weight"], model.emb.weight)

    shared = nn.Module()
    shared.emb = nn.Embedding(7, 3)
    shared.head = nn.Linear(3, 7, bias=False)
    shared.head.weight = shared.emb.weight
    with pytest.raises(RuntimeError, match="share memory"):
        safetensors.torch.save_file(shared.state_dict(), tmp_path / "shared.safetensors")


# Compile and autocast ----------------------------------------------------------------------


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(17, 8)
        self.block = nn.Linear(8, 8)
        self.head = TiedLinear(self.emb)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(self.emb(idx))))


def test_compiles_in_one_graph_with_no_break() -> None:
    torch._dynamo.reset()
    model = _TinyLM()
    idx = torch.tensor([[1, 2, 3], [4, 5, 16]])
    explanation = torch._dynamo.explain(model)(idx)
    assert explanation.graph_count == 1
    assert explanation.graph_break_count == 0

    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(idx), model(idx))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_behaves_as_an_equivalent_linear(dtype: torch.dtype) -> None:
    emb = nn.Embedding(7, 3)
    linear = nn.Linear(3, 7, bias=False)
    with torch.no_grad():
        linear.weight.copy_(emb.weight)
    x = torch.randn(2, 3)
    with torch.autocast("cpu", dtype=dtype):
        ours, expected = TiedLinear(emb)(x), linear(x)
    assert ours.dtype == expected.dtype == dtype
    assert torch.equal(ours, expected)
