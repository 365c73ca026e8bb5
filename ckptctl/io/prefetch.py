"""Overlap producing bytes with writing them: a bounded read-ahead thread.

Reading source ranges, assembling bands and casting (torch and file reads release the GIL) run
in a worker while the caller checksums and writes the previous band, so the two halves of a copy
use both cores. The queue depth bounds memory.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar, cast

if TYPE_CHECKING:
    from ckptctl.io.runs import Run

T = TypeVar("T")
_END = object()


class ReadAhead(Generic[T]):
    """``producer(item)`` for every item, computed up to ``depth`` chunks ahead of the reader.

    Call the instance with each item, in the same order, to get that item's chunks.
    """

    def __init__(
        self,
        items: Sequence[T],
        producer: Callable[[T], Iterable[memoryview | Run]],
        depth: int = 2,
    ) -> None:
        self._queue: queue.Queue[tuple[int, object] | BaseException] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._items = list(items)
        self._next = 0
        self._thread = threading.Thread(
            target=self._run, args=(producer,), daemon=True, name="ckptctl-read-ahead"
        )
        self._thread.start()

    def _put(self, value: tuple[int, object] | BaseException) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(value, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, producer: Callable[[T], Iterable[memoryview | Run]]) -> None:
        try:
            for index, item in enumerate(self._items):
                for chunk in producer(item):
                    if not self._put((index, chunk)):
                        return
                if not self._put((index, _END)):
                    return
        except BaseException as err:  # handed to the reader, re-raised there
            self._put(err)

    def __call__(self, item: T) -> Iterator[memoryview | Run]:
        expected = self._next
        if self._items[expected] is not item and self._items[expected] != item:
            raise AssertionError("read-ahead items must be consumed in order")
        self._next += 1
        while True:
            got = self._queue.get()
            if isinstance(got, BaseException):
                raise got
            index, chunk = got
            if index != expected:
                raise AssertionError(f"read-ahead out of order: {index} != {expected}")
            if chunk is _END:
                return
            yield cast("memoryview | Run", chunk)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
