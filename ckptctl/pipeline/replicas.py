"""The copies a source keeps of its own tensors (``CheckpointView.replicas``: DeepSeek's MTP
layers keep copies of the embedding and output layer) hold the same bytes as what they copy:
a conversion reads only the originals, so a copy that differs would be silently lost. Checked
a band of rows at a time before the output is marked complete."""

from __future__ import annotations

from math import prod
from typing import Any

from ckptctl.errors import CheckpointError
from ckptctl.formats.base import Checkpoint
from ckptctl.model.stored import Replica

BAND_BYTES = 64 << 20
"""Rows compared at a time (both sides in memory): the largest copies are vocabulary-sized."""


def check_replicas(ckpt: Checkpoint) -> int:
    """Compare every replica of ``ckpt`` with its original, bit for bit; the bytes read."""
    replicas = ckpt.view.replicas
    if not replicas:
        return 0  # (most jobs: and they need not import numpy)
    from ckptctl import arrays

    read = 0
    for replica in replicas:
        shape = replica.shape
        rows = shape[0] if shape else 1
        row_elements = prod(shape[1:]) if shape else 1
        step = max(1, BAND_BYTES // max(1, row_elements * 4))
        for start in range(0, rows, step):
            offsets = (start, *(0,) * (len(shape) - 1)) if shape else ()
            sizes = (min(step, rows - start), *shape[1:]) if shape else ()
            original = ckpt.read(replica.path, replica.key, offsets, sizes)
            copy = ckpt.read(replica.copy_path, replica.copy_key, offsets, sizes)
            read += original.nbytes + copy.nbytes
            same = (
                original.dtype == copy.dtype
                and (arrays.words(original) == arrays.words(copy)).all()
            )
            if not same:
                raise CheckpointError(_differ(ckpt, replica, start, start + sizes[0] - 1))
    return read


def _differ(ckpt: Any, replica: Replica, first: int, last: int) -> str:
    copy = ckpt.storage.describe(replica.copy_path)
    why = replica.why or (
        "the model shares one tensor there; a conversion keeps only the original: fix or "
        "drop the copy"
    )
    return (
        f"{copy}: {replica.copy_key[-1]} should copy {replica.key[-1]} of "
        f"{ckpt.storage.describe(replica.path)} but differs from it in rows {first}-{last} "
        f"({why})"
    )
