"""The options a vocabulary-sharded loss compares across ranks, and a call that differs in one.

Shared by the threaded-rank and the gloo-process tests of the sharded loss.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

from toolkit.nn import TiedLinear

# Each option that changes the loss, its gradients or the collectives, by the name the error
# gives it: rank 0's and rank 1's keyword arguments where they differ in it. The others differ
# in what the rank does around the call (see ``call_with_one_difference``).
OPTIONS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "chunk_size": ({"chunk_size": 2}, {"chunk_size": 3}),
    "ignore_index": ({"ignore_index": -100}, {"ignore_index": -101}),
    "reduction": ({"reduction": "mean"}, {"reduction": "sum"}),
    "label_smoothing": ({"label_smoothing": 0.0}, {"label_smoothing": 0.1}),
    "z_loss": ({"z_loss": 0.0}, {"z_loss": 0.01}),
    "softcap": ({}, {"softcap": 4.0}),
}
# Each case: the options it names, and how rank 1's call differs from rank 0's.
DIFFERENCES: dict[str, tuple[str, ...]] = {
    **{name: (name,) for name in OPTIONS},
    "reduction-none": ("reduction",),  # a gradient in forward on one rank only
    "ignore_index-smallest-int64": ("ignore_index",),  # -2**63, which negation maps to itself
    "softcap-one": ("softcap",),  # 1.0 on one rank, None on the other (coded as 0.0)
    "dtype": ("dtype",),  # bfloat16 products under autocast on rank 1
    "x.requires_grad": ("x.requires_grad",),  # x requires grad on rank 0 only
    "weight.requires_grad": ("weight.requires_grad",),  # on rank 0 only
    "grad-mode": ("x.requires_grad", "weight.requires_grad"),  # torch.no_grad() on rank 1
}
NAMES = ("chunk_size", "ignore_index", "reduction", "label_smoothing", "z_loss", "softcap")
NAMES += ("dtype", "x.requires_grad", "weight.requires_grad")


def call_with_one_difference(head: TiedLinear, x: Tensor, target: Tensor, case: str) -> Tensor:
    """This rank's loss of ``x`` (a leaf copy is returned), differing from rank 0's as ``case``.

    The rank is that of the default group; the weight's ``requires_grad`` is restored.
    """
    rank = torch.distributed.get_rank()
    other = rank == 1
    options = dict(OPTIONS[case][rank]) if case in OPTIONS else {}
    if case == "reduction-none":
        options["reduction"] = "none" if other else "sum"
    if case == "ignore_index-smallest-int64":
        options["ignore_index"] = -(2**63) if other else -100
    if case == "softcap-one" and other:
        options["softcap"] = 1.0
    leaf = x.clone().requires_grad_(not (other and case == "x.requires_grad"))
    weight = head.tied_module.weight
    weight.requires_grad_(not (other and case == "weight.requires_grad"))
    grad_mode = torch.no_grad() if other and case == "grad-mode" else contextlib.nullcontext()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=other and case == "dtype")
    try:
        with grad_mode, autocast:
            head.cross_entropy(leaf, target, **options)
    finally:
        weight.requires_grad_(True)
    return leaf
