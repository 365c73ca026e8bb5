"""Several target files written at once (``execute(files_at_once=...)``, ``--files-at-once``; by
default one per core to a local disk, ``REMOTE_FILES_AT_ONCE`` to an object store): the same
bytes, counts and listing as one writer; two threads really write; a failure or an interrupt in
one writer stops the others, reports the first cause, and leaves nothing marked complete and no
partial file behind."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptctl import synth
from ckptctl.formats import registry
from ckptctl.io.storage import Storage
from tests.io import test_s3

s3_endpoint, bucket = test_s3.s3_endpoint, test_s3.bucket  # moto's S3 server fixtures


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = synth.tiny_llama_config(
        num_layers=4, hidden_size=128, intermediate_size=352, num_heads=8, num_kv_heads=4
    )
    model = synth.make_model(config, seed=0)
    out = tmp_path_factory.mktemp("files-at-once") / "ck"
    synth.write_megatron(model, synth.adam_step(model, seed=0), out, tp=2, pp=2)
    return out


def tree(root: Path) -> dict[str, str]:
    """Every file's digest; the manifest's without the plan fingerprint (it names the target
    directory)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.name == "ckptctl.manifest.json":
                body = json.loads(data)
                body.pop("plan_fingerprint")
                data = json.dumps(body, sort_keys=True).encode()
            out[str(p.relative_to(root))] = hashlib.sha256(data).hexdigest()
    return out


@contextlib.contextmanager
def writing_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Which thread opened each file for writing."""
    opened: dict[str, int] = {}
    real = Storage.open_write

    @contextlib.contextmanager
    def spy(self: Storage, rel: str, digest: Any = None) -> Iterator[Any]:
        opened[rel] = threading.get_ident()
        with real(self, rel, digest) as out:
            yield out

    with monkeypatch.context() as patch:
        patch.setattr(Storage, "open_write", spy)
        yield opened


JOBS = {
    "tp1-pp4": ("reshard", "--tp", "1", "--pp", "4"),
    "tp4-pp1": ("reshard", "--tp", "4", "--pp", "1", "--memory-budget", "1MiB"),
    "torch_dist": ("reshard", "--tp", "2", "--pp", "1", "--format", "torch_dist"),
    "universal": ("consolidate", "--format", "deepspeed-universal"),
}
FIGURES = ("files", "bytes_written", "bytes_read")
"""(Not ``read_requests``: writers share the memory budget, so a tensor built in memory is read
in bands half as large, twice as many.)"""


@pytest.mark.parametrize("job", list(JOBS))
def test_files_written_at_once_are_what_one_writer_writes(
    job: str, megatron: Path, tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    command, *options = JOBS[job]
    with writing_threads(monkeypatch) as opened:
        report = cli.json(command, megatron, tmp_path / "at-once", *options, "--files-at-once", "2")
    data_files = [f for f in report["files"] if f != "ckptctl.manifest.json"]
    assert len({opened[f] for f in data_files if f in opened}) == 2  # two writers wrote
    with monkeypatch.context() as patch, writing_threads(patch) as alone:
        one = cli.json(command, megatron, tmp_path / "one", *options, "--files-at-once", "1")
    assert len(set(alone.values())) == 1
    assert tree(tmp_path / "at-once") == tree(tmp_path / "one")
    for figure in (*FIGURES, "bytes_copied_without_passing_through"):
        assert report[figure] == one[figure], figure
    cli("verify", tmp_path / "at-once")


def test_files_at_once_to_an_object_store_are_what_one_writer_writes(
    bucket: str, megatron: Path, tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--files-at-once`` counts for an object-store target too (its default is
    ``REMOTE_FILES_AT_ONCE``, uploads being bound by the link rather than the cores), and the
    files share the parts in flight that two files had, so upload memory does not grow."""
    from ckptctl.io import multipart, storage
    from ckptctl.settings import StorageConfig

    options = ("--tp", "1", "--pp", "4")
    parts: list[int] = []  # each upload's parts in flight

    class Counted(multipart.MultipartUpload):
        def __init__(self, fs: Any, path: str, part_size: int, parallel: int) -> None:
            parts.append(parallel)
            super().__init__(fs, path, part_size, parallel)

    monkeypatch.setattr(storage, "MultipartUpload", Counted)
    with writing_threads(monkeypatch) as opened:
        cli("reshard", megatron, f"{bucket}/at-once", *options, "--files-at-once", "3")
    # Three files share the parts (and their memory) that two files had at once.
    configured = StorageConfig().upload_parallel
    assert parts and 3 * max(parts) <= 2 * configured
    parts.clear()
    with monkeypatch.context() as patch, writing_threads(patch) as alone:
        cli("reshard", megatron, f"{bucket}/one", *options, "--files-at-once", "1")
    assert parts and set(parts) == {configured}
    data = [f for f in opened if f.endswith(".pt")]
    assert len(data) == 4 and len({opened[f] for f in data}) == 3  # three writers wrote
    assert len({alone[f] for f in data}) == 1
    assert objects(f"{bucket}/at-once") == objects(f"{bucket}/one")


