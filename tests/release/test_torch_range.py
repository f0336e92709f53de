"""Every package allows exactly the torch minor release that constraints.txt pins and CI tests.

A new torch minor release may change what the packages rely on (FSDP2, DTensor, pipelining);
pip must not choose one that the suite has not run on, and moving the pin without the range
(or the range without the pin) must fail here.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECTS = sorted(ROOT.glob("packages/*/pyproject.toml"))


def pinned_torch(constraints: str) -> Version:
    """The torch release that ``constraints`` (the text of constraints.txt) pins."""
    (pin,) = re.findall(r"^torch==(\S+)$", constraints, re.MULTILINE)
    return Version(pin)


def torch_range(pyproject: Path) -> SpecifierSet:
    """The torch specifier of the package whose ``pyproject.toml`` this is."""
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    (torch,) = (Requirement(d) for d in dependencies if Requirement(d).name == "torch")
    return torch.specifier


def problems(pin: Version, allowed: SpecifierSet) -> list[str]:
    """What is wrong with ``allowed`` for a suite that runs on torch ``pin``."""
    found = []
    if pin not in allowed:
        found.append(f"the pinned torch {pin} is outside {allowed}")
    next_minor = Version(f"{pin.major}.{pin.minor + 1}")
    if next_minor in allowed or Version(f"{pin.major + 1}.0") in allowed:
        found.append(f"{allowed} allows torch {next_minor}, which CI does not run")
    return found


@pytest.mark.parametrize("pyproject", PYPROJECTS, ids=lambda p: p.parent.name)
def test_each_package_allows_the_pinned_torch_minor_release_only(pyproject: Path) -> None:
    pin = pinned_torch((ROOT / "constraints.txt").read_text())
    assert problems(pin, torch_range(pyproject)) == []


@pytest.mark.parametrize(
    ("pin", "allowed", "wrong"),
    [
        ("2.13.0", ">=2.13", "allows torch 2.14"),  # open above
        ("2.13.0", ">=2.13,<3", "allows torch 2.14"),
        ("2.14.0", ">=2.13,<2.14", "outside"),  # the pin moved, the range did not
    ],
)
def test_a_range_that_disagrees_with_the_pin_is_reported(
    pin: str, allowed: str, wrong: str
) -> None:
    assert any(wrong in problem for problem in problems(Version(pin), SpecifierSet(allowed)))
    assert problems(Version("2.13.0"), SpecifierSet(">=2.13,<2.14")) == []
