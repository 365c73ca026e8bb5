"""The staging tier: write each file to fast local disk, upload it in the background.

This is how training jobs save ("NVMe first, then the lake"): the conversion runs at local-disk
speed while finished files travel to object storage behind it. Control files (the in-progress
run log, the manifest) go straight to the target; the executor calls ``drain`` before the
manifest, so the commit marker is written only once every upload has landed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckptctl.io.storage import HashingWriter, Storage

UPLOAD_CHUNK = 8 << 20


class StagedStorage(Storage):
    """``target`` with its data files written through ``stage`` (a local directory)."""

    uploads_directly = False

    def __init__(self, target: Storage, stage_url: str) -> None:
        super().__init__(target.url, target.config)
        self.stage = Storage(stage_url)
        self.stage.durable = False  # its files go to the lake, then away: never to the device
        # One file at a time: each upload already sends its parts in parallel.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptctl-stage")
        self._uploads: list[Future[None]] = []
        self.bytes_staged = 0

    @contextlib.contextmanager
    def open_write(self, rel: str, digest: Any = None) -> Iterator[HashingWriter]:
        self._raise_failed()
        with self.stage.open_write(rel, digest) as out:
            yield out
        self.bytes_staged += out.size
        self._uploads.append(self._pool.submit(self._upload, rel))

    def write_text(self, rel: str, text: str) -> None:
        # Control files are small and go straight up, not queued behind data uploads.
        with Storage.open_write(self, rel) as f:
            f.write(text.encode())

    def _upload(self, rel: str) -> None:
        with self.stage.open_read(rel) as src, Storage.open_write(self, rel) as dst:
            while chunk := src.read(UPLOAD_CHUNK):
                dst.write(chunk)
        self.stage.remove(rel)  # uploaded: the local copy has done its job

    def _raise_failed(self) -> None:
        """Fail fast: a finished upload's error stops the job before more work is done."""
        for future in self._uploads:
            if future.done() and future.exception() is not None:
                future.result()

    def drain(self) -> None:
        try:
            for future in self._uploads:
                future.result()
        finally:
            self._uploads.clear()

    def close(self) -> None:
        for future in self._uploads:
            future.cancel()
        self._pool.shutdown(wait=True)
