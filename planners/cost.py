"""The storage cost model: how long reads and writes take on a kind of storage. Pure.

time = latency x requests / concurrency (or requests / IOPS, whichever is slower)
       + bytes / bandwidth, for reads and writes separately.
"""

from __future__ import annotations

from ckptctl.model.plan import Estimates
from ckptctl.model.profile import PROFILES, StorageProfile


def profile_for(url: str, measured: dict[str, StorageProfile] | None = None) -> StorageProfile:
    """A measured profile (``ckptctl calibrate``) whose URL prefixes ``url``, else the built-in
    profile for the URL's scheme."""
    for prefix in sorted(measured or {}, key=len, reverse=True):
        if url.startswith(prefix):
            return (measured or {})[prefix]
    if url.startswith(("s3://", "s3a://", "gs://", "az://")):
        return PROFILES["s3"]
    if url.startswith(("hdfs://", "webhdfs://")):
        return PROFILES["hdfs"]
    return PROFILES["local-nvme"]


def with_time(estimates: Estimates, source: StorageProfile, target: StorageProfile) -> Estimates:
    seconds = source.seconds(estimates.bytes_read, estimates.read_requests) + target.seconds(
        estimates.bytes_written, estimates.write_requests, write=True
    )
    return estimates.model_copy(update={"seconds": round(seconds, 6)})
