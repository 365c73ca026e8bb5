"""``ckptctl compress --dry-run``: what a compression would store and how long it would take,
without writing anything. The ratio is measured, not guessed: a few chunks spread over the
checkpoint's bytes are encoded exactly as the job would encode them (against the base too)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ckptctl.checksums.manifest import refuse_incomplete
from ckptctl.compression.codec import CHUNK_SIZE, encode
from ckptctl.compression.view import open_view
from ckptctl.errors import CheckpointError
from ckptctl.io.storage import Storage
from ckptctl.model.profile import StorageProfile
from ckptctl.settings import StorageConfig
from planners.cost import QUANTIZED_BYTES_PER_ELEMENT, compress_seconds, profile_for

if TYPE_CHECKING:
    from ckptctl.compression.jobs import Opener

SAMPLES = 8
"""Chunks encoded to measure the ratio (4 MiB each: a fraction of a second)."""


@dataclass
class CompressPlan:
    source: str
    target: str
    base: str | None
    files: int
    bytes_in: int
    delta_files: int
    """Files stored as deltas (the base holds a file of the same name)."""
    sampled_bytes: int
    ratio: float
    """Measured on the sampled chunks (losslessly encoded)."""
    estimated_bytes_out: int
    estimated_seconds: float
    quantize: str | None = None
    quantized_bytes: int = 0
    """Bytes of the tensors ``--quantize`` would store lossily (before the check for NaN)."""

    def as_dict(self) -> dict[str, Any]:
        return {"operation": "compress", "dry_run": True, **asdict(self)}


def plan_compress(
    source_url: str,
    target_url: str,
    base_url: str | None,
    config: StorageConfig,
    measured: dict[str, StorageProfile] | None = None,
    quantize: str | None = None,
    opener: Opener | None = None,
) -> CompressPlan:
    """The plan, after the checks the job makes first (complete source, base present, a
    destination that is new and outside both), with nothing written."""
    from ckptctl.compression.jobs import check_destination

    source = open_view(Storage(source_url, config, read_only=True), config)
    if not source.isdir():
        raise CheckpointError(f"{source_url}: not a checkpoint directory")
    refuse_incomplete(source)
    base = open_view(Storage(base_url, config, read_only=True), config) if base_url else None
    if base is not None and not base.isdir():
        raise CheckpointError(f"--base {base_url}: not a checkpoint directory")
    check_destination(target_url, config, {"source": source_url, "base": base_url})
    if quantize is not None and base_url is not None:
        from ckptctl.compression.jobs import refuse_quantized_delta

        refuse_quantized_delta()
    files = {rel: source.size(rel) for rel in source.find_files()}
    with_base = {rel for rel in files if base is not None and base.exists(rel)}
    total = sum(files.values())
    sampled = stored = 0
    for rel, offset in _samples(files):
        block = source.read_range(rel, offset, CHUNK_SIZE)
        against = None
        if base is not None and rel in with_base:
            against = base.read_range(rel, offset, len(block))
        sampled += len(block)
        stored += len(encode(block, against)[1])
    ratio = sampled / stored if stored else 1.0
    quantized = codes = 0
    if quantize is not None:
        regions = _regions(source_url, config, quantize, opener)
        quantized = sum(r.nbytes for r in regions)
        codes = int(sum(r.numel for r in regions) * QUANTIZED_BYTES_PER_ELEMENT)
    stored_bytes = codes + int((total - quantized) / ratio)
    seconds = compress_seconds(
        total,
        total / max(stored_bytes, 1),
        len(files),
        profile_for(source_url, measured),
        profile_for(target_url, measured),
        profile_for(base_url, measured) if base_url else None,
        quantized=quantized,
    )
    return CompressPlan(
        source_url,
        target_url,
        base_url,
        len(files),
        total,
        len(with_base),
        sampled,
        round(ratio, 4),
        stored_bytes,
        round(seconds, 3),
        quantize,
        quantized,
    )


def _regions(url: str, config: StorageConfig, scope: str, opener: Opener | None) -> list[Any]:
    from ckptctl.compression.lossy import find_regions

    if opener is None:
        raise ValueError("quantizing needs the source opened as a checkpoint (an opener)")
    found = find_regions(opener(url, config), scope)
    return [r for regions in found.values() for r in regions]


def _samples(files: dict[str, int]) -> list[tuple[str, int]]:
    """``SAMPLES`` chunk positions evenly spread over all the bytes (files in name order), so
    large files (tensors) weigh as much as they do in the job."""
    total = sum(files.values())
    if total == 0:
        return []
    picks = sorted({int(total * (i + 0.5) / SAMPLES) for i in range(SAMPLES)})
    out, start = [], 0
    for rel, size in sorted(files.items()):
        for pick in picks:
            if start <= pick < start + size:
                chunk = (pick - start) // CHUNK_SIZE * CHUNK_SIZE
                if (rel, chunk) not in out:
                    out.append((rel, chunk))
        start += size
    return out
