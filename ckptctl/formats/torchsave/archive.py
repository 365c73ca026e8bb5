"""``torch.save`` zip archives read lazily and written as a stream, with a restricted unpickler.

``torch.load`` either reads a whole file or maps it; neither lets us fetch one tensor's byte range
from object storage, and ``weights_only=True`` rejects the ``argparse.Namespace`` every Megatron
file holds. So we parse the archive ourselves: the pickle is loaded with an allow-list (tensors
become ``TensorRef`` records naming their storage and geometry, nothing is executed), and each
tensor is read by byte range from its stored (uncompressed) zip entry.

Writing mirrors it: the pickle goes first, then each storage is streamed into an aligned zip entry,
so a multi-gigabyte shard never has to sit in memory. ``torch.load`` reads the result.

Private APIs, on purpose: the pickle names ``torch._utils._rebuild_tensor_v2`` (that is what
``torch.save`` writes, so the reader maps it and the writer emits it); the writer subclasses the
pure-Python ``pickle._Pickler`` because only it lets stub classes be saved under their original
global names. Both hold for the releases the tests run on (torch 2.13, Python 3.11); a change
shows up as a failing round-trip test, never as a silently wrong file.
"""

from __future__ import annotations

import io
import os
import struct
import threading
import zipfile
from collections.abc import Callable
from math import prod
from typing import TYPE_CHECKING, Any, BinaryIO

from ckptctl.checksums import record_checks
from ckptctl.checksums.crc import crc32
from ckptctl.errors import CheckpointError
from ckptctl.formats.torchsave.unpickle import Shape, TensorRef, restricted_loads
from ckptctl.io.runs import Span
from ckptctl.model.dtypes import NUMBER_FORMATS, unpack_number

if TYPE_CHECKING:
    import numpy as np

# numpy is imported where arrays are made: a job moving every byte by kernel copy makes none.

_ALIGNMENT = 64  # torch aligns storage records so they can be memory-mapped
_EXTRA_GUESS = 2 * _ALIGNMENT
"""Most bytes of a local header's extra field (torch's alignment padding) fetched on the guess
that a record's bytes follow its header this closely."""


