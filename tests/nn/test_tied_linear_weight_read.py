"""How TiedLinear reads the tied weight on each call, and the module hooks that call fires.

A registered Parameter is read straight from ``tied_module._parameters``; every other kind of
weight is read through the attribute. Both must give what ``tied_module.weight`` gives at
the time of the call, including inside ``torch.compile``. The ``linear`` submodule is still
called as a Module, so global module hooks fire as well as its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_hooks

from toolkit.nn import TiedLinear


class _BufferWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.randn(5, 3))


class _PlainWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.randn(5, 3)  # not a Parameter, so a plain attribute


class _PropertyWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, 3))
        self.scale = 2.0

    @property
    def weight(self) -> torch.Tensor:
        return self.table * self.scale


_OWNERS: dict[str, Callable[[], nn.Module]] = {
    "parameter": lambda: nn.Linear(3, 5, bias=False),
    "buffer": _BufferWeight,
    "plain attribute": _PlainWeight,
    "property": _PropertyWeight,
}


def _change_weight(owner: nn.Module) -> None:
    if isinstance(owner, _PropertyWeight):
        owner.scale = -3.0
    elif isinstance(owner, (_BufferWeight, _PlainWeight)):
        owner.weight = torch.randn(5, 3)
    else:
        owner.weight = nn.Parameter(torch.randn(5, 3))


@pytest.mark.parametrize("kind", list(_OWNERS))
def test_every_kind_of_weight_is_read_live(kind: str) -> None:
    owner = _OWNERS[kind]()
    head = TiedLinear(owner)
    x = torch.randn(2, 3)
    torch.testing.assert_close(head(x), F.linear(x, owner.weight), rtol=0, atol=0)
    _change_weight(owner)
    torch.testing.assert_close(head(x), F.linear(x, owner.weight), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["parameter", "buffer"])
def test_both_reads_compile_in_one_graph(kind: str) -> None:
    torch._dynamo.reset()
    owner = _OWNERS[kind]()
    head = TiedLinear(owner)
    x = torch.randn(2, 3)
    explanation = torch._dynamo.explain(head)(x)
    assert explanation.graph_count == 1
    assert explanation.graph_break_count == 0
    compiled = torch.compile(head, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), F.linear(x, owner.weight), rtol=0, atol=0)


@contextmanager
def _global_hooks(seen: list[tuple[str, nn.Module, Any]]) -> Iterator[None]:
    handles = [
        module_hooks.register_module_forward_pre_hook(
            lambda m, args: seen.append(("pre", m, args))
        ),
        module_hooks.register_module_forward_hook(
            lambda m, _args, out: seen.append(("post", m, out))
        ),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def test_global_module_hooks_see_input_weight_and_output_once_per_call() -> None:
    emb = nn.Embedding(7, 3)
    head = TiedLinear(emb)
    x = torch.randn(2, 3)
    seen: list[tuple[str, nn.Module, Any]] = []

    with _global_hooks(seen):
        out = head(x)
        head(x)

    assert [(kind, m) for kind, m, _ in seen] == [
        ("pre", head.linear),
        ("post", head.linear),
    ] * 2
    pre_x, pre_weight = seen[0][2]
    assert pre_x is x
    assert pre_weight is emb.weight
    assert torch.equal(seen[1][2], out)


def test_global_and_local_hooks_fire_together_once_each() -> None:
    head = TiedLinear(nn.Embedding(7, 3))
    order: list[str] = []
    head.linear.register_forward_pre_hook(lambda _m, _args: order.append("local pre"))
    head.linear.register_forward_hook(lambda _m, _args, _out: order.append("local post"))
    seen: list[tuple[str, nn.Module, Any]] = []

    with _global_hooks(seen):
        head(torch.randn(2, 3))

    assert order == ["local pre", "local post"]
    assert [kind for kind, _, _ in seen] == ["pre", "post"]


def test_a_tied_module_replaced_by_an_object_that_is_no_module_is_read_through_the_attribute() -> (
    None
):
    # Only the constructor insists on an nn.Module; like torchtune's, the attribute can be set
    # to anything with a weight afterwards, and the call reads it as it reads any attribute.
    head = TiedLinear(nn.Linear(3, 5, bias=False))
    weight = torch.randn(5, 3)

    class Holder:  # no __getattr__ of its own, unlike every Module
        def __init__(self) -> None:
            self.weight = weight

    head.tied_module = Holder()  # type: ignore[assignment]
    x = torch.randn(2, 3)
    torch.testing.assert_close(head(x), F.linear(x, weight), rtol=0, atol=0)
