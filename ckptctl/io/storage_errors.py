"""What a failure of the store means to the user: one ``StorageError`` with the URL and the fix.

Object-store clients raise their own exception types (botocore, aiohttp), local disks raise
``OSError`` with an errno; whatever the layer, a user needs the same two things: which URL and
what to do. The types are recognised by name so that no client library is imported here.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import urllib.parse

from pydantic import ByteSize

from ckptctl.errors import CkptctlError, StorageError
from ckptctl.io.locations import location

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
_READ_ONLY = {errno.EROFS}
_DENIED = {errno.EACCES, errno.EPERM}


def _class_names(err: BaseException) -> set[str]:
    return {f"{c.__module__}.{c.__name__}" for c in type(err).__mro__}


def classify(err: BaseException, where: str = "") -> StorageError | None:
    """The ``StorageError`` ``err`` stands for, or ``None`` if it is not a storage failure.

    ``where`` names the URLs involved when the error itself does not (e.g. ``SRC -> DST``)."""
    if isinstance(err, CkptctlError):
        return err if isinstance(err, StorageError) else None
    names = _class_names(err)
    path = getattr(err, "filename", None) or where
    prefix = f"{path}: " if path else ""
    if any(n.endswith(("NoCredentialsError", "PartialCredentialsError")) for n in names):
        return StorageError(
            f"{prefix}no credentials for the object store",
            hint="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass "
            "--storage-option anon=true for a public bucket",
        )
    if any(
        n.endswith(("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError"))
        for n in names
    ):
        return StorageError(
            f"{prefix}cannot reach the object store ({err})",
            hint="check --endpoint-url (or AWS_ENDPOINT_URL) and that the server is up",
        )
    if not isinstance(err, OSError):
        return None
    code = err.errno
    if code in _NO_SPACE:
        return StorageError(
            f"{prefix}no space left on the device; nothing was marked complete",
            hint="free space or choose another destination, then rerun to resume",
        )
    if code in _READ_ONLY:
        return StorageError(
            f"{prefix}read-only file system",
            hint="choose a destination on a writable file system",
        )
    if isinstance(err, PermissionError) or code in _DENIED:
        return StorageError(
            f"{prefix}permission denied ({err.strerror or err})",
            hint="check this user's permissions there (or the credentials for an object "
            "store), or choose another destination",
        )
    return StorageError(
        f"{prefix}{err.strerror or err}; nothing was marked complete",
        hint="check the URL, credentials and endpoint, then rerun to resume",
    )


CONNECT_TIMEOUT = 5.0
"""Seconds to wait for a TCP connection to an object-store endpoint."""

_reachable: set[str] = set()


def check_endpoint(endpoint: str | None, timeout: float = CONNECT_TIMEOUT) -> None:
    """Fail fast when an explicit object-store endpoint does not answer.

    botocore retries a refused or timed-out connection with backoff for a minute or more before
    it gives up; one TCP connection attempt answers the same question within seconds. Checked
    once per endpoint and process; retries for throttling during a job are untouched. The
    timeout is botocore's ``connect_timeout`` when the user set one
    (``--storage-option 'config_kwargs={"connect_timeout": 30}'``)."""
    if not endpoint or endpoint in _reachable:
        return
    url = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout):
            pass
    except OSError as err:
        raise StorageError(
            f"cannot reach the object store at {endpoint} ({err.strerror or err})",
            hint="check --endpoint-url (or AWS_ENDPOINT_URL) and that the server is up",
        ) from None
    _reachable.add(endpoint)


def explicit_endpoint(options: dict) -> str | None:
    """The endpoint an S3 client will use when one is configured rather than AWS's default."""
    client = options.get("client_kwargs") or {}
    return (
        options.get("endpoint_url")
        or client.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )


def check_free_space(url: str, needed: int) -> None:
    """Refuse a local destination whose file system cannot hold ``needed`` more bytes, before
    anything is written (a full disk found mid-write wastes the whole run)."""
    where = location(url)
    if where.store != "file" or needed <= 0:
        return
    path = where.path
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    free = shutil.disk_usage(path).free
    if free < needed:
        missing = ByteSize(needed - free).human_readable()
        raise StorageError(
            f"{url}: the job writes {ByteSize(needed).human_readable()} but only "
            f"{ByteSize(free).human_readable()} is free there ({missing} missing)",
            hint="free space or choose another destination",
        )
