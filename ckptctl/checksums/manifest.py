"""The manifest ckptctl writes last into every checkpoint it produces, and the in-progress marker.

``ckptctl.incomplete`` is written before anything else and removed only after
``ckptctl.manifest.json`` (every file with size and xxh3-64 checksum, per-tensor checksums taken
while streaming, layout, model spec, the source's fingerprint, tool version) has been written:
a directory holding the first, or lacking the second, was never finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from ckptctl import __version__, json_input
from ckptctl.errors import CheckpointError
from ckptctl.model.plan import Plan

if TYPE_CHECKING:  # (checksums sit below storage: they take its objects, never import it)
    from ckptctl.io.storage import Storage

MANIFEST = "ckptctl.manifest.json"
LOCK = "ckptctl.lock"
"""Held by the job writing a destination (``ckptctl.pipeline.lease``)."""
INCOMPLETE = "ckptctl.incomplete"
MANIFEST_VERSION = 1
SAVE_EVERY = 1.0
"""Seconds between rewrites of the in-progress log as files finish: a killed job redoes at
most this long of finished files (a file is only ever logged after it is whole), and a job of
thousands of small files does not rewrite a growing log (an upload, on S3) after each one."""


CHECKSUMS = ("xxh3_64", "sha256")


def new_digest(algorithm: str) -> Any:
    return hashlib.sha256() if algorithm == "sha256" else xxhash.xxh3_64()


def file_checksum(
    storage: Storage, rel: str, chunk: int = 8 << 20, algorithm: str = "xxh3_64"
) -> str:
    digest = new_digest(algorithm)
    with storage.open_read(rel) as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def rank_log(rank: int) -> str:
    """The log of files finished by rank ``rank`` (> 0) of a job run by several processes;
    rank 0's is the in-progress marker itself."""
    return f"{INCOMPLETE}.rank{rank}"


