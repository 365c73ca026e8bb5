"""Storage profiles: how fast a kind of storage reads and writes (a serialised schema: built-in
profiles here, measured ones saved by ``ckptctl calibrate``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


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
    overlap: float | None = None
    """How much of the shorter of a job's reads and writes on this storage runs during the
    longer: 0, one after the other (one disk serving both in turn); 1, entirely at once (a
    full-duplex link, or a disk with separate read and write budgets). Measured by ``ckptctl
    calibrate`` (reads and writes at once against each alone); None: not measured (the cost
    model then takes 0 for a job on local disks and 1 otherwise)."""

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
