"""Which process writes which target file when one job runs on several (``--workers``,
torchrun): shares balanced by bytes, each kept near the source files it reads. Pure.

Files are dealt largest first, each to the least loaded process that it fits on (load plus the
file within ``slack`` of an even share), preferring among those the process that already reads
most of the same source files (its page cache or connections are warm for them). A file too big
for any share goes to the least loaded process. Every process computes the same shares from the
same plan, so nothing has to be sent.
"""

from __future__ import annotations

from collections.abc import Sequence

from ckptctl.model.plan import COPY, FileWrite


def sources_of(file: FileWrite) -> frozenset[int]:
    """The plan's source files (indices) that ``file`` reads."""
    if file.kind == COPY:
        return frozenset({file.copy_of or 0})
    return frozenset(c.source for t in file.tensors for c in t.copies)


def split_files(
    files: Sequence[FileWrite], sizes: Sequence[int], ranks: int, slack: float = 0.05
) -> tuple[tuple[int, ...], ...]:
    """Indices into ``files`` for each of ``ranks`` processes, each share in plan order.

    ``sizes[i]`` is the bytes file ``i`` moves (the caller knows copied files' sizes)."""
    return split_sizes(sizes, ranks, [sources_of(f) for f in files], slack)


def split_sizes(
    sizes: Sequence[int],
    ranks: int,
    reads: Sequence[frozenset[int]] | None = None,
    slack: float = 0.05,
) -> tuple[tuple[int, ...], ...]:
    """Indices of items of ``sizes`` bytes for each of ``ranks`` processes (``reads``: what
    each item reads, to keep items reading the same sources together)."""
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, not {ranks}")
    even = sum(sizes) / ranks
    load = [0] * ranks
    reading: list[set[int]] = [set() for _ in range(ranks)]
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        wanted = reads[i] if reads is not None else frozenset()
        fits = [r for r in range(ranks) if load[r] + sizes[i] <= even * (1 + slack)]
        if fits:
            rank = max(fits, key=lambda r: (len(wanted & reading[r]), -load[r], -r))
        else:
            rank = min(range(ranks), key=lambda r: (load[r], r))
        load[rank] += sizes[i]
        reading[rank] |= wanted
        shares[rank].append(i)
    return tuple(tuple(sorted(share)) for share in shares)


def share_bytes(sizes: Sequence[int], shares: Sequence[Sequence[int]]) -> tuple[int, ...]:
    return tuple(sum(sizes[i] for i in share) for share in shares)


def parallel_seconds(
    seconds: float,
    sizes: Sequence[int],
    shares: Sequence[Sequence[int]],
    shared_storage: bool,
    pipeline: float = 0.0,
    window: int = 0,
) -> float:
    """The cost model's time for a job split into ``shares``, from its one-process time
    (``pipeline`` of it the fill and drain of a ``window`` of bytes between reads and writes).

    The model charges storage bandwidth and latency: processes sharing one machine's disk
    and NIC (``shared_storage``) share that bandwidth, so they cannot beat one process's
    estimate; processes on nodes with their own NVMe and NIC (against an object store that
    scales with clients) each take their share's part of it, and the job the largest; each
    fills and drains its own pipeline, so that part is not divided (a share smaller than the
    ``window``, if given, pays for its share)."""
    total = sum(sizes)
    if shared_storage or not total:
        return seconds
    largest = max(share_bytes(sizes, shares))
    pipeline = min(max(pipeline, 0.0), seconds)
    held = min(window, total)
    own = pipeline * min(1.0, largest / held) if held > 0 else pipeline
    return (seconds - pipeline) * largest / total + own
