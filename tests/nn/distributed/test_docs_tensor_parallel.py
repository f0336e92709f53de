"""The examples of docs/tensor-parallel.md run on two gloo ranks, and its error is the real one.

The page's ```py blocks form one ``torchrun`` script, run in order in one namespace on two
ranks, as ``torchrun --nproc-per-node 2`` would. Their assertions check the page's claims:
the loss of each recipe equals the unsharded model's, the logits' layouts, and the
collectives counted by ``CommDebugMode``. On two ranks the 2-D mesh is 1 x 2; the 2 x 2 mesh
is trained against a reference in ``test_tensor_parallel.py``.
"""

from __future__ import annotations

import pytest

from tests.nn.distributed.pages import DOCS, blocks, fences, run_page

PAGE = DOCS / "tensor-parallel.md"


@pytest.fixture(scope="module")
def namespaces() -> list[dict[str, object]]:
    return run_page(PAGE)


def test_every_block_of_the_page_is_run_or_checked() -> None:
    kinds = fences(PAGE)
    assert kinds.count("py") == 9
    assert kinds.count("text") == 1
    # ```python blocks would run in a single process, without the process group they need.
    assert set(kinds) == {"py", "text"}


def test_the_page_script_runs_on_two_ranks(namespaces: list[dict[str, object]]) -> None:
    assert len(namespaces) == 2
    for namespace in namespaces:
        assert namespace["collectives"] == ["all_reduce"]
        assert namespace["outside_loss_parallel"] == "raises"
        assert "loss_parallel()" in str(namespace["local_slice"])


def test_the_error_shown_is_the_one_every_rank_raises(
    namespaces: list[dict[str, object]],
) -> None:
    ((_, shown),) = blocks(PAGE, "text")
    for namespace in namespaces:
        assert " ".join(str(namespace["message"]).split()) == " ".join(shown.split())
