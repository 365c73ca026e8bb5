"""What ``verify`` checks of a checkpoint stored as DCP: its description files and the CRC-32
that ``torch.save`` keeps of every entry of each record inside the ``.distcp`` files."""

from __future__ import annotations

from typing import Any

from ckptctl.checksums.integrity import ZIP_MAGIC, Targets, whole_file_entries, zip_entries
from ckptctl.formats.dcp_container.metadata import METADATA_FILE
from ckptctl.formats.megatron_common.iterations import COMMON, MCORE_METADATA
from ckptctl.io.storage import Storage
from ckptctl.model.stored import CheckpointView


def description_files(storage: Storage, view: CheckpointView) -> list[str]:
    """``.metadata`` (and Megatron-Core's ``common.pt`` and ``metadata.json``)."""
    if not view.files:
        return []
    base = view.files[0].path.rpartition("/")[0]
    candidates = [f"{base}/{n}" if base else n for n in (METADATA_FILE, COMMON, MCORE_METADATA)]
    return [c for c in candidates if storage.exists(c)]


def record_checksums(ckpt: Any) -> Targets:
    """The CRC-32 of every ``torch.save`` record inside the ``.distcp`` files, and of
    ``common.pt``; pickled byte records carry none."""
    from ckptctl.formats.dcp_container.records import RecordWindow

    storage = ckpt.storage
    targets = Targets()
    plain = 0
    by_file: dict[str, list] = {}
    for key, info in ckpt.metadata.storage.items():
        rel = f"{ckpt.base}/{info.relative_path}" if ckpt.base else info.relative_path
        by_file.setdefault(rel, []).append((key, info))
    for rel, records in sorted(by_file.items()):
        entries = targets.zips.setdefault(rel, [])
        with storage.open_read(rel) as f:
            for key, info in sorted(records, key=lambda r: r[1].offset):
                window = RecordWindow(f, info.offset, info.length)
                if info.transform_descriptors or window.read(4) != ZIP_MAGIC:
                    plain += 1  # pickled bytes, or a record written without torch.save
                    continue
                window.seek(0)
                fqn = key[0] if isinstance(key, tuple) else key
                where = f"{storage.describe(rel)}@{info.offset}"
                entries += zip_entries(window, where, info.offset, f"record {fqn}")
    common = f"{ckpt.base}/{COMMON}" if ckpt.base else COMMON
    if storage.exists(common):
        targets.zips[common] = whole_file_entries(storage, common)
    if plain:
        targets.unchecked.append(f"{plain} DCP records store no checksum (pickled bytes)")
    return targets
