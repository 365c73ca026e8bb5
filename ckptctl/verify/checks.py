"""``ckptctl verify``: is a checkpoint whole, and are its numbers sound?

Checks, each reported as passed, failed or skipped (with why):

* complete: no in-progress marker left by an interrupted ckptctl job;
* manifest: every file the manifest lists exists with its size and xxh3-64 checksum (skipped
  for checkpoints ckptctl did not write);
* checksums: what foreign files can prove about themselves: the CRC-32 of every zip entry of
  every ``torch.save`` archive (Megatron rank files, ``distrib_optim.pt``, ``common.pt``, DCP
  tensor records), read in the same pass as the manifest digest; safetensors headers against
  file sizes (the format has no checksum, and the report says so);
* structure: every rank file has every tensor the layout needs, with its shape, and the files
  agree on ``args`` (the probe);
* coverage: every element of every canonical tensor, optimizer state included, is held by some
  stored shard;
* numerics (``--numerics``): no NaN or Inf in any tensor.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from ckptctl.arrays import finite
from ckptctl.checksums.integrity import Targets, stream_check
from ckptctl.checksums.manifest import INCOMPLETE, MANIFEST, new_digest
from ckptctl.compression.jobs import check_compressed
from ckptctl.compression.view import CompressedStorage, open_view
from ckptctl.errors import CheckpointError, CkptctlError
from ckptctl.formats.safetensors_header import read_header
from ckptctl.io.storage import Storage
from ckptctl.model.geometry import nbytes
from ckptctl.model.stored import Shape
from ckptctl.pipeline.distributed import Group
from ckptctl.pipeline.probe import Checkpoint, format_of, open_against, open_checkpoint
from ckptctl.pipeline.replicas import check_replicas
from ckptctl.progress import NoProgress, Progress
from ckptctl.settings import Settings
from ckptctl.verify.coverage import coverage_problems
from ckptctl.verify.padding_rows import padding_rows_compared
from planners.shares import split_sizes


@dataclass
class Check:
    name: str
    status: str
    """passed, failed or skipped."""
    detail: str = ""


def verify(
    url: str,
    settings: Settings | None = None,
    *,
    numerics: bool = False,
    band_bytes: int = 64 << 20,
    group: Group | None = None,
    progress: Progress | None = None,
    against: bool = False,
) -> list[Check]:
    """The checks of ``url``; with a process ``group``, each rank reads its share of the files
    and every rank returns the same checks. ``progress`` hears of the bytes read; ``against``:
    another checkpoint is compared next (options its format reads are not refused here)."""
    settings = settings or Settings()
    progress = progress or NoProgress()
    storage = Storage(url, settings.storage, read_only=True)
    checks = [
        Check("complete", "failed", f"{INCOMPLETE} present: the job that wrote it was interrupted")
        if storage.exists(INCOMPLETE)
        else Check("complete", "passed", f"no {INCOMPLETE} marker")
    ]
    try:
        opened = open_checkpoint(url, settings, allow_incomplete=True, refuse_unread=not against)
        structure = Check(
            "structure",
            "passed",
            f"{len(opened.view.files)} files, {opened.view.format} {opened.view.layout.describe()}",
        )
        ckpt: Checkpoint | None = opened
    except CkptctlError as err:
        ckpt, structure = None, Check("structure", "failed", str(err))
    view = open_view(storage, settings.storage)
    differ: set[str] = set()
    stored = _stored_bytes(view, ckpt, group, differ, progress)
    if isinstance(view, CompressedStorage):
        checks.append(_compressed_check(view, group, differ))
    checks.extend(stored)
    checks.append(structure)
    if ckpt is None:
        checks.append(Check("tensors", "skipped", "the structure check failed"))
        checks.append(Check("coverage", "skipped", "the structure check failed"))
        checks.append(Check("numerics", "skipped", "the structure check failed"))
        return checks
    checks.append(_tensors(ckpt))
    checks.append(_coverage(ckpt))
    if ckpt.view.replicas:
        checks.append(_replicas(ckpt))
    checks.append(
        _numerics(ckpt, band_bytes, group, progress)
        if numerics
        else Check("numerics", "skipped", "not asked (--numerics)")
    )
    progress.finish()
    return checks


def _mine(group: Group | None, sizes: list[int]) -> set[int]:
    """The items (of these sizes) this rank checks: all of them without a group."""
    if group is None:
        return set(range(len(sizes)))
    return set(split_sizes(sizes, group.world)[group.rank])


def _everyone(group: Group | None, problems: list[tuple[int, str]]) -> list[str]:
    """Every rank's problems, in the order of the items they concern."""
    if group is not None:
        problems = [p for part in group.all_gather(problems) for p in part]
    return [text for _, text in sorted(problems, key=lambda p: p[0])]


