"""Commands that touch no tensor bytes (``--version``, ``--help``, ``formats``, ``inspect``,
``plan``, ``--dry-run``) never import torch, whatever the checkpoint's format: torch costs
1.5-2 s of start-up. Each command runs in a fresh interpreter that reports whether it did."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptctl import synth

WATCHED = ("fsspec", "torch", "numpy", "rich")

DRIVER = f"""
import sys
from ckptctl.cli.main import run_command
sys.argv = ["ckptctl", *sys.argv[1:]]
try:
    run_command()
finally:
    sys.stderr.write("imported: " + " ".join(m for m in {WATCHED!r} if m in sys.modules) + "\\n")
"""


def run(*argv: object) -> str:
    """Whether the command imported torch."""
    return "torch imported" if "torch" in imported(*argv) else "torch not imported"


def imported(*argv: object, code: int = 0) -> set[str]:
    """Which of ``WATCHED`` the command (exiting with ``code``) imported, run in a fresh
    interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, *map(str, argv)], capture_output=True, text=True
    )
    assert done.returncode == code, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("imported:"), done.stderr[-2000:]
    return set(last.removeprefix("imported:").split())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One small checkpoint per format ckptctl reads (DeepSpeed ZeRO's own has its tests)."""
    from typer.testing import CliRunner

    from ckptctl.cli.main import app

    root = tmp_path_factory.mktemp("startup")
    model = synth.make_model(synth.tiny_llama_config(num_heads=4, num_kv_heads=2), seed=2)
    synth.write_megatron(model, synth.adam_step(model, seed=2), root / "megatron", tp=2, pp=2)
    synth.save_hf(model, str(root / "hf"))
    runner = CliRunner()
    megatron = str(root / "megatron")
    for argv in (
        ["reshard", megatron, str(root / "torch_dist"), "--pp", "1", "--format", "torch_dist"],
        ["consolidate", str(root / "torch_dist"), str(root / "torch"), "--format", "torch"],
        ["consolidate", megatron, str(root / "universal"), "--format", "deepspeed-universal"],
    ):
        result = runner.invoke(app, argv)
        assert result.exit_code == 0, result.output
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict()}, checkpoint_id=str(root / "dcp"))
    return {
        "megatron": root / "megatron",
        "hf": root / "hf",
        "torch_dist": root / "torch_dist",
        "torch": root / "torch" / "state_dict.pt",
        "deepspeed-universal": root / "universal",
        "dcp": root / "dcp",
    }


def test_version_help_and_formats_do_not_import_torch() -> None:
    for argv in (["--version"], ["--help"], ["formats"], ["reshard", "--help"]):
        assert run(*argv) == "torch not imported", argv