def objects(prefix: str) -> dict[str, str]:
    """Every object's digest under ``prefix`` but the manifest (it names its target)."""
    import s3fs

    store = s3fs.S3FileSystem(skip_instance_cache=True)
    root = prefix.removeprefix("s3://")
    return {
        key[len(root) :]: hashlib.sha256(store.cat_file(key)).hexdigest()
        for key in store.find(root)
        if not key.endswith("ckptctl.manifest.json")
    }


def _corrupt_largest_record(path: Path) -> None:
    import zipfile

    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        info = max(zf.infolist(), key=lambda i: i.file_size)
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
    start = info.header_offset + 30 + name_len + extra_len
    raw = bytearray(path.read_bytes())
    raw[start + info.file_size // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def test_a_failing_file_stops_the_job_with_its_own_error(
    megatron: Path, tmp_path: Path, cli
) -> None:
    """One writer's file fails its source's CRC-32 check: that error (not the other writer's
    stop) is reported, nothing is marked complete, and no partial file is left."""
    src = Path(shutil.copytree(megatron, tmp_path / "src"))
    _corrupt_largest_record(src / "iter_0000001/mp_rank_00_000/model_optim_rng.pt")
    # (pipeline stages split, tensor-parallel shards kept: whole records move, CRC-checked)
    result = cli("reshard", src, tmp_path / "out", "--tp", "2", "--pp", "4", code=3)
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert "fails its CRC-32 check" in line and "mp_rank_00_000" in line
    out = tmp_path / "out"
    assert not (out / "ckptctl.manifest.json").exists()
    assert not list(out.rglob("*.partial"))


def test_an_interrupt_stops_the_other_writers_at_their_next_tensor(
    megatron: Path, tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C reaches the calling thread only: the helper writing another file stops at its
    next tensor and takes no further file; the job exits 130 with nothing complete."""
    _, real = registry.writer_for("megatron-rank")
    helper_started = threading.Event()
    caller = threading.get_ident()

    def write(job: Any, file: Any, out: Any) -> None:
        if threading.get_ident() == caller:
            assert helper_started.wait(30)
            raise KeyboardInterrupt
        helper_started.set()
        real(job, file, out)

    monkeypatch.setattr(registry, "writer_for", lambda k: (None, write))
    with writing_threads(monkeypatch) as opened:
        result = cli("reshard", megatron, tmp_path / "out", "--tp", "1", "--pp", "4", code=130)
    assert "interrupted" in result.stderr
    rank_files = [f for f in opened if f.endswith(".pt")]
    assert len(rank_files) == 2, rank_files  # the caller's and the helper's first: no more
    out = tmp_path / "out"
    assert not (out / "ckptctl.manifest.json").exists()
    assert not list(out.rglob("*.pt")) and not list(out.rglob("*.partial"))


@pytest.mark.parametrize("flag", ["--read-parallel", "--files-at-once"])
def test_a_count_below_one_is_refused_by_name(flag: str, megatron: Path, tmp_path: Path, cli):
    result = cli("reshard", megatron, tmp_path / "out", "--tp", "1", flag, "0", code=2)
    assert f"{flag} 0: must be at least 1" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_the_defaults_follow_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptctl import settings

    monkeypatch.setattr(settings, "cores", lambda: 64)
    assert settings.default_files_at_once() == settings.MOST_AT_ONCE
    assert settings.default_read_parallel(local=True) == settings.MOST_AT_ONCE
    assert settings.default_read_parallel(local=False) == settings.REMOTE_READ_PARALLEL
    # An object store's uploads are bound by the link, not the cores.
    assert settings.default_files_at_once(local=False) == settings.REMOTE_FILES_AT_ONCE
    monkeypatch.setattr(settings, "cores", lambda: 1)
    assert settings.default_files_at_once() == 2 and settings.default_read_parallel(True) == 2
