"""Run the oracle scripts of this folder in forks of one process that imported torch and
megatron-core once (test harness, driven by ``tests/oracle_runner.py``).

Importing megatron-core takes ~5 s on this machine (torch, then its fusions pull in dynamo and
inductor); a test suite that runs the oracle scripts some eighty times paid it each time, and
again in every rank process they spawned. Here it is paid once: each request is a fresh fork of
this process, which has run nothing else, so a script sees what it would see as ``python
SCRIPT ARGS`` with those modules already loaded, and its ranks fork from it in turn.

``python fork_server.py megatron`` preloads torch and megatron-core (the megatron-core and
torch-only oracles); ``python fork_server.py deepspeed`` preloads DeepSpeed for CPU
(``DS_ACCELERATOR=cpu``) and transformers, apart from megatron-core, since DeepSpeed's import
touches torch's state process-wide.

``python fork_server.py ckptctl`` preloads ckptctl's CLI and every format's reader and writer
(the fuzz suite runs the CLI hundreds of times).

Protocol, one JSON object per line: a request ``{"script" or "module", "args", "cwd",
"stdout", "stderr", "timeout"}`` (optionally ``"memory_limit"``: bytes of address space the
run may map beyond the warm process's, and ``"env"``) on stdin (a script of this folder or by
absolute path, or a module run as ``python -m``; its own output goes to the two files), an
answer ``{"code": exit
code, "timed_out": bool}`` on stdout. A run that outlives its timeout is killed with every
process it started (each request runs in a process group of its own).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
POLL = 0.02


def preload(flavour: str) -> None:
    """torch, and megatron-core or DeepSpeed where installed, as the oracle scripts import them."""
    sys.path.insert(0, str(HERE))  # the scripts' own ``import mcore_cpu``
    import torch.distributed
    import torch.multiprocessing  # noqa: F401

    if flavour == "ckptctl":  # the CLI and every format's reader and writer (the fuzz suite)
        import ckptctl.cli.main  # noqa: F401
        from ckptctl.formats import registry

        for name in registry.BUILTIN:
            for part in ("format", "reader", "writer"):
                with contextlib.suppress(ImportError):
                    importlib.import_module(f"ckptctl.formats.{name}.{part}")
        for name in (
            "ckptctl.pipeline.execute",
            "ckptctl.verify.checks",
            "ckptctl.verify.compare",
            "ckptctl.arrays",
        ):
            importlib.import_module(name)
        return
    if flavour == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        with contextlib.suppress(ImportError):
            import deepspeed  # noqa: F401
            import transformers  # noqa: F401

            _build_deepspeed_ops()
        return
    try:
        import mcore_cpu  # silences megatron-core's import-time warnings first
    except ImportError:  # megatron-core not installed: the torch-only oracles still run
        return
    for name in mcore_cpu.MEGATRON_MODULES:
        importlib.import_module(name)


def _build_deepspeed_ops() -> None:
    """Build (or load) the op DeepSpeed compiles on its first CPU run, once, here.

    torch marks a build in progress with a bare ``lock`` file and waits for it to vanish,
    without limit; a run killed while building (a timeout, an interrupted test session)
    leaves it behind and every later run waits forever. So the builds live in a folder of
    the oracles' own, are made under an ``flock`` (released by the kernel when its holder
    dies, so a holder is always alive), and a ``lock`` found while holding it is stale.
    Forked ranks then find the op loaded and never take torch's lock themselves."""
    import fcntl

    from deepspeed.comm.torch import build_shm_op

    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    cache = Path.home() / ".cache" / "ckptctl-oracles" / "torch_extensions" / python
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache))
    root = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "ckptctl-oracles.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        for stale in root.rglob("lock"):
            stale.unlink(missing_ok=True)
        # stdout is this server's answer channel: the build's chatter goes to its log
        saved = os.dup(1)
        os.dup2(2, 1)
        try:
            with contextlib.redirect_stdout(sys.stderr):
                build_shm_op()
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def run_script(request: dict) -> None:
    """In the forked child: become ``python SCRIPT ARGS`` and exit with its code."""
    code = 1
    try:
        os.setpgid(0, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.chdir(request["cwd"])
        if request.get("memory_limit"):
            # Address space beyond what the warm process already maps: a run that would
            # allocate more fails its allocation instead of taking the machine's memory.
            import resource

            limit = _mapped_bytes() + int(request["memory_limit"])
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        os.environ.update(request.get("env", {}))
        if "module" in request:
            sys.argv = [request["module"], *request["args"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            script = str(HERE / request["script"])
            sys.argv = [script, *request["args"]]
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if not isinstance(done.code, int | None):
            print(done.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _mapped_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def wait(pid: int, timeout: float) -> tuple[int, bool]:
    """The child's exit code, or -SIGKILL once ``timeout`` has passed (then ``True``)."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status), True
        time.sleep(POLL)


def serve() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_script(request)
        code, timed_out = wait(pid, float(request["timeout"]))
        with contextlib.suppress(ProcessLookupError):  # ranks a failed script left behind
            os.killpg(pid, signal.SIGKILL)
        print(json.dumps({"code": code, "timed_out": timed_out}), flush=True)


if __name__ == "__main__":
    preload(sys.argv[1] if len(sys.argv) > 1 else "megatron")
    serve()