def _stored_bytes(
    storage: Storage,
    ckpt: Checkpoint | None,
    group: Group | None,
    differ: set[str],
    progress: Progress,
) -> list[Check]:
    """The manifest and the checksums the files carry themselves, in one read of each file;
    ``differ`` receives the files whose digest is not the manifest's."""
    manifest, unreadable = _read_manifest(storage)
    listed: dict[str, dict] = manifest["files"] if manifest else {}
    targets, unlisted = Targets(), ""
    if ckpt is not None:
        try:
            targets = format_of(ckpt).checksums(ckpt)
        except CkptctlError as err:  # a file whose checksums cannot even be found
            unlisted = str(err)
    # Zip entries are checked in the same pass as the manifest digest where the roots agree
    # (they differ only for a single ``.pt`` file named directly, which has no manifest).
    same_root = ckpt is None or ckpt.storage.url == storage.url
    zips = targets.zips if same_root else {}
    algorithm = manifest.get("checksum", "xxh3_64") if manifest else "xxh3_64"
    manifest_problems: list[tuple[int, str]] = []
    crc_problems: list[tuple[int, str]] = []
    paths = sorted(set(listed) | set(zips))
    sizes = [
        int(listed.get(p, {}).get("size", 0)) or sum(e.size for e in zips.get(p, [])) for p in paths
    ]
    mine = _mine(group, sizes)
    progress.start(sum(sizes[n] for n in mine), f"verify {storage.url}")
    for n, path in enumerate(paths):
        if n not in mine:
            continue
        meta = listed.get(path)
        if meta is not None:
            if not storage.exists(path):
                manifest_problems.append((n, f"{path} missing"))
                continue
            if (size := storage.size(path)) != meta["size"]:
                said = f"{path} has {size} bytes, manifest says {meta['size']}"
                manifest_problems.append((n, said))
                meta = None
        digest = new_digest(algorithm) if meta is not None else None
        found = stream_check(storage, path, zips.get(path, []), digest, progress.advance)
        crc_problems += [(n, p) for p in found]
        expected = meta["checksum"] if meta is not None else None
        if expected is not None and hasattr(storage, "decoded_checksum"):
            expected = storage.decoded_checksum(path, expected, algorithm)  # quantized files
        if digest is not None and digest.hexdigest() != expected:
            manifest_problems.append((n, f"{path} checksum differs from the manifest"))
            differ.add(path)
    # Checks of files outside the manifest's list: rank 0's alone (each rank's problems are
    # gathered, so a check every rank made would be reported once per rank).
    lead = group is None or group.rank == 0
    if ckpt is not None and not same_root and lead:
        for path, entries in targets.zips.items():
            crc_problems += [(len(paths), p) for p in stream_check(ckpt.storage, path, entries)]
    for path in targets.safetensors if lead else ():
        found = _safetensors_problems(ckpt.storage, path)  # type: ignore[union-attr]
        crc_problems += [(len(paths), p) for p in found]
    in_manifest, in_files = _everyone(group, manifest_problems), _everyone(group, crc_problems)
    if unreadable:
        manifest_check = Check("manifest", "failed", unreadable)
    elif manifest is None:
        manifest_check = Check(
            "manifest", "skipped", "no ckptctl manifest (not written by ckptctl)"
        )
    elif in_manifest:
        manifest_check = Check("manifest", "failed", "; ".join(in_manifest[:5]))
    else:
        lossy = " (quantized files: as recorded when compressed)" if _lossy(storage) else ""
        if isinstance(manifest.get("lossy"), dict):  # restored from a quantized copy
            scope = manifest["lossy"].get("scope")
            lossy = f" (a LOSSY copy: {scope} quantized by ckptctl compress --quantize)"
        manifest_check = Check(
            "manifest", "passed", f"{len(listed)} files, sizes and checksums match{lossy}"
        )
    if unlisted:
        in_files.insert(0, unlisted)
    return [manifest_check, _checksum_check(targets, in_files, manifest is not None)]


