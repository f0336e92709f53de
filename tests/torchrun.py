"""Launch an example script with torchrun on gloo ranks, as its docstring says to."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.nn.ranks import crashed, loopback_interface

# torchrun's summary of a rank that died: "exitcode  : -11 (pid: 123)".
EXIT_CODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


@dataclass(frozen=True)
class Launch:
    """How a launch ended: torchrun's exit status, and everything the ranks printed."""

    returncode: int
    output: str


def torchrun(script: Path, nproc: int, *args: str, timeout: float) -> Launch:
    """Run ``torchrun --standalone --nproc-per-node nproc script args`` on this machine.

    ``--standalone`` takes a free port, so two launches never share one. As in
    ``run_processes``, a launch in which a rank crashed in native code runs once more.
    """
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    loopback = loopback_interface()
    if loopback is not None:
        env.setdefault("GLOO_SOCKET_IFNAME", loopback)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), str(script), *args]
    for _ in range(2):
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        output = done.stdout + done.stderr
        if not any(crashed(int(code)) for code in EXIT_CODE.findall(output)):
            break
    return Launch(done.returncode, output)
