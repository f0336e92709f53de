"""Shared test configuration: Hypothesis profiles from the root pyproject.toml.

Hypothesis loads its built-in "ci" profile by itself when the CI variable is set; the "ci"
table here refines it in place. Elsewhere the "dev" profile is loaded. HYPOTHESIS_PROFILE or
pytest's ``--hypothesis-profile`` choose another, such as "nightly".
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

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
