"""The torchtitan guide's recipe, examples/torchtitan_pp.py, trains as one process does.

docs/torchtitan.md shows the recipe; it runs here as the page says, with torchrun on gloo
ranks: torchtitan's Qwen3 debug model, tied by ``TiedLinear`` and ``PipelineTie``, split by
torchtitan into two pipeline stages, with FSDP2 on four ranks. Each launch trains three
steps, resumes step 3 from a DCP checkpoint of step 2 into fresh stages, and checks the
losses, the clip norms and the weights against torchtitan's own tied model in one process;
it also loads the checkpoint into torchtitan's own tied model, and exits with status 1 if
anything differs. ``nox -s torchtitan`` runs these tests (CI
does); elsewhere, without torchtitan, they are skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.torchrun import torchrun

pytest.importorskip("torchtitan")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchtitan_pp.py"
TIMEOUT = 600


@pytest.mark.parametrize(
    ("nproc", "args", "layout"),
    [
        (2, ("--schedule", "1F1B"), "pp=2 x dp=1, 1F1B, partial_dtensor"),
        (2, ("--schedule", "GPipe"), "pp=2 x dp=1, GPipe, partial_dtensor"),
        (2, ("--spmd-backend", "spmd_types"), "pp=2 x dp=1, 1F1B, spmd_types"),
        (4, (), "pp=2 x dp=2, 1F1B, partial_dtensor"),
        (
            4,
            ("--fsdp-reshard-after-forward", "always"),
            "pp=2 x dp=2, 1F1B, partial_dtensor",
        ),
    ],
    ids=["pp2-1f1b", "pp2-gpipe", "pp2-spmd-types", "pp2-dp2-fsdp2", "pp2-dp2-reshard-always"],
)
def test_the_recipe_trains_and_resumes_as_one_process(
    nproc: int, args: tuple[str, ...], layout: str
) -> None:
    done = torchrun(EXAMPLE, nproc, *args, timeout=TIMEOUT)
    assert done.returncode == 0, done.output[-5000:]
    assert f"parity with one process ({layout}): all match" in done.output


def test_without_the_tie_reduction_the_clip_is_refused_on_every_rank() -> None:
    done = torchrun(EXAMPLE, 2, "--no-tie-reduction", timeout=TIMEOUT)
    assert done.returncode != 0, done.output[-5000:]
    for rank in (0, 1):  # the last stage's copy still holds its part of the tied gradient
        assert f"[rank{rank}]: RuntimeError: pipeline_clip_grad_norm_" in done.output
        assert "reduce_grads()" in done.output


def test_fsdp2_under_spmd_types_is_refused_with_where_to_read_why() -> None:
    done = torchrun(EXAMPLE, 4, "--spmd-backend", "spmd_types", timeout=TIMEOUT)
    assert done.returncode != 0
    assert "torchtitan's FSDP2 set-up fails under spmd_types: see the guide" in done.output


def test_torchtitans_own_untied_model_fails_there_too() -> None:
    """Why the recipe refuses FSDP2 under spmd_types: torchtitan fails without the tie too.

    When this fails, torchtitan has fixed it: lift the recipe's refusal and test the layout.
    """
    done = torchrun(Path(__file__).parent / "stock_spmd_types.py", 4, timeout=TIMEOUT)
    assert done.returncode == 0, done.output[-5000:]
    failed = "FSDP2 set-up failed: When dp_mesh_dims is provided, all parameters must be DTensors"
    for rank in range(4):
        assert f"rank {rank}: {failed}" in done.output


def test_the_private_name_the_recipe_sets_is_still_torchtitans_device_type() -> None:
    """The recipe's one reach into torchtitan's internals, on the CPU: it fails loudly here."""
    import torchtitan.distributed.parallel_dims as parallel_dims  # noqa: PLC0415

    assert parallel_dims.device_type in ("cuda", "cpu")
