"""Rows of q/k projections stored in Meta's interleaved rotary order. Pure.

Meta's Llama code (and torchtitan, whose complex-number RoPE rotates adjacent pairs) keeps the
two halves of each head's rotary dimension interleaved: row ``2i + j`` of a head is HF's row
``j * head_dim / 2 + i`` (HF rotates the first half against the second). Converting between
the two is a permutation of rows inside each head, so a stored chunk of such a tensor is read
through a row map: its local rows are the rows it holds, in HF order. A chunk that cuts a head
(FSDP shards at any row) still holds a run of evens and a run of odds of that head, each a
contiguous run of HF rows, so a chunk is a handful of runs, never one piece per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True, slots=True)
class RotaryRows:
    """Which rows of a tensor are interleaved: in every block of ``period`` rows, the first
    ``rotary`` rows are heads of ``head_dim`` rows each (q and k heads of a fused QKV); the
    rest (v heads) are stored as they are."""

    head_dim: int
    period: int
    rotary: int


@dataclass(frozen=True, slots=True)
class Run:
    """Local rows ``[local, local + rows)`` of a chunk are HF rows ``[hf, hf + rows)`` of the
    tensor, stored at chunk rows ``stored, stored + step, ...``."""

    local: int
    hf: int
    rows: int
    stored: int
    step: int


@lru_cache(maxsize=4096)
def runs(order: RotaryRows, first: int, count: int) -> tuple[Run, ...]:
    """The runs of the chunk holding stored rows ``[first, first + count)``, in local order
    (ascending HF rows)."""
    out: list[Run] = []
    local, end = 0, first + count
    d, half = order.head_dim, order.head_dim // 2

    def add(hf: int, rows: int, stored: int, step: int) -> None:
        nonlocal local
        if rows > 0:
            out.append(Run(local, hf, rows, stored - first, step))
            local += rows

    block = first - first % order.period
    while block < end:
        for head in range(block, block + order.rotary, d):
            lo, hi = max(first, head), min(end, head + d)
            if lo >= hi:
                continue
            for parity in (0, 1):  # HF's first half is the even rows, its second the odd
                start = lo + (lo - head + parity) % 2
                rows = (hi - start + 1) // 2 if start < hi else 0
                add(head + parity * half + (start - head) // 2, rows, start, 2)
        lo, hi = max(first, block + order.rotary), min(end, block + order.period)
        add(lo, hi - lo, lo, 1)
        block += order.period
    return tuple(out)


def hf_runs(order: RotaryRows, first: int, count: int) -> list[tuple[int, int, int]]:
    """``(local row, HF row, rows)`` of the chunk, adjacent runs merged (a chunk of whole heads
    is one run): what its pieces are cut from."""
    merged: list[tuple[int, int, int]] = []
    for run in runs(order, first, count):
        if merged and merged[-1][1] + merged[-1][2] == run.hf:
            local, hf, rows = merged[-1]
            merged[-1] = (local, hf, rows + run.rows)
        else:
            merged.append((run.local, run.hf, run.rows))
    return merged


def stored_rows(order: RotaryRows, first: int, count: int, local: int, rows: int) -> list[int]:
    """The chunk rows (from the chunk's first) holding local rows ``[local, local + rows)``."""
    out: list[int] = []
    for run in runs(order, first, count):
        lo, hi = max(local, run.local), min(local + rows, run.local + run.rows)
        out.extend(run.stored + (r - run.local) * run.step for r in range(lo, hi))
    return out
