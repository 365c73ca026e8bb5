"""Run a script of ``tests/oracles`` as ``python SCRIPT ARGS`` would, in a fork of one warm
process (``tests/oracles/fork_server.py``) that has imported torch and megatron-core once for
the whole test session, instead of ~5 s of imports per run and per rank.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ORACLES = Path(__file__).parent / "oracles"


class OracleFailed(AssertionError):
    """An oracle script exited non-zero or ran out of time; the message holds its output."""


class _Server:
    def __init__(self) -> None:
        self.logs = Path(tempfile.mkdtemp(prefix="ckptctl-oracles-"))
        self.process = subprocess.Popen(
            [sys.executable, str(ORACLES / "fork_server.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.logs / "server.log", "wb"),  # noqa: SIM115 (the server's lifetime)
            text=True,
            cwd=ORACLES,
        )
        self.lock = threading.Lock()
        self.runs = 0

    def run(self, script: str, args: list[str], timeout: float) -> tuple[int, bool, str, str]:
        with self.lock:
            self.runs += 1
            stdout, stderr = (self.logs / f"{self.runs}.{n}" for n in ("out", "err"))
            request = {
                "script": script,
                "args": args,
                "cwd": os.getcwd(),
                "stdout": str(stdout),
                "stderr": str(stderr),
                "timeout": timeout,
            }
            assert self.process.stdin is not None and self.process.stdout is not None
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
            if not line:
                log = (self.logs / "server.log").read_text(errors="replace")
                raise OracleFailed(f"the oracle fork server died:\n{log[-4000:]}")
            answer = json.loads(line)
            out, err = (p.read_text(errors="replace") for p in (stdout, stderr))
            stdout.unlink()
            stderr.unlink()
            return answer["code"], answer["timed_out"], out, err

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


_server: _Server | None = None
_server_lock = threading.Lock()


def _the_server() -> _Server:
    global _server
    with _server_lock:
        if _server is None or _server.process.poll() is not None:
            _server = _Server()
            atexit.register(_server.close)
        return _server


def run_oracle(script: str | Path, *args: object, timeout: float = 600) -> str:
    """Run ``tests/oracles/<script> ARGS`` (or a script by its absolute path); its stdout, or
    ``OracleFailed`` with its output."""
    code, timed_out, out, err = _the_server().run(str(script), [str(a) for a in args], timeout)
    if timed_out:
        raise OracleFailed(f"{script} ran out of {timeout} s:\n{out}\n{err[-4000:]}")
    if code != 0:
        raise OracleFailed(f"{script} failed (exit {code}):\n{out}\n{err[-4000:]}")
    return out
