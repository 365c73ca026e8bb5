"""Streaming writes to S3: one object as a multipart upload, parts sent in parallel.

Why not s3fs's own writer: it uploads parts one after another, and when the ``with`` block
around it fails it still *completes* the upload, publishing a truncated object under the final
name. Here the object appears only on ``commit`` (S3 makes a completed multipart upload visible
atomically, so no ``.partial`` name and server-side copy are needed) and ``abort`` throws the
parts away. Memory stays within ``part_size * (parallel + 1)``.

The S3 calls go through s3fs's client, so credentials, endpoint and botocore's retry settings
are the filesystem's.
"""

from __future__ import annotations

import contextlib
import io
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckptctl.io.runs import feed

MIN_PART_SIZE = 5 << 20
"""S3's smallest part (all but the last)."""
MAX_PARTS = 10_000
COPY_PART = 512 << 20
"""Part size of server-side copies (S3 allows up to 5 GiB; nothing is buffered here)."""


class MultipartUpload(io.RawIOBase):
    def __init__(self, fs: Any, path: str, part_size: int, parallel: int) -> None:
        super().__init__()
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part size {part_size} is below S3's minimum of 5 MiB")
        self.fs = fs
        self.path = path
        self.bucket, self.key, _ = fs.split_path(path)
        self.part_size = part_size
        self.parallel = max(parallel, 1)
        self._buffer = bytearray(part_size)
        self._filled = 0
        self._copied = False
        """A server-side copy ended the object: its last part may be under 5 MiB, so nothing
        may follow it."""
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []
        self._part_count = 0
        self._pending: deque[Future[None]] = deque()
        self._pool: ThreadPoolExecutor | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        """Copy ``data`` into the part being filled (the only copy: a full part is handed to
        the upload as it is, and a fresh one started)."""
        view = memoryview(data).cast("B")
        if self._copied and len(view):
            raise ValueError(f"{self.path}: nothing may be written after a server-side copy")
        pos = 0
        while pos < len(view):
            take = min(self.part_size - self._filled, len(view) - pos)
            self._buffer[self._filled : self._filled + take] = view[pos : pos + take]
            self._filled += take
            pos += take
            if self._filled == self.part_size:
                part, self._buffer, self._filled = self._buffer, bytearray(self.part_size), 0
                self._send(self._upload_part, part)
        return len(view)

    def _rest(self) -> bytes:
        """The part being filled, as the last (or only) body."""
        return bytes(memoryview(self._buffer)[: self._filled])

    def copy_object(self, source_path: str, size: int) -> None:
        """Append all ``size`` bytes of object ``source_path`` (same store) by server-side
        copy (``UploadPartCopy``): the bytes never pass through this machine. Only at a part
        boundary, only for a non-empty source, and as the object's end."""
        if self._filled or self._copied or size <= 0:
            raise ValueError("a server-side copy must start a part and copy something")
        self._copy_parts(source_path, 0, size)
        self._copied = True

    @property
    def filled(self) -> int:
        """Bytes written into the part not yet sent."""
        return self._filled

    def end_part(self) -> None:
        """Send the part being filled now, short of ``part_size`` (it must hold S3's minimum),
        so that what follows starts a part of its own."""
        if not self._filled:
            return
        if self._filled < MIN_PART_SIZE:
            raise ValueError(f"a part of {self._filled} bytes is below S3's minimum of 5 MiB")
        part, self._buffer, self._filled = self._rest(), bytearray(self.part_size), 0
        self._send(self._upload_part, part)

    def copy_range(self, source_path: str, start: int, nbytes: int) -> None:
        """Append bytes ``[start, start + nbytes)`` of object ``source_path`` (same store) by
        server-side copy, as parts of at least S3's minimum, so writing may go on after it.
        Only at a part boundary (``end_part``)."""
        if self._filled or self._copied or nbytes < MIN_PART_SIZE:
            raise ValueError("a server-side copy must start a part and copy at least 5 MiB")
        self._copy_parts(source_path, start, nbytes)

    def _copy_parts(self, source_path: str, start: int, nbytes: int) -> None:
        """Queue ``UploadPartCopy`` parts for the range, in equal pieces of at most
        ``COPY_PART`` (so none is shorter than the range allows)."""
        bucket, key, _ = self.fs.split_path(source_path)
        count = -(-nbytes // COPY_PART)
        step = -(-nbytes // count)
        for lo in range(start, start + nbytes, step):
            hi = min(lo + step, start + nbytes)
            self._send(self._copy_part, {"Bucket": bucket, "Key": key}, f"bytes={lo}-{hi - 1}")

    def _send(self, how: Any, *args: Any) -> None:
        """Queue part number n+1 as ``how(number, *args)`` (an upload or a copy)."""
        if self._upload_id is None:
            started = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)
            self._upload_id = started["UploadId"]
            self._pool = ThreadPoolExecutor(self.parallel, thread_name_prefix="ckptctl-upload")
        self._part_count += 1
        number = self._part_count
        if number > MAX_PARTS:
            raise OSError(f"{self.path}: more than {MAX_PARTS} parts; raise --part-size")
        # Bounded in flight: wait for the oldest part before queueing another.
        while len(self._pending) >= self.parallel:
            self._pending.popleft().result()
        assert self._pool is not None
        self._pending.append(self._pool.submit(how, number, *args))

    def _upload_part(self, number: int, body: bytes | bytearray) -> None:
        out = self.fs.call_s3(
            "upload_part",
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=body,
        )
        self._parts.append({"PartNumber": number, "ETag": out["ETag"]})

    def _copy_part(self, number: int, source: dict[str, str], byte_range: str) -> None:
        out = self.fs.call_s3(
            "upload_part_copy",
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self._upload_id,
            PartNumber=number,
            CopySource=source,
            CopySourceRange=byte_range,
        )
        self._parts.append({"PartNumber": number, "ETag": out["CopyPartResult"]["ETag"]})

    def commit(self) -> None:
        """Publish the object: one PUT if it never filled a part, else the last part and the
        completion request once every part has arrived."""
        if self._upload_id is None:
            self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=self._rest())
        else:
            if self._filled:
                self._send(self._upload_part, self._rest())
            while self._pending:
                self._pending.popleft().result()
            parts = sorted(self._parts, key=lambda p: p["PartNumber"])
            self.fs.call_s3(
                "complete_multipart_upload",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
            )
        self._buffer, self._filled = bytearray(), 0
        self._shutdown()
        self.fs.invalidate_cache(self.path)

    def abort(self) -> None:
        """Drop the upload: no object appears and S3 frees the stored parts."""
        for future in self._pending:
            future.cancel()
        self._shutdown()
        if self._upload_id is not None:
            with contextlib.suppress(Exception):  # the original error matters more
                self.fs.call_s3(
                    "abort_multipart_upload",
                    Bucket=self.bucket,
                    Key=self.key,
                    UploadId=self._upload_id,
                )
            self._upload_id = None
        self._buffer, self._filled = bytearray(), 0

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._pending.clear()


