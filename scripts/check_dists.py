"""Build and check the sdist and wheel of every package under ``packages/``.

For each package: build the sdist and, from it, the wheel; run ``twine check`` and
``check-wheel-contents``; assert that the wheel ships no ``toolkit/__init__.py`` (``toolkit``
is a PEP 420 namespace shared by every package), that torch is its only requirement, that
the wheel and the sdist ship the repository's LICENSE and declare it, that the project URLs
are given, and that the classifiers name the typed package and the Python versions from
``requires-python`` on. Then install all the wheels into a new temporary venv, with a
throwaway second ``toolkit.*`` distribution built here, and import every one. Artifacts are
copied to ``--outdir`` (``dist/``).
"""

from __future__ import annotations

import argparse
import email.message
import email.parser
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import zipfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "toolkit"
ALLOWED_REQUIREMENTS = {"torch"}
PROBE = "probe"
LICENSE = ROOT / "LICENSE"
LICENSE_EXPRESSION = "Apache-2.0"
URL_LABELS = ("Homepage", "Documentation", "Repository", "Issues", "Changelog")
TYPED = "Typing :: Typed"
PYTHON_CLASSIFIER = re.compile(r"Programming Language :: Python :: 3\.(?P<minor>\d+)")
LOWER_BOUND = re.compile(r">=\s*3\.(?P<minor>\d+)")


def run(*command: str | Path, cwd: Path | None = None) -> None:
    """Run ``command``, echoing it; raise if it fails."""
    print("+", " ".join(map(str, command)), flush=True)
    subprocess.run(list(map(str, command)), check=True, cwd=cwd)


def build(package: Path, outdir: Path) -> Path:
    """Build the sdist of ``package`` and the wheel from that sdist; return the wheel."""
    run(sys.executable, "-m", "build", "--outdir", outdir, package)
    (wheel,) = outdir.glob(f"{package.name.replace('-', '_')}-*.whl")
    return wheel


def check_wheel(wheel: Path, license_text: bytes) -> list[str]:
    """What is wrong with ``wheel``'s namespace layout, requirements, licence and metadata."""
    problems: list[str] = []
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = (n for n in names if n.endswith(".dist-info/METADATA"))
        message = email.parser.Parser().parsestr(archive.read(metadata).decode())
        licence = metadata.replace("METADATA", "licenses/LICENSE")
        shipped = archive.read(licence) if licence in names else None
    if f"{NAMESPACE}/__init__.py" in names:
        problems.append(f"{wheel.name} ships {NAMESPACE}/__init__.py, which breaks the namespace")
    if not any(n.startswith(f"{NAMESPACE}/") and n.endswith("/py.typed") for n in names):
        problems.append(f"{wheel.name} ships no py.typed marker")
    requirements = message.get_all("Requires-Dist") or []
    names_required = {re.split(r"[\s;<>=!~\[(]", r, maxsplit=1)[0].lower() for r in requirements}
    if names_required != ALLOWED_REQUIREMENTS:
        problems.append(
            f"{wheel.name} requires {sorted(requirements)}; torch must be its only requirement"
        )
    if shipped is None:
        problems.append(f'{wheel.name} ships no {licence}; set license-files = ["LICENSE"]')
    elif shipped != license_text:
        problems.append(f"{wheel.name}: {licence} differs from the repository's LICENSE")
    return problems + check_metadata(wheel.name, message)


def check_metadata(name: str, message: email.message.Message) -> list[str]:
    """What is missing from the core metadata ``message`` of the distribution ``name``."""
    problems: list[str] = []
    if message.get("License-Expression") != LICENSE_EXPRESSION:
        problems.append(
            f"{name}: License-Expression is {message.get('License-Expression')!r}; set "
            f'license = "{LICENSE_EXPRESSION}"'
        )
    if "LICENSE" not in (message.get_all("License-File") or []):
        problems.append(f'{name}: no License-File LICENSE; set license-files = ["LICENSE"]')
    labels = {url.split(",", 1)[0].strip() for url in message.get_all("Project-URL") or []}
    if missing := [label for label in URL_LABELS if label not in labels]:
        problems.append(
            f"{name}: no project URL for {', '.join(missing)}; add them to [project.urls]"
        )
    classifiers = message.get_all("Classifier") or []
    if TYPED not in classifiers:
        problems.append(f"{name}: no classifier {TYPED!r}; add it for the py.typed marker")
    minors = sorted(int(m["minor"]) for c in classifiers if (m := PYTHON_CLASSIFIER.fullmatch(c)))
    bound = LOWER_BOUND.fullmatch(message.get("Requires-Python") or "")
    if bound is None:
        problems.append(f"{name}: Requires-Python must be '>=3.X'")
    elif not minors or minors != list(range(int(bound["minor"]), minors[-1] + 1)):
        versions = ", ".join(f"3.{minor}" for minor in minors) or "none"
        problems.append(
            f"{name}: the Python classifiers ({versions}) must be consecutive versions from "
            f"Requires-Python {bound[0]} on"
        )
    return problems


