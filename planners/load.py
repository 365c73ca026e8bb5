"""Which stored bytes one rank reads to fill its part of a state dict: the per-rank decision of
``ckptctl.load``.

A training job restarts in one of three situations, and each has a cheapest way in:

* **direct** — same layout, shards intact: every tensor this rank holds is one stored chunk of
  exactly its box, read whole (usually from the file this rank wrote itself).
* **reshard** — another layout (other number of ranks, other placements): each box is
  assembled from the stored chunks that overlap it, reading only the overlapping byte ranges.
* **from-full** — files of the sharded checkpoint are lost: the boxes they held are cut from a
  full (consolidated) checkpoint of the same step instead.

Pure: the caller lists what the rank needs and what is stored; nothing here reads a file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod

Shape = tuple[int, ...]

SHARDED, FULL = "sharded", "full"


@dataclass(frozen=True, slots=True)
class Need:
    """A tensor box this rank fills: ``sizes`` elements at ``offsets`` of the global tensor."""

    fqn: str
    dtype: str
    shape: Shape
    """Global shape."""
    offsets: Shape
    sizes: Shape


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """A stored box of a tensor and the file holding its record."""

    offsets: Shape
    sizes: Shape
    file: str


@dataclass(frozen=True, slots=True)
class StoredTensor:
    dtype: str
    shape: Shape
    chunks: tuple[StoredChunk, ...]


@dataclass(frozen=True, slots=True)
class Read:
    """Copy box ``(chunk_start, size)`` of stored chunk ``chunk`` of ``fqn`` (from ``source``)
    to ``need_start`` of the rank's box."""

    fqn: str
    source: str
    chunk: StoredChunk
    chunk_start: Shape
    need_start: Shape
    size: Shape

    @property
    def whole_chunk(self) -> bool:
        return self.chunk_start == (0,) * len(self.size) and self.size == self.chunk.sizes


@dataclass(frozen=True, slots=True)
class LoadDecision:
    strategy: str
    """``direct``, ``reshard`` or ``from-full``."""
    reason: str
    reads: tuple[Read, ...]
    problems: tuple[str, ...] = ()
    """Why the state dict cannot be filled (missing tensors, other shapes or dtypes)."""

    @property
    def files(self) -> tuple[tuple[str, str], ...]:
        """``(source, file)`` pairs this rank reads, in order."""
        return tuple(sorted({(r.source, r.chunk.file) for r in self.reads}))


def overlap(chunk: StoredChunk, need: Need) -> tuple[Shape, Shape, Shape] | None:
    """``(chunk_start, need_start, size)`` of the box both cover, or None if they do not meet."""
    lo = [max(c, n) for c, n in zip(chunk.offsets, need.offsets, strict=True)]
    hi = [
        min(c + cs, n + ns)
        for c, cs, n, ns in zip(chunk.offsets, chunk.sizes, need.offsets, need.sizes, strict=True)
    ]
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return (
        tuple(low - c for low, c in zip(lo, chunk.offsets, strict=True)),
        tuple(low - n for low, n in zip(lo, need.offsets, strict=True)),
        tuple(h - low for low, h in zip(lo, hi, strict=True)),
    )


def _reads(need: Need, stored: StoredTensor, source: str, lost: frozenset[str]) -> list[Read]:
    """The reads filling ``need`` from ``stored``, or [] if chunks in ``lost`` files (or gaps)
    leave part of it uncovered."""
    reads = []
    for chunk in stored.chunks:
        if not prod(chunk.sizes) or (box := overlap(chunk, need)) is None:
            continue
        if chunk.file in lost:
            return []
        reads.append(Read(need.fqn, source, chunk, *box))
    covered = sum(prod(r.size) for r in reads)
    return reads if covered == prod(need.sizes) else []


def _mismatch(need: Need, stored: StoredTensor, what: str) -> str | None:
    if stored.shape != need.shape or stored.dtype != need.dtype:
        return (
            f"{need.fqn}: {what} holds {stored.dtype} {list(stored.shape)}, the state dict "
            f"expects {need.dtype} {list(need.shape)}"
        )
    return None


def plan_load(
    needs: Sequence[Need],
    sharded: Mapping[str, StoredTensor],
    lost: frozenset[str] = frozenset(),
    full: Mapping[str, StoredTensor] | None = None,
) -> LoadDecision:
    """How this rank fills ``needs`` from the sharded checkpoint ``sharded`` (whose files in
    ``lost`` are gone), falling back to ``full`` for what the lost files held."""
    reads: list[Read] = []
    problems: list[str] = []
    from_full: list[str] = []
    for need in needs:
        if not prod(need.sizes):
            continue  # an empty shard of an unevenly split tensor: nothing to read
        stored = sharded.get(need.fqn)
        if stored is None:
            problems.append(f"{need.fqn}: not in the checkpoint")
            continue
        if bad := _mismatch(need, stored, "the checkpoint"):
            problems.append(bad)
            continue
        found = _reads(need, stored, SHARDED, lost)
        if not found and full is not None and need.fqn in full:
            if bad := _mismatch(need, full[need.fqn], "the full checkpoint"):
                problems.append(bad)
                continue
            found = _reads(need, full[need.fqn], FULL, frozenset())
            from_full.append(need.fqn)
        if not found:
            why = f"files lost: {', '.join(sorted(lost))}" if lost else "chunks leave gaps"
            problems.append(f"{need.fqn}: part of its box is not stored ({why})")
            continue
        reads.extend(found)
    return LoadDecision(*_strategy(needs, reads, lost, from_full), tuple(reads), tuple(problems))


def _strategy(
    needs: Sequence[Need], reads: list[Read], lost: frozenset[str], from_full: list[str]
) -> tuple[str, str]:
    """Direct when each box is exactly one stored chunk (a whole chunk that starts where the
    box starts and has its size); reshard otherwise."""
    files = len({(r.source, r.chunk.file) for r in reads})
    if from_full:
        return "from-full", (
            f"{len(lost)} file(s) of the sharded checkpoint lost ({', '.join(sorted(lost))}): "
            f"{len(from_full)} tensor(s) cut from the full checkpoint, the rest read from "
            "intact shards"
        )
    per_tensor: dict[str, list[Read]] = {}
    for r in reads:
        per_tensor.setdefault(r.fqn, []).append(r)
    assembled = {
        fqn
        for fqn, rs in per_tensor.items()
        if len(rs) != 1 or not rs[0].whole_chunk or rs[0].need_start != (0,) * len(rs[0].size)
    }
    if not assembled:
        return "direct", (
            f"same layout, shards intact: {len(needs)} tensor(s), each one stored chunk read "
            f"whole, from {files} file(s)"
        )
    return "reshard", (
        f"layout differs: {len(assembled)} of {len(needs)} tensor(s) assembled from parts of "
        f"overlapping stored chunks, {len(reads)} range(s) from {files} file(s)"
    )
