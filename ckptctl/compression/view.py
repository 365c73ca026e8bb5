"""A compressed checkpoint seen as the checkpoint it stores: ``CompressedStorage`` answers every
read a format reader makes (listings, sizes, whole files, byte ranges) by decoding only the
chunks that hold the bytes asked for, so every command reads it as it would read the original.

Layout of a compressed checkpoint directory::

    ckptctl.compressed.json   index: each original file's size, checksum and chunks; the base
    data/<original path>      the file's encoded chunks, back to back
    ckptctl.manifest.json     written last: the directory is complete
"""

from __future__ import annotations

import io
import json
import posixpath
import threading
from typing import Any, BinaryIO

from ckptctl.errors import CheckpointError, CheckpointNotFoundError
from ckptctl.io.byteview import ByteView
from ckptctl.io.storage import Storage
from ckptctl.settings import StorageConfig

INDEX = "ckptctl.compressed.json"
DATA = "data"
QUANTIZED = ".q"
"""Suffix of the file beside ``data/<path>`` holding the int8 codes of its quantized tensors."""
FORMAT = "ckptctl-compressed"


def is_compressed(storage: Storage) -> bool:
    return storage.isdir() and storage.exists(INDEX)


def open_view(storage: Storage, config: StorageConfig | None = None) -> Storage:
    """``storage`` itself, or the view of the checkpoint it holds compressed."""
    return CompressedStorage(storage, config) if is_compressed(storage) else storage


