"""What the bytes of a file can prove about themselves: zip CRC-32s, checked in one pass.

A ``torch.save`` archive (Megatron rank files, ``distrib_optim.pt``, ``common.pt``, every tensor
record of a DCP ``.distcp`` shard written with torch's serialization) stores a CRC-32 of each
entry in its central directory. Checking them needs the entries' positions (a few small reads
of each directory) and then one sequential read of the file, which can feed a manifest digest
at the same time, so no byte is read twice. Safetensors files carry no checksum at all; for
them only the header and the file size can be checked.
"""

from __future__ import annotations

import struct
import zipfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptctl.checksums.crc import crc32
from ckptctl.errors import CheckpointError

if TYPE_CHECKING:  # (checksums sit below storage: they take its objects, never import it)
    from ckptctl.io.byte_streams import ByteStream
    from ckptctl.io.storage import Storage

ZIP_MAGIC = b"PK\x03\x04"
_LOCAL_HEADER = 30
_CHUNK = 8 << 20


@dataclass(frozen=True, slots=True)
class ZipEntry:
    name: str
    header_offset: int
    """Absolute position of the entry's local header in the file."""
    size: int
    crc: int
    record: str = ""
    """For entries of an archive embedded in a larger file (a DCP record): which record."""


def zip_entries(fileobj: ByteStream, where: str, base: int = 0, record: str = "") -> list[ZipEntry]:
    """The stored entries of the zip archive ``fileobj`` shows (a whole file, or a window onto
    one record at ``base``), positioned absolutely."""
    try:
        infos = zipfile.ZipFile(fileobj).infolist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        raise CheckpointError(f"{where}: not a readable zip archive ({err})") from None
    out = []
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{where}: entry {info.filename} is compressed")
        out.append(
            ZipEntry(info.filename, base + info.header_offset, info.file_size, info.CRC, record)
        )
    return out


@dataclass
class Targets:
    """What a checkpoint's files can prove about themselves, per file (each format says)."""

    zips: dict[str, list[ZipEntry]] = field(default_factory=dict)
    """File -> the zip entries inside it whose CRC-32 can be checked."""
    safetensors: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    """What carries no checksum, said in the report."""


def whole_file_entries(storage: Storage, rel: str) -> list[ZipEntry]:
    """The entries of a file that is one ``torch.save`` archive."""
    with storage.open_read(rel) as f:
        return zip_entries(f, storage.describe(rel))


class _SequentialReader:
    """Reads a file front to back exactly once; every byte passes through ``digest``."""

    def __init__(self, f: ByteStream, digest: Any, advance: Any = None) -> None:
        self._f = f
        self._digest = digest
        self._advance = advance
        self.pos = 0

    def read(self, n: int) -> bytes:
        data = self._f.read(n)
        if self._digest is not None:
            self._digest.update(data)
        if self._advance is not None:
            self._advance(len(data))
        self.pos += len(data)
        return data

    def skip_to(self, pos: int) -> None:
        while self.pos < pos:
            if not self.read(min(_CHUNK, pos - self.pos)):
                return

    def drain(self) -> None:
        while self.read(_CHUNK):
            pass


def stream_check(
    storage: Storage, rel: str, entries: list[ZipEntry], digest: Any = None, advance: Any = None
) -> list[str]:
    """Read ``rel`` once, front to back: check each entry's CRC-32 and feed ``digest`` (if
    given) with every byte (``advance(nbytes)`` hears of each read). Returns the problems
    found, each naming the file and entry."""
    where = storage.describe(rel)
    problems = []
    with storage.open_sequential(rel) as f:
        reader = _SequentialReader(f, digest, advance)
        for entry in sorted(entries, key=lambda e: e.header_offset):
            label = f"{where}: {entry.record + ' ' if entry.record else ''}entry {entry.name}"
            if entry.header_offset < reader.pos:
                problems.append(f"{label} overlaps the entry before it")
                continue
            reader.skip_to(entry.header_offset)
            header = reader.read(_LOCAL_HEADER)
            if len(header) < _LOCAL_HEADER or header[:4] != ZIP_MAGIC:
                problems.append(f"{label}: corrupt local header")
                continue
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            reader.read(name_len + extra_len)
            crc, left = 0, entry.size
            while left:
                block = reader.read(min(_CHUNK, left))
                if not block:
                    break
                crc = crc32(block, crc)
                left -= len(block)
            if left:
                problems.append(f"{label}: file ends {left} bytes early")
                break
            if crc != entry.crc:
                problems.append(f"{label}: CRC-32 mismatch (the bytes changed after writing)")
        reader.drain()
    return problems
