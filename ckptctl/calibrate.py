"""Measure a storage target's cost profile: write and read bandwidth and per-request latency.

Writes one scratch file under the URL, reads it back whole and by small ranges, and removes it.
The result is a ``ckptctl.model.profile.StorageProfile`` saved as JSON for later plans.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path

from ckptctl.model.profile import StorageProfile
from ckptctl.settings import StorageConfig
from ckptctl.storage import Storage, write_in_slices

SCRATCH = ".ckptctl-calibrate"


def profile_dir() -> Path:
    home = os.environ.get("CKPTCTL_HOME") or Path.home() / ".config" / "ckptctl"
    return Path(home) / "profiles"


def calibrate(
    url: str, size: int = 64 << 20, probes: int = 32, config: StorageConfig | None = None
) -> StorageProfile:
    storage = Storage(url, config)
    payload = os.urandom(1 << 20) * max(size >> 20, 1)
    started = time.perf_counter()
    with storage.open_write(SCRATCH) as f:
        write_in_slices(f, payload)
    write_seconds = time.perf_counter() - started
    try:
        started = time.perf_counter()
        with storage.open_read(SCRATCH) as f:
            while f.read(8 << 20):
                pass
        read_seconds = time.perf_counter() - started
        latencies = []
        rng = random.Random(0)
        with storage.open_read(SCRATCH) as f:
            for _ in range(probes):
                f.seek(rng.randrange(0, len(payload) - 4096))
                t = time.perf_counter()
                f.read(4096)
                latencies.append(time.perf_counter() - t)
    finally:
        storage.remove(SCRATCH)
    return StorageProfile(
        name=url,
        read_bandwidth=len(payload) / max(read_seconds, 1e-9),
        write_bandwidth=len(payload) / max(write_seconds, 1e-9),
        latency=statistics.median(latencies),
        concurrency=1,
    )


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
