"""The examples of docs/pipeline-parallel.md run on three gloo ranks; its error is the real one.

The page's ```py blocks form one ``torchrun`` script: three pipeline stages of a tied model,
the middle one without a copy of the embedding, trained (with gradient accumulation, and with
the tied embedding frozen), checked against the whole model trained in one process,
checkpointed and exported. This test runs them in order, in one namespace, on three ranks,
as ``torchrun`` would.
"""

from __future__ import annotations

import pytest

from tests.nn.distributed.pages import DOCS, blocks, fences, run_page

PAGE = DOCS / "pipeline-parallel.md"


@pytest.fixture(scope="module")
def namespaces() -> list[dict[str, object]]:
    return run_page(PAGE, world_size=3)


def test_every_block_of_the_page_is_run_or_checked() -> None:
    kinds = fences(PAGE)
    assert kinds.count("py") >= 9
    assert kinds.count("text") == 1
    # ```python blocks would run in a single process, without the process group they need.
    assert set(kinds) == {"py", "text"}


def test_the_pipeline_matches_the_whole_model_in_one_process(
    namespaces: list[dict[str, object]],
) -> None:
    first, middle, last = namespaces
    assert first["losses"] == middle["losses"] == []  # only the last stage computes losses
    assert len(last["losses"]) == 6  # type: ignore[arg-type]
    for namespace in namespaces:
        assert len(namespace["norms"]) == 3  # type: ignore[arg-type]
        assert min(namespace["norms"]) > 1.0  # type: ignore[type-var]  # clipping scaled
        assert namespace["norms"] == pytest.approx(last["norms"], rel=1e-6)
    assert last["losses"] == pytest.approx(last["reference_losses"], rel=1e-5)


def test_accumulating_over_two_steps_matches_one_step_on_all_rows(
    namespaces: list[dict[str, object]],
) -> None:
    # The page asserts the weights too; here the norms, the same on every rank.
    for namespace in namespaces:
        assert namespace["accumulated_norm"] > 1.0  # type: ignore[operator]
        assert namespace["accumulated_norm"] == pytest.approx(namespace["reference_norm"], rel=1e-5)


def test_a_frozen_tied_embedding_keeps_no_gradient(namespaces: list[dict[str, object]]) -> None:
    first, middle, last = namespaces
    assert first["frozen_gradients"] == last["frozen_gradients"] == [None]
    assert middle["frozen_gradients"] == []


def test_the_export_holds_every_weight_once(namespaces: list[dict[str, object]]) -> None:
    for namespace in namespaces:
        assert namespace["exported_keys"] == [
            "layers.0.bias",
            "layers.0.weight",
            "layers.1.bias",
            "layers.1.weight",
            "layers.2.bias",
            "layers.2.weight",
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
