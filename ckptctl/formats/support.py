"""What a format supports, as ``ckptctl formats`` prints it (pure data; each format's registry
entry holds its own)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class FormatSupport:
    name: str
    """The name used by ``--format`` and shown by ``inspect``."""
    description: str
    recognised_by: str
    reads: bool
    writes: str
    """Which commands write it (empty: read only)."""
    supports: str
    checksums: str
    """What ``verify`` can prove about a copy ckptctl did not write."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


STORES = "local paths, file://, s3:// (S3 and S3-compatible), memory://, any fsspec URL"
