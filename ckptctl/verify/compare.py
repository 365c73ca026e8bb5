"""``ckptctl verify A --against B``: compare two checkpoints tensor by tensor, in any layouts
and formats, through their canonical tensors (full, vocabulary unpadded), in row bands.

Both sides are first named alike: two checkpoints of a known model by their canonical names;
a checkpoint of named tensors (one ``torch.save`` file, a DCP checkpoint of unknown keys) beside
one of a known model by the naming that places its keys in that model (``formats.named``); two
of unknown models by their stored names. Every tensor of either side is then accounted for:
compared, or listed as held by one side only (which fails the comparison unless the caller
narrowed it to a pattern or to the weights).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import numpy as np
import torch

from ckptctl.arrays import to_torch, words
from ckptctl.formats.hf.target import SAFETENSORS
from ckptctl.formats.named import under_spec
from ckptctl.model.catalog import is_state
from ckptctl.model.geometry import Piece, missing_elements, nbytes
from ckptctl.model.plan import TensorWrite
from ckptctl.model.stored import CheckpointView, StoredFile, StoredTensor, canonical_shapes
from ckptctl.pipeline.assembler import Assembler
from ckptctl.pipeline.job_report import Report, Sources
from ckptctl.pipeline.probe import Checkpoint
from ckptctl.progress import NoProgress, Progress
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
    problem: str = ""
    """Why the tensor could not be compared element by element (shapes differ, elements held
    nowhere); such a tensor is never equal."""


@dataclass
class Comparison:
    """What was compared, and what could not be."""

    diffs: list[TensorDiff]
    """Every tensor both sides hold (after narrowing), in name order."""
    only_a: list[str]
    only_b: list[str]
    held: tuple[int, int]
    """Tensors each side holds before narrowing."""
    left_out: int = 0
    """Tensors of either side that the narrowing (``only``, ``weights_only``) set aside."""
    naming: str = "canonical"
    """How the two sides were named alike: ``canonical``, ``stored`` (both unknown models), or
    ``placed`` (named tensors placed in the other side's model)."""
    steps: tuple[float | None, float | None] = (None, None)
    """Adam's step where a side keeps it per parameter group (compared when both do)."""
    notes: list[str] = field(default_factory=list)


def is_optimizer_state(name: str) -> bool:
    """A canonical optimizer-state name (``exp_avg/<param>``), or a stored key of one in a
    checkpoint of unknown model (``optimizer.state...``, ``optim.state...``, ``*.exp_avg``)."""
    if is_state(name):
        return True
    return name.startswith(("optimizer.", "optim.")) or ".state." in name


def _generic(ckpt: Checkpoint) -> Checkpoint:
    """The checkpoint read key by key, where its format can (DCP and ``torch_dist``)."""
    return ckpt.as_generic() or ckpt


def _with_view(ckpt: Checkpoint, view: CheckpointView) -> Checkpoint:
    if dataclasses.is_dataclass(ckpt):
        return dataclasses.replace(ckpt, view=view)
    other = copy.copy(ckpt)
    other.view = view
    return other


def named_alike(a: Checkpoint, b: Checkpoint) -> tuple[Checkpoint, Checkpoint, str]:
    """The two checkpoints with views that name the same tensors the same way."""
    spec_a, spec_b = a.view.spec, b.view.spec
    if spec_a is not None and spec_b is not None:
        return a, b, "canonical"
    if spec_a is None and spec_b is None:
        if a.view.hf_named is not None and b.view.hf_named is not None:
            return a, b, "hub names"  # HF models known by name: their tensors as HF names them
        return _generic(a), _generic(b), "stored"
    known, other = (a, b) if spec_a is not None else (b, a)
    assert known.view.spec is not None
    plain = _generic(other)
    view, placed = under_spec(plain.view, known.view.spec)
    if placed:
        other, how = _with_view(plain, view), "placed"
    else:  # nothing of it belongs to the model: compare what both store by name
        known, other, how = _generic(known), plain, "stored"
    return (known, other, how) if spec_a is not None else (other, known, how)


def _shapes(view: CheckpointView) -> dict[str, tuple[int, ...]]:
    """Each tensor a side holds and its full shape: the bounding box of what is stored, which
    for a model ckptctl knows is the canonical shape (vocabulary unpadded, as its pieces are
    clipped); a key that no naming placed keeps its own, so a stored tensor is never compared
    in part with a model's smaller one of the same name."""
    return {name: shape for name, (shape, _) in canonical_shapes(view).items()}


def _implied(view: CheckpointView, shapes: dict[str, tuple[int, ...]], wanted: set[str]) -> None:
    """Add the tensors ``view`` holds in effect that ``wanted`` names: where a side's weights
    are the optimizer's masters (or fp32 weights, their own masters) it holds ``fp32_param/<p>``,
    and where it keeps Adam's step per group, ``step/<p>`` (``plan_files`` reads them so)."""
    dtypes = view.canonical_dtypes()
    for name in wanted - set(shapes):
        state, sep, param = name.partition("/")
        if not sep or param not in shapes:
            continue
        # An fp32 weight is its own master copy (Megatron's FP32Optimizer keeps none apart).
        own_master = view.has_optimizer and dtypes.get(param) == "float32"
        if state == "fp32_param" and (view.weights_are_masters or own_master):
            shapes[name] = shapes[param]
        elif state == "step" and view.optimizer_step is not None:
            shapes[name] = ()


def narrowed(names: Iterable[str], only: tuple[str, ...], weights_only: bool) -> set[str]:
    kept = set()
    for name in names:
        if weights_only and is_optimizer_state(name):
            continue
        if only and not any(fnmatchcase(name, pattern) for pattern in only):
            continue
        kept.add(name)
    return kept


def _canonical_file(
    names: list[str], shapes: dict[str, tuple], dtypes: dict[str, str]
) -> StoredFile:
    tensors = []
    for name in names:
        shape = shapes[name]
        zero = (0,) * len(shape)
        tensors.append(
            StoredTensor((name,), name, shape, dtypes[name], (Piece(zero, zero, shape),))
        )
    return StoredFile("canonical", tuple(tensors))


def _uncovered(view: CheckpointView, names: set[str]) -> dict[str, int]:
    """Elements of each of ``names`` that no stored piece holds (only names that lack some)."""
    pieces: dict[str, list[Piece]] = {}
    for f in view.files:
        for t in f.tensors:
            if t.canonical in names:
                pieces.setdefault(t.canonical, []).extend(t.pieces)
    shapes = {n: s for n, (s, _) in canonical_shapes(view).items()}
    out = {}
    for name in names & set(pieces):
        missing = missing_elements(shapes[name], pieces[name])
        if missing:
            out[name] = missing
    return out


def compare(
    a: Checkpoint,
    b: Checkpoint,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    band: int = 64 << 20,
    only: tuple[str, ...] = (),
    weights_only: bool = False,
    progress: Progress | None = None,
) -> Comparison:
    """Every tensor of ``a`` and ``b`` accounted for: those both hold compared (bit-exact
    unless a tolerance is given), the others listed by side. ``progress`` hears of the bytes
    compared (of both sides)."""
    progress = progress or NoProgress()
    a, b, naming = named_alike(a, b)
    shapes_a, shapes_b = _shapes(a.view), _shapes(b.view)
    _implied(a.view, shapes_a, set(shapes_b))
    _implied(b.view, shapes_b, set(shapes_a))
    held = (len(shapes_a), len(shapes_b))
    names_a = narrowed(shapes_a, only, weights_only)
    names_b = narrowed(shapes_b, only, weights_only)
    left_out = held[0] - len(names_a) + held[1] - len(names_b)
    common = sorted(names_a & names_b)
    result = Comparison(
        [], sorted(names_a - names_b), sorted(names_b - names_a), held, left_out, naming
    )
    dtypes_a, dtypes_b = a.view.canonical_dtypes(), b.view.canonical_dtypes()
    problems: dict[str, str] = {}
    for name in common:
        if shapes_a[name] != shapes_b[name]:
            problems[name] = f"shape {list(shapes_a[name])} here, {list(shapes_b[name])} there"
    for side, view in (("here", a.view), ("there", b.view)):
        for name, missing in _uncovered(view, set(common) - set(problems)).items():
            problems[name] = f"{missing} elements held nowhere {side}"
    readable = [n for n in common if n not in problems]
    for n in readable:  # tensors held in effect take the dtype of what they are read from
        for dtypes in (dtypes_a, dtypes_b):
            if n not in dtypes:
                state, _, param = n.partition("/")
                dtypes[n] = "float32" if state == "step" else dtypes[param]
    writes = {}
    for side, ckpt, dtypes in (("a", a, dtypes_a), ("b", b, dtypes_b)):
        target = _canonical_file(readable, shapes_a, dtypes)
        (file,), _ = plan_files(ckpt.view, (target,), SAFETENSORS)
        paths = tuple(f.path for f in ckpt.view.files)
        assembler = Assembler(paths, Sources(ckpt), Report(), NoProgress(), band)
        writes[side] = (dict(zip(readable, file.tensors, strict=True)), assembler)
    total = sum(
        nbytes(shapes_a[n], dtypes_a[n]) + nbytes(shapes_b[n], dtypes_b[n]) for n in readable
    )
    progress.start(total, "compare")
    for name in common:
        if name in problems:
            dt = (dtypes_a.get(name, "?"), dtypes_b.get(name, "?"))
            result.diffs.append(TensorDiff(name, False, float("inf"), dt, 0, problems[name]))
            continue
        asm_a, asm_b = writes["a"][1], writes["b"][1]
        wa, wb = writes["a"][0][name], writes["b"][0][name]
        result.diffs.append(_compare_tensor(name, wa, wb, asm_a, asm_b, rtol, atol, progress))
    progress.finish()
    result.steps = (a.view.optimizer_step, b.view.optimizer_step)
    return result


def _compare_tensor(
    name: str,
    wa: TensorWrite,
    wb: TensorWrite,
    asm_a: Assembler,
    asm_b: Assembler,
    rtol: float,
    atol: float,
    progress: Progress,
) -> TensorDiff:
    equal, worst, nan_mismatch = True, 0.0, 0
    exact = rtol == 0 and atol == 0
    rows = wa.shape[0] if wa.shape else 1
    step = max(asm_a.band_bytes // max(nbytes(wa.shape[1:], wa.dtype), 1), 1)
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        xa, ya = asm_a._band(wa, lo, hi), asm_b._band(wb, lo, hi)
        progress.advance(xa.nbytes + ya.nbytes)
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


def describe_names(names: list[str], limit: int = 4) -> str:
    """``a, b, c, d and 12 more``."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def steps_differ(comparison: Comparison) -> bool:
    here, there = comparison.steps
    return here is not None and there is not None and here != there


def summary_fields(comparison: Comparison) -> dict[str, Any]:
    """The counts a report states whatever the outcome."""
    return {
        "compared": len(comparison.diffs),
        "held": list(comparison.held),
        "only_here": comparison.only_a,
        "only_there": comparison.only_b,
        "left_out_by_narrowing": comparison.left_out,
        "naming": comparison.naming,
    }
