"""The distribution: its version, its place in the ``toolkit`` namespace and its public names."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from torch import nn

import toolkit
import toolkit.nn

ROOT = Path(__file__).parents[2]


def test_version_comes_from_the_installed_metadata_and_matches_the_release() -> None:
    release = (ROOT / "VERSION").read_text().strip()
    assert toolkit.nn.__version__ == importlib.metadata.version("toolkit-nn") == release


def test_toolkit_is_a_namespace_package() -> None:
    # PEP 420: no toolkit/__init__.py, so sibling distributions can add toolkit.* modules.
    assert getattr(toolkit, "__file__", None) is None
    assert type(toolkit.__path__).__name__ == "_NamespacePath"


def test_public_api() -> None:
    assert toolkit.nn.__all__ == [
        "ModuleDefaultDict",
        "PipelineTie",
        "TiedLinear",
        "TiedLinearParallel",
        "__version__",
        "clip_grad_norm_",
        "create_entries",
        "pipeline_clip_grad_norm_",
        "sync_entries",
        "tie_output_embeddings",
    ]


def test_public_names_print_as_toolkit_nn() -> None:
    # Where a user finds them, not the private module that defines them: in reprs, pickles
    # and torch's own errors.
    for name in toolkit.nn.__all__:
        if name != "__version__":
            assert getattr(toolkit.nn, name).__module__ == "toolkit.nn", name
    assert repr(toolkit.nn.TiedLinearParallel) == "<class 'toolkit.nn.TiedLinearParallel'>"
    embedding = nn.Embedding(17, 8)
    with pytest.raises(TypeError, match=r"^toolkit\.nn\.TiedLinear is not a Module subclass$"):
        nn.Sequential(embedding, toolkit.nn.TiedLinear(embedding))