@pytest.mark.parametrize(
    "fmt", ["megatron", "hf", "torch_dist", "torch", "deepspeed-universal", "dcp"]
)
def test_inspect_plan_and_dry_runs_do_not_import_torch(
    fmt: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    src = checkpoints[fmt]
    assert run("inspect", src, "--json") == "torch not imported"
    target = ("--format", "torch") if fmt in ("dcp", "torch") else ()  # keys of no known model
    assert run("consolidate", src, tmp_path / "out", *target, "--dry-run") == "torch not imported"
    if fmt in ("megatron", "torch_dist"):
        assert run("plan", src, tmp_path / "out", "--tp", "1", "--pp", "1") == "torch not imported"


@pytest.mark.parametrize(
    ("fmt", "argv"),
    [
        ("megatron", ["consolidate", "--format", "hf"]),
        ("megatron", ["consolidate", "--format", "megatron"]),
        ("megatron", ["reshard", "--tp", "1", "--pp", "2"]),
        ("megatron", ["consolidate", "--format", "deepspeed-universal"]),
        ("megatron", ["reshard", "--tp", "1", "--format", "torch_dist"]),
        ("torch_dist", ["consolidate", "--format", "torch"]),
        ("torch_dist", ["reshard", "--tp", "2", "--pp", "2"]),
        ("hf", ["reshard", "--format", "megatron", "--tp", "2"]),
        ("dcp", ["consolidate", "--format", "torch"]),
        ("deepspeed-universal", ["consolidate", "--format", "hf"]),
    ],
)
def test_jobs_that_keep_dtypes_move_bytes_without_torch(
    fmt: str, argv: list[str], checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Bytes are read, cut, hashed and written as numpy arrays: torch (1.5-2 s to import) is
    needed only for dtype casts and value comparisons (``verify --against``). The
    outputs' correctness is proven elsewhere; here, that a plain job and ``verify`` of its
    output (numerics included) never pay for torch, and that a cast does (DCP ``.metadata``
    is pickled without torch's classes, see ``test_dcp_metadata``)."""
    command, *options = argv
    out = tmp_path / "out"
    assert run(command, checkpoints[fmt], out, *options) == "torch not imported"
    assert run("verify", out) == "torch not imported"
    if command == "consolidate" and "hf" in options:
        cast = ("consolidate", checkpoints[fmt], tmp_path / "bf16", *options, "--dtype", "bf16")
        assert run(*cast) == "torch imported"


def test_local_jobs_do_not_import_fsspec(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """fsspec (and asyncio, which it imports) is start-up time spent for nothing when every
    path is local: only remote URLs load it."""
    src = checkpoints["megatron"]
    out = tmp_path / "out"
    assert "fsspec" not in imported("inspect", src, "--json")
    assert "fsspec" not in imported("reshard", src, out, "--tp", "1", "--pp", "2")
    assert "fsspec" not in imported("verify", f"file://{out}")
    assert "fsspec" in imported("inspect", "memory://nothing-here", "--json", code=3)


def test_jobs_that_only_copy_bytes_import_neither_numpy_nor_rich(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """numpy (~60 ms, ~140 ms from a cold disk) is imported where arrays are made, and rich
    (~30 ms) where something is printed for people: a ``--json`` job whose every tensor moves
    by kernel copy needs neither, nor do ``inspect --json`` and ``plan --json``. A job that
    builds arrays, and a table for people, still get them."""
    out = tmp_path / "out"
    dcp = ("consolidate", checkpoints["dcp"], out, "--format", "torch", "--json")
    assert imported(*dcp) == set()
    assert imported("inspect", checkpoints["dcp"], "--json") == set()
    plan = ("plan", checkpoints["megatron"], tmp_path / "p", "--tp", "1", "--pp", "1", "--json")
    assert imported(*plan) == set()
    assert imported("inspect", checkpoints["dcp"]) == {"rich"}
    merge = ("consolidate", checkpoints["megatron"], tmp_path / "hf", "--format", "hf", "--json")
    assert imported(*merge) == {"numpy"}  # TP shards are joined in memory


@pytest.mark.parametrize(
    "dtype", ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int8", "bool"]
)
def test_numbers_read_without_torch_equal_torchs(dtype: str, tmp_path: Path) -> None:
    """Adam's step and other one-element tensors a plan reads are decoded with ``struct``;
    each dtype's value equals torch's own, also at an offset into a shared storage."""
    import torch

    from ckptctl.arrays import to_torch
    from ckptctl.errors import CheckpointError
    from ckptctl.formats.torchsave.archive import TorchZipReader

    kind = getattr(torch, dtype)
    base = torch.tensor([0, 3, 1, 0], dtype=torch.float64) * 1.7 + 2.5
    values = base.to(kind)
    torch.save({"alone": values[1].clone(), "inside": values[2:3]}, tmp_path / "n.pt")
    with open(tmp_path / "n.pt", "rb") as f:
        reader = TorchZipReader(f, "n.pt")
        for key in ("alone", "inside"):
            ref = reader.tree[key]
            assert reader.read_number(ref) == float(to_torch(reader.read(ref)).item())
    # A flipped byte in a whole one-element record fails its CRC-32, as any read would.
    data = bytearray((tmp_path / "n.pt").read_bytes())
    with open(tmp_path / "n.pt", "rb") as f:
        reader = TorchZipReader(f, "n.pt")
        start, _ = reader._storage_span(reader.tree["alone"].storage.key)
    data[start] ^= 0x40
    (tmp_path / "bad.pt").write_bytes(bytes(data))
    with open(tmp_path / "bad.pt", "rb") as f, pytest.raises(CheckpointError, match="CRC-32"):
        reader = TorchZipReader(f, "bad.pt")
        reader.read_number(reader.tree["alone"])


@pytest.mark.parametrize(
    "dtype",
    [
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    ],
)
def test_fill_values_packed_without_torch_are_torchs_or_refused(dtype: str) -> None:
    """A fill (Adam's step in a universal checkpoint, padding) is packed with ``struct`` only
    when the dtype holds the value exactly, and then its bytes are torch's own; any other
    value is left to torch's conversion (``None``)."""
    import math

    import torch

    from ckptctl.model.dtypes import pack_exactly

    values = [0.0, -0.0, 1.0, -1.0, 2.0, 5.0, 0.5, 0.1, 3.0e-3, 1 / 3, 255.0, 256.0, -129.0]
    values += [257.0, 65504.0, 65505.0, 2.0**24 + 1, 2.0**31, 2.0**63, 1e39, 1e300, 2.0**-140]
    values += [math.inf, -math.inf, math.nan]
    kind = getattr(torch, dtype)
    packed_some = False
    for value in values:
        packed = pack_exactly(dtype, value)
        try:
            theirs = torch.full((), value, dtype=kind)
        except RuntimeError:  # torch refuses to store it (out of an integer dtype's range)
            assert packed is None, value
            continue
        exact = float(theirs) == value and math.copysign(1, float(theirs)) == math.copysign(
            1, value
        )
        if packed is None:
            assert not exact, (value, float(theirs))
        else:
            assert exact, value
            assert packed == theirs.reshape(1).view(torch.uint8).numpy().tobytes(), value
            packed_some = True
    assert packed_some


def test_the_program_delivers_every_byte_of_its_output(
    checkpoints: dict[str, Path],
) -> None:
    """What ``ckptctl`` printed into a pipe (block-buffered) arrives whole, a profiler writes
    its results at exit, and a failure exits with its own code."""
    import json

    from typer.testing import CliRunner

    from ckptctl.cli.main import app

    argv = ["plan", str(checkpoints["megatron"]), "/nowhere", "--tp", "1", "--pp", "1", "--json"]
    piped = subprocess.run([sys.executable, "-m", "ckptctl", *argv], capture_output=True)
    assert piped.returncode == 0, piped.stderr[-2000:]
    in_process = CliRunner().invoke(app, argv)
    assert json.loads(piped.stdout) == json.loads(in_process.stdout)
    assert len(piped.stdout) > 8192  # more than one pipe buffer's worth
    from ckptctl import __version__

    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    version = subprocess.run(
        [sys.executable, "-m", "ckptctl", "--version"], capture_output=True, env=buffered
    )
    assert version.stdout.decode() == f"ckptctl {__version__}\n"  # print(): not flushed by itself
    profile = checkpoints["megatron"].parent / "version.prof"
    profiled = [sys.executable, "-m", "cProfile", "-o", profile, "-m", "ckptctl", "--version"]
    assert subprocess.run(profiled, capture_output=True).returncode == 0
    assert profile.stat().st_size > 0  # a profiler writes its results at exit: not skipped
    missing = [sys.executable, "-m", "ckptctl", "inspect", str(checkpoints["megatron"]) + "-x"]
    assert subprocess.run(missing, capture_output=True).returncode == 3


def test_messages_reach_stderr_as_written_on_a_pipe_and_on_a_terminal(tmp_path: Path) -> None:
    """Without a terminal an error line is written by ckptctl itself (rich is not imported
    for it); on a terminal rich colours the label. Either way a path that looks like rich
    markup is printed as it is."""
    import pty

    missing = tmp_path / "[bold]ckpt[/]"
    argv = [sys.executable, "-m", "ckptctl", "inspect", str(missing)]
    piped = subprocess.run(argv, capture_output=True, text=True)
    assert piped.returncode == 3
    assert piped.stderr.startswith(f"error: {missing}"), piped.stderr
    leader, follower = pty.openpty()
    on_tty = subprocess.run(
        argv, stdout=subprocess.DEVNULL, stderr=follower, env=dict(os.environ, COLUMNS="400")
    )
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal's other end closed
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert on_tty.returncode == 3
    text = shown.decode()
    assert "\x1b[" in text and "error:" in text  # coloured
    assert str(missing) in text.replace("\r\n", "\n"), text


NATIVE_THREADS = """
import os, sys, threading, time
from ckptctl.cli import main as cli
def report(code):
    for _ in range(40):  # a thread just joined may take a moment to leave the kernel's list
        native = len(os.listdir("/proc/self/task")) - threading.active_count()
        if native == 0:
            break
        time.sleep(0.005)
    sys.stderr.write(f"native threads: {native}\\n")
    sys.stderr.flush()
    os._exit(code)
sys.argv = ["ckptctl", *sys.argv[1:]]
try:
    cli.main()
except SystemExit as done:
    report(done.code or 0)
"""


@pytest.mark.skipif(
    not Path("/proc/self/task").is_dir() or (os.cpu_count() or 1) < 2,
    reason="counts the threads of a process on a Linux machine with several cores",
)
def test_a_job_that_builds_arrays_starts_no_blas_threads(checkpoints, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    argv = ["consolidate", checkpoints["megatron"], tmp_path / "out", "--format", "hf", "--json"]
    done = subprocess.run(
        [sys.executable, "-c", NATIVE_THREADS, *map(str, argv)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "native threads: 0" in done.stderr.splitlines()[-1], done.stderr[-2000:]
