"""Runs of an oracle kept for later test sessions, keyed by everything that decides what they
write: the oracle scripts' source (all of ``tests/oracles``), the environment they ran in, the
command line (paths under the run's folder spelt relative to it) and the content of every
file or directory the command names that exists before it runs (its inputs: a checkpoint
ckptctl wrote is hashed byte for byte, so a change in ckptctl's output is a new run). A kept
run restores the files it wrote, at the same places under the folder. Any change to an oracle
script, to the environment or to an input runs the oracle again; ``CKPTCTL_ORACLE_CACHE=0``
always does.

Why: Megatron-LM's training code takes 10-40 s a run on two cores, the largest part of the
suite's time, and most runs see the same inputs from one session to the next.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from tests.oracle_venvs import ROOT

ORACLES = Path(__file__).parent / "oracles"
CACHE = ROOT / "runs"
SKIPPED = ("torch_extensions", "__pycache__", "ckptctl.manifest.json")
"""Folders of build caches a run leaves under its folder (not what it wrote), and ckptctl's
manifest in an input (it records where and when ckptctl wrote; no oracle reads it)."""


def enabled() -> bool:
    return os.environ.get("CKPTCTL_ORACLE_CACHE", "1") != "0"


def _hash_tree(path: Path, digest: hashlib._Hash) -> None:
    """Every file under ``path`` (or ``path`` itself): its relative name and its bytes."""
    files = (
        [path]
        if path.is_file()
        else sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part in SKIPPED for part in p.relative_to(path).parts)
        )
    )
    for file in files:
        digest.update(str(file.relative_to(path) if file != path else "").encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\1")


def key(folder: Path, command: Iterable[str], environment: str, inputs: Iterable[Path] = ()) -> str:
    """The run's key: the oracles' source, ``environment`` (what identifies the interpreter
    and its packages), ``command`` with ``folder`` spelt ``@``, and the content of each
    existing path it names and of ``inputs``."""
    digest = hashlib.sha256()
    _hash_tree(ORACLES, digest)
    digest.update(environment.encode() + b"\0")
    base = str(folder.resolve())
    named = []
    for arg in command:
        # where this checkout and the run's folder lie is not what decides the run
        spelt = arg.replace(str(ORACLES), "<oracles>").replace(base, "@")
        digest.update(spelt.encode() + b"\0")
        if arg.startswith("/") and Path(arg).exists():
            named.append(Path(arg))
    for path in [*named, *inputs]:
        spelt = str(path).replace(str(ORACLES), "<oracles>").replace(base, "@")
        digest.update(spelt.encode() + b"\2")
        _hash_tree(path, digest)
    return digest.hexdigest()[:32]


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for path in folder.rglob("*"):
        rel = path.relative_to(folder)
        if path.is_file() and not any(part in SKIPPED for part in rel.parts):
            stat = path.stat()
            out[str(rel)] = (stat.st_size, stat.st_mtime_ns)
    return out


def run_once(folder: Path, run_key: str, run: Callable[[], None]) -> bool:
    """``run()`` (which writes under ``folder``), or the files a run of the same key wrote
    restored there; whether they were restored. A run that raises keeps nothing."""
    kept = CACHE / run_key
    if enabled() and (kept / "done.json").is_file():
        os.utime(kept / "done.json")  # used: kept from pruning
        written = json.loads((kept / "done.json").read_text())
        for rel in written:
            target = folder / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(kept / "files" / rel, target)
        return True
    before = _files(folder)
    run()
    if not enabled():
        return False
    written = sorted(rel for rel, stat in _files(folder).items() if before.get(rel) != stat)
    CACHE.mkdir(parents=True, exist_ok=True)
    _prune()
    staging = Path(tempfile.mkdtemp(prefix=f".{run_key}.", dir=CACHE))
    for rel in written:
        (staging / "files" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(folder / rel, staging / "files" / rel)
    (staging / "done.json").write_text(json.dumps(written))  # last: the run is complete
    try:
        staging.rename(kept)
    except OSError:  # another session kept the same run first
        shutil.rmtree(staging, ignore_errors=True)
    return False


UNUSED_DAYS = 30


def _prune() -> None:
    """Runs no session has used for ``UNUSED_DAYS`` (their inputs changed since: a run of
    ckptctl's older output, an older oracle) are dropped, so the cache does not grow for ever."""
    horizon = time.time() - UNUSED_DAYS * 86400
    for entry in CACHE.iterdir():
        done = entry / "done.json"
        try:
            stale = done.stat().st_mtime < horizon
        except OSError:  # a run being kept by another session, or left half kept
            stale = entry.name.startswith(".") and entry.stat().st_mtime < horizon
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
