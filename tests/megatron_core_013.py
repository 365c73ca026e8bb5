"""megatron-core 0.13.1 for the tests of the distributed optimizer's older torch_dist form
(``fully_sharded_model_space``, its default up to 0.14; 0.15 and later no longer write it).

Its wheel is pure Python and runs on this project's own torch, so it is installed without
dependencies into a directory of its own under ``~/.cache/ckptctl-oracles``
(``$CKPTCTL_ORACLES``), built on first use and kept, and put ahead of the venv's
megatron-core 0.16.1 on ``PYTHONPATH`` for the oracle script only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.oracle_runner import OracleFailed
from tests.oracle_venvs import pip_target

RELEASE = "0.13.1"
ORACLE = Path(__file__).parent / "oracles" / "megatron_core_torch_dist_writer.py"


def site() -> Path:
    """The directory holding megatron-core 0.13.1, installed first if it is not there."""
    return pip_target(f"megatron-core-{RELEASE}", f"megatron-core=={RELEASE}")


MBRIDGE = "0.15.1"
"""mbridge, the bridge verl's Megatron workers save HF weights through (its ``vanilla_bridge``,
pure Python, running on megatron-core 0.13.1)."""


def run(
    *args: object, script: str = ORACLE.name, timeout: float = 900, mbridge: bool = False
) -> str:
    """``tests/oracles/<script> ARGS`` (the torch_dist writer unless named) on megatron-core
    0.13.1; ``mbridge``: with mbridge importable too."""
    path = [str(site())]
    if mbridge:
        path.append(str(pip_target(f"mbridge-{MBRIDGE}", f"mbridge=={MBRIDGE}")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    oracle = ORACLE.with_name(script)
    command = [sys.executable, str(oracle), *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise OracleFailed(
            f"{script} {' '.join(map(str, args))} on megatron-core {RELEASE} failed "
            f"(exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
    return done.stdout
