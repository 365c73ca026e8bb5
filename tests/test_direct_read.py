"""Local headers of a cold ``torch.save`` file are read past the page cache, so the source
stream that follows finds no cached pages to stop at. ``torch.load`` is the judge of the
bytes; ``mincore`` is the judge of what the page cache holds."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptctl.direct_read import BLOCK, PastCache
from ckptctl.formats.torchsave.archive import TorchZipReader
from ckptctl.formats.torchsave.refs import read_box, resolve
from tests.page_cache import evict, resident


@pytest.fixture()
def many_records(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Small records close together (their headers share a read) and large ones apart."""
    g = torch.Generator().manual_seed(3)
    sizes = [300_000 if i % 40 == 0 else 200 for i in range(200)]
    tensors = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    path = tmp_path / "shard.pt"
    torch.save(tensors, path)
    return path, tensors


def _reader(path: Path) -> TorchZipReader:
    return TorchZipReader(open(path, "rb"), str(path))  # the reader owns it


def _locate_all(reader: TorchZipReader, names: list[str]) -> None:
    for name in names:
        key = resolve(reader.tree, (name,)).storage.key
        with reader._lock:
            reader._storage_span(key)


def _reads_directly(path: Path) -> bool:
    """Whether the file system under ``path`` takes ``O_DIRECT`` reads (else headers are read
    through the cache, as they must be)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return PastCache(fd)._read_window(0, 1)
    finally:
        os.close(fd)


def test_locating_records_of_a_cold_file_caches_none_of_their_headers(many_records) -> None:
    path, tensors = many_records
    evict(path)
    if not _reads_directly(path):
        pytest.skip("this file system does not take O_DIRECT reads")
    reader = _reader(path)  # reads the zip directory and the pickle: those pages are cached
    before = resident(path)
    _locate_all(reader, list(tensors))
    after = resident(path)
    pages = enumerate(zip(before, after, strict=True))
    new = [page for page, (was, now) in pages if now and not was]
    assert new == [], f"{len(new)} pages came into the page cache while locating records"


def test_records_located_past_the_cache_read_as_torch_loads_them(many_records) -> None:
    path, tensors = many_records
    evict(path)
    reader = _reader(path)
    _locate_all(reader, list(tensors))
    for name, tensor in tensors.items():
        got = read_box(reader, (name,), (0,), tuple(tensor.shape))
        assert np.array_equal(np.asarray(got), tensor.numpy()), name


def test_without_direct_reads_records_are_located_through_the_cache(
    many_records, monkeypatch
) -> None:
    path, tensors = many_records
    monkeypatch.delattr(os, "O_DIRECT")
    evict(path)
    reader = _reader(path)
    for name, tensor in tensors.items():
        got = read_box(reader, (name,), (0,), tuple(tensor.shape))
        assert np.array_equal(np.asarray(got), tensor.numpy()), name


@pytest.mark.parametrize("cold", [True, False])
def test_past_cache_reads_equal_plain_reads(tmp_path: Path, cold: bool) -> None:
    path = tmp_path / "bytes.bin"
    path.write_bytes(os.urandom(5 * BLOCK + 123))
    if cold:
        evict(path)
    else:
        path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        reader = PastCache(fd)
        size = path.stat().st_size
        for offset, nbytes, through in [
            (0, 30, 0),
            (BLOCK - 10, 30, 0),  # across a block's end
            (3 * BLOCK, 30, size),  # taking in the rest of the file
            (3 * BLOCK + 100, 30, 0),  # from what that read kept
            (size - 10, 30, 0),  # past the end: fewer bytes
            (size + 5, 30, 0),  # wholly past the end: none
        ]:
            assert reader.read(offset, nbytes, through) == os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)
