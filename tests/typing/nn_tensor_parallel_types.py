"""Static typing of TiedLinearParallel, checked by ``mypy --strict`` (``nox -s typecheck``).

The package loads the style on first use, through a module ``__getattr__``; its type is
still the class itself, as this file shows.
"""

from __future__ import annotations

from typing import assert_type

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from toolkit.nn import TiedLinearParallel

style = TiedLinearParallel(
    input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True
)
assert_type(style, TiedLinearParallel)
base: ParallelStyle = style
default = TiedLinearParallel()
