"""Measure a storage target's cost profile: write and read bandwidth and per-request latency.

Writes one scratch file under the URL, reads it back whole and by small ranges (on a local disk
from the device, not from the page cache the write filled), and removes it.
The result is a ``ckptctl.model.profile.StorageProfile`` saved as JSON for later plans.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckptctl.io.runs import write_in_slices
from ckptctl.io.storage import Storage
from ckptctl.model.profile import StorageProfile
from ckptctl.settings import REMOTE_READ_PARALLEL, StorageConfig

SCRATCH = ".ckptctl-calibrate"


def profile_dir() -> Path:
    home = os.environ.get("CKPTCTL_HOME") or Path.home() / ".config" / "ckptctl"
    return Path(home) / "profiles"


READ_PIECE = 4 << 20
"""Size of each ranged read of the bandwidth probe: about one tensor band of a real job."""


def calibrate(
    url: str, size: int = 64 << 20, probes: int = 32, config: StorageConfig | None = None
) -> StorageProfile:
    """Measure ``url`` the way jobs use it: a streamed (multipart) write until it is durable
    (flushed to the device on local disks), ranged reads with as many in flight as a job keeps
    (one on local disks), single small reads for latency, and then a read and a write at once,
    for how much the two overlap on this storage."""
    storage = Storage(url, config)
    payload = os.urandom(1 << 20) * max(size >> 20, 1)
    parallel = 1 if storage.is_local else REMOTE_READ_PARALLEL
    write_seconds = _timed_write(storage, SCRATCH, payload)
    try:
        read_seconds = _timed_read(storage, SCRATCH, len(payload), parallel)
        latencies = []
        rng = random.Random(0)
        for _ in range(probes):
            offset = rng.randrange(0, len(payload) - 4096)
            t = time.perf_counter()
            storage.read_range(SCRATCH, offset, 4096)
            latencies.append(time.perf_counter() - t)
        both_seconds = _read_while_writing(storage, parallel, payload)
    finally:
        storage.remove(SCRATCH)
        if storage.exists(SCRATCH_TOO):
            storage.remove(SCRATCH_TOO)
    # Of the shorter direction's time, the part the longer one hid.
    hidden = read_seconds + write_seconds - both_seconds
    return StorageProfile(
        name=url,
        read_bandwidth=len(payload) / max(read_seconds, 1e-9),
        write_bandwidth=len(payload) / max(write_seconds, 1e-9),
        latency=statistics.median(latencies),
        concurrency=parallel,
        overlap=round(min(max(hidden / max(min(read_seconds, write_seconds), 1e-9), 0.0), 1.0), 3),
    )


SCRATCH_TOO = ".ckptctl-calibrate-2"
"""The file written while the first is read back."""


def _timed_write(storage: Storage, rel: str, payload: bytes) -> float:
    started = time.perf_counter()
    with storage.open_write(rel) as f:
        write_in_slices(f, payload)
    storage.drain()  # durable, as a job's outputs are before its manifest: not the page cache
    return time.perf_counter() - started


def _timed_read(storage: Storage, rel: str, nbytes: int, parallel: int) -> float:
    if storage.is_local:
        _forget_cached(storage.path(rel))
    starts = range(0, nbytes, READ_PIECE)
    started = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        got = sum(pool.map(lambda s: len(storage.read_range(rel, s, READ_PIECE)), starts))
    if got != nbytes:
        raise OSError(f"{storage.describe(rel)}: read back {got} of {nbytes} calibration bytes")
    return time.perf_counter() - started


def _read_while_writing(storage: Storage, parallel: int, payload: bytes) -> float:
    """Seconds to read the scratch file back (from the device) while writing another as big:
    a job's reads and writes at once."""
    started = time.perf_counter()
    with ThreadPoolExecutor(1) as writer:
        written = writer.submit(_timed_write, storage, SCRATCH_TOO, payload)
        _timed_read(storage, SCRATCH, len(payload), parallel)
        written.result()
    return time.perf_counter() - started


def _forget_cached(path: str) -> None:
    """Take the scratch file's pages out of the page cache: the file was just written, so
    reading it back would measure memory, not the disk a job's (cold) source is read from."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # only clean pages can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def save_profile(profile: StorageProfile, path: Path | None = None) -> Path:
    path = path or profile_dir() / (profile.name.replace("://", "_").replace("/", "_") + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.model_dump_json(indent=1))
    return path


def saved_profiles() -> dict[str, StorageProfile]:
    """Every calibrated profile, keyed by the URL it was measured on."""
    if not profile_dir().is_dir():
        return {}
    out = {}
    for path in sorted(profile_dir().glob("*.json")):
        try:
            profile = StorageProfile.model_validate_json(path.read_text())
        except ValueError:
            continue
        out[profile.name] = profile
    return out
