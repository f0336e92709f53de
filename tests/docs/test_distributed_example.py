"""The parallelism guide's example, examples/parallel_3d.py, trains as one process does.

docs/parallelism.md walks through the example and gives its command; it runs here as the
page says, once, with torchrun on 8 gloo ranks: it trains the tied LM on a ``(pp, dp, tp)``
mesh of 2 x 2 x 2 with the tensor-parallel guide's plan and with the sequence-parallel one,
resumes step 3 of each from a DCP checkpoint of step 2 in fresh stages, checks itself against
the whole model in one process, and writes what each rank measured with ``--report``. These
tests read that report and compare each plan's run with the one-process reference computed
here.
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.torchrun import torchrun

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "parallel_3d.py"
TIMEOUT = 300


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("parallel_3d", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the example once, as its docstring says; its output, status and report."""
    report = tmp_path_factory.mktemp("parallel-3d") / "report.json"
    done = torchrun(EXAMPLE, 8, "--report", str(report), timeout=TIMEOUT)
    return {
        "returncode": done.returncode,
        "output": done.output,
        "ranks": json.loads(report.read_text()) if report.exists() else None,
    }


@pytest.fixture(scope="module")
def ranks(launch: dict[str, Any]) -> list[dict[str, Any]]:
    """What each rank measured: written even when the example's own check fails."""
    assert launch["ranks"] is not None, launch["output"][-5000:]
    return launch["ranks"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    return load_example().reference()  # type: ignore[no-any-return]


PLANS = ("tp", "sp")


def test_the_example_prints_each_step_and_passes_its_parity_check(
    launch: dict[str, Any], ranks: list[dict[str, Any]]
) -> None:
    assert launch["returncode"] == 0, launch["output"][-5000:]
    for plan in PLANS:
        for step in (1, 2, 3):
            assert f"{plan} step {step}: loss " in launch["output"]
    passed = "parity with one process (tp and sp): losses, norms and weights match"
    assert passed in launch["output"]
    for rank in ranks:
        assert sorted(rank["plans"]) == sorted(PLANS)
    coords = sorted(tuple(rank["coords"]) for rank in ranks)
    assert coords == [(pp, dp, tp) for pp in (0, 1) for dp in (0, 1) for tp in (0, 1)]


@pytest.mark.parametrize("plan", PLANS)
def test_each_rank_finds_its_losses_norms_and_weights_are_those_of_one_process(
    plan: str, ranks: list[dict[str, Any]]
) -> None:
    for rank in ranks:
        assert rank["plans"][plan]["problems"] == []


@pytest.mark.parametrize("plan", PLANS)
def test_losses_and_norms_are_those_of_one_process(
    plan: str, ranks: list[dict[str, Any]], expected: dict[str, Any]
) -> None:
    example = load_example()
    assert min(step["norm"] for step in expected["steps"]) > example.MAX_NORM  # always clips
    for rank in ranks:
        pp, dp, _ = rank["coords"]
        run = rank["plans"][plan]
        for got, want in zip(run["steps"], expected["steps"], strict=True):
            assert got["norm"] == pytest.approx(want["norm"], rel=1e-5)
            mine = want["losses"][dp * example.MICROBATCHES : (dp + 1) * example.MICROBATCHES]
            assert got["losses"] == ([] if pp == 0 else pytest.approx(mine, rel=1e-5))
    # Between them the stages hold every weight of the whole model; both hold the tie.
    stage_keys = [set(rank["plans"][plan]["keys"]) for rank in ranks]
    assert set().union(*stage_keys) == set(expected["state"])
    assert all("emb.weight" in keys for keys in stage_keys)


def test_the_plans_put_the_norms_on_their_meshes(ranks: list[dict[str, Any]]) -> None:
    # The guide's plan leaves the norms and the adapters to FSDP2 alone, on dp, beside the
    # tensor-parallel weights on (dp, tp): one clip over two meshes. Sequence parallelism
    # replicates them over tp, so every weight is on (dp, tp).
    for rank in ranks:
        pp = rank["coords"][0]
        unsharded = [f"blocks.{pp}.norm.weight", f"blocks.{pp}.norm.bias"]
        if pp == 1:
            unsharded += ["norm.weight", "adapters.lm.weight", "adapters.lm.bias"]
        for plan, on_dp in (("tp", ["dp"]), ("sp", ["dp", "tp"])):
            meshes = rank["plans"][plan]["meshes"]
            assert meshes["emb.weight"] == meshes[f"blocks.{pp}.up.weight"] == ["dp", "tp"]
            assert all(meshes[name] == on_dp for name in unsharded)


@pytest.mark.parametrize("plan", PLANS)
def test_a_resume_from_the_step_2_checkpoint_reproduces_step_3(
    plan: str, ranks: list[dict[str, Any]]
) -> None:
    for rank in ranks:
        run = rank["plans"][plan]
        assert run["resumed"] == run["steps"][-1]  # exactly, on every rank


@pytest.mark.parametrize("plan", PLANS)
def test_the_tie_adds_one_all_reduce_and_one_broadcast_of_its_local_shard_and_nothing_else(
    plan: str, ranks: list[dict[str, Any]]
) -> None:
    shards = set()
    for rank in ranks:
        run = rank["plans"][plan]
        tied, untied = dict(run["counts"]["tied"]), dict(run["counts"]["untied"])
        tied_sizes, untied_sizes = tied.pop("all_reduce_sizes"), untied.pop("all_reduce_sizes")
        assert tied.pop("c10d.allreduce_") == untied.pop("c10d.allreduce_") + 1
        assert tied.pop("c10d.broadcast_") == untied.pop("c10d.broadcast_", 0) + 1
        assert tied == untied
        added = Counter(tied_sizes)
        added.subtract(untied_sizes)
        # The local shard of the gradient, three counters (copies with a gradient, frozen, that
        # train), the two copies' checksums (8 elements each) and two flags (a copy replaced
        # since set-up; a gradient on stage 1's copy at the last broadcast).
        added[run["shard"] + 21] -= 1
        # On a stage with a copy, the clip leaves the duplicate out: its agreement on which
        # DTensors have a gradient (two flags a parameter, one all-reduce per dimension of
        # the mesh) is one parameter shorter.
        changed = sorted((size, n) for size, n in added.items() if n)
        if changed:
            (shorter, fewer), (longer, more) = changed
            assert (fewer, more, longer - shorter) == (2, -2, 2)
        shards.add(run["shard"])
    # 17 rows split 9 + 8 by tp, then 5 + 4 and 4 + 4 by dp, of 8 columns: uneven shards.
    assert shards == {5 * 8, 4 * 8}
