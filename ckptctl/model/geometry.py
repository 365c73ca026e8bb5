"""Tensor geometry: which region of a canonical (full, unpadded) tensor a stored tensor holds.

A stored tensor is described by ``Piece``s, each mapping a box of the stored (local) tensor onto a
box of the canonical tensor. Local regions that no piece covers are padding (vocabulary rows past
the true vocabulary) and are written as zeros. Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from math import prod

from ckptctl.model.dtypes import ITEMSIZE

Shape = tuple[int, ...]


def nbytes(shape: Shape, dtype: str) -> int:
    """Bytes of a C-contiguous tensor of ``shape`` and ``dtype``."""
    return prod(shape) * ITEMSIZE[dtype]


class Split(StrEnum):
    """How tensor parallelism cuts a parameter (Megatron-Core's module classes decide)."""

    REPLICATED = "replicated"
    """Norms, row-parallel biases: every TP rank holds the whole tensor."""
    COLUMN = "column"
    """Column-parallel weight and bias: even chunks of dim 0. Fused QKV is stored group-major,
    so its TP split is this same even chunking (valid when tp divides the query groups)."""
    ROW = "row"
    """Row-parallel weight: even chunks of dim 1."""
    VOCAB = "vocab"
    """Embedding / output layer: dim 0 padded to the TP-dependent vocabulary, then chunked."""
    GATED = "gated"
    """SwiGLU ``linear_fc1``: gate and up halves chunked separately; shard = [gate_s; up_s]."""
    PARTS = "parts"
    """Dim 0 is consecutive parts of the given sizes (gated delta net's fused ``in_proj``:
    q, k, v, z, beta, alpha), each chunked separately; shard = [part0_s; part1_s; ...]."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Box ``[local, local + sizes)`` of a stored tensor is ``[canonical, canonical + sizes)``
    of the canonical tensor."""

    local: Shape
    canonical: Shape
    sizes: Shape

    @property
    def numel(self) -> int:
        return prod(self.sizes)


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy box ``[src, src + sizes)`` of a source tensor to ``[dst, dst + sizes)`` of a target."""

    src: Shape
    dst: Shape
    sizes: Shape

    @property
    def numel(self) -> int:
        return prod(self.sizes)


def with_dim(values: Shape, dim: int, value: int) -> Shape:
    """``values`` with entry ``dim`` replaced by ``value``."""
    return (*values[:dim], value, *values[dim + 1 :])


@lru_cache(maxsize=4096)
def shard_shape_and_pieces(
    split: Split,
    shape: Shape,
    tp: int,
    rank: int,
    padded_rows: int | None = None,
    parts: Shape = (),
) -> tuple[Shape, tuple[Piece, ...]]:
    """Local shape of TP rank ``rank`` of ``tp`` and the pieces of the canonical tensor it holds.

    ``shape`` is the canonical shape (vocabulary unpadded); ``padded_rows`` is the padded
    vocabulary for ``Split.VOCAB``; ``parts`` the part sizes of ``Split.PARTS``.
    """
    zero = (0,) * len(shape)
    if split is Split.REPLICATED or (tp == 1 and split not in (Split.VOCAB, Split.PARTS)):
        return shape, (Piece(zero, zero, shape),)
    if split in (Split.COLUMN, Split.ROW):
        dim = 0 if split is Split.COLUMN else 1
        if shape[dim] % tp:
            raise ValueError(f"tp={tp} does not divide dim {dim} of shape {shape}")
        n = shape[dim] // tp
        local = with_dim(shape, dim, n)
        return local, (Piece(zero, with_dim(zero, dim, rank * n), local),)
    if split is Split.GATED:
        if shape[0] % (2 * tp):
            raise ValueError(f"tp={tp} does not divide the gate/up halves of shape {shape}")
        half = shape[0] // 2
        n = half // tp
        size = with_dim(shape, 0, n)
        return with_dim(shape, 0, 2 * n), (
            Piece(zero, with_dim(zero, 0, rank * n), size),
            Piece(with_dim(zero, 0, n), with_dim(zero, 0, half + rank * n), size),
        )
    if split is Split.PARTS:
        return _parts_shard(shape, tp, rank, parts)
    if split is Split.VOCAB:
        padded = padded_rows if padded_rows is not None else shape[0]
        if padded % tp or padded < shape[0]:
            raise ValueError(f"padded vocabulary {padded} does not fit tp={tp}, rows {shape[0]}")
        n = padded // tp
        start, stop = rank * n, min((rank + 1) * n, shape[0])
        local = with_dim(shape, 0, n)
        if stop <= start:
            return local, ()
        return local, (Piece(zero, with_dim(zero, 0, start), with_dim(shape, 0, stop - start)),)
    raise AssertionError(split)


def _parts_shard(shape: Shape, tp: int, rank: int, parts: Shape) -> tuple[Shape, tuple[Piece, ...]]:
    """Each part of dim 0 chunked over TP, the rank's chunks one after the other."""
    if sum(parts) != shape[0] or any(size % tp for size in parts):
        raise ValueError(f"tp={tp} does not divide the parts {parts} of shape {shape}")
    zero = (0,) * len(shape)
    pieces, local_row, start = [], 0, 0
    for size in parts:
        n = size // tp
        at, size_n = with_dim(zero, 0, start + rank * n), with_dim(shape, 0, n)
        pieces.append(Piece(with_dim(zero, 0, local_row), at, size_n))
        local_row += n
        start += size
    return with_dim(shape, 0, local_row), tuple(pieces)


def whole(shape: Shape) -> Piece:
    """The one piece of a tensor held whole, at the same place on both sides."""
    zero = (0,) * len(shape)
    return Piece(zero, zero, shape)


def chunk_pieces(whole: tuple[Piece, ...], offsets: Shape, sizes: Shape) -> tuple[Piece, ...]:
    """The pieces of the chunk ``[offsets, offsets + sizes)`` of a tensor, in the chunk's
    own coordinates."""
    out = []
    for piece in whole:
        lo = tuple(max(o, p) for o, p in zip(offsets, piece.local, strict=True))
        hi = tuple(
            min(o + s, p + n)
            for o, s, p, n in zip(offsets, sizes, piece.local, piece.sizes, strict=True)
        )
        if any(a >= b for a, b in zip(lo, hi, strict=True)):
            continue
        out.append(
            Piece(
                tuple(a - o for a, o in zip(lo, offsets, strict=True)),
                tuple(c + a - p for c, a, p in zip(piece.canonical, lo, piece.local, strict=True)),
                tuple(b - a for a, b in zip(lo, hi, strict=True)),
            )
        )
    return tuple(out)


def overlap(target: Piece, source: Piece) -> Copy | None:
    """The copy that moves the part of ``source`` lying inside ``target``, if any."""
    # Hot in planning (every target piece against every holder): plain loops, early exit.
    t_can, s_can, t_sz, s_sz = target.canonical, source.canonical, target.sizes, source.sizes
    lo = []
    sizes = []
    for k in range(len(t_can)):
        a = t_can[k] if t_can[k] > s_can[k] else s_can[k]
        t_end, s_end = t_can[k] + t_sz[k], s_can[k] + s_sz[k]
        b = t_end if t_end < s_end else s_end
        if a >= b:
            return None
        lo.append(a)
        sizes.append(b - a)
    src = tuple(source.local[k] + lo[k] - s_can[k] for k in range(len(lo)))
    dst = tuple(target.local[k] + lo[k] - t_can[k] for k in range(len(lo)))
    return Copy(src, dst, tuple(sizes))


def boxes_disjoint(a: tuple[Shape, Shape], b: tuple[Shape, Shape]) -> bool:
    """Whether boxes ``(offsets, sizes)`` ``a`` and ``b`` share no element."""
    return any(
        ao + asz <= bo or bo + bsz <= ao
        for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1], strict=True)
    )


