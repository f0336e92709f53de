"""Sessions for every package of the toolkit monorepo.

Packages are found by listing ``packages/``; sessions that concern one package are
parametrized by its id, the folder name without the ``toolkit-`` prefix (``nn`` for
``packages/toolkit-nn``, imported as ``toolkit.nn`` and tested in ``tests/nn``).

Python: every session runs on one interpreter, the first of ``SUPPORTED`` that is on the
PATH (3.11 first: CI runs it, and torch's CPU build is the one installed there).
``TOOLKIT_PYTHON=3.12 nox`` picks another; CI sets ``TOOLKIT_PYTHON=3.11``, so a missing 3.11
fails there instead of falling back.

Virtual environments, all under ``.nox/``, created with venv and filled with pip, every
version pinned by ``constraints.txt`` (``nox -s pins`` refreshes it):

- torch is installed once, into ``.nox/torch-<python>``, which the sessions that import it
  (typecheck, tests, example, docs, bench) share. It holds the packages, editable, and every
  dependency group those sessions use. It is reinstalled only when ``constraints.txt`` or a
  ``pyproject.toml`` changes: a stamp file records their digest. Sharing trades a little
  isolation for four fewer torch installs; ``nox -s build`` still installs the wheels into a
  venv that holds nothing else.
- lint, build, lockstep and bump need no torch and keep nox's own small venvs, reused from run
  to run: pip brings them back to the pins on every run.

Delete ``.nox/`` to start from nothing. The release version is the one line of ``VERSION``;
``lockstep`` checks that every package, the CHANGELOG and the docs agree with it, and ``bump``
moves them all.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
CONSTRAINTS = ROOT / "constraints.txt"
PACKAGE_PYPROJECTS = sorted(ROOT.glob("packages/*/pyproject.toml"))
PACKAGES = [p.parent.name.removeprefix("toolkit-") for p in PACKAGE_PYPROJECTS]
# The Python versions every package supports, oldest first, from their classifiers (which
# `nox -s build` checks against requires-python).
SUPPORTED = tuple(
    version
    for version in nox.project.python_versions(nox.project.load_toml(PACKAGE_PYPROJECTS[0]))
    if all(
        version in nox.project.python_versions(nox.project.load_toml(p)) for p in PACKAGE_PYPROJECTS
    )
)
# The dependency groups installed into the shared torch venv.
TORCH_GROUPS = ("test", "typecheck", "docs", "example", "bench")
# pip's -c does not reach the isolated environments that build the packages (hatchling);
# the environment variable does.
PINNED_BUILDS = {"PIP_CONSTRAINT": str(CONSTRAINTS)}

nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "typecheck", "tests", "example", "docs", "build", "lockstep"]

# nox looks for uv on every run and logs "uv binary not found." when it is absent. This
# project uses pip and venv only, so the message says nothing; drop it.
logging.getLogger("nox").addFilter(lambda record: record.getMessage() != "uv binary not found.")


def find_python() -> str:
    """The Python version the sessions run on: ``TOOLKIT_PYTHON``, or the first that runs."""
    if chosen := os.environ.get("TOOLKIT_PYTHON"):
        return chosen
    for version in SUPPORTED:
        # A version manager's shim can be on the PATH without an interpreter behind it.
        found = shutil.which(f"python{version}")
        if found is None:
            continue
        if subprocess.run([found, "-c", ""], capture_output=True, check=False).returncode == 0:
            return version
    return SUPPORTED[0]  # nox then reports "Python interpreter 3.11 not found"


PYTHON = find_python()
TORCH_VENV = Path(".nox") / f"torch-{PYTHON}"  # relative, so that logged commands stay short


def package_dir(package: str) -> str:
    """The source folder of the package with id ``package``."""
    return f"packages/toolkit-{package}"


def requirements(*names: str) -> list[str]:
    """The requirements of the root dependency groups ``names``, in order, without repeats."""
    found = (req for name in names for req in nox.project.dependency_groups(PYPROJECT, name))
    return list(dict.fromkeys(found))


def install(session: nox.Session, *packages: str, groups: tuple[str, ...] = ()) -> None:
    """Install ``packages`` editable plus the root dependency ``groups`` into the session's venv."""
    editables = [arg for package in packages for arg in ("-e", package_dir(package))]
    session.install("-c", str(CONSTRAINTS), *editables, *requirements(*groups))


