"""TiedLinearParallel in one process: its defaults, its repr, and its lazy import.

Its behaviour on ranks is tested in ``tests/nn/distributed/test_tensor_parallel.py``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

import toolkit.nn
from toolkit.nn import TiedLinearParallel


def test_the_defaults_give_vocabulary_sharded_logits_as_dtensors() -> None:
    style = TiedLinearParallel()
    assert isinstance(style, ParallelStyle)
    assert style.input_layouts == (Replicate(),)
    assert style.desired_input_layouts == (Replicate(),)
    assert style.output_layouts == (Shard(-1),)
    assert style.use_local_output is False


def test_the_arguments_are_kept_as_torch_styles_keep_them() -> None:
    style = TiedLinearParallel(
        input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True
    )
    assert style.input_layouts == (Shard(1),)
    assert style.desired_input_layouts == (Replicate(),)
    assert style.output_layouts == (Replicate(),)
    assert style.use_local_output is True
    assert repr(style) == (
        "TiedLinearParallel(input_layouts=(Shard(dim=1),), output_layouts=(Replicate(),), "
        "use_local_output=True)"
    )


@pytest.mark.parametrize("kwargs", [{}, {"output_layouts": Shard(-1)}], ids=["default", "shard-1"])
def test_a_local_tensor_of_vocabulary_sharded_logits_is_refused_naming_both_fixes(
    kwargs: dict[str, object],
) -> None:
    """A plain loss on this rank's slice of the vocabulary is silently wrong, so the
    combination is refused at once."""
    with pytest.raises(ValueError, match=r"^TiedLinearParallel\(use_local_output=True") as info:
        TiedLinearParallel(use_local_output=True, **kwargs)  # type: ignore[arg-type]
    assert str(info.value) == (
        "TiedLinearParallel(use_local_output=True, output_layouts=Shard(dim=-1)) would return "
        "this rank's slice of the vocabulary as a plain tensor, and a loss computed on it is "
        "silently wrong. Keep use_local_output=False and compute the loss inside "
        "torch.distributed.tensor.parallel.loss_parallel(), or pass output_layouts=Replicate() "
        "for the full logits"
    )


def test_importing_the_package_does_not_import_tensor_parallelism() -> None:
    code = (
        "import sys, toolkit.nn; "
        "assert 'torch.distributed.tensor' not in sys.modules; "
        "toolkit.nn.TiedLinearParallel; "
        "assert 'torch.distributed.tensor' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match=r"^module 'toolkit.nn' has no attribute 'Nope'$"):
        toolkit.nn.Nope  # noqa: B018


def test_the_package_attribute_is_looked_up_on_each_use_and_gives_the_style() -> None:
    # The name is not cached in the package's namespace: every access asks __getattr__.
    assert "TiedLinearParallel" not in vars(toolkit.nn)
    assert toolkit.nn.TiedLinearParallel is TiedLinearParallel
    assert getattr(toolkit.nn, "TiedLinearParallel") is TiedLinearParallel  # noqa: B009
