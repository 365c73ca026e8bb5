"""Probe: find out, read-only, what a URL holds and open it for planning and execution."""

from __future__ import annotations

import hashlib
import json
import posixpath

from ckptctl.errors import CheckpointNotFoundError
from ckptctl.formats.dcp.metadata import METADATA_FILE
from ckptctl.formats.dcp.reader import DcpCheckpoint, find_dcp_dir, probe_dcp
from ckptctl.formats.hf.layout import CONFIG
from ckptctl.formats.hf.reader import HFCheckpoint, probe_hf
from ckptctl.formats.megatron.layout import TRACKER
from ckptctl.formats.megatron.reader import MegatronCheckpoint, find_iteration, probe_megatron
from ckptctl.formats.torch_dist.layout import COMMON, MCORE_METADATA
from ckptctl.formats.torch_file.reader import STATE_DICT_FILE, TorchFileCheckpoint, probe_torch_file
from ckptctl.manifest import refuse_incomplete
from ckptctl.model.plan import Plan
from ckptctl.model.stored import CheckpointView, Format
from ckptctl.settings import Settings
from ckptctl.storage import Storage

Checkpoint = MegatronCheckpoint | HFCheckpoint | DcpCheckpoint | TorchFileCheckpoint


def open_checkpoint(
    url: str,
    settings: Settings | None = None,
    *,
    iteration: int | None = None,
    true_vocab_size: int | None = None,
    allow_missing: bool = False,
    allow_incomplete: bool | None = None,
) -> Checkpoint:
    """Probe ``url`` read-only and open it: its view for planners, and lazy readers."""
    settings = settings or Settings()
    hf_config = dict(settings.hf_config) if settings.hf_config is not None else None
    # A source: never written, whatever happens.
    storage = Storage(url, settings.storage, read_only=True)
    if not storage.exists():
        raise CheckpointNotFoundError(f"{url}: no such checkpoint directory")
    if not storage.isdir() and url.endswith((".pt", ".pth")):
        # One torch.save state dict given by its file name (e.g. dcp_to_torch_save's output).
        parent, _, name = url.rstrip("/").rpartition("/")
        return probe_torch_file(Storage(parent or ".", settings.storage, read_only=True), name)
    if not (settings.allow_incomplete if allow_incomplete is None else allow_incomplete):
        refuse_incomplete(storage)
    names = set(storage.listdir(""))
    if METADATA_FILE in names:
        return probe_dcp(storage, "", None, true_vocab_size, hf_config)
    if TRACKER in names or any(n.startswith(("mp_rank_", "iter_", "release")) for n in names):
        if TRACKER in names or iteration is not None:
            rel, number = find_iteration(storage, iteration)
            if find_dcp_dir(storage, rel):
                return probe_dcp(storage, rel, number, true_vocab_size, hf_config)
        return probe_megatron(
            storage,
            iteration=iteration,
            true_vocab_size=true_vocab_size,
            allow_missing=allow_missing,
        )
    if CONFIG in names:
        return probe_hf(storage)
    if STATE_DICT_FILE in names:
        return probe_torch_file(storage)
    raise CheckpointNotFoundError(
        f"{url}: neither a Megatron checkpoint ({TRACKER}, mp_rank_*) nor an HF one ({CONFIG})"
    )


def file_sizes(storage: Storage, view: CheckpointView, lost: frozenset[str]) -> dict[str, int]:
    return {f.path: storage.size(f.path) for f in view.files if f.path not in lost}


def _description_files(storage: Storage, view: CheckpointView) -> list[str]:
    """Files besides the tensor files that say what the checkpoint is (its metadata)."""
    if view.format in (Format.DCP, Format.TORCH_DIST) and view.files:
        base = posixpath.dirname(view.files[0].path)
        names = (METADATA_FILE, COMMON, MCORE_METADATA)
        candidates = [posixpath.join(base, n) if base else n for n in names]
    elif view.format is Format.HF:
        candidates = [CONFIG]
    else:
        candidates = []
    return [c for c in candidates if storage.exists(c)]


def identities(
    storage: Storage, view: CheckpointView, lost: frozenset[str] = frozenset()
) -> dict[str, str]:
    """Every file the checkpoint's content depends on -> its content identity."""
    files = [f.path for f in view.files if f.path not in lost]
    return {p: storage.identity(p) for p in sorted({*files, *_description_files(storage, view)})}


def fingerprint(storage: Storage, view: CheckpointView, lost: frozenset[str] = frozenset()) -> str:
    """A hash of what is stored (each file's content identity: size, times, inode or ETag) and
    how it was read (spec, layout): any change to a source file changes it."""
    body = {
        "files": sorted(identities(storage, view, lost).items()),
        "spec": view.spec.model_dump(mode="json") if view.spec else None,
        "layout": view.layout.model_dump(mode="json"),
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def with_identities(
    plan: Plan, storage: Storage, view: CheckpointView, lost: frozenset[str] = frozenset()
) -> Plan:
    """``plan`` recording the content identity of each source file it depends on."""
    found = tuple(identities(storage, view, lost).items())
    return plan.model_copy(update={"source_identities": found})


def changed_files(plan: Plan, storage: Storage) -> list[str]:
    """Source files whose identity differs from what ``plan`` recorded (or that are gone)."""
    changed = []
    for path, recorded in plan.source_identities:
        try:
            now = storage.identity(path)
        except (OSError, CheckpointNotFoundError):
            now = "missing"
        if now != recorded:
            changed.append(f"{path} ({'missing' if now == 'missing' else 'changed'})")
    return changed