def _checksum_check(targets: Targets, problems: list[str], has_manifest: bool) -> Check:
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        return Check("checksums", "failed", "; ".join(problems[:5]) + more)
    said = []
    if targets.zips:
        entries = sum(len(e) for e in targets.zips.values())
        said.append(f"CRC-32 of {entries} zip entries in {len(targets.zips)} files match")
    said += targets.unchecked
    if targets.safetensors:
        said.append(
            f"{len(targets.safetensors)} safetensors files: headers and sizes consistent; the "
            "format stores no checksum, so their tensor bytes "
            + ("are covered by the manifest" if has_manifest else "cannot be checked")
        )
    if not targets.zips and not has_manifest:
        return Check("checksums", "skipped", "; ".join(said) or "no checksums in this format")
    return Check("checksums", "passed", "; ".join(said))


def _read_manifest(storage: Storage) -> tuple[dict | None, str]:
    if not storage.exists(MANIFEST):
        return None, ""
    try:
        manifest = json.loads(storage.read_text(MANIFEST))
        manifest["files"].items()
        return manifest, ""
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return None, f"{MANIFEST} unreadable ({err})"


def _tensors(ckpt: Checkpoint) -> Check:
    """Every tensor the checkpoint describes is found where its file says, with the dtype,
    shape and strides it is described with, and every byte of it inside the file: what a
    conversion reads, located without reading a byte of data (a reader that cannot locate
    tensors says so)."""
    if not ckpt.locates:
        return Check("tensors", "skipped", "this format's reader cannot locate tensors alone")
    where, lost = ckpt.where, ckpt.lost
    problems: list[str] = []
    located: set[tuple] = set()
    for f in ckpt.view.files:
        if f.path in lost:
            continue
        for t in f.tensors:
            shape = t.block_shape if t.view_offset is not None else t.stored_shape
            view = None if t.view_offset is None else (t.view_offset, shape)
            if (f.path, t.key, view) in located:
                continue
            located.add((f.path, t.key, view))
            try:
                where(f.path, t.key, (0,) * len(shape), shape, view)
            except CkptctlError as err:
                problems.append(str(err))
            except (KeyError, IndexError, TypeError, ValueError) as err:
                problems.append(f"{f.path}: {'.'.join(map(str, t.key))}: {err!r}")
            if len(problems) >= 5:
                break
    if problems:
        return Check("tensors", "failed", "; ".join(problems[:5]))
    return Check(
        "tensors", "passed", f"{len(located)} stored tensors lie inside their files as described"
    )


def _replicas(ckpt: Checkpoint) -> Check:
    """The copies the checkpoint keeps of its own tensors hold the same bytes (``replicas``)."""
    try:
        check_replicas(ckpt)
    except CheckpointError as err:
        return Check("replicas", "failed", str(err))
    return Check("replicas", "passed", f"{len(ckpt.view.replicas)} copies equal what they copy")


def _coverage(ckpt: Checkpoint) -> Check:
    problems, tensors = coverage_problems(ckpt.view, ckpt.lost)
    if problems:
        return Check("coverage", "failed", "; ".join(problems[:5]))
    states = "weights and optimizer state" if ckpt.view.has_optimizer else "weights"
    return Check("coverage", "passed", f"every element of {tensors} tensors ({states}) held")


