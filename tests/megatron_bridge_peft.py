"""Megatron-Bridge's LoRA (``megatron.bridge.peft``), the adapter verl's Megatron workers train,
for the oracle that writes verl's Megatron LoRA checkpoints
(``tests/oracles/megatron_bridge_lora_writer.py``).

Megatron-Bridge's wheel is pure Python, but its dependencies (TransformerEngine built for CUDA,
transformers < 5, mamba-ssm, ...) cannot all be installed here, and only its ``peft`` package is
needed: the wheel is installed without dependencies into a directory of its own under
``~/.cache/ckptctl-oracles`` (``$CKPTCTL_ORACLES``), built on first use and kept, and the oracle
imports ``megatron.bridge.peft`` from it over the venv's megatron-core 0.16.1 (see the oracle's
``import_bridge_lora`` for the two import shims that needs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.oracle_runner import OracleFailed
from tests.oracle_venvs import pip_target

RELEASE = "0.3.1"
"""The newest Megatron-Bridge; it asks for megatron-core >= 0.15, < 0.17 (0.16.1 here)."""
ORACLE = Path(__file__).parent / "oracles" / "megatron_bridge_lora_writer.py"


def site() -> Path:
    """The directory holding Megatron-Bridge, installed first if it is not there."""
    return pip_target(f"megatron-bridge-{RELEASE}", f"megatron-bridge=={RELEASE}")


def run(*args: object, timeout: float = 900) -> str:
    """``tests/oracles/megatron_bridge_lora_writer.py ARGS`` with Megatron-Bridge's site."""
    env = {**os.environ, "CKPTCTL_MEGATRON_BRIDGE": str(site())}
    command = [sys.executable, str(ORACLE), *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise OracleFailed(
            f"{ORACLE.name} {' '.join(map(str, args))} failed (exit {done.returncode}):\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
    return done.stdout


OMEGACONF = ("omegaconf-2.3.0", "omegaconf==2.3.0")
ANTLR = ("antlr4-4.9.3", "antlr4-python3-runtime==4.9.3")
"""What Megatron-Bridge's config module needs beyond its wheel (``omegaconf`` and the parser
runtime it pins), each installed without dependencies into a directory of its own."""


def oracle_args() -> list[str]:
    """``--bridge SITE --bridge-deps DIRS``: what an oracle saving with Megatron-Bridge's own
    ``save_checkpoint`` (``tests/oracles/megatron_bridge_save.py``) is given."""
    deps = [pip_target(*OMEGACONF), pip_target(*ANTLR)]
    return ["--bridge", str(site()), "--bridge-deps", ",".join(map(str, deps))]
