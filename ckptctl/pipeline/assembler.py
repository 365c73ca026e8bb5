"""Builds each target tensor's bytes, in order, from the source boxes a plan names: as runs the
kernel copies where a tensor lies contiguously in local source files in its dtype, else in bands
of whole rows read (ahead, in parallel, within the memory budget) into numpy arrays.

numpy (and ``ckptctl.arrays``) is imported by the methods that build bands: a job whose tensors
all move as runs or fills never needs it, and saves its import (~60 ms; more from a cold disk).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from math import prod
from typing import TYPE_CHECKING, Any

import xxhash

from ckptctl.io.disk_ahead import DiskAhead, Extent, window_for
from ckptctl.io.runs import Run
from ckptctl.model.dtypes import DTYPES, pack_exactly
from ckptctl.model.geometry import with_dim
from ckptctl.model.plan import Plan, TensorWrite
from ckptctl.model.stored import FlatView, KeyPath, Shape
from ckptctl.pipeline.bands import Band, BandQueue, band_ranges
from ckptctl.pipeline.job_report import Report, Sources
from ckptctl.progress import Progress

if TYPE_CHECKING:
    import numpy as np


MIN_AVERAGE_RUN = 64 << 10
"""A tensor made of several runs moves by kernel copy only if they average this many bytes:
each run costs a few system calls, which many small pieces would spend in vain..."""
SMALL_TENSOR = 1 << 20
"""...unless the tensor is this small and local: a few calls more, but no band to build (and
a job whose every tensor moves so never imports numpy)."""


def _contiguous_box(shape: Shape, offsets: Shape, sizes: Shape) -> bool:
    """The box is one contiguous range of a C-ordered array of ``shape``: after its first
    dimension of more than one element, it spans every dimension whole."""
    spanning = False
    for n, o, full in zip(sizes, offsets, shape, strict=True):
        if spanning and (o != 0 or n != full):
            return False
        spanning = spanning or n > 1
    return True


def _fill_element(write: TensorWrite) -> bytes | None:
    """One element's bytes when the tensor is all fill (no copies) of a value its dtype holds
    exactly (else ``None``: arrays build it, as torch would round it)."""
    if write.copies or write.transposed or not write.padding:
        return None
    return pack_exactly(write.dtype, write.fill)


class JobStopped(Exception):
    """Raised in a file's writer when another file of the same job has failed: the job stops,
    and the first failure is the one reported."""


_Read = tuple[str, KeyPath, Shape, Shape, FlatView, bool]
"""A read of a box from the source: path, key, offsets, sizes, view, transposed."""


class Assembler:
    """Builds each target tensor from its copies, in bands of whole rows that fit the budget.

    A band is a slice of dim 0; tensors are row-major, so bands streamed in order are exactly the
    tensor's bytes. Each copy contributes the part of its box inside the band, read as one range.
    """

    def __init__(
        self,
        plan: Plan | tuple[str, ...],
        source: Sources,
        report: Report,
        progress: Progress,
        budget: int,
        pool: ThreadPoolExecutor | None = None,
        ahead: int = 1,
        counting: threading.Lock | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        """``ahead``: the pool's threads; twice as many bands are kept in flight. Assemblers
        writing files of one job at once share ``counting`` (their report and progress) and
        ``stop`` (set when one of them fails: the others give up at their next tensor or
        band, instead of finishing files the job will not keep)."""
        self.source_files = plan.source_files if isinstance(plan, Plan) else tuple(plan)
        self.source, self.report, self.progress = source, report, progress
        self.adjust = source.adjust
        """What changes some tensors' bands as they are built (``Sources.adjust``)."""
        self.pool = pool
        self.counting = counting or threading.Lock()
        """Held to update the report's counters and the progress: bands are counted on read
        threads, runs on the writing thread, and a job may write several files at once."""
        self.stop = stop or threading.Event()
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
        self._disk_ahead: DiskAhead | None = None
        """Reads the announced tensors' local source bytes into the page cache ahead..."""
        self.read_ahead = window_for(budget)
        """...at most this many bytes ahead of the writer."""
        self.consumed = 0
        """Source bytes this assembler has read (what ``DiskAhead`` keeps ahead of)."""
        self._rounded: dict[int, float] = {}
        """Largest rounding error so far of each tensor shifted with rounding, by ``id``."""

    def expect(self, writes: Iterable[TensorWrite]) -> None:
        """The tensors a writer will ask ``chunks`` for, in its order: with a read pool their
        bands are then fetched and built ahead, several at once (tensors that move as runs
        need no bands)."""
        banded, extents = [], []
        for write in writes:
            runs = self._runs[id(write)] = self._runs_of(write)
            if runs is None and _fill_element(write) is None:
                banded.append(write)
            extents += self._read_extents(write, runs)
        if self.queue is not None:
            self.queue.expect(banded)
        if extents:
            if self._disk_ahead is not None:
                self._disk_ahead.close()
            self._disk_ahead = DiskAhead(extents, lambda: self.consumed, self.read_ahead)

    def _read_extents(self, write: TensorWrite, runs: list[Run] | None) -> list[Extent]:
        if runs is not None:
            return [Extent(r.path, r.offset, r.nbytes, r.nbytes) for r in runs if r.storage is None]
        return self._extents_of(write) if _fill_element(write) is None else []

    def _extents_of(self, write: TensorWrite) -> list[Extent]:
        """The local source bytes a tensor's reads touch, where its formats can say."""
        itemsize = DTYPES[write.dtype].itemsize
        extents = []
        for copy in write.copies:
            path = self.source_files[copy.source]
            found = self.source.extent(path, copy.key, copy.src, copy.sizes, copy.view)
            if found is not None:
                local, offset, length = found
                extents.append(Extent(local, offset, length, prod(copy.sizes) * itemsize))
        return extents

    def chunks(self, write: TensorWrite, file: str = "") -> Iterator[memoryview | Run]:
        """The tensor's bytes in order: bands built in memory, or, where the tensor is
        contiguous ranges of local source files in its dtype, ``Run``s that the writer moves by
        kernel copy (their checksums are taken as the writer emits them), or, for a fill its
        dtype holds exactly, slices of packed elements."""
        self._check_stop()
        runs = self._runs.pop(id(write)) if id(write) in self._runs else self._runs_of(write)
        if runs is not None:
            yield from self._watched(write, file, runs)
            return
        digest = xxhash.xxh3_64()
        element = _fill_element(write)
        if element is not None:  # nothing to read: the fill's bytes, a slice at a time
            total = prod(write.shape) * len(element)
            whole = element * max(1, min(total, self.band_bytes) // len(element))
            for start in range(0, total, len(whole)):
                yield self._emit(memoryview(whole)[: total - start], digest)
            self._record(write, file, digest)
            return
        bands = None
        if self.queue is not None:
            bands = self.queue.take(write)
            if bands is None:  # not announced: at least this tensor's bands go ahead
                self.queue.expect([write])
                bands = self.queue.take(write)
        if bands is None:
            bands = (self._build(write, b) for b in band_ranges(write, self.band_bytes))
        for band in bands:
            self._check_stop()
            yield self._emit(band, digest)
        self._record(write, file, digest)

    def _check_stop(self) -> None:
        if self.stop.is_set():
            raise JobStopped("another file of this job failed")

    def _runs_of(self, write: TensorWrite) -> list[Run] | None:
        """The tensor as runs of local source files, in order, when its copies tile it with
        contiguous boxes that lie contiguously in their files in its dtype (and are not so
        many small pieces that a band is cheaper); ``None`` otherwise."""
        if (
            write.padding
            or write.transposed
            or write.interleaved
            or write.shift
            or not write.copies
        ):
            return None
        if self.adjust is not None and self.adjust.covers(write):
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
        few = len(placed) == 1 or total / len(placed) >= MIN_AVERAGE_RUN
        small = total <= SMALL_TENSOR and all(run.storage is None for _, run in placed)
        if cursor != total or not (few or small):
            return None
        return [run for _, run in placed]

    def _watched(self, write: TensorWrite, file: str, runs: list[Run]) -> Iterator[Run]:
        """``runs`` with the tensor's checksum and the job's counts attached: both are taken
        on the writer's thread as it emits each run."""
        digest = xxhash.xxh3_64()

        def advance(view: memoryview) -> None:
            with self.counting:  # bands may be counted on a read-ahead thread meanwhile
                self.report.bytes_written += len(view)
                self.progress.advance(len(view))

        def done(run: Run) -> None:
            with self.counting:
                self.consumed += run.nbytes
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
        # rounded as it was read (HF's gated norm under --allow-rounding); a fill read nothing
        read = self.source.rounding_error(write.canonical) if write.copies else None
        if id(write) in self._rounded or read is not None:  # --allow-rounding: held by verify
            with self.counting:
                errors = self.report.quantized.setdefault(file, {})
                error = max(self._rounded.pop(id(write), 0.0), read or 0.0)
                errors[write.canonical] = max(errors.get(write.canonical, 0.0), error)

    def _build(self, write: TensorWrite, band: Band, *, parallel: bool = True) -> np.ndarray:
        """One band's bytes in the order they are written."""
        import numpy as np

        from ckptctl import arrays

        lo, hi, dim = band
        data = self._band(write, lo, hi, dim, parallel)
        if self.adjust is not None and self.adjust.covers(write):
            data = self.adjust.apply(write, lo, hi, dim, data)
        if write.shift and write.shift_rounds:
            data, error = arrays.shifted_rounded(data, write.shift)
            with self.counting:
                self._rounded[id(write)] = max(self._rounded.get(id(write), 0.0), error)
        elif write.shift:
            data = arrays.shifted(data, write.shift, ".".join(map(str, write.key)))
        if write.interleaved:  # a band holds every row of dim 0 (``band_ranges``)
            data = arrays.interleave_halves(data)
        # A transposed band is reordered as words: numpy copies those at memory speed.
        return np.ascontiguousarray(arrays.words(data).T) if write.transposed else data

    def forget(self) -> None:
        """Drop the bands built ahead and the runs planned (a file is done, or failed)."""
        self._runs.clear()
        if self.queue is not None:
            self.queue.close()
        if self._disk_ahead is not None:
            self._disk_ahead.close()
            self._disk_ahead = None

    def _emit(self, band: np.ndarray | memoryview, digest: Any) -> memoryview:
        if isinstance(band, memoryview):
            view = band
        else:
            from ckptctl import arrays

            view = arrays.raw_bytes(band)
        digest.update(view)
        with self.counting:  # runs are counted on the writer's thread
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
        # (band offsets, box sizes, the source read: path, key, offsets, sizes, view, transposed)
        reads: list[tuple[Shape, Shape, _Read]] = []
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

        def read(entry: tuple[Shape, Shape, _Read]) -> None:
            dst, sizes, args = entry
            # (the Ellipsis keeps a 0-dimensional box a view, not a scalar copy)
            where: tuple[Any, ...] = (*(slice(o, o + n) for o, n in zip(dst, sizes, strict=True)),)
            box = out[(*where, ...)]
            # The box of the band can take the bytes straight from the file (a contiguous
            # box by a read, any box from mapped pages); if the reader cannot, copy what it
            # returns.
            into = box if not args[-1] else None
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
        with self.counting:  # reads finish on several threads
            self.consumed += data.nbytes
            self.report.bytes_read += data.nbytes
            self.report.read_requests += 1
