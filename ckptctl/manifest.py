"""The manifest ckptctl writes last into every checkpoint it produces, and the in-progress marker.

``ckptctl.incomplete`` is written before anything else and removed only after
``ckptctl.manifest.json`` (every file with size and xxh3-64 checksum, per-tensor checksums taken
while streaming, layout, model spec, the source's fingerprint, tool version) has been written:
a directory holding the first, or lacking the second, was never finished.
"""

from __future__ import annotations

import json
from typing import Any

import xxhash

from ckptctl import __version__
from ckptctl.errors import CheckpointError
from ckptctl.plan import Plan
from ckptctl.storage import Storage

MANIFEST = "ckptctl.manifest.json"
INCOMPLETE = "ckptctl.incomplete"
MANIFEST_VERSION = 1


def file_checksum(storage: Storage, rel: str, chunk: int = 8 << 20) -> str:
    digest = xxhash.xxh3_64()
    with storage.open_read(rel) as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def mark_incomplete(storage: Storage, plan: Plan) -> None:
    storage.write_text(
        INCOMPLETE,
        json.dumps({"operation": plan.operation, "plan_fingerprint": plan.fingerprint()}),
    )


def write_manifest(
    storage: Storage, plan: Plan, tensor_checksums: dict[str, dict[str, str]]
) -> dict[str, Any]:
    """Checksum every written file, write the manifest, then clear the in-progress marker."""
    paths = [f.path for f in plan.files] + [t.path for t in plan.finalize]
    body = {
        "manifest_version": MANIFEST_VERSION,
        "tool": f"ckptctl {__version__}",
        "operation": plan.operation,
        "strategy": plan.strategy,
        "source": {"url": plan.source_url, "fingerprint": plan.source_fingerprint},
        "format": plan.target_format.value,
        "layout": plan.target_layout.model_dump(mode="json"),
        "spec": plan.spec.model_dump(mode="json"),
        "checksum": "xxh3_64",
        "files": {
            p: {"size": storage.size(p), "checksum": file_checksum(storage, p)} for p in paths
        },
        "tensors": tensor_checksums,
    }
    storage.write_text(MANIFEST, json.dumps(body, indent=1, sort_keys=True))
    storage.remove(INCOMPLETE)
    return body


def refuse_incomplete(storage: Storage) -> None:
    if storage.exists(INCOMPLETE):
        raise CheckpointError(
            f"{storage.url} was never completed ({INCOMPLETE} is present): rerun the job that "
            "wrote it, or pass --allow-incomplete to read it anyway"
        )
