"""``ckptctl verify``: is a checkpoint whole, and are its numbers sound?

Checks, each reported as passed, failed or skipped (with why):

* complete: no in-progress marker left by an interrupted ckptctl job;
* manifest: every file the manifest lists exists with its size and xxh3-64 checksum (skipped
  for checkpoints ckptctl did not write);
* structure: every rank file has every tensor the layout needs, with its shape, and the files
  agree on ``args`` (the probe);
* coverage: every element of every canonical tensor, optimizer state included, is held by some
  stored shard;
* numerics (``--numerics``): no NaN or Inf in any tensor.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from math import prod

import torch

from ckptctl.catalog import parameters
from ckptctl.errors import CkptctlError
from ckptctl.geometry import box_difference, nbytes
from ckptctl.manifest import INCOMPLETE, MANIFEST, file_checksum
from ckptctl.probe import Checkpoint, open_checkpoint
from ckptctl.storage import Storage
from ckptctl.stored import canonical_shapes


@dataclass
class Check:
    name: str
    status: str
    """passed, failed or skipped."""
    detail: str = ""


def verify(url: str, *, numerics: bool = False, band_bytes: int = 64 << 20) -> list[Check]:
    storage = Storage(url)
    checks = [
        Check("complete", "failed", f"{INCOMPLETE} present: the job that wrote it was interrupted")
        if storage.exists(INCOMPLETE)
        else Check("complete", "passed", f"no {INCOMPLETE} marker")
    ]
    checks.append(_manifest(storage))
    try:
        ckpt = open_checkpoint(url, allow_incomplete=True)
    except CkptctlError as err:
        checks.append(Check("structure", "failed", str(err)))
        checks.append(Check("coverage", "skipped", "the structure check failed"))
        checks.append(Check("numerics", "skipped", "the structure check failed"))
        return checks
    checks.append(
        Check(
            "structure",
            "passed",
            f"{len(ckpt.view.files)} files, {ckpt.view.format.value} {ckpt.view.layout.describe()}",
        )
    )
    checks.append(_coverage(ckpt))
    checks.append(
        _numerics(ckpt, band_bytes)
        if numerics
        else Check("numerics", "skipped", "not asked (--numerics)")
    )
    return checks


def _manifest(storage: Storage) -> Check:
    if not storage.exists(MANIFEST):
        return Check("manifest", "skipped", "no ckptctl manifest (not written by ckptctl)")
    try:
        manifest = json.loads(storage.read_text(MANIFEST))
        files = manifest["files"]
        algorithm = manifest.get("checksum", "xxh3_64")
    except (ValueError, KeyError) as err:
        return Check("manifest", "failed", f"{MANIFEST} unreadable ({err})")
    problems = []
    for path, meta in sorted(files.items()):
        if not storage.exists(path):
            problems.append(f"{path} missing")
        elif storage.size(path) != meta["size"]:
            problems.append(f"{path} has {storage.size(path)} bytes, manifest says {meta['size']}")
        elif file_checksum(storage, path, algorithm=algorithm) != meta["checksum"]:
            problems.append(f"{path} checksum differs from the manifest")
    if problems:
        return Check("manifest", "failed", "; ".join(problems[:5]))
    return Check("manifest", "passed", f"{len(files)} files, sizes and checksums match")


def _coverage(ckpt: Checkpoint) -> Check:
    view = ckpt.view
    if view.spec is None:  # unknown model: each stored tensor's bounding box must be full
        shapes = {n: s for n, (s, _) in canonical_shapes(view).items()}
    else:
        shapes = {p.name: p.shape for p in parameters(view.spec)}
    pieces: dict[str, list] = {}
    for f in view.files:
        if f.path in getattr(ckpt, "lost", frozenset()):
            continue
        for t in f.tensors:
            pieces.setdefault(t.canonical, []).extend(t.pieces)
    problems = []
    for name, shape in shapes.items():
        wanted = [name]
        if view.has_optimizer and view.spec is not None:
            wanted += [f"{s}/{name}" for s in ("exp_avg", "exp_avg_sq")]
        for canonical in wanted:
            held = pieces.get(canonical, [])
            left = [((0,) * len(shape), shape)]
            for p in held:
                left = [b for box in left for b in box_difference(box, [(p.canonical, p.sizes)])]
                if not left:
                    break
            missing = sum(prod(s) for _, s in left)
            if missing:
                problems.append(f"{canonical}: {missing} of {prod(shape)} elements held nowhere")
    if problems:
        return Check("coverage", "failed", "; ".join(problems[:5]))
    states = "weights and optimizer state" if view.has_optimizer else "weights"
    return Check("coverage", "passed", f"every element of {len(shapes)} tensors ({states}) held")


def _numerics(ckpt: Checkpoint, band_bytes: int) -> Check:
    bad = []
    checked = 0
    for f in ckpt.view.files:
        for t in f.tensors:
            if not t.shape:
                ranges = [((), ())]
            else:
                row = max(nbytes(t.shape[1:], t.dtype), 1)
                rows = max(band_bytes // row, 1)
                ranges = [
                    ((lo, *([0] * (len(t.shape) - 1))), (min(rows, t.shape[0] - lo), *t.shape[1:]))
                    for lo in range(0, t.shape[0], rows)
                ]
            for offsets, sizes in ranges:
                view = None if t.view_offset is None else (t.view_offset, t.shape)
                data = ckpt.read(f.path, t.key, tuple(offsets), tuple(sizes), view)
                if data.is_floating_point() and not torch.isfinite(data).all():
                    bad.append(f"{f.path}: {'.'.join(map(str, t.key))}")
                    break
            checked += 1
    if bad:
        return Check("numerics", "failed", "NaN/Inf in " + "; ".join(bad[:5]))
    return Check("numerics", "passed", f"{checked} tensors finite")


def against(url: str, other: str, *, rtol: float, atol: float) -> tuple[Check, list[dict]]:
    """Compare ``url`` with ``other`` tensor by tensor (any layouts and formats)."""
    from ckptctl.compare import compare

    diffs = compare(open_checkpoint(url), open_checkpoint(other), rtol=rtol, atol=atol)
    rows = [asdict(d) for d in diffs]
    bad = [d for d in diffs if not d.equal]
    how = "bit-exact" if rtol == 0 and atol == 0 else f"rtol={rtol}, atol={atol}"
    if not diffs:
        return Check("against", "failed", f"no tensor in common with {other}"), rows
    if bad:
        worst = max(bad, key=lambda d: d.max_abs_diff)
        return Check(
            "against",
            "failed",
            f"{len(bad)} of {len(diffs)} tensors differ from {other} ({how}); largest max abs "
            f"diff {worst.max_abs_diff:.3g} in {worst.name}",
        ), rows
    return Check("against", "passed", f"{len(diffs)} tensors equal to {other} ({how})"), rows


def as_json(checks: list[Check]) -> dict:
    return {"ok": all(c.status != "failed" for c in checks), "checks": [asdict(c) for c in checks]}
