"""One writer per destination: a lease held in the destination while a job writes it.

Two jobs writing one destination at once corrupt it: each clears or resumes what the other
is writing, aborts the other's uploads as a killed run's leftovers, and one may mark complete
files the other has since replaced. So a job takes ``ckptctl.lock`` in its destination before
it touches anything there, renews it while it writes, and removes it after the manifest.

* Taking it is atomic: ``O_CREAT | O_EXCL`` on a local disk, a conditional PUT
  (``If-None-Match: *``) on an object store; the lock is then read back, so a store that ignores
  the condition is caught in all but a narrow race.
* A job killed while holding it leaves it behind. A rerun takes it over once it is stale: on the
  same machine when its process is gone, anywhere when it was not renewed for ``LEASE`` seconds
  (the holder renews it every ``LEASE / 4``). A stale local lock is renamed aside first, so two
  reruns cannot both take it over.
* Readers never look at it; ``--overwrite`` counts it as ckptctl's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from ckptctl.checksums.manifest import LOCK
from ckptctl.errors import CkptctlError
from ckptctl.io.storage import Storage

LEASE = 120.0
"""Seconds a lock stays valid without being renewed."""


class DestinationBusyError(CkptctlError):
    """Another job holds the destination."""

    exit_code = 2


class Lease:
    """The lock of ``storage``'s destination, held by this process (``acquire`` / ``release``,
    or use ``hold``)."""

    def __init__(self, storage: Storage, lease: float = LEASE) -> None:
        self.storage = storage
        self.lease = lease
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps(
            {
                "token": self.token,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "renewed": time.time(),
                "lease_seconds": self.lease,
            }
        ).encode()

    def acquire(self) -> None:
        for _ in range(3):
            if self._create():
                if (self._read() or {}).get("token") != self.token:
                    break  # a store that ignored the condition: the other writer won
                self._start_renewing()
                return
            holder = self._read()
            if holder is None or not self._stale(holder):
                break
            self._take_over(holder)
        raise self.busy()

    def busy(self) -> DestinationBusyError:
        return DestinationBusyError(
            f"{self.storage.url} is being written by another ckptctl job ({self._who()})",
            hint=f"wait for it to finish, or stop it; a killed job's {LOCK} is taken over by "
            f"the next job once stale (its process gone, or {int(self.lease)} s unrenewed)",
        )

    def _create(self) -> bool:
        """Write the lock if there is none; whether this process now holds it."""
        body = self._body()
        if self.storage.is_local:
            path = self.storage.path(LOCK)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(body)
            return True
        if self.storage.is_s3:
            bucket, key, _ = self.storage.fs.split_path(self.storage.path(LOCK))
            try:
                self.storage.fs.call_s3(
                    "put_object", Bucket=bucket, Key=key, Body=body, IfNoneMatch="*"
                )
            except FileExistsError:  # s3fs's word for 412 Precondition Failed
                return False
            except Exception as err:
                if "PreconditionFailed" in repr(err) or "412" in repr(err):
                    return False
                raise
            return True
        if self.storage.exists(LOCK):  # another store: best effort
            return False
        self.storage.write_text(LOCK, body.decode())
        return True

    def _read(self) -> dict[str, Any] | None:
        try:
            doc = json.loads(self.storage.read_text(LOCK, limit=1 << 16))
        except (CkptctlError, OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def _stale(self, holder: dict[str, Any]) -> bool:
        renewed = holder.get("renewed")
        lease = holder.get("lease_seconds", self.lease)
        if not isinstance(renewed, int | float) or not isinstance(lease, int | float):
            return True  # not a lock ckptctl wrote whole
        if time.time() - renewed > lease:
            return True  # not renewed: its holder is gone or stuck
        same_host = holder.get("host") == socket.gethostname()
        return same_host and isinstance(holder.get("pid"), int) and not _alive(holder["pid"])

    def _take_over(self, holder: dict[str, Any]) -> None:
        """Move a stale lock aside (one rerun succeeds; the others find it gone or fresh)."""
        aside = f"{LOCK}.stale.{holder.get('token', 'unknown')}"
        if self.storage.is_local:
            with contextlib.suppress(FileNotFoundError):
                os.rename(self.storage.path(LOCK), self.storage.path(aside))
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.storage.path(aside))
        else:
            self.storage.remove(LOCK)

    def _who(self) -> str:
        holder = self._read() or {}
        since = holder.get("renewed")
        when = (
            time.strftime("%H:%M:%S", time.localtime(since))
            if isinstance(since, int | float)
            else "?"
        )
        return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, renewed at {when}"

    def _start_renewing(self) -> None:
        def renew() -> None:
            while not self._stop.wait(self.lease / 4):
                with contextlib.suppress(Exception):  # a missed renewal is retried
                    if (self._read() or {}).get("token") == self.token:
                        self.storage.write_text(LOCK, self._body().decode())

        self._renewer = threading.Thread(target=renew, daemon=True, name="ckptctl-lease")
        self._renewer.start()

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        with contextlib.suppress(Exception):
            if (self._read() or {}).get("token") == self.token:
                self.storage.remove(LOCK)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def refuse_if_held(storage: Storage) -> None:
    """Refuse a destination another job holds (a stale lock is left for ``acquire``)."""
    if not storage.exists(LOCK):
        return
    lease = Lease(storage)
    holder = lease._read()
    if holder is not None and not lease._stale(holder):
        raise lease.busy()


@contextlib.contextmanager
def hold(storage: Storage) -> Iterator[Lease]:
    """The destination's lock, for the duration of the block."""
    lease = Lease(storage)
    lease.acquire()
    try:
        yield lease
    finally:
        lease.release()
