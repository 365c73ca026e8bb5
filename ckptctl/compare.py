"""``ckptctl verify A --against B``: compare two checkpoints tensor by tensor, in any layouts
and formats, through their canonical tensors (full, vocabulary unpadded), in row bands."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ckptctl.arrays import to_torch, words
from ckptctl.assembler import Assembler
from ckptctl.job_report import NoProgress, Report, Sources
from ckptctl.model.catalog import parameters
from ckptctl.model.geometry import Piece, nbytes
from ckptctl.model.plan import FileKind, TensorWrite
from ckptctl.model.stored import StoredFile, StoredTensor, canonical_shapes
from ckptctl.probe import Checkpoint
from planners.convert import plan_files


@dataclass
class TensorDiff:
    name: str
    equal: bool
    max_abs_diff: float
    """Over the elements that are numbers on both sides."""
    dtypes: tuple[str, str]
    nan_mismatch: int = 0
    """Elements that are NaN on one side only (NaN compares unequal to everything, so a max
    abs diff alone would hide them)."""


def _canonical_file(ckpt: Checkpoint, names: list[str], shapes: dict[str, tuple]) -> StoredFile:
    dtypes = ckpt.view.canonical_dtypes()
    tensors = []
    for name in names:
        shape = shapes[name]
        zero = (0,) * len(shape)
        tensors.append(
            StoredTensor((name,), name, shape, dtypes[name], (Piece(zero, zero, shape),))
        )
    return StoredFile("canonical", tuple(tensors))


def compare(
    a: Checkpoint, b: Checkpoint, *, rtol: float = 0.0, atol: float = 0.0, band: int = 64 << 20
) -> list[TensorDiff]:
    """Every canonical tensor both hold, compared: bit-exact unless a tolerance is given."""
    if a.view.spec is None or b.view.spec is None:
        # One side's model is unknown: compare stored tensors by name, DCP keys as stored.
        a, b = (c.as_generic() if hasattr(c, "as_generic") else c for c in (a, b))
    shapes: dict[str, tuple] = {}
    if a.view.spec is not None and b.view.spec is not None:
        for p in parameters(a.view.spec):
            shapes[p.name] = p.shape
            for state in ("fp32_param", "exp_avg", "exp_avg_sq"):
                shapes[f"{state}/{p.name}"] = p.shape
    else:  # a model ckptctl does not know: tensors are compared by stored name
        held = canonical_shapes(b.view)
        shapes = {
            n: s for n, (s, _) in canonical_shapes(a.view).items() if held.get(n, [0])[0] == s
        }
    held_a = set(a.view.canonical_dtypes())
    held_b = set(b.view.canonical_dtypes())
    names = [n for n in shapes if n in held_a and n in held_b]
    writes = {}
    for side, ckpt in (("a", a), ("b", b)):
        (file,), _ = plan_files(
            ckpt.view, (_canonical_file(ckpt, names, shapes),), FileKind.SAFETENSORS
        )
        writes[side] = (
            file.tensors,
            Assembler(
                tuple(f.path for f in ckpt.view.files), Sources(ckpt), Report(), NoProgress(), band
            ),
        )
    out = []
    for i, name in enumerate(names):
        wa, asm_a = writes["a"][0][i], writes["a"][1]
        wb, asm_b = writes["b"][0][i], writes["b"][1]
        out.append(_compare_tensor(name, wa, wb, asm_a, asm_b, rtol, atol))
    return out


def _compare_tensor(
    name: str,
    wa: TensorWrite,
    wb: TensorWrite,
    asm_a: Assembler,
    asm_b: Assembler,
    rtol: float,
    atol: float,
) -> TensorDiff:
    equal, worst, nan_mismatch = True, 0.0, 0
    exact = rtol == 0 and atol == 0
    rows = wa.shape[0] if wa.shape else 1
    step = max(asm_a.band_bytes // max(nbytes(wa.shape[1:], wa.dtype), 1), 1)
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        xa, ya = asm_a._band(wa, lo, hi), asm_b._band(wb, lo, hi)
        if wa.dtype == wb.dtype and np.array_equal(words(xa), words(ya)):
            continue  # same bits: nothing to compare by value
        x, y = to_torch(xa), to_torch(ya)
        xd, yd = x.double(), y.double()
        nan_x, nan_y = xd.isnan(), yd.isnan()
        nan_mismatch += int((nan_x ^ nan_y).sum())
        numbers = ~(nan_x | nan_y)
        xn, yn = xd[numbers], yd[numbers]
        diff = torch.where(xn == yn, 0.0, (xn - yn).abs())  # inf - inf is no difference
        worst = max(worst, float(diff.max())) if diff.numel() else worst
        if exact:
            # Across dtypes (a bf16 weight kept as fp32), exact means every value is the same:
            # the conversion lost nothing.
            lossless = wa.dtype != wb.dtype and bool((xn == yn).all())
            if not lossless or bool((nan_x ^ nan_y).any()):
                equal = False
        elif not torch.allclose(xn, yn, rtol=rtol, atol=atol) or bool((nan_x ^ nan_y).any()):
            equal = False
    return TensorDiff(name, equal, worst, (wa.dtype, wb.dtype), nan_mismatch)
