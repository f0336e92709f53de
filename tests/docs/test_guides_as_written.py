"""Every guide runs as a user runs it: in a fresh venv, with what the page says to install.

The other docs tests run the pages' code in the docs session's venv, which holds every tool of
the project, so a page that imports a package it never names would pass there. Here a venv
holds torch and this package, installed by the quickstart's own commands, and each page's
code runs with only what the page's introduction says to ``pip install`` added: its Python
blocks as one script, its multi-process blocks as one script under ``torchrun`` with the
page's number of processes, and the page's example commands as written. pip takes the
versions of ``constraints.txt``, the ones the pages were tested with.

docs/torchtitan.md is left to the torchtitan session, which runs its commands in a venv of
torch, torchtitan, triton and this package (2.5 GB), as the page says.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from tests.docs.examples import python_blocks
from tests.nn.ranks import crashed
from tests.torchrun import EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CONSTRAINTS = ROOT / "constraints.txt"
# Each guide: a page with code, which runs here, but torchtitan.md (see above).
GUIDES = sorted(
    p.name
    for p in DOCS.glob("*.md")
    if p.name not in {"index.md", "changelog.md", "benchmarks.md", "torchtitan.md"}
)
FENCE = re.compile(r"^ *```")
PIP_LINE = re.compile(r"`pip install ([^`]+)`")
PROCESSES = re.compile(r"--nproc-per-node (\d+)")
TIMEOUT_S = 600


def introduction(page: str) -> str:
    """The page up to its first fenced block: where it says what to install."""
    lines = (DOCS / page).read_text(encoding="utf-8").splitlines()
    end = next(i for i, line in enumerate(lines) if FENCE.match(line))
    return "\n".join(lines[:end])


def extras(page: str) -> tuple[str, ...]:
    """What the page's introduction says to ``pip install``, beyond torch and this package."""
    return tuple(
        sorted(name for line in PIP_LINE.findall(introduction(page)) for name in line.split())
    )


def commands(page: str) -> list[str]:
    """The commands of the page's ``bash`` blocks."""
    text = (DOCS / page).read_text(encoding="utf-8")
    return [
        line.split("#")[0].strip()
        for block in python_blocks(text, "bash")
        for line in block.code.splitlines()
        if line.split("#")[0].strip()
    ]


# How many times a torchrun whose rank crashed in native code is launched (see run).
LAUNCHES = 6


