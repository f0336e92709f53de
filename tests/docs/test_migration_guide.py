"""The migration guide's warning holds: torchtune's own code checks for its TiedLinear.

torchtune's activation offloading keeps the output layer's activations in place by hooking
``model.output``, found with ``isinstance(model.output, TiedLinear)`` for torchtune's class.
A ``toolkit.nn.TiedLinear`` is neither an ``nn.Module`` nor that class, so the check misses.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from torch import nn

from toolkit.nn import TiedLinear

ROOT = Path(__file__).resolve().parents[2]
OFFLOADING = "torchtune/training/_activation_offloading.py"


def test_torchtunes_activation_offloading_checks_for_its_own_class() -> None:
    dist = importlib.metadata.distribution("torchtune")
    (file,) = (f for f in dist.files or () if str(f) == OFFLOADING)
    source = Path(str(dist.locate_file(file))).read_text(encoding="utf-8")
    assert "from torchtune.modules import TiedLinear" in source
    assert "elif isinstance(model.output, TiedLinear):" in source
    assert "no output head was detected" in source


def test_the_toolkit_head_matches_neither_of_its_checks(torchtune_tied_linear: type) -> None:
    head = TiedLinear(nn.Embedding(5, 3))
    assert not isinstance(head, nn.Module)
    assert not isinstance(head, torchtune_tied_linear)
    assert isinstance(torchtune_tied_linear(nn.Embedding(5, 3)), torchtune_tied_linear)


def test_the_guide_says_so() -> None:
    guide = " ".join((ROOT / "docs" / "migrating-from-torchtune.md").read_text().split())
    assert "nothing else" not in guide
    assert "`isinstance(model.output, torchtune.modules.TiedLinear)` stops matching" in guide
    assert "activation offloading" in guide
