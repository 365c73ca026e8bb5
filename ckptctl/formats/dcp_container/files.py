"""Where a DCP checkpoint's files are: the directory holding ``.metadata`` (the root, a
Megatron iteration directory, or torchtitan's ``step-<n>``), ``.metadata`` read through the
allow-list and checked, and the record files it names present and long enough."""

from __future__ import annotations

from dataclasses import replace

from ckptctl.errors import CheckpointError, CheckpointNotFoundError
from ckptctl.formats.dcp_container.checks import check_metadata
from ckptctl.formats.dcp_container.metadata import (
    METADATA_FILE,
    DcpMetadata,
    StorageInfo,
    TensorEntry,
)
from ckptctl.formats.dcp_container.parse import parse_metadata
from ckptctl.formats.megatron_common.iterations import find_iteration, recognised
from ckptctl.formats.megatron_common.layout import TRACKER
from ckptctl.io.storage import Storage
from ckptctl.model.geometry import Piece
from ckptctl.model.stored import KeyPath, StoredFile, StoredTensor

ACCELERATE_MODEL = "pytorch_model_fsdp_0"
ACCELERATE_OPTIMIZER = "optimizer_0"
"""Where accelerate's ``save_state`` (and the HF Trainer's ``checkpoint-N``) put an FSDP
model's sharded state dict and its optimizer's, each a DCP checkpoint of its own."""


def join(base: str, rel: str) -> str:
    return f"{base}/{rel}" if base else rel


def read_metadata(storage: Storage, base: str) -> DcpMetadata:
    """``.metadata`` through the allow-list, checked, and every record inside its file."""
    metadata, short = read_metadata_and_lost(storage, base)
    where = storage.describe(join(base, METADATA_FILE))
    for name, (size, end) in sorted(short.items()):
        rel = join(base, name)
        if size is None:
            raise CheckpointNotFoundError(f"{storage.describe(rel)}: missing (named in {where})")
        raise CheckpointError(
            f"{storage.describe(rel)}: {size} bytes, but {METADATA_FILE} places records up "
            f"to byte {end}; the file is truncated"
        )
    return metadata


def read_metadata_and_lost(
    storage: Storage, base: str
) -> tuple[DcpMetadata, dict[str, tuple[int | None, int]]]:
    """``.metadata`` through the allow-list and checked, and the record files that are missing
    (size ``None``) or shorter than the records placed in them: ``name -> (size, needed)``."""
    where = storage.describe(join(base, METADATA_FILE))
    with storage.open_read(join(base, METADATA_FILE)) as f:
        raw = f.read()
    metadata = parse_metadata(raw, where)
    check_metadata(metadata, where)
    ends: dict[str, int] = {}
    for info in metadata.storage.values():
        storage.path(join(base, info.relative_path))  # refuses paths escaping the root
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    short: dict[str, tuple[int | None, int]] = {}
    for name, end in sorted(ends.items()):
        rel = join(base, name)
        if not storage.exists(rel):
            short[name] = (None, end)
        elif (size := storage.size(rel)) < end:
            short[name] = (size, end)
    return metadata, short


def locate(
    storage: Storage, names: frozenset[str], iteration: int | None
) -> tuple[str, int | None] | None:
    """The directory holding ``.metadata`` (the root, or a Megatron iteration directory named
    by the tracker or ``iteration``) and its iteration, or ``None`` if there is none."""
    if METADATA_FILE in names:
        return "", None
    if recognised(names) and (TRACKER in names or iteration is not None):
        rel, number = find_iteration(storage, iteration)
        if storage.exists(join(rel, METADATA_FILE)):
            return rel, number
    steps = {int(n[5:]): n for n in names if n.startswith("step-") and n[5:].isdigit()}
    if steps:  # torchtitan's checkpoint folder: step-<n>/ each; the newest unless asked
        number = max(steps) if iteration is None else iteration
        if number not in steps:
            raise CheckpointNotFoundError(
                f"{storage.describe(f'step-{number}')}: no such step; there are "
                + ", ".join(steps[n] for n in sorted(steps))
            )
        if storage.exists(join(steps[number], METADATA_FILE)):
            return steps[number], number
    return None