def _numerics(ckpt: Checkpoint, band_bytes: int, group: Group | None, progress: Progress) -> Check:
    bad: list[tuple[int, str]] = []
    checked = 0
    files = ckpt.view.files
    sizes = [sum(nbytes(t.shape, t.dtype) for t in f.tensors) for f in files]
    mine = _mine(group, sizes)
    progress.start(sum(sizes[n] for n in mine), "NaN/Inf scan")
    for n, f in enumerate(files):
        if n not in mine:
            continue
        for t in f.tensors:
            if not t.shape:
                ranges: list[tuple[Shape, Shape]] = [((), ())]
            else:
                row = max(nbytes(t.shape[1:], t.dtype), 1)
                rows = max(band_bytes // row, 1)
                ranges = [
                    ((lo, *([0] * (len(t.shape) - 1))), (min(rows, t.shape[0] - lo), *t.shape[1:]))
                    for lo in range(0, t.shape[0], rows)
                ]
            for offsets, box in ranges:
                view = None if t.view_offset is None else (t.view_offset, t.shape)
                if t.transposed:
                    data = ckpt.read(f.path, t.key, offsets, box, view, transposed=True)
                else:
                    data = ckpt.read(f.path, t.key, offsets, box, view)
                progress.advance(nbytes(box, t.dtype))
                if not finite(data):
                    bad.append((n, f"{f.path}: {'.'.join(map(str, t.key))}"))
                    break
            checked += 1
    if group is not None:
        checked = sum(group.all_gather(checked))
    found = _everyone(group, bad)
    if found:
        return Check("numerics", "failed", "NaN/Inf in " + "; ".join(found[:5]))
    return Check("numerics", "passed", f"{checked} tensors finite")


def against(
    url: str,
    other: str,
    settings: Settings | None = None,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    only: tuple[str, ...] = (),
    weights_only: bool = False,
    progress: Progress | None = None,
) -> tuple[Check, list[dict], dict[str, Any]]:
    """Compare ``url`` with ``other`` tensor by tensor (any layouts and formats): every tensor
    of either side is compared or named as held by one side only, which fails the check unless
    ``only`` (glob patterns of canonical names) or ``weights_only`` narrows what is compared.
    Returns the check, a row per compared tensor and the counts (``compare.summary_fields``)."""
    from ckptctl.verify.compare import compare, describe_names, steps_differ, summary_fields

    a, b = open_against(url, other, settings or Settings())
    result = compare(
        a, b, rtol=rtol, atol=atol, only=only, weights_only=weights_only, progress=progress
    )
    diffs = result.diffs
    rows = [asdict(d) for d in diffs]
    # A quantized checkpoint (compress --quantize) differs by design: each such tensor is
    # judged against the largest error recorded when it was quantized, the others stay exact.
    bounds = {**_lossy_bounds(a), **_lossy_bounds(b)}
    within = [d for d in diffs if not d.equal and not d.problem and _within(d, bounds)]
    for row in rows:
        if row["name"] in bounds:
            row["quantized_max_abs_error"] = bounds[row["name"]]
    bad = [d for d in diffs if not d.equal and d not in within]
    how = "bit-exact" if rtol == 0 and atol == 0 else f"rtol={rtol}, atol={atol}"
    counts = summary_fields(result)
    total = len(diffs) + len(result.only_a) + len(result.only_b)
    compared = f"compared {len(diffs)} of {total} tensors"
    if result.left_out:
        compared += f" ({result.left_out} left out by --only/--weights-only)"
    failures = []
    if not diffs:
        failures.append(f"no tensor in common with {other}")
    for side, names in (("here", result.only_a), (f"in {other}", result.only_b)):
        if names:
            failures.append(f"{len(names)} only {side}: {describe_names(names)}")
    if bad:
        failures.append(_differences(bad, len(diffs), other, how))
    if steps_differ(result):
        here, there = result.steps
        failures.append(f"Adam's step is {here:g} here and {there:g} in {other}")
    if failures:
        hint = ""
        if result.only_a or result.only_b:
            hint = "; to compare only what both hold, narrow with --only PATTERN or --weights-only"
        return (
            Check("against", "failed", f"{compared}: " + "; ".join(failures) + hint),
            rows,
            counts,
        )
    detail = f"{compared}: {len(diffs) - len(within)} equal to {other} ({how})"
    if within:
        worst = max(within, key=lambda d: d.max_abs_diff)
        detail += (
            f"; {len(within)} quantized tensors within the error recorded at compression "
            f"(largest max abs diff {worst.max_abs_diff:.3g} in {worst.name})"
        )
    # (a quantized tensor is within its error, not equal: counted above)
    inside = {id(d) for d in within}
    cast = [d for d in diffs if d.dtypes[0] != d.dtypes[1] and id(d) not in inside]
    converted = sorted({d.dtypes for d in cast})
    if converted:
        count = len(cast)
        kinds = ", ".join(f"{x} here, {y} there" for x, y in converted)
        detail += f"; {count} of them equal in value in another dtype ({kinds})"
    if result.steps[0] is not None and result.steps[1] is not None:
        detail += f"; Adam's step {result.steps[0]:g} on both"
    padding, differing = padding_rows_compared(a, b, rtol, atol, only, weights_only)
    if differing:
        return Check("against", "failed", f"{detail}; but {differing}"), rows, counts
    detail += padding
    return Check("against", "passed", detail), rows, counts


def _differences(bad: list[Any], compared: int, other: str, how: str) -> str:
    detail = f"{len(bad)} of {compared} differ from {other} ({how})"
    shaped = [d for d in bad if d.problem]
    if shaped:
        detail += f"; {shaped[0].name}: {shaped[0].problem}"
        if len(shaped) > 1:
            detail += f" (and {len(shaped) - 1} more not comparable)"
    valued = [d for d in bad if not d.problem]
    nans = [d for d in valued if d.nan_mismatch]
    if nans:
        detail += (
            f"; {sum(d.nan_mismatch for d in nans)} elements are NaN on one side only (in "
            f"{', '.join(d.name for d in nans[:3])}{' ...' if len(nans) > 3 else ''})"
        )
    if valued:
        worst = max(valued, key=lambda d: d.max_abs_diff)
        detail += f"; largest max abs diff {worst.max_abs_diff:.3g} in {worst.name}"
    return detail


def _compressed_check(view: CompressedStorage, group: Group | None, differ: set[str]) -> Check:
    """Every original file decodes to the checksum taken at compression: those the manifest
    pass decoded against that same checksum (``differ``: the ones that did not match) are not
    decoded a second time."""
    covered = _covered_by_manifest(view)
    problems = check_compressed(view, covered) if group is None or group.rank == 0 else []
    if group is not None:  # each rank decoded its share of the files in the manifest pass
        problems = group.all_gather(problems)[0]
        differ = set().union(*group.all_gather(sorted(differ)))
    wrong = sorted(differ & covered)
    problems += [f"{rel} decodes to other bytes than were compressed" for rel in wrong]
    if problems:
        return Check("compressed", "failed", "; ".join(problems[:5]))
    base = view.index.get("base")
    return Check(
        "compressed",
        "passed",
        f"{len(view.files)} files decode to the bytes that were compressed"
        + (f" (against the base {base['url']})" if base else ""),
    )


def _covered_by_manifest(view: CompressedStorage) -> frozenset[str]:
    """Files of a compressed checkpoint that the manifest check will decode and compare with
    the very checksum recorded at compression: decoding them once is enough."""
    manifest, _ = _read_manifest(view)
    if not manifest or manifest.get("checksum", "xxh3_64") != "xxh3_64":
        return frozenset()
    covered = set()
    for rel, meta in manifest.get("files", {}).items():
        entry = view.files.get(rel)
        if entry is None or entry.get("size") != meta.get("size"):
            continue
        if view.decoded_checksum(rel, str(meta.get("checksum")), "xxh3_64") == entry["checksum"]:
            covered.add(rel)
    return frozenset(covered)


def _lossy(storage: Storage) -> bool:
    return isinstance(storage, CompressedStorage) and storage.lossy


def _lossy_bounds(ckpt: Checkpoint) -> dict[str, float]:
    """Largest error of each tensor a ``compress --quantize`` stored lossily, or a
    conversion wrote in FP8 (``--dtype fp8-block``), by canonical name, over all its pieces."""
    stored = ckpt.storage
    bounds = stored.quantization_errors() if isinstance(stored, CompressedStorage) else {}
    return {**bounds, **ckpt.quantization_errors()}


def _within(diff: Any, bounds: dict[str, float]) -> bool:
    bound = bounds.get(diff.name)
    return bound is not None and not diff.nan_mismatch and diff.max_abs_diff <= bound


def as_json(checks: list[Check]) -> dict:
    return {"ok": all(c.status != "failed" for c in checks), "checks": [asdict(c) for c in checks]}


def _safetensors_problems(storage: Storage, rel: str) -> list[str]:
    """A safetensors file's header against its size (the parser every reader uses)."""
    where = storage.describe(rel)
    size = storage.size(rel)
    try:
        with storage.open_read(rel) as f:
            header = read_header(f, where, size)
    except CheckpointError as err:
        return [str(err)]
    if header.data_end != size:
        return [f"{where}: {size - header.data_end} bytes after the last tensor"]
    return []
