"""Boxes of tensors that do not lie as one run in a local ``torch.save`` file (a column half of a
row-parallel shard, a stored transposed view) or that go into a box of a band are copied once
from the file's mapped pages. torch's own files and slicing are the judge."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptctl.arrays import words
from ckptctl.errors import CheckpointError
from ckptctl.formats.torchsave.archive import TorchZipReader
from ckptctl.formats.torchsave.refs import resolve

BOXES = {
    "fp32": [((0, 0), (64, 48)), ((0, 48), (64, 48)), ((5, 7), (30, 33))],
    "bf16": [((0, 48), (64, 48)), ((63, 0), (1, 96))],
    "transposed": [((0, 0), (96, 64)), ((10, 32), (20, 32))],
    "cube": [((1, 0, 2), (2, 5, 3))],
}


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(64, 96, generator=g)
    return {
        "fp32": base,
        "bf16": base.to(torch.bfloat16),
        "transposed": torch.randn(64, 96, generator=g).t(),  # saved with strides (1, 96)
        "cube": torch.arange(4 * 5 * 6, dtype=torch.int64).reshape(4, 5, 6),
    }


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy() if t.dim() else t.view(torch.uint8).numpy()


def _reader(path: Path) -> TorchZipReader:
    return TorchZipReader(open(path, "rb"), str(path))  # the reader owns it


@pytest.fixture()
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = _tensors()
    path = tmp_path / "shard.pt"
    torch.save(tensors, path)
    return path, tensors


def test_strided_boxes_from_mapped_pages_equal_torchs_slices(saved) -> None:
    path, tensors = saved
    reader = _reader(path)
    for name, boxes in BOXES.items():
        ref = resolve(reader.tree, (name,))
        for offsets, sizes in boxes:
            expected = tensors[name][
                tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
            ]
            got = reader.read(ref, offsets, sizes)
            assert got.flags.c_contiguous and got.shape == tuple(sizes)
            np.testing.assert_array_equal(
                words(got).view(np.uint8).reshape(-1), _bytes(expected).reshape(-1)
            )
            # A box of a band: every other column of a wider array, so never contiguous.
            band = np.zeros((*sizes[:-1], 2 * sizes[-1]), got.dtype)
            into = band[..., ::2]
            assert reader.read(ref, offsets, sizes, into) is into  # went straight in
            np.testing.assert_array_equal(words(into), words(got))
            assert not words(band[..., 1::2]).any()  # and nowhere else


def test_a_file_that_shrank_under_a_mapped_read_is_refused_not_a_crash(saved) -> None:
    path, _ = saved
    reader = _reader(path)
    ref = resolve(reader.tree, ("fp32",))
    reader.read(ref, (0, 0), (64, 48))  # the record is located while the file is whole
    os.truncate(path, 2000)
    with pytest.raises(
        CheckpointError, match=r"shard\.pt: ends before the bytes of storage record"
    ):
        reader.read(ref, (0, 48), (64, 48))


def test_a_corrupt_record_read_whole_through_its_map_fails_its_crc(saved) -> None:
    path, tensors = saved
    data = bytearray(path.read_bytes())
    stored = tensors["transposed"].t().contiguous().view(torch.uint8).numpy().tobytes()
    at = data.find(stored)
    assert at > 0 and data.find(stored, at + 1) < 0
    data[at + 1000] ^= 0x40
    path.write_bytes(bytes(data))
    reader = _reader(path)
    ref = resolve(reader.tree, ("transposed",))
    reader.read(ref, (10, 32), (20, 32))  # part of the record: not checkable, and not checked
    with pytest.raises(CheckpointError, match="fails its CRC-32 check"):
        reader.read(ref, (0, 0), (96, 64))  # all of it, in its stored (transposed) layout