Box = tuple[Shape, Shape]
"""(offsets, sizes)."""


def box_difference(box: Box, cuts: list[Box]) -> list[Box]:
    """The parts of ``box`` outside every box of ``cuts``, as disjoint boxes."""
    parts = [box]
    for cut in cuts:
        remaining: list[Box] = []
        for part in parts:
            remaining.extend(_subtract(part, cut))
        parts = remaining
    return parts


def missing_elements(shape: Shape, pieces: list[Piece]) -> int:
    """Elements of a tensor of ``shape`` that none of ``pieces`` (canonical boxes) holds."""
    left = [((0,) * len(shape), shape)]
    for p in pieces:
        left = [b for box in left for b in box_difference(box, [(p.canonical, p.sizes)])]
        if not left:
            return 0
    return sum(prod(sizes) for _, sizes in left)


def _subtract(box: Box, cut: Box) -> list[Box]:
    if boxes_disjoint(box, cut):
        return [box]
    out: list[Box] = []
    offsets, sizes = list(box[0]), list(box[1])
    for dim, (c_off, c_size) in enumerate(zip(cut[0], cut[1], strict=True)):
        lo, hi = offsets[dim], offsets[dim] + sizes[dim]
        a, b = max(lo, c_off), min(hi, c_off + c_size)
        if lo < a:  # the slab before the cut along this dim
            out.append((tuple(offsets), (*sizes[:dim], a - lo, *sizes[dim + 1 :])))
        if b < hi:  # the slab after it
            out.append(
                (
                    (*offsets[:dim], b, *offsets[dim + 1 :]),
                    (*sizes[:dim], hi - b, *sizes[dim + 1 :]),
                )
            )
        offsets[dim], sizes[dim] = a, b - a  # continue inside the cut's range
    return out


def padding_origin(
    whole: tuple[Piece, ...], offsets: Shape, sizes: Shape, box: tuple[Piece, ...]
) -> Shape | None:
    """Where the box ``(offsets, sizes)`` of a tensor with pieces ``whole`` lies in the padded
    global tensor, when the box holds padding (its pieces ``box`` do not cover it, so a plan's
    writes, which keep no pieces, cannot place it otherwise); ``None`` for a box its pieces
    cover. The tensor's pieces fix its origin: padded rows continue the canonical ones."""
    if not whole or sum(p.numel for p in box) == prod(sizes):
        return None
    first = whole[0]
    return tuple(
        c - local + o for c, local, o in zip(first.canonical, first.local, offsets, strict=True)
    )
