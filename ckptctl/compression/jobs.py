"""``ckptctl compress`` and ``decompress``: store a checkpoint's files losslessly as chunks
(``codec``), optionally as deltas against a base checkpoint, and restore them byte for byte.

Both stream one chunk at a time (bounded memory), refuse to write into or over a source or the
base, mark the output incomplete until its last file is written, and check what they restore
against the checksums recorded at compression.
"""

from __future__ import annotations

import collections
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xxhash

from ckptctl import __version__
from ckptctl.checksums.manifest import INCOMPLETE, MANIFEST, MANIFEST_VERSION, refuse_incomplete
from ckptctl.compression.codec import CHUNK_SIZE, LEVEL, encode
from ckptctl.compression.lossy import (
    LossyFile,
    check_region,
    crc_patches,
    find_regions,
    to_index,
    write_region,
    zip_windows,
)
from ckptctl.compression.quantize import SCHEME
from ckptctl.compression.view import (
    DATA,
    FORMAT,
    INDEX,
    QUANTIZED,
    CompressedStorage,
    open_view,
)
from ckptctl.errors import CheckpointError, OutputExistsError, UsageError
from ckptctl.io.locations import refuse_overlap
from ckptctl.io.storage import Storage
from ckptctl.progress import NoProgress, Progress
from ckptctl.settings import StorageConfig

Opener = Callable[[str, StorageConfig], Any]
"""Opens a URL as a checkpoint (the pipeline's probe, handed in by the CLI)."""

_WORKERS = os.cpu_count() or 2
_POOL = ThreadPoolExecutor(_WORKERS, thread_name_prefix="ckptctl-compress")


@dataclass
class CompressReport:
    source: str
    target: str
    files: int
    bytes_in: int
    bytes_out: int
    seconds: float
    delta_files: int = 0

    @property
    def ratio(self) -> float:
        return self.bytes_in / self.bytes_out if self.bytes_out else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "ratio": round(self.ratio, 4)}


def _absolute(url: str) -> str:
    return url if "://" in url else os.path.abspath(url)


def check_destination(url: str, config: StorageConfig, sources: dict[str, str | None]) -> Storage:
    """The destination, refused if it lies inside (or over) a source or holds files."""
    refuse_overlap("destination", url, sources)
    target = Storage(url, config)
    if target.exists() and set(target.find_files()) - {INCOMPLETE}:
        raise OutputExistsError(
            f"{url} exists and is not empty", hint="choose an empty or new destination"
        )
    return target


def _fresh_target(url: str, config: StorageConfig, sources: dict[str, str | None]) -> Storage:
    target = check_destination(url, config, sources)
    target.begin_writing()
    return target