def run(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
    """Run ``command``; fail the test with its output if it fails.

    A ``torchrun`` in which a rank crashed in native code runs again, up to five times. The
    pages' scripts end as users' do, with ``destroy_process_group()`` and a normal exit, and
    on two cores gloo's worker thread now and then releases a finished collective's tensors
    while Python is shutting down, which aborts the process after its work is done (about one
    launch in twelve of the pipeline page's; the sharded training page's once crashed three
    launches in a row); the rank processes of the other tests leave with ``os._exit`` and do
    not meet it.
    """
    for _ in range(LAUNCHES):
        done = subprocess.run(
            command,
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
        codes = EXIT_CODE.findall(done.stdout + done.stderr)
        if not (done.returncode and any(crashed(int(code)) for code in codes)):
            break
    if done.returncode:
        pytest.fail(
            f"{shlex.join(command)} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}"
        )


def user_env(folder: Path) -> dict[str, str]:
    """The environment of a shell with ``folder``'s venv activated, pinned as the pages were."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = f"{folder / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(folder)
    env["PIP_CONSTRAINT"] = str(CONSTRAINTS)
    return env


@pytest.fixture(scope="session")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with what the quickstart installs: torch, then this package from the clone."""
    folder = tmp_path_factory.mktemp("user") / "venv"
    venv.create(folder, with_pip=True)
    installs = [c for c in commands("quickstart.md") if c.startswith("pip install")]
    assert installs == ["pip install torch==2.13.0", "pip install ./packages/toolkit-nn"]
    for command in installs:
        run(shlex.split(command), ROOT, user_env(folder))
    return folder


@pytest.fixture(scope="session")
def venv_for(base_venv: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The venv of a page's extras: one that sees the base venv's packages and adds them."""
    made: dict[tuple[str, ...], Path] = {(): base_venv}

    def get(names: tuple[str, ...]) -> Path:
        if names not in made:
            folder = tmp_path_factory.mktemp("extras") / "venv"
            venv.create(folder, with_pip=True)
            purelib = Path(sysconfig.get_path("purelib", vars={"base": str(folder)}))
            base = Path(sysconfig.get_path("purelib", vars={"base": str(base_venv)}))
            (purelib / "base-venv.pth").write_text(f"{base}\n")
            # torch's console script, as pip would have written it into this venv.
            _, body = (base_venv / "bin" / "torchrun").read_text().split("\n", 1)
            torchrun = folder / "bin" / "torchrun"
            torchrun.write_text(f"#!{folder / 'bin' / 'python'}\n{body}")
            torchrun.chmod(0o755)
            run(["pip", "install", *names], ROOT, user_env(folder))
            made[names] = folder
        return made[names]

    return get


def script(page: str, info: str, folder: Path) -> Path | None:
    """The page's blocks fenced exactly ```info, as one script whose lines are the page's."""
    blocks = python_blocks((DOCS / page).read_text(encoding="utf-8"), info)
    if not blocks:
        return None
    lines: list[str] = []
    for block in blocks:
        lines += [""] * (block.line - 1 - len(lines))
        lines += block.code.splitlines()
    path = folder / f"{Path(page).stem}_{info}.py"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("guide", GUIDES)
def test_the_guide_runs_in_a_fresh_venv_with_what_it_names(
    guide: str,
    venv_for,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    folder = venv_for(extras(guide))
    env = user_env(folder)
    ran = 0
    single = script(guide, "python", tmp_path)
    if single is not None:
        run([str(folder / "bin" / "python"), str(single)], tmp_path, env)
        ran += 1
    ranks = script(guide, "py", tmp_path)
    if ranks is not None:
        counts = sorted(set(PROCESSES.findall((DOCS / guide).read_text(encoding="utf-8"))))
        assert counts, f"{guide} does not say how many processes its script needs"
        for count in counts:  # each number of processes the page offers
            torchrun = [str(folder / "bin" / "torchrun"), "--standalone", "--nproc-per-node"]
            run([*torchrun, count, str(ranks)], tmp_path, env)
            ran += 1
    for command in commands(guide):
        if not command.startswith("pip install"):  # the installs are the venv's
            run(shlex.split(command), ROOT, env)  # the page's paths are the repository's
            ran += 1
    assert ran, f"{guide} has no code that runs"


def test_the_venvs_hold_only_what_the_pages_name(venv_for) -> None:  # type: ignore[no-untyped-def]
    # The base venv has torch and its dependencies, this package, and pip: not numpy, not
    # safetensors, not pytest, which the docs session's own venv holds.
    base = venv_for(())
    listed = subprocess.run(
        [str(base / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    names = {line.split("==")[0].lower() for line in listed.splitlines()}
    assert {"torch", "toolkit-nn"} <= names
    assert not names & {"numpy", "safetensors", "pytest", "transformers"}
    assert sys.prefix != str(base)


TORCH_ALONE = """
import torch
import torch.distributed as dist
from torch import nn

from toolkit.nn import ModuleDefaultDict, PipelineTie, TiedLinear, sync_entries

dist.init_process_group("gloo")
rank = dist.get_rank()
model = nn.Module()
model.heads = ModuleDefaultDict(lambda: nn.Linear(2, 2))
model.heads[f"task{rank}"]
assert sync_entries(model) == [f"heads.task{1 - rank}"]
assert list(model.heads) == ["task0", "task1"]
stage = nn.Module()
stage.emb = nn.Embedding(5, 3)
if rank == 1:
    stage.head = TiedLinear(stage.emb)
tie = PipelineTie(stage)
tie.check()
assert tie.names == ("emb",)
dist.destroy_process_group()
"""


def test_the_package_s_multi_process_functions_need_torch_alone(
    venv_for,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    """torch's object collectives need numpy, which neither torch nor this package requires:
    sync_entries and PipelineTie run in the venv of torch and the package alone."""
    folder = venv_for(())
    path = tmp_path / "torch_alone.py"
    path.write_text(TORCH_ALONE, encoding="utf-8")
    torchrun = [str(folder / "bin" / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    run([*torchrun, str(path)], tmp_path, user_env(folder))
