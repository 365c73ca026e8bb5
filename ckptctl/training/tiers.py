"""Tiered saves: a fast local tier (NVMe) first, then the data lake, with a retention policy.

A checkpoint is committed on the local tier (restartable from there at once), then each rank
copies its own shard file to the lake, and rank 0 copies ``.metadata`` and the manifest last,
so the lake copy is complete exactly when its manifest appears. Copies are checked against the
manifest's checksums as they stream. Old local checkpoints are removed by ``Retention``.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field

import xxhash

from ckptctl.checksums.manifest import INCOMPLETE, MANIFEST
from ckptctl.errors import CheckpointError
from ckptctl.formats.dcp_container.metadata import METADATA_FILE
from ckptctl.io.storage import Storage
from ckptctl.settings import StorageConfig
from planners.retention import Retention

COPY_BLOCK = 8 << 20


@dataclass(frozen=True)
class Tiers:
    local: str
    """Root of the fast tier: checkpoint ``name`` is saved to ``<local>/<name>``."""
    lake: str
    """Root of the data lake: ``<lake>/<name>``."""
    retention: Retention = field(default_factory=Retention)

    def at(self, root: str, name: str, config: StorageConfig) -> Storage:
        return Storage(f"{root.rstrip('/')}/{name}", config)


def copy_file(src: Storage, dst: Storage, rel: str, checksum: str) -> int:
    """Stream ``rel`` from ``src`` to ``dst`` (multipart on object stores), refusing a copy whose
    xxh3 differs from ``checksum`` (the manifest's) before it becomes visible."""
    with src.open_sequential(rel) as f, dst.open_write(rel, xxhash.xxh3_64()) as out:
        while block := f.read(COPY_BLOCK):
            out.write(block)
        if out.digest.hexdigest() != checksum:
            raise CheckpointError(
                f"{src.describe(rel)} changed while it was copied to the lake (checksum "
                f"{out.digest.hexdigest()}, manifest {checksum}); the lake copy was not committed"
            )
    dst.drain()
    return out.size


def manifest_of(storage: Storage) -> dict:
    return json.loads(storage.read_text(MANIFEST))


def begin_lake_copy(lake: Storage) -> None:
    lake.begin_writing()
    lake.write_text(INCOMPLETE, json.dumps({"operation": "save (copy to the lake)"}))
    for stale in (MANIFEST, METADATA_FILE):
        lake.remove(stale)


def finish_lake_copy(local: Storage, lake: Storage) -> None:
    """Rank 0, after every rank copied its shard: ``.metadata``, the manifest, then the marker."""
    manifest = manifest_of(local)
    copy_file(local, lake, METADATA_FILE, manifest["files"][METADATA_FILE]["checksum"])
    lake.write_text(MANIFEST, local.read_text(MANIFEST))
    lake.remove(INCOMPLETE)


def prune_local(root: str, retention: Retention, config: StorageConfig) -> list[str]:
    """Remove the local checkpoints ``retention`` no longer keeps: only complete ones that a
    ckptctl save wrote with a step number (never anything else under ``root``)."""
    storage = Storage(root, config)
    steps: dict[int, str] = {}
    for name in storage.listdir():
        with contextlib.suppress(ValueError, KeyError, OSError, CheckpointError):
            if storage.exists(f"{name}/{INCOMPLETE}"):
                continue
            manifest = json.loads(storage.read_text(f"{name}/{MANIFEST}"))
            if manifest.get("operation") == "save" and isinstance(manifest.get("step"), int):
                steps[manifest["step"]] = name
    removed = []
    for step in retention.local_to_remove(steps):
        storage.remove(f"{steps[step]}/{MANIFEST}")  # no longer complete before files go
        storage.remove(steps[step])
        removed.append(steps[step])
    return removed