def pytest_args(package: str, posargs: list[str]) -> list[str]:
    """The pytest arguments of ``nox -s tests``: ``posargs``, by default over ``tests/<id>``.

    pytest itself decides whether ``posargs`` name paths: ``testpaths`` is used only when no
    path or test id is given, so ``-k docs`` stays a pattern and ``tests/docs`` a path.
    """
    return ["-o", f"testpaths=tests/{package}", *posargs]


def torch_venv(session: nox.Session) -> dict[str, str]:
    """Create or update the shared torch venv; return the environment that activates it.

    A stamp holds the digest of what decides its contents (the Python, ``constraints.txt``
    and every ``pyproject.toml``); while it matches, nothing is installed.
    """
    inputs = [CONSTRAINTS, ROOT / "pyproject.toml", *PACKAGE_PYPROJECTS]
    digest = hashlib.sha256(PYTHON.encode())
    for path in inputs:
        digest.update(path.read_bytes())
    stamp = ROOT / TORCH_VENV / "toolkit-inputs.sha256"
    python = ROOT / TORCH_VENV / "bin" / "python"
    env = {
        "VIRTUAL_ENV": str(ROOT / TORCH_VENV),
        "PATH": os.pathsep.join([str(ROOT / TORCH_VENV / "bin"), os.environ.get("PATH", "")]),
    }
    if python.exists() and stamp.exists() and stamp.read_text() == digest.hexdigest():
        session.log(f"Reusing {TORCH_VENV}: its inputs are unchanged")
        return env
    if not python.exists():
        interpreter = shutil.which(f"python{PYTHON}")
        if interpreter is None:
            session.error(f"Python interpreter {PYTHON} not found; install one of {SUPPORTED}")
        session.run(interpreter, "-m", "venv", str(TORCH_VENV), external=True)
    stamp.unlink(missing_ok=True)
    # --no-compile: torch ships thousands of modules and imports few; the rest need no bytecode.
    pip = (str(TORCH_VENV / "bin" / "python"), "-m", "pip", "install", "--no-compile")
    editables = [arg for package in PACKAGES for arg in ("-e", package_dir(package))]
    session.run(
        *pip,
        "-c",
        str(CONSTRAINTS),
        *editables,
        *requirements(*TORCH_GROUPS),
        env=PINNED_BUILDS,
        external=True,
        silent=True,
    )
    # torchtune's own dependencies do not import beside current torchao; the tests and the
    # benchmark load its torchtune/modules/tied_linear.py file alone.
    session.run(*pip, "--no-deps", *requirements("torchtune-reference"), external=True, silent=True)
    stamp.write_text(digest.hexdigest())
    return env


def run_in_torch_venv(session: nox.Session, program: str, *args: str, **env: str) -> None:
    """Run ``program`` of the shared torch venv with ``args``."""
    venv_env = torch_venv(session)
    session.run(str(TORCH_VENV / "bin" / program), *args, env={**venv_env, **env}, external=True)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """Ruff lint and format check over the whole repository."""
    install(session, groups=("lint",))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(venv_backend="none")
@nox.parametrize("package", PACKAGES)
def typecheck(session: nox.Session, package: str) -> None:
    """Mypy --strict over the package and its typing tests (``tests/typing/<id>_types.py``)."""
    targets = [f"{package_dir(package)}/src", *map(str, ROOT.glob(f"tests/typing/{package}_*.py"))]
    run_in_torch_venv(
        session,
        "mypy",
        "--explicit-package-bases",
        *targets,
        MYPYPATH=f"{package_dir(package)}/src",
    )


@nox.session(venv_backend="none")
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """Pytest over ``tests/<id>``; arguments after ``--`` go to pytest."""
    run_in_torch_venv(session, "pytest", *pytest_args(package, session.posargs))


@nox.session(venv_backend="none", default=False)
def bench(session: nox.Session) -> None:
    """Benchmark toolkit-nn against the alternatives; not part of the default sessions.

    torchtune is installed without its dependencies, and only its ``tied_linear.py`` is
    loaded: the package itself no longer imports beside current torchao. Arguments after
    ``--`` go to ``benchmarks/bench_nn.py``: ``--quick``, ``--json PATH``, ``--only SECTION``.
    """
    run_in_torch_venv(session, "python", "benchmarks/bench_nn.py", *session.posargs)