class CompressedStorage(Storage):
    """Read-only view of the original files of a compressed checkpoint (and of its base)."""

    def __init__(self, inner: Storage, config: StorageConfig | None = None) -> None:
        # Not Storage.__init__: no file system of its own; reads go through ``inner``.
        self.inner = inner
        self.url = inner.url
        self.read_only = True
        self.config = inner.config
        self.fs = inner.fs
        self.root = inner.root
        self.is_local = False  # readers must come through read_range/open_read, never the disk
        self.is_s3 = False
        self._unsynced = []
        try:
            index = json.loads(inner.read_text(INDEX))
            if index.get("format") != FORMAT or index.get("version") != 1:
                raise ValueError(f"format {index.get('format')!r} version {index.get('version')}")
            self.files: dict[str, dict[str, Any]] = index["files"]
            self.chunk_size = int(index["chunk_size"])
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{inner.describe(INDEX)}: unreadable index ({err})") from None
        self.index = index
        self.lossy = bool(index.get("lossy"))
        self._base_info = index.get("base")
        self._base: Storage | None = None
        self._checked: set[str] = set()
        self._config = config or inner.config
        self._cache: dict[tuple[str, int], bytes] = {}
        self._lock = threading.Lock()

    def _totals(self) -> tuple[int, int]:
        """Bytes of the original files, and bytes their chunks are stored in."""
        original = sum(int(f["size"]) for f in self.files.values())
        codes = sum(int(f.get("quantized_bytes", 0)) for f in self.files.values())
        return original, codes + sum(c[1] for f in self.files.values() for c in f["chunks"])

    def decoded_checksum(self, rel: str, recorded: str, algorithm: str) -> str:
        """What a file the source's own manifest lists with ``recorded`` must decode to: the
        file as compressed, or for a quantized one (its original had ``recorded``) the
        checksum of its dequantized bytes."""
        entry = self.files.get(rel) or {}
        if algorithm == "xxh3_64" and entry.get("original_checksum") == recorded:
            return str(entry["checksum"])
        return recorded

    def quantization_errors(self) -> dict[str, float]:
        """Largest absolute error of each quantized tensor (its canonical name)."""
        out: dict[str, float] = {}
        for entry in self.files.values():
            for row in entry.get("quantized", []):
                name, error = str(row[4]), float(row[6])
                out[name] = max(out.get(name, 0.0), error)
        return out

    def _scope(self) -> str:
        return str((self.index.get("quantize") or {}).get("scope"))

    def stored_ratio(self) -> float:
        """Original bytes per stored byte."""
        original, stored = self._totals()
        return original / max(1, stored)

    def summary(self) -> str:
        """One line for ``inspect`` and ``plan``: how much smaller, against what."""
        original, stored = self._totals()
        base = self._base_info["url"] if self._base_info else None
        return (
            f"compressed ({self.index.get('codec')}): {original} bytes stored in {stored}, "
            f"ratio {original / max(stored, 1):.2f}"
            + (f", as deltas against the base {base}" if base else "")
            + (
                f", lossy ({self.index['quantize']['scope']} quantized)"
                if self.lossy
                else ", lossless"
            )
        )

    # --- the base -------------------------------------------------------------------------

    def base(self) -> Storage:
        if self._base is None:
            assert self._base_info is not None
            url = self._base_info["url"]
            plain = Storage(url, self._config, read_only=True)
            if not plain.exists():
                raise CheckpointNotFoundError(
                    f"{self.url} was compressed against the base {url}, which does not exist",
                    hint="restore the base checkpoint at that place (it is needed to read this "
                    "one), or decompress this checkpoint where the base is present",
                )
            self._base = open_view(plain, self._config)
        return self._base

    def _base_file(self, rel: str) -> Storage:
        """The base, after checking its file ``rel`` is the one the delta was taken against."""
        base = self.base()
        if rel not in self._checked:
            want = self._base_info["files"][rel]
            found = base.identity(rel) if base.exists(rel) else "missing"
            if found != want["identity"]:
                raise CheckpointError(
                    f"{self.url}: its base file {base.describe(rel)} changed since compression "
                    f"({found}; recorded {want['identity']}); refusing to decode against it",
                    hint="restore the base the checkpoint was compressed against",
                )
            self._checked.add(rel)
        return base

    # --- the original files ---------------------------------------------------------------

    def _entry(self, rel: str) -> dict[str, Any]:
        self.path(rel)  # refuses paths escaping the root
        entry = self.files.get(posixpath.normpath(rel))
        if entry is None:
            raise CheckpointNotFoundError(f"{self.describe(rel)}: file not found")
        return entry

    def exists(self, rel: str = "") -> bool:
        return rel in ("", ".") or rel in self.files or self.isdir(rel)

    def isdir(self, rel: str = "") -> bool:
        prefix = "" if rel in ("", ".") else rel.rstrip("/") + "/"
        return any(f.startswith(prefix) for f in self.files)

    def size(self, rel: str) -> int:
        return int(self._entry(rel)["size"])

    def identity(self, rel: str) -> str:
        entry = self._entry(rel)
        return f"size={entry['size']} xxh3={entry['checksum']}"

    def listdir(self, rel: str = "") -> list[str]:
        prefix = "" if rel in ("", ".") else rel.rstrip("/") + "/"
        names = {f[len(prefix) :].split("/", 1)[0] for f in self.files if f.startswith(prefix)}
        if not names:
            raise CheckpointNotFoundError(f"{self.describe(rel)}: no such directory")
        return sorted(names)

    def find_files(self, rel: str = "") -> list[str]:
        prefix = "" if rel in ("", ".") else rel.rstrip("/") + "/"
        return sorted(f[len(prefix) :] for f in self.files if f.startswith(prefix))

    def read_text(self, rel: str, limit: int = 256 << 20) -> str:
        size = self.size(rel)
        if size > limit:
            raise CheckpointError(
                f"{self.describe(rel)}: larger than {limit} bytes; not a text file"
            )
        try:
            return self.read_range(rel, 0, size).decode()
        except UnicodeDecodeError as err:
            raise CheckpointError(f"{self.describe(rel)}: not UTF-8 text ({err.reason})") from None

    def open_read(self, rel: str) -> BinaryIO:
        return io.BufferedReader(_ChunkedFile(self, rel, self.size(rel)), 1 << 20)

    def open_sequential(self, rel: str, block_size: int = 8 << 20) -> BinaryIO:
        return self.open_read(rel)

    def chunk(self, rel: str, n: int) -> bytes:
        """Chunk ``n`` of ``rel``, decoded (the last one or two are cached)."""
        key = (rel, n)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        entry = self._entry(rel)
        offset, length, mode = entry["chunks"][n]
        start = n * self.chunk_size
        size = min(self.chunk_size, int(entry["size"]) - start)
        payload = self.inner.read_range(f"{DATA}/{rel}", offset, length)
        base = None
        if mode.startswith("x"):
            base_file = self._base_file(rel)
            base_size = base_file.size(rel)
            base = base_file.read_range(rel, start, max(0, min(size, base_size - start)))
        from ckptctl.compression.codec import decode  # zstd: imported only when decoding

        try:
            data = decode(mode, payload, size, base)
        except Exception as err:
            raise CheckpointError(
                f"{self.inner.describe(f'{DATA}/{rel}')}: chunk {n} does not decode ({err}); the "
                "compressed file is damaged"
            ) from None
        if entry.get("quantized"):
            data = self._dequantized(rel, start, data, entry["quantized"])
        with self._lock:
            if len(self._cache) >= 4:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = data
        return data

    def _dequantized(self, rel: str, start: int, data: bytes, rows: list[Any]) -> bytes:
        """A decoded chunk with its quantized regions (stored as zeros) filled in from their
        codes (``compress --quantize``)."""
        from ckptctl.compression.lossy import from_index, stored_bytes

        out = bytearray(data)

        def read(offset: int, nbytes: int) -> bytes:
            return self.inner.read_range(f"{DATA}/{rel}{QUANTIZED}", offset, nbytes)

        for row in rows:
            region, at = from_index(row)
            lo, hi = max(start, region.offset), min(start + len(out), region.end)
            if lo < hi:
                out[lo - start : hi - start] = stored_bytes(read, region, at, lo, hi)
        return bytes(out)

    def read_range(self, rel: str, start: int, nbytes: int) -> bytes:
        size = self.size(rel)
        end = min(size, start + nbytes)
        if start >= end:
            return b""
        first, last = start // self.chunk_size, (end - 1) // self.chunk_size
        parts = [self.chunk(rel, n) for n in range(first, last + 1)]
        joined = parts[0] if len(parts) == 1 else b"".join(parts)
        skip = start - first * self.chunk_size
        return joined[skip : skip + end - start]

    # --- never written through ------------------------------------------------------------

    def begin_writing(self) -> None:
        self._refuse_if_source("")


class _ChunkedFile(ByteView):
    def __init__(self, view: CompressedStorage, rel: str, size: int) -> None:
        super().__init__(size)
        self._view, self._rel = view, rel

    def _read_at(self, pos: int, view: memoryview) -> int:
        data = self._view.read_range(self._rel, pos, len(view))
        view[: len(data)] = data
        return len(data)
