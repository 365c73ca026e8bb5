"""Megatron's vocabulary padding rows, compared between two checkpoints (``verify --against``).

Megatron pads the embedding and output layer to a multiple of ``make_vocab_size_divisible_by x
TP`` rows; those rows are trained state (its softmax covers the padded logits) that ckptctl's
canonical tensors, the tokenizer's rows, leave out. Where both sides pad to the same number of
rows, the rows are read from the stored boxes whose place in the padded tensor is known
(``formats.megatron_common.rank_state.padding_holders``) and compared.
"""

from __future__ import annotations

import numpy as np

from ckptctl.formats.megatron_common.rank_state import PaddingHolder, padding_holders
from ckptctl.model.stored import Format
from ckptctl.pipeline.probe import Checkpoint


def _padded_rows(side: Checkpoint) -> tuple[int, int] | None:
    """``(tokenizer's rows, padded rows)`` of a Megatron checkpoint that pads its vocabulary."""
    spec, view = side.view.spec, side.view
    if spec is None or view.format not in (Format.MEGATRON, Format.TORCH_DIST):
        return None
    rows = spec.padded_vocab_size(view.layout.tp)
    return (spec.vocab_size, rows) if rows > spec.vocab_size else None


def padding_rows_compared(
    a: Checkpoint,
    b: Checkpoint,
    rtol: float,
    atol: float,
    only: tuple[str, ...],
    weights_only: bool,
) -> tuple[str, str]:
    """Megatron's vocabulary padding rows are trained state (its softmax covers them) outside
    the model's tensors: compared where both sides pad to the same number of rows, said so
    where they cannot be. Returns the detail to add and the failure (empty when none)."""
    from ckptctl.verify.compare import narrowed

    padded = [_padded_rows(side) for side in (a, b)]
    if not any(padded):
        return "", ""
    vocab, rows = next(p for p in padded if p)
    if padded[0] != padded[1]:
        return (
            f"; vocabulary tensors compared on the tokenizer's {vocab} rows: Megatron's "
            "padding rows are not compared (the sides do not pad to the same rows)",
            "",
        )
    holders = [padding_holders(side.view) for side in (a, b)]
    names = sorted(narrowed(set(holders[0]) | set(holders[1]), only, weights_only))
    if not names:
        return "", ""
    for held in holders:  # an fp32 weight is its own master copy (no separate fp32_param)
        for name in names:
            state, _, weight = name.partition("/")
            if state == "fp32_param" and name not in held:
                held[name] = [h for h in held.get(weight, []) if h[2].dtype == "float32"]
    differ, unlocated = [], []
    for name in names:
        here, there = (
            _padding_of(side, held.get(name, []), vocab, rows)
            for side, held in zip((a, b), holders, strict=True)
        )
        same = None if here is None or there is None else _same(here, there, rtol, atol)
        if same is None:
            unlocated.append(name)
        elif not same:
            differ.append(name)
    if differ:
        return "", (
            f"Megatron's vocabulary padding rows ({vocab}..{rows - 1}), which its softmax "
            f"covers (a run resumed from either side trains differently), differ in "
            f"{len(differ)} of {len(names) - len(unlocated)} tensors ({', '.join(differ[:3])}"
            f"{' ...' if len(differ) > 3 else ''}); a reshard that changes the padding starts "
            "them from zeros"
        )
    detail = (
        f"; Megatron's vocabulary padding rows ({vocab}..{rows - 1}) equal in "
        f"{len(names) - len(unlocated)} tensors"
    )
    if unlocated:
        detail += (
            f", not compared in {len(unlocated)} (one side holds some of them where it does "
            "not say, or holds them in a dtype numpy cannot compare) "
            f"({', '.join(unlocated[:2])}{' ...' if len(unlocated) > 2 else ''})"
        )
    return detail, ""


def _padding_of(
    side: Checkpoint, holders: list[PaddingHolder], vocab: int, rows: int
) -> np.ndarray | None:
    """Rows ``vocab..rows-1`` of one vocabulary tensor, from the stored boxes that hold them;
    ``None`` when some elements are held by none of them."""
    columns = max((left + held.shape[1] for _, (_, left), held in holders), default=0)
    out: np.ndarray | None = None
    held_mask = np.zeros((rows - vocab, columns), dtype=bool)
    for index, (top, left), held in sorted(holders, key=lambda h: h[1]):
        r0, r1 = max(vocab, top), min(rows, top + held.shape[0])
        if r0 >= r1 or held_mask[r0 - vocab : r1 - vocab, left : left + held.shape[1]].all():
            continue
        view = None if held.view_offset is None else (held.view_offset, held.shape)
        path = side.view.files[index].path
        part = side.read(path, held.key, (r0 - top, 0), (r1 - r0, held.shape[1]), view)
        if out is None:
            out = np.zeros((rows - vocab, columns), dtype=part.dtype)
        out[r0 - vocab : r1 - vocab, left : left + held.shape[1]] = part
        held_mask[r0 - vocab : r1 - vocab, left : left + held.shape[1]] = True
    return out if out is not None and held_mask.all() else None


def _same(here: np.ndarray, there: np.ndarray, rtol: float, atol: float) -> bool | None:
    """Bit-exact (or within tolerances); ``None`` for rows of two dtypes numpy cannot compare
    (bfloat16 is kept as its bits)."""
    if here.shape != there.shape:
        return False
    if here.dtype == there.dtype and (rtol == atol == 0 or here.dtype.kind != "f"):
        return here.tobytes() == there.tobytes()
    if here.dtype.kind != "f" or there.dtype.kind != "f":
        return None
    return bool(np.allclose(here, there, rtol=rtol, atol=atol, equal_nan=True))