@nox.session(python=PYTHON, default=False)
def transformers_mixin(session: nox.Session) -> None:
    """Run transformers' own model tests on tied models; not a default session.

    Downloads the sdist of the pinned transformers into the session's temporary folder
    (nothing of it is kept) and runs its ``ModelTesterMixin`` on Llama, GPT-2, Qwen2 and
    Gemma 2, stock tied against ``tie_output_embeddings`` (``tests/transformers_mixin``), and
    the PEFT and accelerate tests, which ``nox -s tests`` runs too. The mixin's 1,288 tests
    take about 10 minutes on two busy cores.
    """
    install(session, "nn", groups=("transformers-mixin",))
    tmp = Path(session.create_tmp())
    (transformers,) = requirements("transformers")
    pip = ("python", "-m", "pip", "download", "--no-binary", ":all:", "--no-deps")
    session.run(*pip, "--dest", str(tmp), "-c", str(CONSTRAINTS), transformers, silent=True)
    archive = next(tmp.glob("transformers-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    tests = tmp / archive.name.removesuffix(".tar.gz") / "tests"
    session.run(
        "pytest",
        "tests/nn/test_transformers_peft.py",
        "tests/nn/test_transformers_accelerate.py",
        *session.posargs,
    )
    env = {"TRANSFORMERS_SDIST_TESTS": str(tests)}
    session.run("pytest", "tests/transformers_mixin", *session.posargs, env=env)


@nox.session(python=PYTHON, default=False)
def torchtitan(session: nox.Session) -> None:
    """Train torchtitan's tied Qwen3 with pipeline parallelism: ``examples/torchtitan_pp.py``.

    Runs ``tests/torchtitan``, which launch the recipe of ``docs/torchtitan.md`` on 2 and 4
    gloo ranks and compare it with one process. Its own venv holds torchtitan and triton,
    which torchtitan imports even on the CPU: about 2.5 GB with torch, so it is not a default
    session; CI runs it. Arguments after ``--`` go to pytest.
    """
    install(session, "nn")
    session.install("-c", str(CONSTRAINTS), "pytest", "hypothesis")
    # Unconstrained but for torch: datasets, which torchtitan needs, caps fsspec below the pin.
    (torch,) = (line for line in CONSTRAINTS.read_text().splitlines() if line.startswith("torch=="))
    session.install(torch, *requirements("torchtitan"))
    session.run("pytest", "tests/torchtitan", *session.posargs)


@nox.session(venv_backend="none")
def example(session: nox.Session) -> None:
    """Train the tiny tied language model of ``examples/`` on the CPU."""
    run_in_torch_venv(session, "python", "examples/tiny_lm.py", *session.posargs)


@nox.session(venv_backend="none")
def docs(session: nox.Session) -> None:
    """Build the site with ``--strict``, then run the docs' examples and the guides as written.

    Every example of the docs and docstrings runs in the torch venv; then every guide runs
    again in a fresh venv of torch, the package and what the guide says to install.
    ``nox -s docs -- build`` only builds the site, into ``site/`` (seconds; the examples take
    minutes). ``nox -s docs -- serve`` serves it at http://127.0.0.1:8000 instead, rebuilding
    on every change to ``docs/`` or to a package's sources. Other arguments go to pytest.
    """
    env = {"NO_MKDOCS_2_WARNING": "1"}
    if session.posargs == ["serve"]:
        run_in_torch_venv(session, "mkdocs", "serve", "--strict", **env)
        return
    run_in_torch_venv(session, "mkdocs", "build", "--strict", **env)
    if session.posargs == ["build"]:
        return
    run_in_torch_venv(session, "pytest", "tests/docs", *session.posargs, **env)


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """Build, check, install and import the sdist and wheel of every package (into dist/).

    The wheels are installed, with torch, into a temporary venv that holds nothing else of
    this repository. It is deleted afterwards: keeping a second copy of torch in ``.nox``
    would cost about 0.8 GB to save the 15 to 30 seconds of installing it from pip's cache.
    """
    install(session, groups=("build",))
    command = ("python", "scripts/check_dists.py", "--constraints", str(CONSTRAINTS))
    session.run(*command, env=PINNED_BUILDS)


@nox.session(python=PYTHON)
def lockstep(session: nox.Session) -> None:
    """Check that every package, CHANGELOG.md and the docs agree with ``VERSION``.

    It also runs the tests of the release and mutation scripts (``tests/release``,
    ``tests/mutation``), which need no torch.
    """
    install(session, groups=("lockstep",))
    session.run("pytest", "tests/release", "tests/mutation", *session.posargs)
    session.run("python", "scripts/lockstep.py", "check")


@nox.session(python=PYTHON, default=False)
def bump(session: nox.Session) -> None:
    """Move ``VERSION`` and every package to a new release: ``nox -s bump -- X.Y.Z``.

    It refuses when the packages' sources differ from those of the last whole mutation run
    (``tests/mutation/whole-run.toml``): run ``nox -s mutation -- --record`` first.
    """
    if len(session.posargs) != 1:
        session.error("give the new version: nox -s bump -- X.Y.Z")
    # A release ships only sources that the whole mutation run has passed.
    session.run("python", "scripts/mutation.py", "--check-release")
    session.run("python", "scripts/lockstep.py", "bump", *session.posargs)


@nox.session(python=PYTHON, default=False)
def mutation(session: nox.Session) -> None:
    """Mutation testing of every package (``scripts/mutation.py``); not a default session.

    The whole run: mutmut mutates every function of ``packages/*/src`` and runs the
    single-process tests, then the compile and multi-rank tests run against each mutant still
    alive; it fails on a survivor missing from ``tests/mutation/equivalent.toml`` or on a stale
    entry there, and ``-- --record`` writes its commit and score to
    ``tests/mutation/whole-run.toml``. ``-- --changed`` mutates only the functions changed
    since that commit and those a changed test file reaches, at most ``--budget`` mutants
    (CI runs ``-- --changed --budget 300``), and skips before installing anything when
    nothing changed; ``-- --changed --list`` only prints them. The packages are installed,
    not editable: the tests import the mutated copy.
    """
    if "--changed" in session.posargs:
        plan = session.run("python", "scripts/mutation.py", "--list", *session.posargs, silent=True)
        if isinstance(plan, str) and "nothing changed" in plan:
            session.skip("nothing changed since the whole run, tests/mutation/whole-run.toml")
    session.install("-c", str(CONSTRAINTS), *map(package_dir, PACKAGES), *requirements("mutation"))
    session.install("--no-deps", *requirements("torchtune-reference"))
    session.run("pytest", "tests/mutation", "-q")
    session.run("python", "scripts/mutation.py", *session.posargs)


@nox.session(python=PYTHON, reuse_venv=False, default=False)
def pins(session: nox.Session) -> None:
    """Refresh ``constraints.txt``: the newest release of every tool, torch kept as pinned.

    Installs every dependency group, the packages' build backends and nox into a fresh venv,
    with only torch constrained (move it by editing its line first), and writes what pip
    installed, ``pip freeze``'s exact versions, below the file's comment header. pip chooses
    for the Python it runs on: run it on the oldest supported one (``TOOLKIT_PYTHON``), and
    cap in ``pyproject.toml`` a tool whose newest release needs a newer patch release.
    """
    text = CONSTRAINTS.read_text(encoding="utf-8")
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    torch = re.search(r"^torch==\S+$", text, re.MULTILINE)
    if torch is None:
        session.error("constraints.txt has no torch==X.Y.Z line to keep")
    backends = [
        requirement
        for path in PACKAGE_PYPROJECTS
        for requirement in nox.project.load_toml(path)["build-system"]["requires"]
    ]
    names = [name for name in PYPROJECT["dependency-groups"] if name != "torchtune-reference"]
    session.install("--no-compile", torch[0], *requirements(*names), *backends)
    session.install("--no-deps", *requirements("torchtune-reference"))
    frozen = session.run("python", "-m", "pip", "freeze", "--all", silent=True)
    assert isinstance(frozen, str)
    # A local version label (+cpu) would refuse every other build of the same release.
    lines = sorted(
        {re.sub(r"\+\S+$", "", line) for line in frozen.splitlines() if "==" in line},
        key=lambda line: re.sub(r"[-_.]+", "-", line.split("==")[0]).lower(),
    )
    keep = [line for line in lines if line.split("==")[0].lower() not in {"pip", "setuptools"}]
    CONSTRAINTS.write_text(header + "\n".join(keep) + "\n", encoding="utf-8")
    session.log(f"Wrote {len(keep)} pins to constraints.txt; review the diff and run nox")
