"""Where a URL points, whatever its spelling, and whether two URLs overlap.

A source must never be written, so the destination is compared with every source before
anything is touched. Spellings differ (``ck``, ``./ck/``, ``ck/../ck``, a symlink, ``file:///abs/ck``;
``s3://b/p``, ``s3://b/p/``, ``s3a://b//p``), so each URL is reduced to one canonical location:
the store it lives in and an absolute, normalised path inside it.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from enum import StrEnum

from ckptctl.errors import UsageError

_SAME_STORE = {"s3a": "s3", "gcs": "gs", "abfs": "az", "local": "file", "": "file"}


@dataclass(frozen=True, slots=True)
class Location:
    store: str
    """``file`` for local paths, else the URL scheme (aliases folded, e.g. ``s3a`` -> ``s3``)."""
    path: str
    """Absolute and normalised; local paths with symlinks resolved."""

    def parts(self) -> tuple[str, ...]:
        return tuple(p for p in self.path.split("/") if p)


def location(url: str) -> Location:
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "file", url
    scheme = _SAME_STORE.get(scheme.lower(), scheme.lower())
    if scheme == "file":
        # realpath resolves symlinks and '..' even for a path that does not exist yet.
        return Location("file", os.path.realpath(os.path.expanduser(rest)))
    return Location(scheme, posixpath.normpath("/" + rest.strip("/")))


class Overlap(StrEnum):
    SAME = "is"
    INSIDE = "lies inside"
    CONTAINS = "contains"


def overlap(a: str, b: str) -> Overlap | None:
    """How location ``a`` relates to location ``b``, or ``None`` if they are apart."""
    la, lb = location(a), location(b)
    if la.store != lb.store:
        return None
    pa, pb = la.parts(), lb.parts()
    if pa == pb:
        return Overlap.SAME
    if pa[: len(pb)] == pb:
        return Overlap.INSIDE
    if pb[: len(pa)] == pa:
        return Overlap.CONTAINS
    return None


def refuse_overlap(what: str, url: str, sources: dict[str, str | None]) -> None:
    """Refuse ``url`` (an output: the destination, a staging directory, a saved plan) if it is,
    lies inside, or contains any of ``sources`` (label -> URL), before anything is written."""
    for label, source in sources.items():
        if not source:
            continue
        relation = overlap(url, source)
        if relation is not None:
            raise UsageError(
                f"{what} {url} {relation.value} the {label} {source}; ckptctl never writes into "
                "or over a source",
                hint=f"choose a {what} outside {source}",
            )