class TorchZipReader:
    """Lazy reader of one ``torch.save`` archive on any seekable binary file object."""

    def __init__(
        self,
        fileobj: BinaryIO,
        where: str,
        fetch: Callable[[int, int], bytes] | None = None,
        place: tuple[str, int] | None = None,
        stored: tuple[str, Callable[[], str]] | None = None,
        checks: record_checks.RecordChecks | None = None,
    ) -> None:
        """``checks``: those of the storage the archive is read from, which see the parts of
        records read in parts (without them, such parts go unchecked: a reader used alone).
        ``fetch(start, nbytes)``, if given, reads tensor bytes by exact range, thread-safely
        and without read-ahead (remote stores: one ranged GET per read, several in flight);
        ``fileobj`` then serves only the zip directory and the pickle. ``place``: the file
        holding the archive (relative to its checkpoint's root) and the archive's offset in it,
        so ``span`` can say where a box's bytes lie. ``stored``: for an object in a store, its
        URL and what the store says of its content (asked when a record is first read in
        part), so records read in parts are checked (``record_checks``)."""
        self._f = fileobj
        plain = isinstance(fileobj, io.BufferedReader) and isinstance(fileobj.raw, io.FileIO)
        self._fd = fileobj.fileno() if plain else None
        """A plain local file's descriptor, for mapped reads (record windows and remote files
        have none)."""
        local = getattr(fileobj, "local_file", None)  # a window of a local file (DCP record)
        self._path: str | None
        self._base: int
        self._path, self._base = (os.path.abspath(fileobj.name), 0) if plain else local or (None, 0)
        """The local file holding the archive, and the archive's offset in it, for the checks
        of records read in parts (``record_checks``)."""
        self._fetch = fetch
        self._checks = checks
        self.place = place
        self._stored = stored
        self._version: str | None = None
        self.where = where
        try:
            self._zip = zipfile.ZipFile(fileobj)
            names = self._zip.namelist()
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
            raise CheckpointError(
                f"{where}: not a readable torch checkpoint ({err}); the file may be truncated"
            ) from None
        pkl = [n for n in names if n.endswith("data.pkl") and n.count("/") == 1]
        if not pkl:
            raise CheckpointError(f"{where}: archive has no data.pkl; not a torch.save file")
        self._prefix = pkl[0].rsplit("/", 1)[0]
        self._data_offsets: dict[str, tuple[int, int]] = {}
        self._crcs: dict[str, int] = {}
        # One file handle: seek + read must not interleave between reader threads.
        self._lock = threading.Lock()
        self.tree = restricted_loads(self._read_entry(pkl[0]), where)
        self._check_tensors()

    def _check_tensors(self) -> None:
        """Every tensor the pickle describes lies inside its storage record, which the archive
        holds uncompressed: checked from the zip directory before any byte is read, so a
        forged offset, stride or shape is refused here, never followed into memory."""
        for ref in tensor_refs(self.tree):
            key = ref.storage.key
            info = self._zip.NameToInfo.get(f"{self._prefix}/data/{key}")
            if info is None:
                raise CheckpointError(f"{self.where}: storage record {key} is missing")
            if info.compress_type != zipfile.ZIP_STORED:
                raise CheckpointError(f"{self.where}: storage record {key} is compressed")
            problem = geometry_problem(ref, info.file_size)
            if problem is not None:
                raise CheckpointError(
                    f"{self.where}: a tensor of storage record {key} {problem}; the file is "
                    "corrupt or forged"
                )

    def _read_entry(self, name: str) -> bytes:
        try:
            return self._zip.read(name)
        except (zipfile.BadZipFile, OSError, EOFError) as err:
            raise CheckpointError(f"{self.where}: cannot read {name} ({err})") from None

    def _storage_span(self, key: str) -> tuple[int, int]:
        """Absolute file offset and size of a storage record's bytes (call under the lock)."""
        if key not in self._data_offsets:
            info = self._record_info(key)
            self._locate(key, info, self._local_header(info.header_offset))
        return self._data_offsets[key]

    def _local_header(self, offset: int) -> bytes:
        """A record's 30-byte local header."""
        return self._read_at(offset, 30)

    def _record_info(self, key: str) -> zipfile.ZipInfo:
        try:
            info = self._zip.getinfo(f"{self._prefix}/data/{key}")
        except KeyError:
            raise CheckpointError(f"{self.where}: storage record {key} is missing") from None
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{self.where}: storage record {key} is compressed")
        return info

    def _locate(self, key: str, info: zipfile.ZipInfo, header: bytes) -> tuple[int, int]:
        """Where record ``key``'s bytes start, from its 30-byte local header: the local extra
        field (torch's alignment padding) differs from the central directory's."""
        if len(header) < 30 or header[:4] != b"PK\x03\x04":
            raise CheckpointError(f"{self.where}: corrupt zip header for record {key}")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        self._data_offsets[key] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
        self._crcs[key] = info.CRC
        return self._data_offsets[key]

    def _fetch_box(self, ref: TensorRef, offset: int, nbytes: int) -> bytes | memoryview:
        """Bytes ``[offset, offset + nbytes)`` of ``ref``'s storage record from the remote
        store. A record not yet located and read from its start is fetched together with its
        local header in one request (a header alone is a round trip for 30 bytes)."""
        key = ref.storage.key
        with self._lock:
            span = self._data_offsets.get(key)
            info = None if span is not None else self._record_info(key)
        assert self._fetch is not None
        if info is not None:
            reach = 30 + len(info.filename.encode()) + _EXTRA_GUESS
            header = self._fetch(info.header_offset, reach + nbytes if offset == 0 else 30)
            with self._lock:
                span = self._locate(key, info, bytes(header[:30]))
            skip = span[0] - info.header_offset
            if offset == 0 and skip <= reach:
                self._check_size(ref, span[1], nbytes)
                return memoryview(header)[skip : skip + nbytes]
        assert span is not None
        self._check_size(ref, span[1], offset + nbytes)
        return self._fetch(span[0] + offset, nbytes)

    def _check_size(self, ref: TensorRef, size: int, end: int) -> None:
        if end > size:
            raise CheckpointError(
                f"{self.where}: storage record {ref.storage.key} holds {size} bytes, fewer than "
                "its tensor needs; the file is truncated or corrupt"
            )

    def _check_whole(self, ref: TensorRef, first: int, data: Any) -> None:
        """A read that covers a whole storage record is checked against the record's CRC-32
        (cheap next to the read), so corrupt foreign files are refused instead of carried into
        the output; a part of a record read from a local file goes to ``record_checks``, which
        checks the record once (``first``: the part's byte offset in the record)."""
        key = ref.storage.key
        whole = first == 0 and len(data) == self._data_offsets[key][1]
        if whole and crc32(data) != self._crcs[key]:
            raise CheckpointError(
                f"{self.where}: storage record {key} fails its CRC-32 check; the file is "
                "corrupt (ckptctl verify lists every damaged entry)"
            )
        if not whole and (record := self._whole_record(key)) is not None:
            record_checks.saw(record, first, data)

    def _whole_record(self, key: str) -> record_checks.Record | None:
        """Record ``key``, to be checked whole (``record_checks``) where it is read in parts;
        ``None`` where the reader was not told its file or object."""
        start, size = self._data_offsets[key]
        name = f"{self.where}: storage record {key}"
        if self._checks is None:
            return None
        if self._path is not None:
            return self._checks.record(self._path, self._base + start, size, self._crcs[key], name)
        if self._stored is None or self._fetch is None:
            return None
        url, version = self._stored
        if self._version is None:
            self._version = version()
        fetch = self._fetch
        return self._checks.record(
            url,
            (self.place[1] if self.place else 0) + start,
            size,
            self._crcs[key],
            name,
            fetch=lambda at, nbytes: fetch(start + at, nbytes),
            version=self._version,
        )

    def read(
        self,
        ref: TensorRef,
        offsets: Shape | None = None,
        sizes: Shape | None = None,
        into: np.ndarray | None = None,
    ) -> np.ndarray:
        """Read box ``[offsets, offsets + sizes)`` of ``ref`` (the whole tensor by default).
        ``into`` (a contiguous array of the box's shape) receives the bytes straight from the
        file when the box lies contiguously there in the same dtype; the result is ``into``
        then, else a new array."""
        import numpy as np

        from ckptctl.arrays import numpy_dtype, strided

        dtype = numpy_dtype(ref.dtype)
        offsets = offsets if offsets is not None else (0,) * len(ref.shape)
        sizes = sizes if sizes is not None else ref.shape
        if prod(sizes) == 0:
            return np.empty(sizes, dtype)
        first = ref.offset + sum(o * s for o, s in zip(offsets, ref.stride, strict=True))
        last = first + sum((n - 1) * s for n, s in zip(sizes, ref.stride, strict=True))
        if self._fetch is None:
            direct = into is not None and _fits(into, ref, sizes)
            mapped = not direct and (into is not None or not _contiguous(sizes, ref.stride))
            if mapped and self._fd is not None:
                return self._read_mapped(self._fd, ref, sizes, first, last, into)
            with self._lock:
                return self._read_span(ref, sizes, first, last, into if direct else None)
        nbytes = (last - first + 1) * ref.dtype.itemsize
        data = self._fetch_box(ref, first * ref.dtype.itemsize, nbytes)
        if len(data) != nbytes:
            raise CheckpointError(f"{self.where}: unexpected end of file in {ref.storage.key}")
        self._check_whole(ref, first * ref.dtype.itemsize, data)
        # Fetched bytes are read-only and nothing writes into a read's result: view them as
        # they are instead of copying them into a bytearray first.
        return strided(np.frombuffer(data, dtype), sizes, ref.stride)

    def span(
        self, ref: TensorRef, offsets: Shape, sizes: Shape, *, covering: bool = False
    ) -> Span | None:
        """Where the box's bytes lie in the file holding the archive, when they lie
        contiguously (``None`` otherwise, or when the reader was not told its ``place``). A
        span covering a whole storage record carries the record's CRC-32. ``covering``: the
        bytes from the box's first element to its last, contiguous or not (what a read of
        the box touches)."""
        if self.place is None or prod(sizes) == 0:
            return None
        if not covering and not _contiguous(sizes, ref.stride):
            return None
        size = ref.dtype.itemsize
        first = ref.offset + sum(o * s for o, s in zip(offsets, ref.stride, strict=True))
        last = first + sum((n - 1) * s for n, s in zip(sizes, ref.stride, strict=True))
        nbytes = (last - first + 1) * size
        with self._lock:
            start = self._checked_start(ref, last)
        whole = first == 0 and nbytes == self._data_offsets[ref.storage.key][1]
        crc = self._crcs[ref.storage.key] if whole else None
        record = None if whole else self._whole_record(ref.storage.key)
        rel, base = self.place
        return Span(rel, base + start + first * size, nbytes, ref.dtype.name, crc, record)

    def read_number(self, ref: TensorRef) -> float:
        """A one-element tensor's value (Adam's step, an iteration count) without torch: the
        only tensor a plan reads."""
        if ref.numel != 1 or ref.dtype.name not in NUMBER_FORMATS:
            from ckptctl.arrays import first_value

            return float(first_value(self.read(ref)))
        size = ref.dtype.itemsize
        if self._fetch is None:
            with self._lock:
                start = self._checked_start(ref, ref.offset)
                data = self._read_at(start + ref.offset * size, size)
        else:
            data = bytes(self._fetch_box(ref, ref.offset * size, size))
        if len(data) != size:
            raise CheckpointError(f"{self.where}: unexpected end of file in {ref.storage.key}")
        self._check_whole(ref, ref.offset * size, data)
        return unpack_number(ref.dtype.name, data)

    def _read_mapped(
        self, fd: int, ref: TensorRef, sizes: Shape, first: int, last: int, into: np.ndarray | None
    ) -> np.ndarray:
        """A box that is not one run in the file, or that goes into a box of a band, copied
        once from the file's mapped pages (``arrays.box_from_file``)."""
        from ckptctl.arrays import box_from_file

        size = ref.dtype.itemsize
        with self._lock:
            start = self._checked_start(ref, last)
        offset, nbytes = start + first * size, (last - first + 1) * size
        if os.fstat(fd).st_size < offset + nbytes:
            raise CheckpointError(
                f"{self.where}: ends before the bytes of storage record {ref.storage.key}; the "
                "file is truncated"
            )
        if into is not None and not _matches(into, ref, sizes):
            into = None

        def check(span: memoryview) -> None:
            self._check_whole(ref, first * size, span)

        return box_from_file(fd, offset, nbytes, ref.dtype, sizes, ref.stride, into, check)

    def _read_at(self, start: int, nbytes: int) -> bytes:
        if self._fetch is not None:
            return self._fetch(start, nbytes)
        self._f.seek(start)
        return self._f.read(nbytes)

    def _checked_start(self, ref: TensorRef, last: int) -> int:
        """File offset of the storage record holding ``ref`` (call under the lock)."""
        start, size = self._storage_span(ref.storage.key)
        self._check_size(ref, size, (last + 1) * ref.dtype.itemsize)
        return start

    def _read_span(
        self, ref: TensorRef, sizes: Shape, first: int, last: int, into: np.ndarray | None
    ) -> np.ndarray:
        import numpy as np

        from ckptctl.arrays import buffer, numpy_dtype, strided, words

        itemsize = ref.dtype.itemsize
        start = self._checked_start(ref, last)
        self._f.seek(start + first * itemsize)
        nbytes = (last - first + 1) * itemsize
        # Read straight into the array's memory: no zero-filled buffer, no copy afterwards.
        flat = (
            into.reshape(-1)
            if into is not None
            else np.empty(nbytes // itemsize, numpy_dtype(ref.dtype))
        )
        view = buffer(words(flat)).cast("B")
        got = 0
        while got < nbytes:
            n = self._f.readinto(view[got:]) if hasattr(self._f, "readinto") else None
            if n is None:
                chunk = self._f.read(nbytes - got)
                n = len(chunk)
                view[got : got + n] = chunk
            if not n:
                raise CheckpointError(f"{self.where}: unexpected end of file in {ref.storage.key}")
            got += n
        self._check_whole(ref, first * itemsize, view)
        if into is not None:
            return into
        return strided(flat, sizes, ref.stride)


def tensor_refs(tree: Any) -> list[TensorRef]:
    """Every tensor of an unpickled tree, each container visited once (``census`` has bounded
    the tree)."""
    out, seen, stack = [], set(), [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, TensorRef):
            out.append(node)
            continue
        if id(node) in seen:
            continue
        if isinstance(node, dict):
            seen.add(id(node))
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            seen.add(id(node))
            stack.extend(node)
    return out


def geometry_problem(ref: TensorRef, record_bytes: int) -> str | None:
    """What is wrong with a tensor's geometry over a storage record of ``record_bytes``, if
    anything: sizes, strides and offset must be non-negative integers, one stride per
    dimension, and every element inside the record."""
    plain = all(isinstance(v, int) and not isinstance(v, bool) for v in (*ref.shape, *ref.stride))
    if not plain or not isinstance(ref.offset, int) or len(ref.shape) != len(ref.stride):
        return f"has shape {list(ref.shape)} and strides {list(ref.stride)}, not one per dimension"
    if min((*ref.shape, *ref.stride, ref.offset), default=0) < 0:
        return (
            f"has a negative size, stride or offset (shape {list(ref.shape)}, strides "
            f"{list(ref.stride)}, offset {ref.offset})"
        )
    if prod(ref.shape) == 0:
        return None
    last = ref.offset + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride, strict=True))
    if (last + 1) * ref.dtype.itemsize > record_bytes:
        return (
            f"reaches byte {(last + 1) * ref.dtype.itemsize} of a record of {record_bytes} "
            f"(shape {list(ref.shape)}, strides {list(ref.stride)}, offset {ref.offset})"
        )
    return None


def _fits(into: np.ndarray, ref: TensorRef, sizes: Shape) -> bool:
    """The box of ``ref`` lies in the file exactly as ``into`` lays it out in memory: same
    dtype and shape, both C-contiguous (so the bytes can be read straight into it)."""
    return _matches(into, ref, sizes) and into.flags.c_contiguous and _contiguous(sizes, ref.stride)


def _matches(into: np.ndarray, ref: TensorRef, sizes: Shape) -> bool:
    """``into`` holds the box's elements as they are: same dtype and shape."""
    from ckptctl.arrays import dtype_of

    return dtype_of(into) == ref.dtype.name and tuple(into.shape) == tuple(sizes)


def _contiguous(sizes: Shape, stride: Shape) -> bool:
    """A box of ``sizes`` elements laid out by ``stride`` is one run of consecutive ones."""
    expected = 1
    for n, step in zip(reversed(sizes), reversed(stride), strict=True):
        if n > 1 and step != expected:
            return False
        expected *= n
    return True
