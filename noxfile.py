"""Sessions for every package of the toolkit monorepo.

Packages are found by listing ``packages/``; sessions that concern one package are
parametrized by its id, the folder name without the ``toolkit-`` prefix (``nn`` for
``packages/toolkit-nn``, imported as ``toolkit.nn`` and tested in ``tests/nn``).

Every session installs with pip into a fresh venv and pins torch through ``constraints.txt``.
The release version is the one line of ``VERSION``; ``lockstep`` checks that every package, the
CHANGELOG and the docs agree with it, and ``bump`` moves them all.
"""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
PYTHON = "3.11"
PACKAGES = sorted(
    p.parent.name.removeprefix("toolkit-") for p in ROOT.glob("packages/*/pyproject.toml")
)

nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "typecheck", "tests", "example", "docs", "build", "lockstep"]


def package_dir(package: str) -> str:
    """The source folder of the package with id ``package``."""
    return f"packages/toolkit-{package}"


def install(session: nox.Session, *packages: str, groups: tuple[str, ...] = ()) -> None:
    """Install ``packages`` editable plus the root dependency ``groups``, torch pinned."""
    requirements = [
        req for group in groups for req in nox.project.dependency_groups(PYPROJECT, group)
    ]
    editables = [arg for package in packages for arg in ("-e", package_dir(package))]
    session.install(*CONSTRAINTS, *editables, *requirements)


def install_torchtune_reference(session: nox.Session) -> None:
    """Install torchtune without its dependencies, for ``benchmarks/torchtune_reference.py``."""
    session.install("--no-deps", *nox.project.dependency_groups(PYPROJECT, "torchtune-reference"))


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """Ruff lint and format check over the whole repository."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
@nox.parametrize("package", PACKAGES)
def typecheck(session: nox.Session, package: str) -> None:
    """Mypy --strict over the package and its typing tests (``tests/typing/<id>_types.py``)."""
    install(session, package, groups=("typecheck",))
    targets = [f"{package_dir(package)}/src", *map(str, ROOT.glob(f"tests/typing/{package}_*.py"))]
    session.run(
        "mypy",
        "--explicit-package-bases",
        *targets,
        env={"MYPYPATH": f"{package_dir(package)}/src"},
    )


@nox.session(python=PYTHON)
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """Pytest over ``tests/<id>``; arguments after ``--`` go to pytest."""
    install(session, package, groups=("test",))
    install_torchtune_reference(session)
    # Arguments naming existing files or folders (``tests/nn/test_x.py::test_y``) replace the
    # default path; option values such as the pattern after ``-k`` do not.
    has_paths = any((ROOT / arg.split("::")[0]).exists() for arg in session.posargs)
    paths = [] if has_paths else [f"tests/{package}"]
    session.run("pytest", *paths, *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmark toolkit-nn against the alternatives; not part of the default sessions.

    torchtune is installed without its dependencies, and only its ``tied_linear.py`` is
    loaded: the package itself no longer imports beside current torchao. Arguments after
    ``--`` go to ``benchmarks/bench_nn.py``: ``--quick``, ``--json PATH``, ``--only SECTION``.
    """
    install(session, "nn", groups=("bench",))
    install_torchtune_reference(session)
    session.run("python", "benchmarks/bench_nn.py", *session.posargs)


@nox.session(python=PYTHON)
def example(session: nox.Session) -> None:
    """Train the tiny tied language model of ``examples/`` on the CPU."""
    install(session, *PACKAGES, groups=("example",))
    session.run("python", "examples/tiny_lm.py", *session.posargs)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the site with ``--strict`` and run every example of the docs and docstrings.

    ``nox -s docs -- serve`` serves the site at http://127.0.0.1:8000 instead, rebuilding on
    every change.
    """
    install(session, *PACKAGES, groups=("docs",))
    env = {"NO_MKDOCS_2_WARNING": "1"}
    if session.posargs == ["serve"]:
        session.run("mkdocs", "serve", "--strict", env=env)
        return
    session.run("mkdocs", "build", "--strict", env=env)
    session.run("pytest", "tests/docs", *session.posargs, env=env)


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """Build, check, install and import the sdist and wheel of every package (into dist/)."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "build"))
    session.run("python", "scripts/check_dists.py", "--constraints", CONSTRAINTS[1])


@nox.session(python=PYTHON)
def lockstep(session: nox.Session) -> None:
    """Check that every package, CHANGELOG.md and the docs agree with ``VERSION``."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "lockstep"))
    session.run("pytest", "tests/release", *session.posargs)
    session.run("python", "scripts/lockstep.py", "check")


@nox.session(python=PYTHON)
def bump(session: nox.Session) -> None:
    """Move ``VERSION`` and every package to a new release: ``nox -s bump -- X.Y.Z``."""
    if len(session.posargs) != 1:
        session.error("give the new version: nox -s bump -- X.Y.Z")
    session.run("python", "scripts/lockstep.py", "bump", *session.posargs)


@nox.session(python=PYTHON)
def mutation(session: nox.Session) -> None:
    """Mutation testing of every package (``scripts/mutation.py``); not a default session.

    mutmut mutates every function of ``packages/*/src`` and runs the single-process tests, then
    the compile and multi-rank tests run against each mutant still alive. It fails on a
    survivor missing from ``tests/mutation/equivalent.toml`` or on a stale entry there, and
    reports the score. The packages are installed, not editable: the tests import the mutated
    copy, which comes first on the path. Arguments after ``--`` go to the script:
    ``--changed`` mutates only the sources that differ from the last recorded full run (CI
    runs that), ``--record`` records a full run that passed.
    """
    requirements = nox.project.dependency_groups(PYPROJECT, "mutation")
    session.install(*CONSTRAINTS, *map(package_dir, PACKAGES), *requirements)
    install_torchtune_reference(session)
    session.run("pytest", "tests/mutation", "-q")
    session.run("python", "scripts/mutation.py", *session.posargs)