def abort_stale_uploads(fs: Any, prefix_path: str) -> int:
    """Abort multipart uploads under ``prefix_path`` left by a killed earlier run (S3 keeps and
    bills their parts until aborted). Returns how many were aborted."""
    bucket, key, _ = fs.split_path(prefix_path)
    prefix = key.rstrip("/") + "/" if key else ""
    listed = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    aborted = 0
    for upload in listed.get("Uploads", []):
        with contextlib.suppress(Exception):
            fs.call_s3(
                "abort_multipart_upload",
                Bucket=bucket,
                Key=upload["Key"],
                UploadId=upload["UploadId"],
            )
            aborted += 1
    return aborted


def copy_run_on_server(upload: Any, run: Any, observers: list[Any]) -> int | None:
    """Append ``run`` (bytes of an object on the store ``upload`` writes to) mostly by
    server-side copy: its first bytes complete the part being filled up to S3's 5 MiB minimum,
    the rest is copied by the store. Every byte is still fetched once, a window ahead, for
    ``observers`` (the checksums the output carries and the source's CRC-32), but is not
    uploaded. Returns the bytes copied on the server, or ``None`` when it does not apply (not
    this store, or too short a run to leave 5 MiB to copy): the caller writes the bytes."""
    if not isinstance(upload, MultipartUpload) or run.storage.fs is not upload.fs:
        return None
    lead = MIN_PART_SIZE - upload.filled if 0 < upload.filled < MIN_PART_SIZE else 0
    if run.nbytes - lead < MIN_PART_SIZE:
        return None

    def copy_rest() -> None:
        upload.end_part()
        upload.copy_range(run.storage.path(run.rel), run.offset + lead, run.nbytes - lead)

    if not lead:
        copy_rest()  # the server copies while the bytes are fetched and hashed here
    seen = 0
    for view in run.views():
        feed(observers, view)
        if seen < lead:
            upload.write(view[: lead - seen])
            if seen + len(view) >= lead:
                copy_rest()
        seen += len(view)
    return run.nbytes - lead
