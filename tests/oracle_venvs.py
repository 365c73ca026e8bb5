"""Virtual environments of their own for oracles whose dependencies clash with this project's
(Megatron-LM's training code needs Python 3.12; torchtitan pulls datasets, wandb, tensorboard),
built on first use and kept under ``~/.cache/ckptctl-oracles`` (``$CKPTCTL_ORACLES``) for every
later session. A ``ckptctl-ready.json`` naming what was installed is written last: a half-built
environment is built again.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.oracle_runner import OracleFailed

ROOT = Path(os.environ.get("CKPTCTL_ORACLES", Path.home() / ".cache" / "ckptctl-oracles"))


def venv_python(name: str, interpreter: str, packages: tuple[str, ...]) -> Path:
    """The interpreter of the environment ``name`` holding ``packages``, built first with
    ``interpreter`` if it is not there (under a lock: test sessions side by side build it
    once)."""
    venv = ROOT / name
    python = venv / "bin" / "python"
    if _ready(venv, packages):
        return python
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _ready(venv, packages):
            return python
        shutil.rmtree(venv, ignore_errors=True)
        _run([interpreter, "-m", "venv", str(venv)], name, "creating the venv")
        _run([str(python), "-m", "pip", "install", "--quiet", *packages], name, "pip install")
        (venv / "ckptctl-ready.json").write_text(json.dumps({"packages": packages}))
    return python


def _ready(venv: Path, packages: tuple[str, ...]) -> bool:
    try:
        return json.loads((venv / "ckptctl-ready.json").read_text()).get("packages") == list(
            packages
        )
    except (OSError, ValueError):
        return False


def _run(command: list[str], name: str, what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise OracleFailed(f"oracle environment {name}, {what}:\n{done.stdout}\n{done.stderr}")


def pip_target(name: str, requirement: str) -> Path:
    """A directory of its own under ``ROOT`` holding ``requirement`` installed without its
    dependencies (``pip --target``: a pure-Python wheel run on this project's own torch),
    installed first if it is not there (under a lock: test sessions side by side install it
    once; a ``ckptctl-ready`` file written last marks it complete)."""
    site = ROOT / name
    ready = site / "ckptctl-ready"
    if ready.exists():
        return site
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready.exists():
            return site
        shutil.rmtree(site, ignore_errors=True)
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
        _run([*command, "--target", str(site), requirement], name, "pip install")
        ready.write_text(requirement)
    return site
