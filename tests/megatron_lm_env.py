"""The environment Megatron-LM's own training code runs in for the tests (issue 52): the
megatron-core 0.19.2 wheel, which ships ``megatron/training``, needs Python >= 3.12, so it has a
virtual environment of its own (this project's tests run on 3.11), built on first use and kept
under ``~/.cache/ckptctl-oracles`` (``$CKPTCTL_ORACLES``) for every later session.

On PyPI, torch for Python 3.12 on x86_64 is a CUDA build (about 5.5 GB once installed; the
machine's own CPU build is for 3.11): the first build downloads it, later runs only start it.
The oracle script (``tests/oracles/megatron_lm.py``) runs it on the CPU.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests import oracle_cache
from tests.oracle_runner import OracleFailed
from tests.oracle_venvs import ROOT, venv_python

RELEASE = "0.19.2"
PACKAGES = (
    f"megatron-core=={RELEASE}",
    "torch==2.14.1",  # the newest this machine's pip admits; megatron-core asks >= 2.6
    # what megatron/training imports besides megatron-core's own requirements
    "numpy",
    "packaging",
    "psutil",
    "six",
    "pyyaml",
    "regex",
    "sentencepiece",
    "tiktoken",
    "pydantic",
    "einops",
)
ORACLE = Path(__file__).parent / "oracles" / "megatron_lm.py"
VENV = ROOT / f"mlm-{RELEASE}-py312"


def python312() -> str:
    """A Python 3.12 interpreter that runs: on the PATH, or one pyenv installed. (pyenv's shim
    for python3.12 is on the PATH even where 3.12 is not a selected version, and then fails.)"""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    installed = sorted(glob.glob(str(pyenv / "versions" / "3.12*" / "bin" / "python3.12")))
    on_path = shutil.which("python3.12")
    for candidate in [*([on_path] if on_path else []), *reversed(installed)]:
        if subprocess.run([candidate, "-c", ""], capture_output=True).returncode == 0:
            return candidate
    raise OracleFailed(
        "Megatron-LM 0.19.2 needs Python 3.12, and none was found (python3.12 on the PATH, "
        "or pyenv's): install one, e.g. `pyenv install 3.12`"
    )


def megatron_python() -> Path:
    """The environment's interpreter, built first if it is not there."""
    return venv_python(VENV.name, python312(), PACKAGES)


def command(
    report: Path,
    megatron_args: list[str],
    *,
    world: int = 1,
    steps: int,
    logits: Path | None = None,
) -> list[str]:
    """The oracle's command line: ``steps`` steps of Megatron-LM on ``world`` gloo ranks with
    ``megatron_args``, its report (losses, iteration, each rank's peak RSS) written to
    ``report``."""
    line = [str(megatron_python()), str(ORACLE), "train", str(report), "--world", str(world)]
    line += ["--steps", str(steps)]
    if logits is not None:
        line += ["--logits", str(logits)]
    return [*line, "--", *megatron_args]


def environment(scratch: Path) -> dict[str, str]:
    """The oracle's environment, its build caches under ``scratch``."""
    env = {
        **os.environ,
        # torch's build cache of the run's own: a build killed half way leaves a lock behind
        # that would stall every later run (see fork_server._build_deepspeed_ops)
        "TORCH_EXTENSIONS_DIR": str(scratch / "torch_extensions"),
        "CUDA_VISIBLE_DEVICES": "",
    }
    env.pop("PYTHONPATH", None)  # the oracle's interpreter is not this one
    return env


def train(
    out: Path,
    megatron_args: list[str],
    *,
    world: int = 1,
    steps: int,
    logits: Path | None = None,
    timeout: float = 900,
) -> dict[str, Any]:
    """Run Megatron-LM's training code (``tests/oracles/megatron_lm.py``) in ``out``'s folder:
    ``steps`` steps on ``world`` gloo ranks; the losses and iteration it reports."""
    report = out.with_suffix(".json")
    argv = command(report, megatron_args, world=world, steps=steps, logits=logits)

    def run() -> None:
        for _attempt in range(2):
            done = subprocess.run(
                argv,
                cwd=out.parent,
                env=environment(out.parent),
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            # the rendezvous port the run picked free was taken before it listened (another
            # test process's): the harness, not what is under test; one more try on another
            if "EADDRINUSE" not in done.stderr:
                break
        if done.returncode != 0 or not report.exists():
            lines = [line for line in done.stderr.splitlines() if not line.startswith("INFO:")]
            tail = "\n".join([*done.stdout.splitlines()[-20:], *lines[-40:]])
            raise OracleFailed(f"Megatron-LM (exit {done.returncode}, no report):\n{tail}")

    # the interpreter's path stands for the environment: rebuilt, it is a new ready marker
    ready = (VENV / "ckptctl-ready.json").stat().st_mtime_ns if VENV.exists() else 0
    run_key = oracle_cache.key(out.parent, argv, f"{VENV} {ready}")
    oracle_cache.run_once(out.parent, run_key, run)
    result: dict[str, Any] = json.loads(report.read_text())
    return result


def stamp_args(ckpt: Path, megatron_args: list[str], *, world: int, timeout: float = 300) -> None:
    """Put the ``args`` Megatron-LM's own ``parse_args`` + ``validate_args`` make of
    ``megatron_args`` on ``world`` ranks into every legacy rank file of ``ckpt``."""
    line = [str(megatron_python()), str(ORACLE), "args", str(ckpt), "--world", str(world)]
    done = subprocess.run(
        [*line, "--", *megatron_args],
        cwd=ckpt.parent,
        env=environment(ckpt.parent),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise OracleFailed(f"Megatron-LM's args (exit {done.returncode}):\n{done.stderr[-4000:]}")


if __name__ == "__main__":  # build the environment ahead of a test run
    print(megatron_python())
    sys.exit(0)
