"""Local paths go through the OS instead of fsspec (``ckptctl.io.local_files``); fsspec's own
LocalFileSystem is the judge: the same root for every spelling of a URL, and the same answers
to every call ``Storage`` makes, on a real tree with a linked directory."""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest

from ckptctl.io.local_files import LocalFiles, local_root, protocol_of
from ckptctl.io.storage import Storage


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "ckpt"
    (root / "iter_1" / "mp_rank_00").mkdir(parents=True)
    (root / "iter_1" / "mp_rank_00" / "model.pt").write_bytes(bytes(range(256)) * 4)
    (root / "latest").write_text("1")
    (root / ".hidden").write_text("x")
    (root / "empty").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "shard.bin").write_bytes(b"abc")
    os.symlink(elsewhere, root / "linked")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    return root


SPELLINGS = [
    "ckpt",
    "./ckpt",
    "ckpt/",
    "ckpt/iter_1/../iter_1",
    "~/ckpt",
    ".",
    "{abs}",
    "{abs}/",
    "file://{abs}",
    "local://{abs}",
    "file:{abs}",
]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_local_url_names_the_root_fsspec_names(spelling: str, tree: Path) -> None:
    url = spelling.format(abs=tree)
    _, theirs = fsspec.core.url_to_fs(url)
    assert protocol_of(url) == fsspec.utils.get_protocol(url)
    assert local_root(url) == (theirs.rstrip("/") or "/")
    assert Storage(url).root == local_root(url)


@pytest.mark.parametrize(
    "url", ["s3://bucket/key", "memory://x", "simplecache::file:///tmp/x", "gs://b/k"]
)
def test_other_urls_are_left_to_fsspec(url: str) -> None:
    assert protocol_of(url) == fsspec.utils.get_protocol(url)
    assert local_root(url) is None


def test_every_call_storage_makes_answers_as_fsspec_does(tree: Path) -> None:
    ours, theirs = LocalFiles(), fsspec.filesystem("file")
    root = str(tree)
    paths = [
        root,
        f"{root}/latest",
        f"{root}/iter_1",
        f"{root}/iter_1/mp_rank_00/model.pt",
        f"{root}/linked",
        f"{root}/empty",
        f"{root}/missing",
    ]
    for path in paths:
        assert ours.exists(path) == theirs.exists(path), path
        assert ours.isdir(path) == theirs.isdir(path), path
        if not theirs.exists(path):
            for call in (ours.size, ours.ls, ours.find):
                with pytest.raises(FileNotFoundError):
                    call(path)
            continue
        if not theirs.isdir(path):
            assert ours.size(path) == theirs.size(path)
            assert ours.cat_file(path) == theirs.cat_file(path)
            assert ours.cat_file(path, start=3, end=77) == theirs.cat_file(path, start=3, end=77)
        assert sorted(ours.ls(path)) == sorted(theirs.ls(path, detail=False)), path
        assert ours.find(path) == theirs.find(path), path
    with ours.open(f"{root}/iter_1/mp_rank_00/model.pt") as mine:
        mine.seek(1000)
        assert mine.read() == theirs.cat_file(f"{root}/iter_1/mp_rank_00/model.pt", start=1000)


def test_removal(tree: Path) -> None:
    files = LocalFiles()
    (tree / "new" / "dir").mkdir(parents=True)
    (tree / "new" / "dir" / "x.bin").write_bytes(b"1")
    files.rm(f"{tree}/new/dir/x.bin")
    assert not (tree / "new" / "dir" / "x.bin").exists()
    with pytest.raises(IsADirectoryError):
        files.rm(f"{tree}/new")
    files.rm(f"{tree}/new", recursive=True)
    assert not (tree / "new").exists()
    files.rm(f"{tree}/linked", recursive=True)  # the link goes, not what it points at
    assert not (tree / "linked").exists() and (tree.parent / "elsewhere" / "shard.bin").exists()
    with pytest.raises(FileNotFoundError):
        files.rm(f"{tree}/missing")
