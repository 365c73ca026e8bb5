"""How ckptctl prints quantities."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """Bytes in binary units, the one unit ckptctl prints (``1.5 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"
