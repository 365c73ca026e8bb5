"""Where a DCP checkpoint's files are: the directory holding ``.metadata`` (the root, or a
Megatron iteration directory), ``.metadata`` read through the allow-list and checked, and the
record files it names present and long enough."""

from __future__ import annotations

from ckptctl.errors import CheckpointError, CheckpointNotFoundError
from ckptctl.formats.dcp.checks import check_metadata
from ckptctl.formats.dcp.metadata import METADATA_FILE, DcpMetadata
from ckptctl.formats.dcp.parse import parse_metadata
from ckptctl.formats.megatron.format import recognised
from ckptctl.formats.megatron.layout import TRACKER
from ckptctl.formats.megatron.reader import find_iteration
from ckptctl.io.storage import Storage


def join(base: str, rel: str) -> str:
    return f"{base}/{rel}" if base else rel


def read_metadata(storage: Storage, base: str) -> DcpMetadata:
    """``.metadata`` through the allow-list, checked, and every record inside its file."""
    metadata, short = read_metadata_and_lost(storage, base)
    where = storage.describe(join(base, METADATA_FILE))
    for name, (size, end) in sorted(short.items()):
        rel = join(base, name)
        if size is None:
            raise CheckpointNotFoundError(f"{storage.describe(rel)}: missing (named in {where})")
        raise CheckpointError(
            f"{storage.describe(rel)}: {size} bytes, but {METADATA_FILE} places records up "
            f"to byte {end}; the file is truncated"
        )
    return metadata


def read_metadata_and_lost(
    storage: Storage, base: str
) -> tuple[DcpMetadata, dict[str, tuple[int | None, int]]]:
    """``.metadata`` through the allow-list and checked, and the record files that are missing
    (size ``None``) or shorter than the records placed in them: ``name -> (size, needed)``."""
    where = storage.describe(join(base, METADATA_FILE))
    with storage.open_read(join(base, METADATA_FILE)) as f:
        raw = f.read()
    metadata = parse_metadata(raw, where)
    check_metadata(metadata, where)
    ends: dict[str, int] = {}
    for info in metadata.storage.values():
        storage.path(join(base, info.relative_path))  # refuses paths escaping the root
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    short: dict[str, tuple[int | None, int]] = {}
    for name, end in sorted(ends.items()):
        rel = join(base, name)
        if not storage.exists(rel):
            short[name] = (None, end)
        elif (size := storage.size(rel)) < end:
            short[name] = (size, end)
    return metadata, short


def locate(
    storage: Storage, names: frozenset[str], iteration: int | None
) -> tuple[str, int | None] | None:
    """The directory holding ``.metadata`` (the root, or a Megatron iteration directory named
    by the tracker or ``iteration``) and its iteration, or ``None`` if there is none."""
    if METADATA_FILE in names:
        return "", None
    if recognised(names) and (TRACKER in names or iteration is not None):
        rel, number = find_iteration(storage, iteration)
        if storage.exists(join(rel, METADATA_FILE)):
            return rel, number
    return None
