"""The harness that runs the oracle scripts (``tests/oracle_runner.py``): a script run in a fork
of the warm server must report what ``python SCRIPT`` would, or every oracle test that relies on
it would pass on a failing oracle."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.oracle_runner import OracleFailed, run_oracle


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(body)
    return path


def _running(pid: int) -> bool:
    """Alive, as opposed to gone or a zombie its new parent has not yet reaped."""
    for _ in range(50):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True


def test_a_script_sees_its_arguments_and_its_output_is_returned(tmp_path: Path) -> None:
    script = _script(tmp_path, "import sys\nprint(__name__, sys.argv[1:])\n")
    assert run_oracle(script, "a", 2) == "__main__ ['a', '2']\n"


def test_a_failing_script_fails_with_its_exit_code_and_output(tmp_path: Path) -> None:
    script = _script(tmp_path, "import sys\nprint('went wrong', file=sys.stderr)\nsys.exit(3)\n")
    with pytest.raises(OracleFailed, match=r"(?s)exit 3.*went wrong"):
        run_oracle(script)


def test_a_rank_that_raises_fails_the_script(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        "import torch.multiprocessing as mp\n"
        "def rank(i):\n"
        "    if i == 1:\n"
        "        raise ValueError('rank 1 broke')\n"
        "mp.start_processes(rank, nprocs=2, join=True, start_method='fork')\n",
    )
    with pytest.raises(OracleFailed, match="rank 1 broke"):
        run_oracle(script)


def test_a_script_out_of_time_is_killed_with_its_children(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = _script(
        tmp_path,
        "import os, sys, time\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child}}')\n"
        "time.sleep(60)\n",
    )
    started = time.monotonic()
    with pytest.raises(OracleFailed, match="ran out of 1"):
        run_oracle(script, timeout=1)
    assert time.monotonic() - started < 30
    for pid in map(int, pids.read_text().split()):
        assert not _running(pid), pid
    # The server goes on serving.
    assert run_oracle(_script(tmp_path, "print('again')\n")) == "again\n"
