"""Byte movement on any fsspec URL: a small storage object rooted at a checkpoint directory.
Local paths go through the OS (``ckptctl.io.local_files``); fsspec is loaded for remote URLs only.

Paths given to it are relative and ``/``-separated; any that would leave the root are refused,
since index files inside an untrusted checkpoint name the files we open. Writes appear only when
complete: a ``.partial`` file renamed into place, or on S3 a multipart upload to the final key.
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

from ckptctl.checksums.record_checks import RecordChecks
from ckptctl.errors import CheckpointError, CheckpointNotFoundError, StorageError, UsageError
from ckptctl.io.filesystems import kernel_copy_pays
from ckptctl.io.local_files import LocalFiles, local_root, protocol_of
from ckptctl.io.multipart import MultipartUpload, abort_stale_uploads, copy_run_on_server
from ckptctl.io.runs import WRITTEN_FROM_MAPPED_PAGES, Run, copy_run, feed
from ckptctl.io.storage_errors import CONNECT_TIMEOUT, check_endpoint, explicit_endpoint
from ckptctl.io.writeback import available as can_write_back
from ckptctl.io.writeback import request_writeback
from ckptctl.settings import StorageConfig


class HashingWriter(io.RawIOBase):
    """A forward-only writer that counts and hashes what passes through it."""

    def __init__(self, inner: BinaryIO, digest: Any = None, *, writeback: bool = False) -> None:
        super().__init__()
        self._inner = inner
        self.digest = digest
        self.size = 0
        self._writeback = writeback
        self._written_back = 0
        """Bytes up to here have been handed to the device (``writeback``)."""
        self._kernel_copy_pays: bool | None = None
        """``kernel_copy_pays`` for this file, asked at its first run."""

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.size

    def seek(self, *args: Any) -> int:
        raise OSError("forward-only stream")

    def write(self, data: Any) -> int:
        n = self._inner.write(data)
        if self.digest is not None:
            self.digest.update(memoryview(data)[:n] if n is not None else data)
        self.size += n if n is not None else len(data)
        self._write_back()
        return n if n is not None else len(data)

    def _write_back(self) -> None:
        """Start writing what has been written so far to the device, each ``WRITEBACK_STEP``:
        a large local file otherwise sits dirty in the page cache until the kernel's dirty
        threshold (10% of RAM) or the final flush, so the device idles while the job computes
        and the flush before the manifest waits for all of it."""
        if not self._writeback or self.size - self._written_back < WRITEBACK_STEP:
            return
        try:
            self._inner.flush()
            request = request_writeback(
                self._inner.fileno(), self._written_back, self.size - self._written_back
            )
        except (OSError, AttributeError, io.UnsupportedOperation):
            request = None
        self._writeback = request is not None
        if request is not False:  # declined for a backlog: the next request covers this too
            self._written_back = self.size

    def write_back_all(self) -> None:
        """At the end of the file: ask for the whole of it to be written out (pages already on
        their way are skipped by the kernel), so little is left for the flush in ``drain``."""
        if not self._writeback:
            return
        with contextlib.suppress(OSError, AttributeError, io.UnsupportedOperation):
            self._inner.flush()
            request_writeback(self._inner.fileno())

    def flush(self) -> None:
        self._inner.flush()

    def copy_file(self, src: str, advance: Any = None) -> int | None:
        """Append local file ``src`` by a kernel copy (``copy_file_range``: no pass through
        Python, and file systems that can share the blocks), hashing it from a read-only map of
        its pages; ``advance(nbytes)`` reports progress. ``None`` when either side is not a
        plain local file, or the kernel cannot copy between them (the caller streams it)."""
        whole = Run(src, 0, os.path.getsize(src), "")
        observers = [] if advance is None else [lambda view: advance(len(view))]
        return self.copy_range(whole, observers)

    def copy_range(self, run: Run, observers: list[Any]) -> int | None:
        """Append ``run`` without its bytes passing through Python: by a kernel copy, or, on a
        file system where that copies through a pipe (``ckptctl.io.filesystems``), by writing the
        source's mapped pages; for a run of an object on the store this uploads to, by a
        server-side copy. The checksums (and ``observers``) see the mapped or fetched pages.
        ``run.copied_by`` says how; ``None``, with nothing written, when none applies (the
        caller writes the bytes)."""
        if run.storage is not None:
            copied = copy_run_on_server(self._inner, run, self._with_digest(observers))
            if copied is not None:
                self.size += run.nbytes
            return copied
        fileno = getattr(self._inner, "fileno", None)
        if fileno is None or not hasattr(os, "copy_file_range"):
            return None
        try:
            dst = fileno()
        except (OSError, io.UnsupportedOperation):
            return None
        if self._kernel_copy_pays is None:
            self._kernel_copy_pays = kernel_copy_pays(dst)
        if not self._kernel_copy_pays:
            for view in run.views():
                feed(observers, view, self)  # (``write``: the file's digest, size, writeback)
            run.copied_by = WRITTEN_FROM_MAPPED_PAGES
            return run.nbytes
        self._inner.flush()
        if not copy_run(dst, run, self._with_digest(observers)):
            return None
        self.size += run.nbytes
        self._write_back()
        return run.nbytes

    def _with_digest(self, observers: list[Any]) -> list[Any]:
        return observers if self.digest is None else [self.digest.update, *observers]

    def copy_object(self, source: Storage, rel: str, advance: Any = None) -> int | None:
        """Append object ``rel`` of ``source`` by a server-side copy, when this writes a
        multipart upload on the same object store and nothing is written yet; the bytes are
        still read once to hash them (the manifest's checksum), but not uploaded. ``None``
        when it does not apply (the caller streams the bytes)."""
        upload = self._inner
        if not (isinstance(upload, MultipartUpload) and source.is_s3 and source.fs is upload.fs):
            return None
        size = source.size(rel)
        if size == 0 or self.size:
            return None
        upload.copy_object(source.path(rel), size)
        if self.digest is None:
            if advance is not None:
                advance(size)
        else:
            with source.open_sequential(rel) as f:
                while chunk := f.read(8 << 20):
                    self.digest.update(chunk)
                    if advance is not None:
                        advance(len(chunk))
        self.size += size
        return size


WRITEBACK_STEP = 32 << 20
"""Bytes of a local file written between requests to the kernel to start writing them out."""

REMOTE_BLOCK_SIZE = 128 << 10
"""Read-ahead of remote file objects, used only for zip and safetensors metadata (tensor bytes
are fetched by exact range): small, since it is read past what was asked for."""

RANGE_PART = 16 << 20
"""Sub-range size for parallel GETs of one large range (AWS suggests 8-16 MiB)."""


def _flush(path: str, sync: Any = None) -> None:
    """``fdatasync`` (or ``sync``) of the file or directory at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        (sync or os.fdatasync)(fd)
    finally:
        os.close(fd)


def _flush_folder(path: str) -> None:
    with contextlib.suppress(OSError):  # file systems that cannot sync a directory
        _flush(path, os.fsync)


def _remote(url: str, protocol: str, options: dict[str, Any]) -> tuple[Any, str]:
    """The fsspec file system of a remote URL, and the path in it."""
    import fsspec  # remote URLs only: see ckptctl.io.local_files

    try:
        return fsspec.core.url_to_fs(url, **options)
    except ValueError:  # fsspec: "Protocol not known: foo"
        raise StorageError(
            f"{url}: unknown URL scheme {protocol!r}",
            hint="use a local path, file://, s3://bucket/prefix or another fsspec URL whose "
            "package is installed (gs:// needs gcsfs, az:// adlfs)",
        ) from None
    except ImportError as err:  # a known scheme whose fsspec package is not installed
        raise StorageError(
            f"{url}: {err}", hint="install the package named, or use a local path or s3://"
        ) from None


def _protocols(fs: Any) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


class Storage:
    uploads_directly = True
    """Writes go straight to this URL (a staged storage writes to local files first, which
    cannot take a server-side copy)."""

    @property
    def checks(self) -> RecordChecks:
        """The checks of the zip records read in parts from here (its own, or its job's)."""
        own = self.__dict__.get("_checks")
        if own is None:
            own = RecordChecks()
            self.__dict__["_checks"] = own
        return own

    def __init__(
        self,
        url: str,
        config: StorageConfig | None = None,
        *,
        read_only: bool = False,
        checks: RecordChecks | None = None,
    ) -> None:
        self.__dict__["_checks"] = checks  # (a view of another storage sets none: made when asked)
        self.url = url
        self.read_only = read_only
        """A source: every write, removal or upload through this object is refused."""
        self.config = config or StorageConfig()
        protocol = protocol_of(url)
        options = self.config.fs_options(protocol)
        root = local_root(url)
        if root is not None:
            self.fs: Any = LocalFiles()
        else:
            self.fs, root = _remote(url, protocol, options)
        self.root = root.rstrip("/") or "/"
        self._unsynced: list[str] = []
        """Local files written and renamed into place, not yet flushed to the device."""
        self.durable = True
        """Local files written here are flushed to the device before ``drain`` returns (a
        staging directory, whose files are uploaded and removed, says no)."""
        self.upload_parallel = self.config.upload_parallel
        """Parts of one file uploading at once (files written at once share the configured)."""
        self._folders: set[str] = set()
        """Local directories this object created or found (not made again per file)."""
        self.is_local = "file" in _protocols(self.fs)
        self.is_s3 = "s3" in _protocols(self.fs) and hasattr(self.fs, "call_s3")
        if self.is_s3:
            timeout = (options.get("config_kwargs") or {}).get("connect_timeout", CONNECT_TIMEOUT)
            check_endpoint(explicit_endpoint(options), float(timeout))

    def connect(self) -> None:
        """Build the object-store client now: botocore builds it at the first request
        (~0.2-0.4 s), which would otherwise delay whatever transfer comes first (a no-op
        elsewhere; a failure here is left for the first real request to report)."""
        if self.is_s3 and hasattr(self.fs, "connect"):
            with contextlib.suppress(Exception):
                self.fs.connect()

    def path(self, rel: str) -> str:
        norm = posixpath.normpath(rel) if rel else "."
        if norm.startswith("/") or norm == ".." or norm.startswith("../") or "\\" in rel:
            raise CheckpointError(
                f"{rel!r} escapes the checkpoint root {self.url}; refusing to open it"
            )
        return self.root if norm == "." else f"{self.root}/{norm}"

    def describe(self, rel: str) -> str:
        return f"{self.url.rstrip('/')}/{rel}" if rel else self.url

    def checked_name(self, rel: str) -> str:
        """The file as ``record_checks`` names it: a local path, an object's URL."""
        return self.path(rel) if self.is_local else self.describe(rel)

    def exists(self, rel: str = "") -> bool:
        return self.fs.exists(self.path(rel))

    def isdir(self, rel: str = "") -> bool:
        return self.fs.isdir(self.path(rel))

    def size(self, rel: str) -> int:
        return int(self.fs.size(self.path(rel)))

    def identity(self, rel: str) -> str:
        """What changes whenever the file's content may have: size, modification and change
        times and inode on local disks (ctime cannot be set back by hand); ETag or version on
        object stores. Cheap: metadata only, never the bytes."""
        path = self.path(rel)
        if self.is_local:
            st = os.stat(path)
            return (
                f"size={st.st_size} mtime={st.st_mtime_ns} ctime={st.st_ctime_ns} ino={st.st_ino}"
            )
        info = self.fs.info(path)
        tag = next(
            (
                str(info[k])
                for k in ("VersionId", "ETag", "etag", "md5Hash", "mtime")
                if info.get(k)
            ),
            str(info.get("LastModified") or info.get("created") or ""),
        )
        return f"size={info.get('size')} tag={tag}"

    def listdir(self, rel: str = "") -> list[str]:
        base = self.path(rel)
        try:
            entries = self.fs.ls(base, detail=False)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.describe(rel)}: no such directory") from None
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    def find_files(self, rel: str = "") -> list[str]:
        """Every file below ``rel``, as paths relative to it (empty if it does not exist)."""
        base = self.path(rel)
        prefix = base.rstrip("/") + "/"
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        return sorted(p[len(prefix) :] for p in found if p.startswith(prefix))

    def _refuse_if_source(self, rel: str) -> None:
        if self.read_only:
            raise UsageError(
                f"refusing to write {self.describe(rel)}: it lies in a source checkpoint",
                hint="this is a bug in ckptctl; please report it",
            )

    def read_text(self, rel: str, limit: int = 256 << 20) -> str:
        """A small text file (a tracker, a JSON document): refused when larger than ``limit``
        bytes or not UTF-8, never read whole into memory first."""
        try:
            with self.fs.open(self.path(rel), "rb") as f:
                data = f.read(limit + 1)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.describe(rel)}: file not found") from None
        if len(data) > limit:
            raise CheckpointError(
                f"{self.describe(rel)}: larger than {limit} bytes; not a text file"
            )
        try:
            return data.decode()
        except UnicodeDecodeError as err:
            raise CheckpointError(f"{self.describe(rel)}: not UTF-8 text ({err.reason})") from None

    def open_read(self, rel: str) -> BinaryIO:
        """A seekable reader. On remote stores the read-ahead block is kept small (1 MiB;
        s3fs defaults to 50 MiB), so fetching a pickle or one tensor's range does not pull in
        megabytes nobody asked for."""
        options = {} if self.is_local else {"block_size": REMOTE_BLOCK_SIZE}
        try:
            return self.fs.open(self.path(rel), "rb", **options)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.describe(rel)}: file not found") from None

    def open_sequential(self, rel: str, block_size: int = 8 << 20) -> BinaryIO:
        """A reader for one front-to-back pass over a whole file (large read-ahead blocks)."""
        options = {} if self.is_local else {"block_size": block_size}
        try:
            return self.fs.open(self.path(rel), "rb", **options)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.describe(rel)}: file not found") from None

    def read_range(self, rel: str, start: int, nbytes: int) -> bytes:
        """Bytes ``[start, start + nbytes)`` of ``rel``: no read-ahead, safe to call from several
        threads at once. One ranged request; a large range is fetched as parallel sub-ranges
        (one object-store connection streams far slower than the store serves)."""
        path = self.path(rel)
        try:
            if nbytes < 2 * RANGE_PART or not hasattr(self.fs, "cat_ranges"):
                return self.fs.cat_file(path, start=start, end=start + nbytes)
            size = -(-nbytes // (nbytes // RANGE_PART))  # equal parts of at least RANGE_PART
            starts = list(range(start, start + nbytes, size))
            ends = [min(s + size, start + nbytes) for s in starts]
            parts = self.fs.cat_ranges([path] * len(starts), starts, ends)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.describe(rel)}: file not found") from None
        for part in parts:
            if isinstance(part, BaseException):
                raise part
        return b"".join(parts)

    @contextlib.contextmanager
    def open_write(self, rel: str, digest: Any = None) -> Iterator[HashingWriter]:
        """Write ``rel`` so that it only appears if the block succeeds.

        On S3 a multipart upload straight to the final key (it becomes visible atomically on
        completion, and is aborted on failure); elsewhere a ``.partial`` file renamed into place.
        The stream is forward-only (zip archives then use data descriptors instead of seeking
        back), so ``digest`` (a hashlib-style object) sees every byte once, as written."""
        self._refuse_if_source(rel)
        final = self.path(rel)
        if self.is_s3:
            upload = MultipartUpload(self.fs, final, self.config.part_size, self.upload_parallel)
            try:
                yield HashingWriter(upload, digest)  # type: ignore[arg-type]
                upload.commit()
            except BaseException:
                upload.abort()
                raise
            return
        partial = final + ".partial"
        if not self.is_local:
            self.fs.makedirs(posixpath.dirname(final), exist_ok=True)
            try:
                with self.fs.open(partial, "wb") as f:
                    yield HashingWriter(f, digest)
            except BaseException:
                # fsspec raises ValueError for a directory in the way: the original error
                # matters.
                with contextlib.suppress(OSError, ValueError):
                    self.fs.rm(partial)
                raise
            self.fs.mv(partial, final)
            return
        # A local disk through the OS directly: a job writing thousands of small files
        # (DeepSpeed universal) spends measurable time in fsspec's per-file wrappers.
        folder = os.path.dirname(final)
        if folder not in self._folders:
            os.makedirs(folder, exist_ok=True)
            self._folders.add(folder)
        try:
            with open(partial, "wb") as f:
                out = HashingWriter(f, digest, writeback=self.durable and can_write_back())
                yield out
                out.write_back_all()
        except BaseException:
            with contextlib.suppress(OSError):  # the original error matters more
                os.remove(partial)
            raise
        try:
            os.replace(partial, final)
        except OSError:  # e.g. a directory where the file goes: leave no partial file behind
            with contextlib.suppress(OSError):
                os.remove(partial)
            raise
        if self.durable:
            self._unsynced.append(final)

    def write_text(self, rel: str, text: str) -> None:
        with self.open_write(rel) as f:
            f.write(text.encode())

    def remove(self, rel: str) -> None:
        self._refuse_if_source(rel)
        self._folders.clear()
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(rel), recursive=True)

    def clear(self, keep: str) -> None:
        """Remove everything under this URL but the entry ``keep`` (the job's lock)."""
        self._refuse_if_source("")
        self._folders.clear()
        if not self.exists():
            return
        if self.is_local:
            for name in self.fs.ls(self.root):
                if name.rsplit("/", 1)[-1] != keep:
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm(name, recursive=True)
            return
        kept = self.path(keep)
        doomed = [p for p in self.fs.find(self.root) if p.rstrip("/") != kept]
        if doomed:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(doomed)

    def begin_writing(self) -> None:
        """Before a job writes here: clear what a killed earlier run left unseen (on S3,
        incomplete multipart uploads under this prefix)."""
        self._refuse_if_source("")
        if self.is_s3:
            abort_stale_uploads(self.fs, self.root)

    def drain(self) -> None:
        """Wait until everything written so far is durable at this URL: on a local disk, the
        files this object wrote (and their directory entries) are flushed to the device, so a
        manifest written next never vouches for bytes a power cut would lose (their writeback
        began as each file closed, so little is left to wait for); object stores hold an
        object once its upload completes; staged storage waits for its uploads."""
        written, self._unsynced = list(dict.fromkeys(self._unsynced)), []
        if not written:
            return
        folders = sorted({os.path.dirname(path) for path in written})
        # Flushes issued together share the file system's journal commits: one at a time,
        # each would wait for a commit of its own.
        with ThreadPoolExecutor(min(16, len(written)), thread_name_prefix="ckptctl-sync") as pool:
            list(pool.map(_flush, written))
            list(pool.map(_flush_folder, folders))  # the renames into place
