"""transformers' own ModelTesterMixin, loaded from its sdist, on stock and tied models.

``nox -s transformers_mixin`` downloads the transformers 5.23.0 sdist, unpacks it and names
its ``tests`` folder in ``TRANSFORMERS_SDIST_TESTS``; nothing of it is kept in this
repository. The sdist's ``test_modeling_common.py`` imports two modules that the sdist does
not ship (the export and generation mixins): empty stand-ins take their place, so their
tests are not run (``generate()`` is compared in ``tests/nn/test_transformers.py``).

Every mixin test runs twice per architecture, on the stock tied model (``...StockTest``) and
with ``tie_output_embeddings`` (``...TiedTest``). At the end, a test that passed on the stock
model and did not pass with the tie fails the run, unless ``EXPECTED`` explains it; what
fails on both (the mixin expects things of its own testers that these small ones do not
meet) is reported, not failed on.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

SDIST_TESTS = os.environ.get("TRANSFORMERS_SDIST_TESTS")

# Tests that inspect what a head that is not an nn.Linear cannot give, each with what a user
# of the tied model sees.
EXPECTED = {
    "test_model_get_set_embeddings": (
        "requires get_output_embeddings() to be None or an nn.Linear; the tied head is a "
        "module but no nn.Linear (whose weight transformers' initialisation would draw anew), "
        "so code that checks the head's type sees another type (its forward, weight and "
        "out_features are the stock head's)"
    ),
    "test_model_weights_reload_no_missing_tied_weights": (
        "from_pretrained's loading info is made before the model can be tied, and names "
        "lm_head.weight as missing, as the stock model's does; the tied model has no such "
        "parameter, so the test's tied-pair exemption, which looks for it, does not apply"
    ),
}


def _stub(name: str, **attributes: object) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    module.__path__ = []  # type: ignore[attr-defined]  # a package, for the dotted names
    sys.modules[name] = module


if SDIST_TESTS:
    package = types.ModuleType("hf_tests")
    package.__path__ = [str(Path(SDIST_TESTS))]  # type: ignore[attr-defined]
    sys.modules["hf_tests"] = package
    _stub("hf_tests.exporters")
    _stub("hf_tests.exporters.test_export", ExportTesterMixin=type("ExportTesterMixin", (), {}))
    _stub("hf_tests.generation")
    _stub(
        "hf_tests.generation.test_utils",
        GenerationTesterMixin=type("GenerationTesterMixin", (), {}),
    )

# The markers transformers' test modules use, which this project's strict markers refuse.
MARKERS = [
    "accelerate_tests",
    "flash_attn_test",
    "flash_attn_3_test",
    "flash_attn_4_test",
    "is_agent_test",
    "is_expert_parallel_test",
    "is_fsdp_test",
    "is_pipeline_test",
    "is_staging_test",
    "is_tensor_parallel_test",
    "is_training_test",
    "order",
    "slow",
    "torch_compile_test",
]


def pytest_configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", f"{marker}: a marker of transformers' own tests")


OUTCOMES: dict[str, str] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        OUTCOMES.setdefault(report.nodeid, report.outcome)


def compare(outcomes: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
    """Tied tests that differ from the stock one: unexplained, explained, and failing on both."""
    unexplained, explained, both = [], [], []
    for node, outcome in sorted(outcomes.items()):
        if "TiedTest::" not in node:
            continue
        stock = outcomes.get(node.replace("TiedTest::", "StockTest::"))
        name = node.rpartition("::")[2]
        if stock == "passed" and outcome != "passed":
            (explained if name in EXPECTED else unexplained).append(node)
        elif stock == "failed" and outcome == "failed":
            both.append(node)
    return unexplained, explained, both


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if not OUTCOMES or "TiedTest::" not in " ".join(OUTCOMES):
        return
    unexplained, explained, both = compare(OUTCOMES)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [
        "",
        f"Stock against tied: {len(unexplained)} unexplained difference(s), "
        f"{len(explained)} expected, {len(both)} failing on both (not counted).",
    ]
    lines += [f"  UNEXPLAINED {node}" for node in unexplained]
    lines += [f"  expected    {node}: {EXPECTED[node.rpartition('::')[2]]}" for node in explained]
    for line in lines:
        if reporter is not None:
            reporter.write_line(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED if unexplained else pytest.ExitCode.OK
