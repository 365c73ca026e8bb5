"""The environment torchtitan's own training code runs in for the tests (issue 55): torchtitan
0.3.0 needs datasets, tensorboard, wandb and more that this project's test environment does
not want, so it has a virtual environment of its own (``oracle_venvs``), with the CPU build
of torch this project pins. The oracle is ``tests/oracles/torchtitan_writer.py``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.oracle_runner import OracleFailed
from tests.oracle_venvs import venv_python

RELEASE = "0.3.0"
PACKAGES = ("torch==2.13.0", f"torchtitan=={RELEASE}")
ORACLE = Path(__file__).parent / "oracles" / "torchtitan_writer.py"


def torchtitan_python() -> Path:
    return venv_python(f"torchtitan-{RELEASE}", sys.executable, PACKAGES)


def write(out: Path, *args: str, timeout: float = 600) -> None:
    """Run the oracle: torchtitan trains a step and saves its checkpoint under ``out``."""
    for attempt in range(2):
        if attempt:  # the next try starts from an empty folder, not the half-saved step
            shutil.rmtree(out, ignore_errors=True)
        done = subprocess.run(
            [str(torchtitan_python()), str(ORACLE), str(out), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        # a rank killed by a signal (gloo's C++ runtime aborting, "terminate called without an
        # active exception", seen once when two test runs shared this machine) is the harness's
        # environment, not the checkpoint under test: one more try; a Python error is not retried
        if done.returncode == 0 or "terminated with signal" not in done.stderr:
            break
    if done.returncode != 0:
        raise OracleFailed(f"torchtitan oracle (exit {done.returncode}):\n{done.stderr[-4000:]}")


if __name__ == "__main__":  # build the environment ahead of a test run
    print(torchtitan_python())
    sys.exit(0)
