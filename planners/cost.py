"""The storage cost model: how long reads and writes take on a kind of storage. Pure.

time = latency x requests / concurrency (or requests / IOPS, whichever is slower)
       + bytes / bandwidth, for reads and writes separately.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ckptctl.plan import Estimates


class StorageProfile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    read_bandwidth: float
    """Bytes per second."""
    write_bandwidth: float
    latency: float
    """Seconds per request."""
    concurrency: int = 1
    """Requests in flight at once."""
    iops: float | None = None
    """Cap on requests per second, if the storage has one."""

    def seconds(self, nbytes: int, requests: int, *, write: bool = False) -> float:
        if requests == 0 and nbytes == 0:
            return 0.0
        per_request = self.latency * requests / max(self.concurrency, 1)
        if self.iops:
            per_request = max(per_request, requests / self.iops)
        bandwidth = self.write_bandwidth if write else self.read_bandwidth
        return per_request + nbytes / bandwidth


PROFILES = {
    profile.name: profile
    for profile in (
        StorageProfile(
            name="local-nvme",
            read_bandwidth=3e9,
            write_bandwidth=2e9,
            latency=1e-4,
            concurrency=32,
            iops=500_000,
        ),
        StorageProfile(
            name="s3",
            read_bandwidth=1e9,
            write_bandwidth=0.5e9,
            latency=0.03,
            concurrency=64,
            iops=5_500,
        ),
        StorageProfile(
            name="hdfs",
            read_bandwidth=0.8e9,
            write_bandwidth=0.4e9,
            latency=0.01,
            concurrency=16,
        ),
    )
}


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