def compress(
    source_url: str,
    target_url: str,
    base_url: str | None,
    config: StorageConfig,
    quantize: str | None = None,
    progress: Progress | None = None,
    opener: Opener | None = None,
) -> CompressReport:
    """``quantize`` (``weights`` or ``all``): opt-in lossy storage of those float tensors
    (``lossy``); never without it. ``progress`` hears of every chunk read. ``opener`` opens the
    source as a checkpoint, to find its tensors (needed with ``quantize``)."""
    progress = progress or NoProgress()
    start = time.perf_counter()
    source = open_view(Storage(source_url, config, read_only=True), config)
    if not source.isdir():
        raise CheckpointError(f"{source_url}: not a checkpoint directory")
    refuse_incomplete(source)
    if quantize is not None and base_url is not None:
        refuse_quantized_delta()
    lossy = _lossy_files(source_url, source, config, quantize, opener) if quantize else {}
    base = open_view(Storage(base_url, config, read_only=True), config) if base_url else None
    if base is not None and not base.isdir():
        raise CheckpointError(f"--base {base_url}: not a checkpoint directory")
    target = _fresh_target(target_url, config, {"source": source_url, "base": base_url})
    target.write_text(INCOMPLETE, json.dumps({"operation": "compress"}))
    files: dict[str, Any] = {}
    base_files: dict[str, Any] = {}
    written: dict[str, Any] = {}
    report = CompressReport(source_url, target_url, 0, 0, 0, 0.0)
    names = source.find_files()
    progress.start(sum(source.size(rel) for rel in names), f"compress -> {target_url}")
    for rel in names:
        against = base if base is not None and base.exists(rel) and not base.isdir(rel) else None
        quantized = lossy.get(rel)
        if quantized is not None:
            written[f"{DATA}/{rel}{QUANTIZED}"] = _write_codes(source, target, quantized)
            report.bytes_out += written[f"{DATA}/{rel}{QUANTIZED}"]["size"]
        entry, base_entry, out = _compress_file(
            source, target, rel, against, quantized, progress.advance
        )
        files[rel] = entry
        written[f"{DATA}/{rel}"] = out
        if base_entry is not None:
            base_files[rel] = base_entry
            report.delta_files += 1
        report.files += 1
        report.bytes_in += entry["size"]
        report.bytes_out += out["size"]
    index = {
        "format": FORMAT,
        "version": 1,
        "codec": f"xor+shuffle+zstd-{LEVEL}",
        "chunk_size": CHUNK_SIZE,
        "lossy": bool(lossy),
        "quantize": {"scope": quantize, "scheme": SCHEME} if lossy else None,
        "source": {"url": source_url, "bytes": report.bytes_in},
        "base": {"url": _absolute(base_url), "files": base_files} if base_url else None,
        "files": files,
    }
    text = json.dumps(index, indent=1, sort_keys=True)
    target.write_text(INDEX, text)
    target.drain()  # data and index on the device before the manifest vouches for them
    written[INDEX] = {
        "size": len(text.encode()),
        "checksum": xxhash.xxh3_64_hexdigest(text.encode()),
    }
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "tool": f"ckptctl {__version__}",
        "operation": "compress",
        "format": FORMAT,
        "lossy": bool(lossy),
        "checksum": "xxh3_64",
        "files": written,
        "tensors": {},
    }
    target.write_text(MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    target.remove(INCOMPLETE)
    progress.finish()
    report.seconds = time.perf_counter() - start
    return report


def refuse_quantized_delta() -> None:
    raise UsageError(
        "--quantize with --base: not supported (a delta of dequantized values against exact "
        "ones would not shrink)",
        hint="quantize each checkpoint alone, or store deltas losslessly",
    )


def _lossy_files(
    url: str, source: Storage, config: StorageConfig, scope: str, opener: Opener | None
) -> dict[str, LossyFile]:
    """The files holding tensors ``scope`` names, with the regions that quantize soundly (a
    tensor holding NaN or inf stays exact) and the zip CRC-32s their decoded bytes need."""
    if opener is None:
        raise ValueError("quantizing needs the source opened as a checkpoint (an opener)")
    ckpt = opener(url, config)
    out = {}
    for rel, regions in find_regions(ckpt, scope).items():
        kept = [r for r in regions if check_region(source, rel, r)]
        if kept:
            windows = zip_windows(ckpt, rel, source.size(rel))
            patches = crc_patches(source, rel, windows, kept, _POOL)
            out[rel] = LossyFile(source, rel, kept, patches)
    return out


def _write_codes(source: Storage, target: Storage, lossy: LossyFile) -> dict[str, Any]:
    """``data/<file>.q``: each region's int8 codes and scales, piece by piece."""
    with target.open_write(f"{DATA}/{lossy.rel}{QUANTIZED}", xxhash.xxh3_64()) as out:
        for region in lossy.regions:
            lossy.at.append(out.size)
            write_region(source, lossy.rel, region, out, _POOL)
    lossy.stored_bytes = out.size
    return {"size": out.size, "checksum": out.digest.hexdigest()}


def _compress_file(
    source: Storage,
    target: Storage,
    rel: str,
    base: Storage | None,
    lossy: LossyFile | None = None,
    advance: Callable[[int], object] = lambda n: None,
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """Encode ``rel`` chunk by chunk: its index entry, its base's entry, the written file's.
    With ``lossy`` regions, what is encoded has them zeroed (their codes are stored apart)
    and the recorded checksum is the decoded file's."""
    original, base_digest = xxhash.xxh3_64(), xxhash.xxh3_64()
    decoded = xxhash.xxh3_64()
    base_size = base.size(rel) if base is not None else 0
    chunks, size = [], 0
    pending: collections.deque[Future[tuple[str, bytes, bytes | None]]] = collections.deque()

    def drain(keep: int) -> None:
        while len(pending) > keep:
            mode, payload, as_decoded = pending.popleft().result()
            chunks.append([out.size, len(payload), mode])
            out.write(payload)
            if as_decoded is not None:
                decoded.update(as_decoded)

    with (
        source.open_sequential(rel) as f,
        target.open_write(f"{DATA}/{rel}", xxhash.xxh3_64()) as out,
    ):
        # Chunks encode in parallel (zstd and numpy release the GIL) and are written in order;
        # a few in flight bound the memory.
        while block := f.read(CHUNK_SIZE):
            original.update(block)
            against = None
            if base is not None:
                against = base.read_range(rel, size, max(0, min(len(block), base_size - size)))
                base_digest.update(against)
            pending.append(_POOL.submit(_encode, block, against, lossy, size))
            size += len(block)
            drain(2 * _WORKERS)
            advance(len(block))
        drain(0)
    if base is not None and size < base_size:  # the rest of the base, for its checksum
        base_digest.update(base.read_range(rel, size, base_size - size))
    entry: dict[str, Any] = {"size": size, "checksum": original.hexdigest(), "chunks": chunks}
    if lossy is not None:
        entry["checksum"] = decoded.hexdigest()
        entry["original_checksum"] = original.hexdigest()
        entry["quantized"] = [
            to_index(r, at) for r, at in zip(lossy.regions, lossy.at, strict=True)
        ]
        entry["quantized_bytes"] = lossy.stored_bytes  # the codes file, counted in the ratio
    base_entry = (
        {"size": base_size, "identity": base.identity(rel), "checksum": base_digest.hexdigest()}
        if base is not None
        else None
    )
    return entry, base_entry, {"size": out.size, "checksum": out.digest.hexdigest()}


def _encode(
    block: bytes, base: bytes | None, lossy: LossyFile | None, at: int
) -> tuple[str, bytes, bytes | None]:
    """One chunk encoded (regions zeroed first when quantized), and as it will decode."""
    if lossy is None:
        return (*encode(block, base), None)
    return (*encode(lossy.stored(at, block), base), lossy.decoded(at, block))


def decompress(
    source_url: str, target_url: str, config: StorageConfig, progress: Progress | None = None
) -> CompressReport:
    """Restore the original files (only them: no file of ckptctl's own is added), each checked
    against its recorded checksum before it is renamed into place; ``progress`` hears of
    every chunk written."""
    progress = progress or NoProgress()
    start = time.perf_counter()
    inner = Storage(source_url, config, read_only=True)
    refuse_incomplete(inner)
    view = open_view(inner, config)
    if not isinstance(view, CompressedStorage):
        raise CheckpointError(f"{source_url}: not a compressed checkpoint (no {INDEX})")
    sources: dict[str, str | None] = {"source": source_url}
    if view.index.get("base"):
        sources["base"] = view.index["base"]["url"]
    target = _fresh_target(target_url, config, sources)
    target.write_text(INCOMPLETE, json.dumps({"operation": "decompress"}))
    report = CompressReport(source_url, target_url, 0, 0, 0, 0.0)
    progress.start(sum(e["size"] for e in view.files.values()), f"decompress -> {target_url}")
    for rel, entry in sorted(view.files.items()):
        if rel == MANIFEST and view.lossy:
            text = lossy_manifest(view.read_text(rel), view.files, view.index["quantize"])
            target.write_text(rel, text)
            report.files += 1
            report.bytes_out += len(text.encode())
            continue
        with target.open_write(rel, xxhash.xxh3_64()) as out:
            pending: collections.deque[Future[bytes]] = collections.deque()
            for n in range(len(entry["chunks"])):  # decoded in parallel, written in order
                pending.append(_POOL.submit(view.chunk, rel, n))
                while len(pending) > 2 * _WORKERS:
                    progress.advance(out.write(pending.popleft().result()) or 0)
            while pending:
                progress.advance(out.write(pending.popleft().result()) or 0)
            if out.digest.hexdigest() != entry["checksum"] or out.size != entry["size"]:
                raise CheckpointError(
                    f"{view.describe(rel)}: decodes to {out.size} bytes with checksum "
                    f"{out.digest.hexdigest()}, recorded {entry['size']} / {entry['checksum']}"
                )
        report.files += 1
        report.bytes_in += sum(c[1] for c in entry["chunks"]) + entry.get("quantized_bytes", 0)
        report.bytes_out += entry["size"]
    target.drain()
    target.remove(INCOMPLETE)
    progress.finish()
    report.seconds = time.perf_counter() - start
    return report


def lossy_manifest(text: str, files: dict[str, Any], quantize: dict[str, Any]) -> str:
    """The source's ckptctl manifest, for its files as a quantized copy restores them: their
    checksums as decoded, the tensor checksums of quantized files dropped (they no longer
    hold), and marked lossy, so ``verify`` checks the copy as what it is."""
    try:
        manifest = json.loads(text)
        listed = manifest["files"]
    except (ValueError, KeyError, TypeError):
        return text  # not one of ours: restored as it was
    changed = []
    for rel, meta in listed.items():
        entry = files.get(rel) or {}
        if entry.get("original_checksum") == meta.get("checksum"):
            meta["checksum"] = entry["checksum"]
            changed.append(rel)
    for rel in changed:
        (manifest.get("tensors") or {}).pop(rel, None)
    manifest["lossy"] = {**quantize, "files": sorted(changed)}
    return json.dumps(manifest, indent=1, sort_keys=True)


def check_compressed(view: CompressedStorage, covered: frozenset[str] = frozenset()) -> list[str]:
    """Problems of a compressed checkpoint: its data files against its own manifest, and every
    original file decoded (against the base, checked too) against its recorded checksum, but
    for ``covered`` ones (the caller decodes and checks those against the same checksum)."""
    problems = []
    inner = view.inner
    try:
        listed = json.loads(inner.read_text(MANIFEST))["files"]
    except (ValueError, KeyError, CheckpointError) as err:
        return [f"{MANIFEST} unreadable ({err})"]
    for rel, meta in sorted(listed.items()):
        if not inner.exists(rel) or inner.size(rel) != meta["size"]:
            problems.append(f"{rel} missing or not {meta['size']} bytes")
    for rel, entry in sorted(view.files.items()):
        if rel in covered:
            continue
        digest = xxhash.xxh3_64()
        try:
            for n in range(len(entry["chunks"])):
                digest.update(view.chunk(rel, n))
        except CheckpointError as err:
            problems.append(str(err))
            continue
        if digest.hexdigest() != entry["checksum"]:
            problems.append(f"{rel} decodes to other bytes than were compressed")
    return problems
