"""Static checks of toolkit.nn's types, run by `nox -s typecheck` (mypy --strict), not pytest.

Each ``assert_type`` fails the type check if the inferred type differs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import assert_type

import torch
from torch import nn

from toolkit.nn import (
    ModuleDefaultDict,
    TiedLinear,
    create_entries,
    sync_entries,
    tie_output_embeddings,
)

heads = ModuleDefaultDict(functools.partial(nn.Linear, 4, 2))
assert_type(heads, ModuleDefaultDict[nn.Linear])
assert_type(heads["task"], nn.Linear)
assert_type(heads.get("task"), nn.Linear | None)
assert_type(heads.get("task", 0), nn.Linear | int)
assert_type(heads.pop("task"), nn.Linear)
assert_type(heads.default_factory, Callable[[], nn.Linear] | None)

explicit = ModuleDefaultDict[nn.Embedding]()
assert_type(explicit["vocab"], nn.Embedding)
for name, module in explicit.items():
    assert_type(name, str)
    assert_type(module, nn.Embedding)
for value in explicit.values():
    assert_type(value, nn.Embedding)

from_class = ModuleDefaultDict(nn.Identity, {"a": nn.Identity()})
assert_type(from_class["a"], nn.Identity)

head = TiedLinear(nn.Embedding(10, 4))
assert_type(head(torch.zeros(4)), torch.Tensor)
assert_type(head.weight, torch.Tensor)
assert_type(head.in_features, int)
assert_type(head.out_features, int)
assert_type(head.requires_grad_(False), TiedLinear)
# Any transformers PreTrainedModel, which is an nn.Module; transformers is not imported here.
assert_type(tie_output_embeddings(nn.Module()), TiedLinear)
assert_type(head.tied_module, nn.Module)
assert_type(head.linear, nn.Module)

assert_type(heads.pop("task", None), nn.Linear | None)
assert_type(heads.setdefault("task", nn.Linear(4, 2)), nn.Linear)
assert_type(ModuleDefaultDict[nn.Linear](None, None), ModuleDefaultDict[nn.Linear])
assert_type(create_entries(heads, ["a.weight"], prefix=""), list[str])
assert_type(sync_entries(heads), list[str])
