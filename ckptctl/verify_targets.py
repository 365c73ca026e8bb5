"""Which files of a probed checkpoint carry checksums of their own, and where they are.

Per format: Megatron rank files and single torch files are ``torch.save`` archives; a DCP or
``torch_dist`` checkpoint holds one small archive per tensor record inside each ``.distcp`` file
(plus ``common.pt``); HF checkpoints are safetensors, which carry none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptctl.formats.dcp.reader import DcpCheckpoint
from ckptctl.formats.dcp.records import RecordWindow
from ckptctl.formats.hf.reader import HFCheckpoint
from ckptctl.formats.torch_dist.layout import COMMON
from ckptctl.integrity import ZIP_MAGIC, ZipEntry, zip_entries
from ckptctl.probe import Checkpoint
from ckptctl.storage import Storage


@dataclass
class Targets:
    zips: dict[str, list[ZipEntry]] = field(default_factory=dict)
    """File -> the zip entries inside it whose CRC-32 can be checked."""
    safetensors: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    """What carries no checksum, said in the report."""


def integrity_targets(ckpt: Checkpoint) -> Targets:
    if isinstance(ckpt, HFCheckpoint):
        return Targets(safetensors=[f.path for f in ckpt.view.files])
    if isinstance(ckpt, DcpCheckpoint):
        return _dcp_targets(ckpt)
    storage = ckpt.storage
    return Targets(zips={f.path: _whole_file(storage, f.path) for f in ckpt.view.files})


def _whole_file(storage: Storage, rel: str) -> list[ZipEntry]:
    with storage.open_read(rel) as f:
        return zip_entries(f, storage.describe(rel))


def _dcp_targets(ckpt: DcpCheckpoint) -> Targets:
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
        targets.zips[common] = _whole_file(storage, common)
    if plain:
        targets.unchecked.append(f"{plain} DCP records store no checksum (pickled bytes)")
    return targets
