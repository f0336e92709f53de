"""The examples of docs/pipeline-parallel.md run on two gloo ranks, and its error is the real one.

The page's ```py blocks form one ``torchrun`` script: two pipeline stages of a tied model,
trained, checked against the whole model trained in one process, checkpointed and exported.
This test runs them in order, in one namespace, on two ranks, as ``torchrun`` would.
"""

from __future__ import annotations

import pytest

from tests.nn.distributed.pages import DOCS, blocks, fences, run_page

PAGE = DOCS / "pipeline-parallel.md"


@pytest.fixture(scope="module")
def namespaces() -> list[dict[str, object]]:
    return run_page(PAGE)


def test_every_block_of_the_page_is_run_or_checked() -> None:
    kinds = fences(PAGE)
    assert kinds.count("py") >= 6
    assert kinds.count("text") == 1
    # ```python blocks would run in a single process, without the process group they need.
    assert set(kinds) == {"py", "text"}


def test_the_pipeline_matches_the_whole_model_in_one_process(
    namespaces: list[dict[str, object]],
) -> None:
    first, last = namespaces
    assert first["losses"] == []  # only the last stage computes losses
    assert len(last["losses"]) == 6  # type: ignore[arg-type]
    for namespace in namespaces:
        assert len(namespace["norms"]) == 3  # type: ignore[arg-type]
        assert min(namespace["norms"]) > 1.0  # type: ignore[type-var]  # clipping scaled
    assert first["norms"] == pytest.approx(last["norms"], rel=1e-6)
    assert last["losses"] == pytest.approx(last["reference_losses"], rel=1e-5)


def test_the_export_holds_every_weight_once(namespaces: list[dict[str, object]]) -> None:
    for namespace in namespaces:
        assert namespace["exported_keys"] == [
            "layers.0.bias",
            "layers.0.weight",
            "layers.1.bias",
            "layers.1.weight",
            "norm.bias",
            "norm.weight",
            "tok_embeddings.weight",
        ]


def test_the_error_shown_is_the_one_every_rank_raises(
    namespaces: list[dict[str, object]],
) -> None:
    ((_, shown),) = blocks(PAGE, "text")
    for namespace in namespaces:
        assert " ".join(str(namespace["message"]).split()) == " ".join(shown.split())
