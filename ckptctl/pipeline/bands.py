"""Bands of target tensors built ahead of the writer, several at once, on object stores.

One ranged GET streams far slower than an object store serves (a few ms of latency, then one
connection's bandwidth), so building one band at a time leaves the job waiting on the network.
A writer says in which order it will ask for its tensors; the queue then keeps up to a window
of bytes (and a number of bands) being fetched and assembled on a thread pool, and hands the
bands back in order. Memory stays bounded by the window; a writer that asks out of order gets
its bands built on the spot, as without the queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckptctl.model.geometry import nbytes, with_dim
from ckptctl.model.plan import TensorWrite

Band = tuple[int, int, int]
"""``(lo, hi, dim)``: indices ``[lo, hi)`` of dimension ``dim`` of a target tensor (``(0, 1,
0)`` for a 0-dimensional one)."""


def band_ranges(write: TensorWrite, band_bytes: int) -> list[Band]:
    """The bands a target tensor is streamed in: whole rows (columns for a tensor stored
    transposed) up to ``band_bytes`` each, in the order of its bytes."""
    shape = write.shape
    if not shape:
        return [(0, 1, 0)]
    dim = 1 if write.transposed else 0  # stored rows are the tensor's columns
    step = max(band_bytes // max(band_nbytes(write, (0, 1, dim)), 1), 1)
    if write.interleaved and dim == 0:  # its rows are reordered over the whole of dim 0
        step = shape[0]
    return [(lo, min(lo + step, shape[dim]), dim) for lo in range(0, shape[dim], step)]


def band_nbytes(write: TensorWrite, band: Band) -> int:
    lo, hi, dim = band
    shape = with_dim(write.shape, dim, hi - lo) if write.shape else ()
    return nbytes(shape, write.dtype)


@dataclass
class _Ahead:
    write: TensorWrite
    future: Future[Any]
    nbytes: int


class BandQueue:
    """Bands of the expected tensors, built on ``pool`` by ``build(write, band)`` up to
    ``window`` bytes and ``depth`` bands ahead of the one being consumed."""

    def __init__(
        self,
        build: Callable[[TensorWrite, Band], Any],
        pool: ThreadPoolExecutor,
        band_bytes: int,
        window: int,
        depth: int,
    ) -> None:
        self._build, self._pool = build, pool
        self._band_bytes, self._window, self._depth = band_bytes, window, depth
        self._waiting: deque[tuple[TensorWrite, Band]] = deque()
        self._ahead: deque[_Ahead] = deque()
        self._bytes = 0

    def expect(self, writes: Iterable[TensorWrite]) -> None:
        """The tensors a writer is about to ask for, in its order; drops what was expected
        before."""
        self.close()
        for write in writes:
            self._waiting.extend((write, band) for band in band_ranges(write, self._band_bytes))
        self._top_up()

    def take(self, write: TensorWrite) -> Iterator[Any] | None:
        """The bands of ``write`` in order, if it is the next expected tensor; else ``None``
        (and the queue is dropped: the writer asks in another order than it said)."""
        head = self._ahead[0].write if self._ahead else None
        if head is None and self._waiting:
            head = self._waiting[0][0]
        if head is not write:
            self.close()
            return None
        return self._bands_of(write)

    def _bands_of(self, write: TensorWrite) -> Iterator[Any]:
        while True:
            self._top_up()
            if not self._ahead or self._ahead[0].write is not write:
                return
            ahead = self._ahead.popleft()
            self._bytes -= ahead.nbytes
            yield ahead.future.result()

    def _top_up(self) -> None:
        while self._waiting and len(self._ahead) < self._depth:
            write, band = self._waiting[0]
            nbytes = band_nbytes(write, band)
            if self._ahead and self._bytes + nbytes > self._window:
                break  # the first band always goes, however large: it is needed next
            self._waiting.popleft()
            future = self._pool.submit(self._build, write, band)
            self._ahead.append(_Ahead(write, future, nbytes))
            self._bytes += nbytes

    def close(self) -> None:
        """Forget every expected band; those being built finish and are dropped."""
        for ahead in self._ahead:
            ahead.future.cancel()
        self._ahead.clear()
        self._waiting.clear()
        self._bytes = 0