def check_sdist(sdist: Path, license_text: bytes) -> list[str]:
    """What is wrong with ``sdist``'s licence and metadata (its PKG-INFO)."""
    with tarfile.open(sdist) as archive:
        top = archive.getnames()[0].split("/")[0]
        files = {member.name: member for member in archive.getmembers() if member.isfile()}

        def read(name: str) -> bytes | None:
            member = files.get(f"{top}/{name}")
            stream = archive.extractfile(member) if member is not None else None
            return stream.read() if stream is not None else None

        shipped, info = read("LICENSE"), read("PKG-INFO")
    problems: list[str] = []
    if shipped is None:
        problems.append(f"{sdist.name} ships no LICENSE; add it to the sdist's include")
    elif shipped != license_text:
        problems.append(f"{sdist.name}: LICENSE differs from the repository's LICENSE")
    if info is None:
        return [*problems, f"{sdist.name} has no PKG-INFO"]
    return problems + check_metadata(sdist.name, email.parser.Parser().parsestr(info.decode()))


def make_probe(folder: Path, version: str) -> Path:
    """Write a minimal second distribution of the namespace, ``toolkit-probe``."""
    project = folder / f"{NAMESPACE}-{PROBE}"
    module = project / "src" / NAMESPACE / PROBE
    module.mkdir(parents=True)
    (module / "__init__.py").write_text('"""A throwaway namespace sibling."""\n\nVALUE = 1\n')
    (project / "pyproject.toml").write_text(
        textwrap.dedent(f"""\
            [build-system]
            requires = ["hatchling>=1.26"]
            build-backend = "hatchling.build"

            [project]
            name = "{NAMESPACE}-{PROBE}"
            version = "{version}"

            [tool.hatch.build.targets.wheel]
            packages = ["src/{NAMESPACE}"]
            """)
    )
    return project


def import_check(python: Path, modules: Sequence[str], cwd: Path) -> None:
    """Import ``modules`` with ``python`` from ``cwd`` and check they come from its venv."""
    script = textwrap.dedent(f"""\
        import importlib, sys
        import {NAMESPACE}
        assert {NAMESPACE}.__spec__.origin is None, "{NAMESPACE} must be a namespace package"
        for name in {list(modules)!r}:
            module = importlib.import_module(name)
            assert module.__file__.startswith(sys.prefix), (name, module.__file__)
            print("imported", name, "from", module.__file__)
        """)
    # torch warns at import that numpy, which it does not require, is missing.
    run(python, "-W", "ignore:Failed to initialize NumPy", "-c", script, cwd=cwd)


def main(argv: Sequence[str] | None = None) -> int:
    """Build, check, install and import every package; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outdir", type=Path, default=ROOT / "dist")
    parser.add_argument("--constraints", type=Path, default=ROOT / "constraints.txt")
    args = parser.parse_args(argv)
    packages = sorted(p.parent for p in ROOT.glob("packages/*/pyproject.toml"))
    if not packages:
        print("no packages/*/pyproject.toml found", file=sys.stderr)
        return 1
    version = (ROOT / "VERSION").read_text(encoding="utf-8").strip()
    license_text = LICENSE.read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        built = work / "dist"
        wheels = [build(package, built) for package in packages]
        run(sys.executable, "-m", "twine", "check", "--strict", *sorted(built.iterdir()))
        run(sys.executable, "-m", "check_wheel_contents", *wheels)
        problems = [problem for wheel in wheels for problem in check_wheel(wheel, license_text)]
        for sdist in sorted(built.glob("*.tar.gz")):
            problems += check_sdist(sdist, license_text)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            return 1
        probe_dir = work / "probe-dist"
        run(sys.executable, "-m", "build", "--wheel", "--outdir", probe_dir,
            make_probe(work, version))  # fmt: skip
        run(sys.executable, "-m", "venv", work / "venv")
        python = work / "venv" / "bin" / "python"
        pip = (python, "-m", "pip", "install", "--quiet", "--no-compile", "-c", args.constraints)
        run(*pip, *wheels)
        modules = [f"{NAMESPACE}.{p.name.removeprefix(f'{NAMESPACE}-')}" for p in packages]
        import_check(python, modules, cwd=work)
        run(*pip, *probe_dir.glob("*.whl"))
        import_check(python, [*modules, f"{NAMESPACE}.{PROBE}"], cwd=work)
        args.outdir.mkdir(parents=True, exist_ok=True)
        for artifact in sorted(built.iterdir()):
            shutil.copy2(artifact, args.outdir / artifact.name)
    print(f"Built and checked {len(packages)} package(s) into {args.outdir}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
