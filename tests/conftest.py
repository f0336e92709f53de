"""Shared test configuration: Hypothesis profiles from the root pyproject.toml.

Hypothesis loads its built-in "ci" profile by itself when the CI variable is set; the "ci"
table here refines it in place. Elsewhere the "dev" profile is loaded. HYPOTHESIS_PROFILE or
pytest's ``--hypothesis-profile`` choose another, such as "nightly".

It also holds the fixtures that more than one test folder uses.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

_CONFIG = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
_PROFILES: dict[str, dict[str, object]] = _CONFIG["tool"]["hypothesis"]["profiles"]

for _name, _options in _PROFILES.items():
    _parent = settings.get_profile("ci") if _name == "ci" else None
    settings.register_profile(
        _name,
        _parent,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        **_options,  # type: ignore[arg-type]
    )

if "HYPOTHESIS_PROFILE" in os.environ:
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])
elif settings.get_current_profile_name() == "default":
    settings.load_profile("dev")

if settings.get_current_profile_name() == "mutation":
    # Hypothesis also draws the constants it finds in the project's loaded modules (about one
    # draw in twenty), so the examples would change with any literal of the sources, mutants
    # included, and with the modules a run has imported. Under mutation testing a verdict
    # must follow from the mutant and its tests alone: draw none of them. (An internal of
    # Hypothesis, pinned in constraints.txt.)
    from hypothesis.internal.conjecture import providers

    providers._get_local_constants = providers.Constants  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def torchtune_tied_linear() -> type:
    """torchtune's own ``TiedLinear``, which ``toolkit.nn.TiedLinear`` replaces.

    torchtune no longer imports beside current torchao, so it is installed without its
    dependencies and only its ``torchtune/modules/tied_linear.py``, which needs torch alone,
    is executed.
    """
    path = "torchtune/modules/tied_linear.py"
    dist_files = importlib.metadata.distribution("torchtune").files or []
    (file,) = [f for f in dist_files if str(f) == path]
    spec = importlib.util.spec_from_file_location("torchtune_tied_linear", file.locate())
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TiedLinear  # type: ignore[no-any-return]
