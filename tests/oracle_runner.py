"""Run a script of ``tests/oracles`` as ``python SCRIPT ARGS`` would (or a module as ``python
-m``), in a fork of one warm process (``tests/oracles/fork_server.py``) that has imported torch
and megatron-core (or DeepSpeed) once for the whole test session, instead of seconds of imports
per run and per rank.
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
from typing import Any

ORACLES = Path(__file__).parent / "oracles"


class OracleFailed(AssertionError):
    """An oracle script exited non-zero or ran out of time; the message holds its output."""


class _Server:
    def __init__(self, flavour: str) -> None:
        self.logs = Path(tempfile.mkdtemp(prefix=f"ckptctl-oracles-{flavour}-"))
        with open(self.logs / "server.log", "wb") as log:  # the server holds its own copy
            self.process = subprocess.Popen(
                [sys.executable, str(ORACLES / "fork_server.py"), flavour],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=ORACLES,
            )
        self.lock = threading.Lock()
        self.runs = 0

    def run(
        self, what: dict[str, Any], args: list[str], timeout: float
    ) -> tuple[int, bool, str, str]:
        with self.lock:
            self.runs += 1
            stdout, stderr = (self.logs / f"{self.runs}.{n}" for n in ("out", "err"))
            request = {
                **what,
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


_servers: dict[tuple[str, int], _Server] = {}
_servers_lock = threading.Lock()


def _server(flavour: str, slot: int = 0) -> _Server:
    """The warm process of ``flavour``; ``slot`` tells apart servers run side by side."""
    with _servers_lock:
        server = _servers.get((flavour, slot))
        if server is None or server.process.poll() is not None:
            server = _servers[(flavour, slot)] = _Server(flavour)
            atexit.register(server.close)
        return server


def run_oracle(
    script: str | Path, *args: object, timeout: float = 600, flavour: str = "megatron"
) -> str:
    """Run ``tests/oracles/<script> ARGS`` (or a script by its absolute path) in a fork of the
    ``flavour`` server ("megatron" or "deepspeed"); its stdout, or ``OracleFailed`` with its
    output."""
    return _run({"script": str(script)}, args, timeout, flavour)


def run_module(module: str, *args: object, timeout: float = 600, flavour: str = "megatron") -> str:
    """``python -m MODULE ARGS`` in a fork of the ``flavour`` server, as ``run_oracle``."""
    return _run({"module": module}, args, timeout, flavour)


def _run(what: dict[str, str], args: tuple[object, ...], timeout: float, flavour: str) -> str:
    name = " ".join(what.values())
    code, timed_out, out, err = _server(flavour).run(what, [str(a) for a in args], timeout)
    if timed_out:
        raise OracleFailed(f"{name} ran out of {timeout} s:\n{out}\n{err[-4000:]}")
    if code != 0:
        raise OracleFailed(f"{name} failed (exit {code}):\n{out}\n{err[-4000:]}")
    return out


def run_cli(
    *args: object, timeout: float = 60, memory_limit: int | None = None, slot: int = 0
) -> tuple[int, bool, str, str]:
    """``python -m ckptctl ARGS`` in a fork of a warm process that imported the CLI and every
    format (servers in different ``slot``s run side by side), with at most ``memory_limit``
    bytes of address space beyond the warm process's: ``(exit code, timed out, stdout,
    stderr)``, whatever the outcome (a signal is a negative code)."""
    what: dict[str, Any] = {"module": "ckptctl", "env": {"COLUMNS": "200"}}
    if memory_limit is not None:
        what["memory_limit"] = memory_limit
    return _server("ckptctl", slot).run(what, [str(a) for a in args], timeout)
