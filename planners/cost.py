"""The storage cost model: how long reads and writes take on a kind of storage. Pure.

time = latency x requests / concurrency (or requests / IOPS, whichever is slower)
       + bytes / bandwidth, for reads and writes separately;
job  = overlap x max(reads + drain, writes + fill) + (1 - overlap) x (reads + writes): a job
       reads ahead of its writer, and how much of the one runs during the other is the
       storage's, measured by ``ckptctl calibrate`` when source and target are on one
       calibrated storage. Without a measure: reads + writes when both are on local disks (they
       may share one device), overlapped otherwise (a network link, or two devices, carries
       both at once).
pipeline: reads and writes overlap only once the pipeline between them is full: a process
       writes nothing until its first ``window`` of bytes is read (``fill``), and when its
       reads end that window is still to be written (``drain``). The window is what the
       executor holds per process, for each file written at once: to an object store a
       multipart part being filled (4 files of 8 MiB parts by default); to a local disk the
       dirty pages it lets build up before starting their writeback (32 MiB), which the
       final flush waits for. Each process of a job split over nodes fills and drains its own
       (``bench/bench_nodes.py``: s3 -> s3 through one 5 MB/s link moved 0.59 GB each way in
       133 s, the longer direction 126.6 s and a 33.5 MB window 6.7 s of it; with the window
       the model is within 11% of every node's job on 1-4 nodes, and within 15% on disks.)
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


DECODE_BANDWIDTH = 0.36e9
"""Bytes per second a compressed checkpoint's chunks decode to (``ckptctl decompress`` of a
delta on this project's 2-core bench machine, ``bench/bench_compress.py``): the CPU a read of
a compressed source costs."""


ENCODE_BANDWIDTH = 0.31e9
"""Bytes per second ``ckptctl compress`` encodes (byte-plane shuffle and zstd-3 on every
core of this project's 2-core bench machine, ``bench/bench_compress.py``; a delta also XORs
with the base)."""


QUANTIZE_BANDWIDTH = 0.13e9
"""Bytes of quantized tensors per second ``compress --quantize`` handles (int8 codes, the zip
CRC-32s over the dequantized bytes, the decoded file's checksum; 2 cores,
``bench/bench_compress.py``)."""
QUANTIZED_BYTES_PER_ELEMENT = 1 + 4 / 256
"""An int8 code per element and a float32 scale per block of 256."""


def compress_seconds(
    bytes_in: int,
    ratio: float,
    files: int,
    source: StorageProfile,
    target: StorageProfile,
    base: StorageProfile | None = None,
    encode_bandwidth: float = ENCODE_BANDWIDTH,
    quantized: int = 0,
) -> float:
    """Time to compress ``bytes_in`` bytes in ``files`` files to ``bytes_in / ratio``: the
    source read (and the base, for a delta), encoding (and quantizing ``quantized`` of the
    bytes), and the stored bytes written; summed, like the rest of the model (the job
    overlaps them, so this is an upper bound)."""
    seconds = source.seconds(bytes_in, files) + bytes_in / encode_bandwidth
    seconds += quantized / QUANTIZE_BANDWIDTH
    if base is not None:
        seconds += base.seconds(bytes_in, files)
    return seconds + target.seconds(int(bytes_in / max(ratio, 1e-9)), files, write=True)


def through_decoder(
    profile: StorageProfile, ratio: float, decode_bandwidth: float = DECODE_BANDWIDTH
) -> StorageProfile:
    """The profile of reading a compressed checkpoint on ``profile``: each original byte costs
    ``1 / ratio`` stored bytes fetched, then decoding (one after the other, per chunk)."""
    per_byte = 1 / (profile.read_bandwidth * ratio) + 1 / decode_bandwidth
    return profile.model_copy(
        update={"name": f"{profile.name}, compressed", "read_bandwidth": 1 / per_byte}
    )


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def job_seconds(
    read: float,
    write: float,
    source_url: str,
    target_url: str,
    overlap: float | None = None,
    *,
    fill: float = 0.0,
    drain: float = 0.0,
) -> float:
    """A job's time from its reads' and its writes', ``overlap`` of them running at once once
    the pipeline between them has filled (see the module's docstring); unmeasured (None):
    summed when both are on local disks, overlapped otherwise."""
    if overlap is None:
        overlap = 0.0 if is_local(source_url) and is_local(target_url) else 1.0
    overlap = min(max(overlap, 0.0), 1.0)
    return overlap * max(read + drain, write + fill) + (1.0 - overlap) * (read + write)


def pipeline_times(
    estimates: Estimates, source: StorageProfile, target: StorageProfile, window: int
) -> tuple[float, float]:
    """``fill`` and ``drain``: the first ``window`` bytes read before any write, the last
    written after every read (no more than the job moves)."""
    if window <= 0:
        return 0.0, 0.0
    fill = min(window, estimates.bytes_read) / source.read_bandwidth
    drain = min(window, estimates.bytes_written) / target.write_bandwidth
    return fill, drain


def shared_overlap(source: StorageProfile, target: StorageProfile) -> float | None:
    """The measured overlap of reads and writes when a job reads and writes one calibrated
    storage (the same profile); None otherwise (two storages: the rule for unmeasured)."""
    return source.overlap if source == target else None


def with_time(
    estimates: Estimates,
    source: StorageProfile,
    target: StorageProfile,
    source_url: str,
    target_url: str,
    window: int = 0,
) -> Estimates:
    """``estimates`` with the model's time; ``window``: the bytes the executor holds between
    reading and writing (``pipeline_times``)."""
    read = source.seconds(estimates.bytes_read, estimates.read_requests)
    write = target.seconds(estimates.bytes_written, estimates.write_requests, write=True)
    overlap = shared_overlap(source, target)
    return timed(estimates, read, write, source, target, source_url, target_url, overlap, window)


def timed(
    estimates: Estimates,
    read: float,
    write: float,
    source: StorageProfile,
    target: StorageProfile,
    source_url: str,
    target_url: str,
    overlap: float | None,
    window: int,
) -> Estimates:
    """The estimates with the time of a job that reads for ``read`` seconds and writes for
    ``write``, and the part of it that is the pipeline's fill and drain, which every process
    of a split job pays whole."""
    fill, drain = pipeline_times(estimates, source, target, window)
    seconds = job_seconds(read, write, source_url, target_url, overlap, fill=fill, drain=drain)
    unpiped = job_seconds(read, write, source_url, target_url, overlap)
    return estimates.model_copy(
        update={
            "seconds": round(seconds, 6),
            "pipeline_seconds": round(max(seconds - unpiped, 0.0), 6),
        }
    )
