"""The executor: carry out a ``Plan``, one tensor at a time, and commit by writing markers last.

Memory holds one target tensor (plus the source box being copied into it) at a time: each target
file is streamed (safetensors header or torch pickle first, then tensor bytes in order), so peak
memory follows the largest tensor, not the checkpoint.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from math import prod
from typing import TYPE_CHECKING, Any

import xxhash

from ckptctl.bands import Band, BandQueue, band_ranges
from ckptctl.distributed import Group
from ckptctl.formats import registry
from ckptctl.formats.base import Checkpoint, WriteJob
from ckptctl.job_report import NoProgress, Progress, Report, Sources, peak_rss_bytes
from ckptctl.manifest import MANIFEST, RunLog, new_digest, write_manifest
from ckptctl.model.dtypes import DTYPES
from ckptctl.model.geometry import with_dim
from ckptctl.model.plan import FileKind, Plan, TensorWrite
from ckptctl.model.stored import Shape
from ckptctl.runs import Run, write_in_slices
from ckptctl.storage import Storage
from planners.shares import split_files

if TYPE_CHECKING:
    import numpy as np

# numpy (and ckptctl.arrays) is imported by the methods that build bands: a job whose tensors
# all move by kernel copy never needs it, and saves its import (~60 ms; more from a cold disk).

DEFAULT_MEMORY_BUDGET = 1 << 30


MIN_AVERAGE_RUN = 64 << 10
"""A tensor made of several runs moves by kernel copy only if they average this many bytes:
each run costs a few system calls, which many small pieces would spend in vain."""


def _contiguous_box(shape: Shape, offsets: Shape, sizes: Shape) -> bool:
    """The box is one contiguous range of a C-ordered array of ``shape``: after its first
    dimension of more than one element, it spans every dimension whole."""
    spanning = False
    for n, o, full in zip(sizes, offsets, shape, strict=True):
        if spanning and (o != 0 or n != full):
            return False
        spanning = spanning or n > 1
    return True


class Assembler:
    """Builds each target tensor from its copies, in bands of whole rows that fit the budget.

    A band is a slice of dim 0; tensors are row-major, so bands streamed in order are exactly the
    tensor's bytes. Each copy contributes the part of its box inside the band, read as one range.
    """

    def __init__(
        self,
        plan: Plan | tuple[str, ...],
        source: Checkpoint,
        report: Report,
        progress: Progress,
        budget: int,
        pool: ThreadPoolExecutor | None = None,
        ahead: int = 1,
    ) -> None:
        """``ahead``: the pool's threads; twice as many bands are kept in flight."""
        self.source_files = plan.source_files if isinstance(plan, Plan) else tuple(plan)
        self.source, self.report, self.progress = source, report, progress
        self.pool = pool
        self._counting = threading.Lock()
        # Up to four bands are alive (two queued for writing, one being written, one being
        # built); the one being built is held up to four times (output band, bytes read in
        # parallel, their contiguous copies, a dtype cast).
        self.band_bytes = max(budget // 8, 1) if pool is None else max(budget // 12, 1)
        self.queue: BandQueue | None = None
        if pool is not None:
            # Bands built ahead hold their output and the fetched bytes: a third of the
            # budget for the bands themselves keeps both within it.
            build = partial(self._build, parallel=False)  # pool threads must not wait on it
            self.queue = BandQueue(build, pool, self.band_bytes, budget // 3, 2 * ahead)
        self._runs: dict[int, list[Run] | None] = {}
        """Tensors announced by ``expect``: the runs they move as (``None``: bands)."""

    def expect(self, writes: Iterable[TensorWrite]) -> None:
        """The tensors a writer will ask ``chunks`` for, in its order: with a read pool their
        bands are then fetched and built ahead, several at once (tensors that move as runs
        need no bands)."""
        banded = []
        for write in writes:
            runs = self._runs[id(write)] = self._runs_of(write)
            if runs is None:
                banded.append(write)
        if self.queue is not None:
            self.queue.expect(banded)

    def chunks(self, write: TensorWrite, file: str = "") -> Iterator[memoryview | Run]:
        """The tensor's bytes in order: bands built in memory, or, where the tensor is
        contiguous ranges of local source files in its dtype, ``Run``s that the writer moves by
        kernel copy (their checksums are taken as the writer emits them)."""
        runs = self._runs.pop(id(write)) if id(write) in self._runs else self._runs_of(write)
        if runs is not None:
            yield from self._watched(write, file, runs)
            return
        digest = xxhash.xxh3_64()
        bands = None
        if self.queue is not None:
            bands = self.queue.take(write)
            if bands is None:  # not announced: at least this tensor's bands go ahead
                self.queue.expect([write])
                bands = self.queue.take(write)
        if bands is None:
            bands = (self._build(write, b) for b in band_ranges(write, self.band_bytes))
        for band in bands:
            yield self._emit(band, digest)
        self._record(write, file, digest)

    def _runs_of(self, write: TensorWrite) -> list[Run] | None:
        """The tensor as runs of local source files, in order, when its copies tile it with
        contiguous boxes that lie contiguously in their files in its dtype (and are not so
        many small pieces that a band is cheaper); ``None`` otherwise."""
        if write.padding or write.transposed or not write.copies:
            return None
        strides = [prod(write.shape[i + 1 :]) for i in range(len(write.shape))]
        placed = []
        for copy in write.copies:
            if copy.transposed or not _contiguous_box(write.shape, copy.dst, copy.sizes):
                return None
            path = self.source_files[copy.source]
            run = self.source.locate(path, copy.key, copy.src, copy.sizes, copy.view)
            if run is None or run.dtype != write.dtype:
                return None
            placed.append((sum(d * s for d, s in zip(copy.dst, strides, strict=True)), run))
        placed.sort(key=lambda p: p[0])
        itemsize = DTYPES[write.dtype].itemsize
        cursor = 0
        for start, run in placed:
            if start * itemsize != cursor:  # a gap or an overlap: bands sort it out
                return None
            cursor += run.nbytes
        total = prod(write.shape) * itemsize
        if cursor != total or (len(placed) > 1 and total / len(placed) < MIN_AVERAGE_RUN):
            return None
        return [run for _, run in placed]

    def _watched(self, write: TensorWrite, file: str, runs: list[Run]) -> Iterator[Run]:
        """``runs`` with the tensor's checksum and the job's counts attached: both are taken
        on the writer's thread as it emits each run."""
        digest = xxhash.xxh3_64()

        def advance(view: memoryview) -> None:
            with self._counting:  # bands may be counted on a read-ahead thread meanwhile
                self.report.bytes_written += len(view)
                self.progress.advance(len(view))

        def done(run: Run) -> None:
            with self._counting:
                self.report.bytes_read += run.nbytes
                self.report.read_requests += 1
                if run.copied:
                    copied = self.report.copied
                    copied[run.copied_by] = copied.get(run.copied_by, 0) + run.copied

        for run in runs:
            run.observers += [digest.update, advance]
            run.finished.append(done)
        runs[-1].finished.append(lambda _: self._record(write, file, digest))
        yield from runs

    def _record(self, write: TensorWrite, file: str, digest: Any) -> None:
        key = ".".join(map(str, write.key))
        if write.view_offset is not None:  # one of several tensors sharing a stored one
            key += f"@{write.view_offset}"
        self.report.tensor_checksums.setdefault(file, {})[key] = digest.hexdigest()

    def _build(self, write: TensorWrite, band: Band, *, parallel: bool = True) -> np.ndarray:
        """One band's bytes in the order they are written."""
        import numpy as np

        from ckptctl import arrays

        lo, hi, dim = band
        data = self._band(write, lo, hi, dim, parallel)
        # A transposed band is reordered as words: numpy copies those at memory speed.
        return np.ascontiguousarray(arrays.words(data).T) if write.transposed else data

    def forget(self) -> None:
        """Drop the bands built ahead and the runs planned (a file is done, or failed)."""
        self._runs.clear()
        if self.queue is not None:
            self.queue.close()

    def _emit(self, band: np.ndarray, digest: Any) -> memoryview:
        from ckptctl import arrays

        view = arrays.raw_bytes(band)
        digest.update(view)
        with self._counting:  # runs are counted on the writer's thread
            self.report.bytes_written += len(view)
            self.progress.advance(len(view))
        return view

    def _band(
        self,
        write: TensorWrite,
        lo: int,
        hi: int,
        dim: int = 0,
        parallel: bool = True,
    ) -> np.ndarray:
        """Indices ``[lo, hi)`` along ``dim`` of the target tensor (the whole tensor if it is
        0-dimensional); its reads go to the pool if ``parallel`` (not from a pool thread)."""
        from ckptctl import arrays

        scalar = not write.shape
        shape = write.shape if scalar else with_dim(write.shape, dim, hi - lo)
        reads = []
        for copy in write.copies:
            src, dst, sizes = copy.src, copy.dst, copy.sizes
            if not scalar:
                a, b = max(lo, dst[dim]), min(hi, dst[dim] + sizes[dim])
                if a >= b:
                    continue
                src = with_dim(src, dim, src[dim] + a - dst[dim])
                dst = with_dim(dst, dim, a - lo)
                sizes = with_dim(sizes, dim, b - a)
            path = self.source_files[copy.source]
            reads.append((dst, sizes, (path, copy.key, src, sizes, copy.view, copy.transposed)))
        whole = len(reads) == 1 and not any(reads[0][0]) and tuple(reads[0][1]) == tuple(shape)
        if whole and not write.padding:
            # The band is one read: hand the read on as it stands (no copy into another buffer).
            data = self.source.read(*reads[0][2])
            self._count(data)
            return arrays.cast(data, write.dtype).reshape(shape)  # no copy if dtypes match
        if write.padding:
            out = arrays.full(shape, write.dtype, write.fill)
        else:
            out = arrays.empty(shape, write.dtype)

        def read(entry: tuple[Shape, Shape, tuple[Any, ...]]) -> None:
            dst, sizes, args = entry
            # (the Ellipsis keeps a 0-dimensional box a view, not a scalar copy)
            box = out[(*(slice(o, o + n) for o, n in zip(dst, sizes, strict=True)), ...)]
            # A box that is contiguous in the band (whole rows) can take the bytes straight
            # from the file; otherwise, or if the reader cannot, copy what it returns.
            into = box if box.flags.c_contiguous and not args[-1] else None
            data = self.source.read(*args, into=into)
            self._count(data)
            if into is None or data is not into:
                arrays.words(box)[...] = arrays.words(arrays.cast(data, write.dtype))

        # The reads of a band are disjoint parts of it, so fetching them at once (from
        # different files and stores in parallel) stays within the band's memory.
        if parallel and self.pool is not None and len(reads) > 1:
            list(self.pool.map(read, reads))
        else:
            for entry in reads:
                read(entry)
        return out

    def _count(self, data: np.ndarray) -> None:
        with self._counting:  # reads finish on several threads
            self.report.bytes_read += data.nbytes
            self.report.read_requests += 1


def execute(
    plan: Plan,
    source: Checkpoint | Sources,
    target: Storage,
    progress: Progress | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    workers: int = 1,
    checksum: str = "xxh3_64",
    group: Group | None = None,
) -> Report:
    """Write every file of ``plan`` to ``target``, then its finalize files in order.

    Tensor data in flight stays within about ``memory_budget`` bytes, whatever the tensor sizes.
    ``workers`` > 1 builds that many bands at once, ahead of the writer (object stores: GETs in
    flight; local disks: reading overlaps hashing and writing). With a process ``group``, this
    process writes its share of the files (``planners.shares``); rank 0 commits once every rank
    has sent what it wrote, and its report covers the whole job (``ranks``: each one's).
    """
    progress = progress or NoProgress()
    if not isinstance(source, Sources):
        source = Sources(source)
    if target.is_s3 and target.uploads_directly:  # runs of its objects: copied by the server
        source.server_copy_to = target
    report = Report()
    started = time.perf_counter()
    sizes = [source.file_bytes(plan, f) for f in plan.files]
    rank, world = (group.rank, group.world) if group else (0, 1)
    mine = split_files(plan.files, sizes, world)[rank]
    progress.start(sum(sizes), f"{plan.operation} -> {plan.target_url}")
    if group is not None:
        progress = _GroupProgress(progress, group)
    target_format = registry.named(str(plan.target_format))
    finish_paths = target_format.finish_paths(plan) if target_format.finish_paths else ()
    if rank == 0:
        target.begin_writing()  # on S3, aborts stale uploads: before any rank starts its own
        log = RunLog(target, plan, checksum, finish_paths, rank, world)
    if group is not None:
        group.agree(None)  # rank 0's log holds every finished file before the others look
    if rank:
        log = RunLog(target, plan, checksum, finish_paths, rank, world)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="ckptctl-read") if workers > 1 else None
    assemble = Assembler(plan, source, report, progress, memory_budget, pool, workers)
    job = WriteJob(plan, source, assemble, report)
    failure: Exception | None = None
    try:
        _write_files(job, mine, sizes, target, log)
        target.drain()  # every rank's files are durable before rank 0 commits
    except Exception as err:  # the other ranks must hear of it, or they wait for this one
        failure = err
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    own_written = report.bytes_written
    if group is not None:
        group.agree(None if failure is None else str(failure) or type(failure).__name__)
        _gather(group, report, log)
    if failure is not None:
        raise failure
    if rank == 0:
        _commit(job, target, log, target_format, checksum)
    if group is not None:
        group.agree(None)  # every rank returns once the job is committed
    progress.finish()
    report.seconds = time.perf_counter() - started
    report.peak_rss_bytes = peak_rss_bytes()
    if group is not None:
        report.ranks = _rank_figures(group, report, own_written)
    return report


def _commit(job: WriteJob, target: Storage, log: RunLog, target_format: Any, checksum: str) -> None:
    """Files written after every data file, then the finalize texts, then the manifest."""
    plan, report = job.plan, job.report
    extra_files: list[str] = []
    for path, payload in target_format.finish(job) if target_format.finish else ():
        with target.open_write(path, new_digest(checksum)) as out:
            out.write(payload)
        log.finished(path, {}, size=out.size, checksum=out.digest.hexdigest())
        extra_files.append(path)
    target.drain()  # staged uploads land before anything that says "complete"
    for text in plan.finalize:
        target.write_text(text.path, text.content)
        report.files_written.append(text.path)
    target.drain()  # and every file is on the device before the manifest vouches for it
    write_manifest(
        target, plan, report.tensor_checksums, log.done, algorithm=checksum, extra=extra_files
    )
    log.clear_rank_logs()
    report.files_written.append(MANIFEST)


def _gather(group: Group, report: Report, log: RunLog) -> None:
    """Rank 0 takes in what every rank wrote: checksums, DCP records, counts."""
    target = group.all_gather(
        {
            "done": log.done,
            "tensors": report.tensor_checksums,
            "records": report.records,
            "files": report.files_written,
            "read": report.bytes_read,
            "requests": report.read_requests,
            "written": report.bytes_written,
            "copied": report.copied,
        }
    )
    if group.rank:
        return
    for r, part in enumerate(target):
        if r == 0:
            continue
        log.done.update(part["done"])
        report.tensor_checksums.update(part["tensors"])
        report.records.update(part["records"])
        report.files_written.extend(part["files"])
        report.bytes_read += part["read"]
        report.read_requests += part["requests"]
        report.bytes_written += part["written"]
        for how, n in part["copied"].items():
            report.copied[how] = report.copied.get(how, 0) + n


def _rank_figures(group: Group, report: Report, written: int) -> list[dict[str, Any]]:
    """Each rank's own figures (rank 0's report sums them)."""
    mine = {
        "rank": group.rank,
        "seconds": round(report.seconds, 3),
        "peak_rss_bytes": report.peak_rss_bytes,
        "bytes_written": written,
    }
    return group.all_gather(mine)


class _GroupProgress:
    """This rank's progress sent to the group; rank 0 shows the whole job's."""

    def __init__(self, inner: Progress, group: Group, every: int = 64 << 20) -> None:
        self.inner, self.group, self.every = inner, group, every
        self.done = self.sent = self.others = 0

    def start(self, total: int, label: str) -> None:
        self.inner.start(total, label)

    def advance(self, n: int) -> None:
        self.done += n
        self.inner.advance(n)
        if self.done - self.sent >= self.every:
            self.sent = self.done
            self.group.report_progress(self.done)
            if self.group.rank == 0:
                others = sum(self.group.progress()[1:])
                self.inner.advance(others - self.others)
                self.others = others

    def finish(self) -> None:
        self.group.report_progress(self.done)
        self.inner.finish()


def _write_files(
    job: WriteJob, share: tuple[int, ...], sizes: list[int], target: Storage, log: RunLog
) -> None:
    plan, report = job.plan, job.report
    for i in share:
        file = plan.files[i]
        reused = log.reusable(file.path)
        if reused is not None:  # resuming: this file was finished and is intact
            report.tensor_checksums[file.path] = reused["tensors"]
            report.records[file.path] = reused.get("records", [])
            job.assemble.progress.advance(sizes[i])
            report.files_written.append(file.path)
            continue
        with target.open_write(file.path, new_digest(log.algorithm)) as out:
            if file.kind == FileKind.COPY:
                _copy_file(job.source, plan.source_files[file.copy_of or 0], out, job.assemble)
            else:
                _, write = registry.writer_for(file.kind)
                try:
                    write(job, file, out)
                finally:
                    job.assemble.forget()
        log.finished(
            file.path,
            report.tensor_checksums.get(file.path, {}),
            size=out.size,
            checksum=out.digest.hexdigest(),
            records=report.records.get(file.path),
        )
        report.files_written.append(file.path)


def _copy_file(source: Sources, path: str, out: Any, assemble: Assembler) -> None:
    """A stored file as it is (direct strategy), streamed in bounded chunks."""
    ckpt, rel = source.owner(path)

    def advance(n: int) -> None:
        assemble.report.bytes_read += n
        assemble.report.bytes_written += n
        assemble.progress.advance(n)

    # Bytes that do not change move by a kernel copy, or the object store's own copy, never
    # through Python.
    report = assemble.report
    local = ckpt.storage.is_local and hasattr(out, "copy_file")
    if local and (n := out.copy_file(ckpt.storage.path(rel), advance)) is not None:
        report.copied["copy_file_range"] = report.copied.get("copy_file_range", 0) + n
        return
    if hasattr(out, "copy_object") and (n := out.copy_object(ckpt.storage, rel, advance)):
        report.copied["upload_part_copy"] = report.copied.get("upload_part_copy", 0) + n
        return
    with ckpt.storage.open_read(rel) as f:
        while chunk := f.read(8 << 20):
            write_in_slices(out, chunk)
            assemble.report.bytes_read += len(chunk)
            assemble.report.bytes_written += len(chunk)
            assemble.progress.advance(len(chunk))