class RunLog:
    """The in-progress marker doubles as a log of finished files (size, checksum, tensor
    checksums), rewritten after each one, so a rerun of the same plan can resume.

    A job run by several processes (``rank`` of ``world``) keeps one log per rank, so no two
    processes rewrite one file: rank 0 writes the marker (``planned``, ``world``), rank ``r``
    ``rank_log(r)``. Rank 0 opens its log first: it takes in what every log of an interrupted
    run of the same plan holds, whatever that run's number of processes, so each rank can reuse
    any finished file; the other ranks open theirs after it (the caller's barrier)."""

    def __init__(
        self,
        storage: Storage,
        plan: Plan,
        algorithm: str = "xxh3_64",
        extra: tuple[str, ...] = (),
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.storage = storage
        self.algorithm = algorithm
        self.rank, self.world = rank, world
        self.operation = plan.operation
        self.fingerprint = plan.fingerprint()
        # Every path this job may write: what a later --overwrite may remove as ckptctl's own.
        self.planned = sorted(
            {f.path for f in plan.files}
            | {t.path for t in plan.finalize}
            | set(extra)
            | {rank_log(r) for r in range(1, world)}
        )
        self._saved_at = 0.0
        self._lock = threading.Lock()  # files finish on several threads at once
        self.done: dict[str, dict[str, Any]] = {}
        """Files this process finished or kept (rank 0: also those other ranks kept before)."""
        previous = read_marker(storage) or {}
        same = (
            bool(previous)
            and previous.get("plan_fingerprint") == self.fingerprint
            and previous.get("checksum", "xxh3_64") == algorithm
        )
        self.known: dict[str, dict[str, Any]] = dict(previous.get("done", {})) if same else {}
        """Files an earlier run (or rank 0, merging every rank's log) recorded as finished."""
        self.unchecked: dict[str, dict[str, Any]] = {}
        """Files this process wrote whole but whose source records were still being checked
        when it stopped: a rerun keeps them once it has checked those records
        (``unchecked_records``)."""
        for path, entry in (previous.get("unchecked", {}) if same else {}).items():
            self.known.setdefault(path, entry)
        if rank == 0:
            stale = [rank_log(r) for r in range(1, int((previous or {}).get("world", 1)))]
            for name in stale if same else ():
                with contextlib.suppress(ValueError, FileNotFoundError, OSError):
                    if self.storage.exists(name):
                        logged = json.loads(self.storage.read_text(name))
                        self.known.update(logged.get("unchecked", {}))
                        self.known.update(logged["done"])
            self.done = {p: e for p, e in self.known.items() if "unchecked_records" not in e}
            self.unchecked = {p: e for p, e in self.known.items() if "unchecked_records" in e}
            self._save()
            for name in stale:  # merged into the marker above, or from another plan
                self.storage.remove(name)
        else:
            self._save()

    def flush(self) -> None:
        """Write the log now (a job stopping early keeps every file it finished)."""
        with self._lock:
            self._save()

    def _save(self) -> None:
        self._saved_at = time.monotonic()
        if self.rank:
            body: dict[str, Any] = {
                "plan_fingerprint": self.fingerprint,
                "done": self.done,
                "unchecked": self.unchecked,
            }
            self.storage.write_text(rank_log(self.rank), json.dumps(body))
            return
        body = {
            "operation": self.operation,
            "plan_fingerprint": self.fingerprint,
            "checksum": self.algorithm,
            "planned": self.planned,
            "world": self.world,
            "done": self.done,
            "unchecked": self.unchecked,
        }
        self.storage.write_text(INCOMPLETE, json.dumps(body))

    def finished_unchecked(self, path: str, entry: dict[str, Any], records: list[Any]) -> None:
        """Record a file written whole whose source ``records`` (``record_checks.describe``)
        were not yet checked."""
        with self._lock:
            self.unchecked[path] = {**entry, "unchecked_records": records}

    def reusable(self, path: str) -> dict[str, Any] | None:
        """The log entry of ``path`` if the file on disk still matches it (an entry with
        ``unchecked_records`` is reused only once the caller has checked those)."""
        entry = self.known.get(path)
        if entry is None or not self.storage.exists(path):
            return None
        if self.storage.size(path) != entry["size"]:
            return None
        if file_checksum(self.storage, path, algorithm=self.algorithm) != entry["checksum"]:
            return None
        if "unchecked_records" not in entry:
            with self._lock:
                self.done[path] = entry
        return entry

    def finished(
        self,
        path: str,
        tensors: dict[str, str],
        size: int,
        checksum: str,
        records: list[Any] | None = None,
        quantized: dict[str, float] | None = None,
    ) -> None:
        """Record a finished file: its size and checksum as written, its tensors' checksums
        (and, for DCP shards, where each record lies, which ``.metadata`` is built from; for
        weights written lossily, each one's largest error)."""
        entry: dict[str, Any] = {"size": size, "checksum": checksum, "tensors": tensors}
        if records is not None:
            entry["records"] = records
        if quantized is not None:
            entry["quantized"] = quantized
        with self._lock:
            self.unchecked.pop(path, None)
            self.done[path] = entry
            if time.monotonic() - self._saved_at >= SAVE_EVERY:
                self._save()

    def clear_rank_logs(self) -> None:
        """After the manifest: the other ranks' logs are no longer needed."""
        for r in range(1, self.world):
            self.storage.remove(rank_log(r))


def read_marker(storage: Storage) -> dict[str, Any] | None:
    if not storage.exists(INCOMPLETE):
        return None
    try:
        return json.loads(storage.read_text(INCOMPLETE))
    except ValueError:
        return {}


def write_manifest(
    storage: Storage,
    plan: Plan,
    tensor_checksums: dict[str, dict[str, str]],
    known: dict[str, dict[str, Any]] | None = None,
    algorithm: str = "xxh3_64",
    extra: list[str] | None = None,
    quantized: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Write the manifest (checksums of files already logged are reused), then clear the
    in-progress marker: from here on the checkpoint is complete."""
    known = known or {}
    paths = [f.path for f in plan.files] + (extra or []) + [t.path for t in plan.finalize]
    body = {
        "manifest_version": MANIFEST_VERSION,
        "tool": f"ckptctl {__version__}",
        "operation": plan.operation,
        "strategy": plan.strategy,
        "plan_fingerprint": plan.fingerprint(),
        "source": {"url": plan.source_url, "fingerprint": plan.source_fingerprint},
        "format": plan.target_format,
        "layout": plan.target_layout.model_dump(mode="json"),
        "spec": plan.spec.model_dump(mode="json") if plan.spec else None,
        "checksum": algorithm,
        "tensor_checksum": "xxh3_64",
        "files": {
            p: {"size": known[p]["size"], "checksum": known[p]["checksum"]}
            if p in known
            else {
                "size": storage.size(p),
                "checksum": file_checksum(storage, p, algorithm=algorithm),
            }
            for p in paths
        },
        "tensors": tensor_checksums,
    }
    if quantized:  # written lossily when asked (--dtype fp8-block): verify holds them to it
        body["quantized_max_abs_error"] = dict(sorted(quantized.items()))
    storage.write_text(MANIFEST, json.dumps(body, indent=1, sort_keys=True))
    storage.remove(INCOMPLETE)
    return body


@dataclass(frozen=True)
class Recorded:
    """What a ckptctl manifest of a source vouches for: each file's checksum (``algorithm``)
    and each tensor's xxh3-64 (by file, then by the tensor's key as the writer named it)."""

    algorithm: str
    files: dict[str, str]
    tensors: dict[str, dict[str, str]]
    quantized: dict[str, float] = field(default_factory=dict)
    """Canonical tensor -> the largest error it was written with (``--dtype fp8-block``)."""


def recorded(storage: Storage) -> Recorded | None:
    """The checksums ``storage``'s manifest records, or ``None`` without one. A manifest that
    is there but unreadable is refused: the checkpoint claims checksums it cannot show."""
    if not storage.exists(MANIFEST):
        return None
    where = storage.describe(MANIFEST)
    doc = json_input.parse_object(storage.read_text(MANIFEST), where)
    algorithm = json_input.field(doc, "checksum", str, where, "xxh3_64")
    files = json_input.field(doc, "files", dict, where)
    tensors = json_input.field(doc, "tensors", dict, where, {})
    if json_input.field(doc, "tensor_checksum", str, where, "xxh3_64") != "xxh3_64":
        tensors = {}
    out_files = {}
    for rel, meta in files.items():
        if not isinstance(meta, dict) or not isinstance(meta.get("checksum"), str):
            raise CheckpointError(f"{where}: the entry of {rel} has no checksum")
        out_files[rel] = meta["checksum"]
    out_tensors = {}
    for rel, named in tensors.items():
        if not isinstance(named, dict) or not all(isinstance(v, str) for v in named.values()):
            raise CheckpointError(f"{where}: the tensor checksums of {rel} are not strings")
        out_tensors[rel] = named
    errors = json_input.field(doc, "quantized_max_abs_error", dict, where, {})
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in errors.values()):
        raise CheckpointError(f"{where}: quantized_max_abs_error holds a value that is no number")
    return Recorded(algorithm, out_files, out_tensors, {k: float(v) for k, v in errors.items()})


def refuse_incomplete(storage: Storage) -> None:
    if storage.exists(INCOMPLETE):
        raise CheckpointError(
            f"{storage.url} was never completed ({INCOMPLETE} is present): rerun the job that "
            "wrote it, or pass --allow-incomplete to read it anyway"
        )


def completed_by(storage: Storage, fingerprint: str) -> bool:
    """Whether ``storage`` holds a finished output of the plan with this fingerprint (a rerun of
    the same command then has nothing to do)."""
    if not storage.exists(MANIFEST) or storage.exists(INCOMPLETE):
        return False
    try:
        return json.loads(storage.read_text(MANIFEST)).get("plan_fingerprint") == fingerprint
    except ValueError:
        return False


def foreign_files(storage: Storage, files: list[str]) -> list[str]:
    """Those of ``files`` (relative paths under ``storage``) that no ckptctl job wrote there: not
    listed by its manifest, nor planned or logged by its in-progress marker. ``--overwrite``
    removes a destination only when this is empty."""
    owned = {MANIFEST, INCOMPLETE, LOCK} | {
        p for p in files if p.startswith((f"{INCOMPLETE}.rank", f"{LOCK}.stale."))
    }
    if MANIFEST in files:
        with contextlib.suppress(ValueError, AttributeError):
            owned |= set(json.loads(storage.read_text(MANIFEST)).get("files", {}))
    if INCOMPLETE in files:
        marker = read_marker(storage) or {}
        owned |= set(marker.get("planned", [])) | set(marker.get("done", {}))
    owned |= {f"{path}.partial" for path in owned}
    return [path for path in files if path not in owned]
