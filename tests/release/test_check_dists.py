"""The checks of scripts/check_dists.py catch a broken wheel or sdist.

The full build, install and import run in `nox -s build`; these tests feed the checks small
hand-made wheels and sdists, so that a check that passes everything is caught.
"""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from scripts.check_dists import check_sdist, check_wheel

ROOT = Path(__file__).resolve().parents[2]
LICENSE = b"The licence text.\n"
GOOD = {"toolkit/nn/__init__.py": "", "toolkit/nn/py.typed": ""}
URLS = ["Homepage", "Documentation", "Repository", "Issues", "Changelog"]
HEADERS = {
    "License-Expression": ["Apache-2.0"],
    "License-File": ["LICENSE"],
    "Requires-Python": [">=3.11"],
    "Classifier": [
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Typing :: Typed",
    ],
    "Project-URL": [f"{label}, https://example.org/{label.lower()}" for label in URLS],
}


def metadata(requires: list[str], **changes: list[str]) -> str:
    headers = {**HEADERS, "Requires-Dist": requires, **changes}
    text = "Metadata-Version: 2.4\nName: toolkit-nn\nVersion: 1.0.0\n"
    return text + "".join(
        f"{key}: {value}\n" for key, values in headers.items() for value in values
    )


def wheel(
    folder: Path,
    files: dict[str, str],
    requires: list[str],
    licence: bytes | None = LICENSE,
    **changes: list[str],
) -> Path:
    path = folder / "toolkit_nn-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, content in files.items():
            archive.writestr(name, content)
        archive.writestr("toolkit_nn-1.0.0.dist-info/METADATA", metadata(requires, **changes))
        if licence is not None:
            archive.writestr("toolkit_nn-1.0.0.dist-info/licenses/LICENSE", licence)
    return path


def sdist(folder: Path, licence: bytes | None = LICENSE, **changes: list[str]) -> Path:
    path = folder / "toolkit_nn-1.0.0.tar.gz"
    files = {"PKG-INFO": metadata(["torch"], **changes).encode(), "pyproject.toml": b""}
    if licence is not None:
        files["LICENSE"] = licence
    with tarfile.open(path, "w:gz") as archive:
        for name, content in files.items():
            info = tarfile.TarInfo(f"toolkit_nn-1.0.0/{name}")
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
    return path


def test_the_licence_files_are_the_repositorys() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0")
    assert "END OF TERMS AND CONDITIONS" in text
    for package in ROOT.glob("packages/*/pyproject.toml"):
        assert (package.parent / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()


@pytest.mark.parametrize("torch", ["torch>=2.13", "torch", "torch==2.13.0"])
def test_a_namespace_wheel_that_needs_only_torch_passes(tmp_path: Path, torch: str) -> None:
    assert check_wheel(wheel(tmp_path, GOOD, [torch]), LICENSE) == []


def test_a_complete_sdist_passes(tmp_path: Path) -> None:
    assert check_sdist(sdist(tmp_path), LICENSE) == []


def test_a_namespace_init_is_reported(tmp_path: Path) -> None:
    (problem,) = check_wheel(
        wheel(tmp_path, {**GOOD, "toolkit/__init__.py": ""}, ["torch"]), LICENSE
    )
    assert "ships toolkit/__init__.py" in problem


def test_a_missing_py_typed_is_reported(tmp_path: Path) -> None:
    (problem,) = check_wheel(wheel(tmp_path, {"toolkit/nn/__init__.py": ""}, ["torch"]), LICENSE)
    assert "no py.typed" in problem


@pytest.mark.parametrize(
    "requires",
    [[], ["numpy"], ["torch>=2.13", "numpy>=1"], ["torch", "torchtune; extra == 'x'"]],
)
def test_any_requirement_but_torch_alone_is_reported(tmp_path: Path, requires: list[str]) -> None:
    (problem,) = check_wheel(wheel(tmp_path, GOOD, requires), LICENSE)
    assert "torch must be its only requirement" in problem


def test_a_wheel_without_the_licence_is_reported(tmp_path: Path) -> None:
    (problem,) = check_wheel(wheel(tmp_path, GOOD, ["torch"], licence=None), LICENSE)
    assert problem == (
        "toolkit_nn-1.0.0-py3-none-any.whl ships no toolkit_nn-1.0.0.dist-info/licenses/LICENSE;"
        ' set license-files = ["LICENSE"]'
    )


def test_a_wheel_with_another_licence_text_is_reported(tmp_path: Path) -> None:
    (problem,) = check_wheel(wheel(tmp_path, GOOD, ["torch"], licence=b"MIT\n"), LICENSE)
    assert problem.endswith("licenses/LICENSE differs from the repository's LICENSE")


def test_an_sdist_without_the_licence_is_reported(tmp_path: Path) -> None:
    (problem,) = check_sdist(sdist(tmp_path, licence=None), LICENSE)
    assert problem == "toolkit_nn-1.0.0.tar.gz ships no LICENSE; add it to the sdist's include"
    (problem,) = check_sdist(sdist(tmp_path, licence=b"MIT\n"), LICENSE)
    assert problem == "toolkit_nn-1.0.0.tar.gz: LICENSE differs from the repository's LICENSE"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"License-Expression": []},
            'License-Expression is None; set license = "Apache-2.0"',
        ),
        (
            {"License-Expression": ["MIT"]},
            "License-Expression is 'MIT'; set license = \"Apache-2.0\"",
        ),
        (
            {"License-File": []},
            'no License-File LICENSE; set license-files = ["LICENSE"]',
        ),
        (
            {"Project-URL": ["Homepage, https://example.org"]},
            "no project URL for Documentation, Repository, Issues, Changelog; "
            "add them to [project.urls]",
        ),
        (
            {"Classifier": HEADERS["Classifier"][:-1]},
            "no classifier 'Typing :: Typed'; add it for the py.typed marker",
        ),
        (
            {"Classifier": ["Typing :: Typed"]},
            "the Python classifiers (none) must be consecutive versions from "
            "Requires-Python >=3.11 on",
        ),
        (
            {"Requires-Python": [">=3.10"]},
            "the Python classifiers (3.11, 3.12) must be consecutive versions from "
            "Requires-Python >=3.10 on",
        ),
        (
            {
                "Classifier": [
                    "Programming Language :: Python :: 3.11",
                    "Programming Language :: Python :: 3.13",
                    "Typing :: Typed",
                ]
            },
            "the Python classifiers (3.11, 3.13) must be consecutive versions from "
            "Requires-Python >=3.11 on",
        ),
        ({"Requires-Python": []}, "Requires-Python must be '>=3.X'"),
    ],
)
def test_missing_metadata_is_reported_for_wheel_and_sdist(
    tmp_path: Path, changes: dict[str, list[str]], message: str
) -> None:
    (problem,) = check_wheel(wheel(tmp_path, GOOD, ["torch"], **changes), LICENSE)
    assert problem == f"toolkit_nn-1.0.0-py3-none-any.whl: {message}"
    (problem,) = check_sdist(sdist(tmp_path, **changes), LICENSE)
    assert problem == f"toolkit_nn-1.0.0.tar.gz: {message}"
