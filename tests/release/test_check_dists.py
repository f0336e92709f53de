"""The wheel checks of scripts/check_dists.py catch a broken namespace or extra requirements.

The full build, install and import run in `nox -s build`; these tests feed the checks small
hand-made wheels, so that a check that passes everything is caught.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from scripts.check_dists import check_wheel

GOOD = {"toolkit/nn/__init__.py": "", "toolkit/nn/py.typed": ""}


def wheel(folder: Path, files: dict[str, str], requires: list[str]) -> Path:
    path = folder / "toolkit_nn-1.0.0-py3-none-any.whl"
    metadata = "Metadata-Version: 2.4\nName: toolkit-nn\nVersion: 1.0.0\n"
    metadata += "".join(f"Requires-Dist: {requirement}\n" for requirement in requires)
    with zipfile.ZipFile(path, "w") as archive:
        for name, content in files.items():
            archive.writestr(name, content)
        archive.writestr("toolkit_nn-1.0.0.dist-info/METADATA", metadata)
    return path


@pytest.mark.parametrize("torch", ["torch>=2.13", "torch", "torch==2.13.0"])
def test_a_namespace_wheel_that_needs_only_torch_passes(tmp_path: Path, torch: str) -> None:
    assert check_wheel(wheel(tmp_path, GOOD, [torch])) == []


def test_a_namespace_init_is_reported(tmp_path: Path) -> None:
    (problem,) = check_wheel(wheel(tmp_path, {**GOOD, "toolkit/__init__.py": ""}, ["torch"]))
    assert "ships toolkit/__init__.py" in problem


def test_a_missing_py_typed_is_reported(tmp_path: Path) -> None:
    (problem,) = check_wheel(wheel(tmp_path, {"toolkit/nn/__init__.py": ""}, ["torch"]))
    assert "no py.typed" in problem


@pytest.mark.parametrize(
    "requires",
    [[], ["numpy"], ["torch>=2.13", "numpy>=1"], ["torch", "torchtune; extra == 'x'"]],
)
def test_any_requirement_but_torch_alone_is_reported(tmp_path: Path, requires: list[str]) -> None:
    (problem,) = check_wheel(wheel(tmp_path, GOOD, requires))
    assert "torch must be its only requirement" in problem