def accelerate_parts(storage: Storage, names: frozenset[str]) -> tuple[str, ...]:
    """The DCP directories of an accelerate ``save_state`` (model first), or none."""
    if ACCELERATE_MODEL not in names or not storage.exists(join(ACCELERATE_MODEL, METADATA_FILE)):
        return ()
    if storage.exists(join(ACCELERATE_OPTIMIZER, METADATA_FILE)):
        return ACCELERATE_MODEL, ACCELERATE_OPTIMIZER
    return (ACCELERATE_MODEL,)


def read_merged_metadata(storage: Storage, parts: tuple[str, ...]) -> DcpMetadata:
    """Several DCP checkpoints of one state dict (accelerate keeps the model's and the
    optimizer's apart) as one, every record placed relative to the root."""
    return merge_metadata(storage, [(part, read_metadata(storage, part)) for part in parts])


def merge_metadata(
    storage: Storage, parts: list[tuple[str, DcpMetadata]], own: str | None = None
) -> DcpMetadata:
    """The ``.metadata`` of each part (a directory under the root) as one checkpoint's. Items
    named ``own`` (or under it, ``own/...``) are each part's own (megatron-core keeps its
    common state so), left out."""
    entries: dict = {}
    records: dict = {}
    planner: dict = {}
    mcore: dict = {}
    for part, metadata in parts:
        if own is not None:
            metadata = _without(metadata, own)
        clash = sorted(set(entries) & set(metadata.entries))
        if clash:
            raise CheckpointError(
                f"{storage.describe(part)}: holds {clash[0]} too; the parts of one state dict "
                "cannot share keys"
            )
        entries.update(metadata.entries)
        for key, info in metadata.storage.items():
            records[key] = replace(info, relative_path=join(part, info.relative_path))
        planner.update(metadata.planner_data or {})
        if isinstance(metadata.mcore_data, dict):
            mcore.update(metadata.mcore_data)
    return DcpMetadata(
        entries=entries, storage=records, planner_data=planner or None, mcore_data=mcore or None
    )


def _without(metadata: DcpMetadata, own: str) -> DcpMetadata:
    def kept(fqn: str) -> bool:
        return fqn != own and not fqn.startswith(f"{own}/")

    return replace(
        metadata,
        entries={k: e for k, e in metadata.entries.items() if kept(k)},
        storage={k: i for k, i in metadata.storage.items() if kept(k[0])},
    )


def files_of(base: str, placed: list[tuple[StorageInfo, StoredTensor]]) -> tuple[StoredFile, ...]:
    """Stored tensors grouped into the ``.distcp`` files their records lie in."""
    by_file: dict[str, list[StoredTensor]] = {}
    for info, tensor in placed:
        by_file.setdefault(join(base, info.relative_path), []).append(tensor)
    return tuple(StoredFile(path, tuple(ts)) for path, ts in sorted(by_file.items()))


def chunks_placed(
    metadata: DcpMetadata, fqn: str, entry: TensorEntry, canonical: str
) -> list[tuple[StorageInfo, StoredTensor]]:
    """Each stored chunk of ``fqn``, placed where it lies in canonical tensor ``canonical``
    (the key's own global tensor)."""
    out = []
    for chunk in entry.chunks:
        zero = (0,) * len(chunk.sizes)
        pieces = (Piece(zero, chunk.offsets, chunk.sizes),) if all(chunk.sizes) else ()
        key: KeyPath = (fqn, *chunk.offsets)
        tensor = StoredTensor(key, canonical, chunk.sizes, entry.dtype, pieces)
        out.append((metadata.storage[(fqn, chunk.offsets)], tensor))
    return out
