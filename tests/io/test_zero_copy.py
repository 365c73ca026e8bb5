"""Bytes that do not change move by the kernel's copy (``ckptctl/io/runs.py``): every output is
byte for byte what the in-memory path writes, the copy is counted in ``--json``, a kernel that
cannot copy falls back cleanly, a corrupt or truncated source is refused, and every file is on
the device before the manifest vouches for it."""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from ckptctl import synth
from ckptctl.io import storage
from ckptctl.pipeline import assembler
from ckptctl.pipeline.assembler import Assembler
from ckptctl.pipeline.job_report import Sources


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Wide enough that the largest tensors are runs of several pages.
    config = synth.tiny_llama_config(
        num_layers=4, hidden_size=128, intermediate_size=352, num_heads=8, num_kv_heads=4
    )
    model = synth.make_model(config, seed=0)
    out = tmp_path_factory.mktemp("zero-copy") / "ck"
    synth.write_megatron(model, synth.adam_step(model, seed=0), out, tp=2, pp=2)
    return out


def tree(root: Path) -> dict[str, str]:
    """Every file's digest; the manifest's without the plan fingerprint (it names the
    target directory)."""
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


def in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor assembled in memory, as before kernel copies (and fills packed without
    numpy) existed."""
    monkeypatch.setattr(Assembler, "_runs_of", lambda self, write: None)
    monkeypatch.setattr(assembler, "_fill_element", lambda write: None)


JOBS = {
    "hf": ("consolidate", "--format", "hf"),
    "megatron": ("consolidate", "--format", "megatron"),
    "universal": ("consolidate", "--format", "deepspeed-universal"),
    "torch_dist": ("reshard", "--tp", "2", "--pp", "1", "--format", "torch_dist"),
    "tp2-pp4": ("reshard", "--tp", "2", "--pp", "4"),
    "tp1-pp4": ("reshard", "--tp", "1", "--pp", "4"),
    "tp4-pp1": ("reshard", "--tp", "4", "--pp", "1"),
}


def kernel_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs move by ``copy_file_range`` whatever file system the test's files are on (on
    ext4, as this project's machines have, they are otherwise written from mapped pages)."""
    monkeypatch.setattr(storage, "kernel_copy_pays", lambda fd: True)


@pytest.mark.parametrize("how", ["copy_file_range", "as the file system prefers"])
@pytest.mark.parametrize("job", list(JOBS))
def test_kernel_copies_write_the_same_bytes_as_memory(
    job: str, how: str, megatron: Path, tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    command, *options = JOBS[job]
    with monkeypatch.context() as patch:
        if how == "copy_file_range":
            kernel_copies(patch)
        report = cli.json(command, megatron, tmp_path / "kernel", *options)
    moved = report["bytes_copied_without_passing_through"]
    assert len(moved) == 1, moved
    if how == "copy_file_range":
        assert set(moved) == {"copy_file_range"}
    copied = sum(moved.values())
    # Merging or splitting along a row-parallel dimension interleaves rows: those tensors are
    # assembled in memory. Tensors moving whole between pipeline stages are runs.
    share = {"tp4-pp1": 0.2, "megatron": 0.3, "tp1-pp4": 0.3, "tp2-pp4": 0.8}.get(job, 0.5)
    assert copied > share * report["bytes_written"], report["bytes_copied_without_passing_through"]
    with monkeypatch.context() as patch:
        in_memory(patch)
        plain = cli.json(command, megatron, tmp_path / "memory", *options)
    assert plain["bytes_copied_without_passing_through"] == {}
    assert tree(tmp_path / "kernel") == tree(tmp_path / "memory")
    cli("verify", tmp_path / "kernel")


@pytest.mark.parametrize(
    ("shape", "dtype", "fill"),
    [((), "float32", 3.0), ((1000, 3), "bfloat16", -2.5), ((7, 5, 3), "int64", 1.0)],
)
def test_a_fill_packed_without_numpy_is_the_array_numpy_builds(
    shape: tuple[int, ...], dtype: str, fill: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor no source covers is written from one packed element, a band's worth at a time
    (here bands of 1000 bytes: several, and a short last one): the same bytes and checksum
    as the array numpy fills."""
    from math import prod

    from ckptctl.model.plan import TensorWrite
    from ckptctl.pipeline.job_report import Report
    from ckptctl.progress import NoProgress

    numel = prod(shape)
    write = TensorWrite(
        key=("t",), canonical="t", shape=shape, dtype=dtype, copies=(), padding=numel, fill=fill
    )
    seen = {}
    for packed in (True, False):
        with monkeypatch.context() as patch:
            if not packed:
                patch.setattr(assembler, "_fill_element", lambda write: None)
            report = Report()
            build = Assembler((), Sources(None), report, NoProgress(), budget=8000)
            data = b"".join(bytes(chunk) for chunk in build.chunks(write, "f"))  # type: ignore[arg-type]
            seen[packed] = (data, report.tensor_checksums, report.bytes_written)
    assert seen[True] == seen[False]
    assert len(seen[True][0]) == numel * {"float32": 4, "bfloat16": 2, "int64": 8}[dtype]


def test_other_sources_move_by_kernel_copy_too(megatron: Path, tmp_path: Path, cli) -> None:
    """safetensors tensors and DCP records (each a torch.save archive inside a .distcp file)
    are runs of their files as well."""
    cli("consolidate", megatron, tmp_path / "hf", "--format", "hf")
    cli("reshard", megatron, tmp_path / "dcp", "--tp", "1", "--pp", "1", "--format", "torch_dist")
    for source, fmt in (("hf", "megatron"), ("dcp", "torch")):
        report = cli.json(
            "consolidate", tmp_path / source, tmp_path / f"{source}-out", "--format", fmt
        )
        assert sum(report["bytes_copied_without_passing_through"].values()) > 0
        cli("verify", tmp_path / f"{source}-out", "--against", tmp_path / source)


def test_a_kernel_that_cannot_copy_falls_back_to_writing(
    megatron: Path, tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel_copies(monkeypatch)
    cli("consolidate", megatron, tmp_path / "kernel", "--format", "megatron")

    def refuse(*args: object) -> int:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    report = cli.json("consolidate", megatron, tmp_path / "refused", "--format", "megatron")
    assert report["bytes_copied_without_passing_through"] == {}
    assert tree(tmp_path / "refused") == tree(tmp_path / "kernel")


def _largest_record(path: Path) -> tuple[int, int]:
    """Byte span of the largest storage record's data in a torch.save file."""
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        info = max(zf.infolist(), key=lambda i: i.file_size)
        f.seek(info.header_offset + 26)
        name_len, extra_len = (
            int.from_bytes(f.read(2), "little"),
            int.from_bytes(f.read(2), "little"),
        )
    start = info.header_offset + 30 + name_len + extra_len
    return start, start + info.file_size


@pytest.mark.parametrize("how", ["copy_file_range", "as the file system prefers"])
def test_a_corrupt_record_moved_whole_is_refused(
    how: str, megatron: Path, tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that is a whole stored record is checked against the record's CRC-32 as it is
    copied: a flipped byte fails the job, and nothing is marked complete."""
    if how == "copy_file_range":
        kernel_copies(monkeypatch)
    src = Path(shutil.copytree(megatron, tmp_path / "src"))
    path = src / "iter_0000001/mp_rank_00_000/model_optim_rng.pt"
    start, end = _largest_record(path)
    raw = bytearray(path.read_bytes())
    raw[(start + end) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    result = cli("reshard", src, tmp_path / "out", "--tp", "2", "--pp", "1", code=3)
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert "fails its CRC-32 check" in line and "mp_rank_00_000" in line
    assert not (tmp_path / "out/ckptctl.manifest.json").exists()


def test_a_truncated_safetensors_source_is_an_error_not_a_crash(
    megatron: Path, tmp_path: Path, cli
) -> None:
    """Mapped pages past a file's end would kill the process (SIGBUS): a source shorter than
    its header says is refused by name first."""
    cli("consolidate", megatron, tmp_path / "hf", "--format", "hf")
    (shard,) = (tmp_path / "hf").glob("*.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 4096)
    result = cli("consolidate", tmp_path / "hf", tmp_path / "out", "--format", "megatron", code=3)
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert shard.name in line and "truncated" in line
    assert not (tmp_path / "out/ckptctl.manifest.json").exists()


def test_every_file_is_flushed_to_the_device_before_the_manifest(
    megatron: Path, tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    flushed: list[str] = []
    real = os.fdatasync

    def record(fd: int) -> None:
        real(fd)
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))

    from ckptctl.checksums import manifest

    real_write = manifest.write_manifest

    def check_then_write(target, *args, **kwargs):  # type: ignore[no-untyped-def]
        written = {str(p) for p in (tmp_path / "out").rglob("*") if p.is_file()}
        written.discard(str(tmp_path / "out" / "ckptctl.incomplete"))
        written.discard(str(tmp_path / "out" / "ckptctl.lock"))  # not the checkpoint's
        assert written and written <= set(flushed), sorted(written - set(flushed))
        return real_write(target, *args, **kwargs)

    monkeypatch.setattr(os, "fdatasync", record)
    monkeypatch.setattr("ckptctl.pipeline.execute.write_manifest", check_then_write)
    cli("reshard", megatron, tmp_path / "out", "--tp", "1", "--pp", "4")
    assert (tmp_path / "out/ckptctl.manifest.json").exists()


def test_a_run_past_the_end_of_its_file_is_refused_by_name(tmp_path: Path) -> None:
    import io

    from ckptctl.errors import CheckpointError
    from ckptctl.io.runs import Run

    path = tmp_path / "short.bin"
    data = os.urandom(10_000)
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=r"short\.bin: ends at byte 10000.*truncated"):
        Run(str(path), 8192, 4096, "float32").write_to(io.BytesIO())
    out = io.BytesIO()
    Run(str(path), 5000, 5000, "float32").write_to(out)  # a run at an unaligned offset
    assert out.getvalue() == data[5000:]


def test_writeback_of_a_large_output_starts_while_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel is asked to write each step of a local file out as it is written (not only
    at the final flush), over the whole file with no gaps; the calls reach the real
    ``sync_file_range`` and succeed."""
    from ckptctl.io import storage, writeback

    if not writeback.available():
        pytest.skip("no sync_file_range on this system")
    real = writeback._libc_sync_file_range()
    calls: list[tuple[int, int, int]] = []

    def spy(fd: int, offset: int, nbytes: int, flags: int) -> int:
        result = real(fd, offset, nbytes, flags)
        calls.append((offset, nbytes, result))
        return result

    monkeypatch.setattr(writeback, "_libc_sync_file_range", lambda: spy)
    monkeypatch.setattr(storage, "WRITEBACK_STEP", 1 << 20)
    block = os.urandom(300_000)
    with storage.Storage(str(tmp_path)).open_write("big.bin") as f:
        for _ in range(20):
            f.write(block)
    writeback.wait_for_requests()
    assert (tmp_path / "big.bin").stat().st_size == 20 * len(block)
    ranged = [(offset, nbytes) for offset, nbytes, _ in calls if nbytes]
    assert len(ranged) >= 5 and all(result == 0 for *_, result in calls)
    assert ranged[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(ranged))
    assert calls[-1][:2] == (0, 0)  # the whole file when it closes


def test_writeback_requests_behind_a_slow_device_are_bounded_and_leave_no_gaps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer far ahead of the device does not queue a request (and a duplicate descriptor)
    per step: past ``MAX_PENDING`` they are declined, and the next request covers the
    declined range, so the ranges handed to the kernel still tile the file."""
    import time

    from ckptctl.io import storage, writeback

    if not writeback.available():
        pytest.skip("no sync_file_range on this system")
    real = writeback._libc_sync_file_range()
    calls: list[tuple[int, int]] = []

    def slow(fd: int, offset: int, nbytes: int, flags: int) -> int:
        time.sleep(0.05)
        calls.append((offset, nbytes))
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(writeback, "_libc_sync_file_range", lambda: slow)
    monkeypatch.setattr(writeback, "MAX_PENDING", 1)
    monkeypatch.setattr(storage, "WRITEBACK_STEP", 1 << 20)
    descriptors = len(os.listdir("/proc/self/fd"))
    block = os.urandom(1 << 20)
    with storage.Storage(str(tmp_path)).open_write("big.bin") as f:
        for _ in range(40):
            f.write(block)
    writeback.wait_for_requests()
    ranged = [c for c in calls if c[1]]
    assert 1 <= len(ranged) < 20, "every step was queued behind the slow device"
    assert ranged[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(ranged))
    assert len(os.listdir("/proc/self/fd")) <= descriptors


def test_the_file_system_is_the_one_statfs_names(tmp_path: Path) -> None:
    """The magic number read through ``fstatfs`` is the one coreutils' ``stat -f`` prints,
    and a file system that copies through a pipe (ext4) takes mapped-page writes."""
    import subprocess

    from ckptctl.io import filesystems

    for folder in (tmp_path, Path("/dev/shm"), Path("/proc")):
        if not folder.is_dir():
            continue
        told = subprocess.run(
            ["stat", "-f", "-c", "%t", str(folder)], capture_output=True, text=True, check=True
        ).stdout
        fd = os.open(folder, os.O_RDONLY)
        try:
            magic = filesystems.file_system_type(fd)
            assert magic == int(told, 16), folder
            assert filesystems.kernel_copy_pays(fd) == (magic != 0xEF53)
        finally:
            os.close(fd)


def test_a_runs_pages_are_asked_of_the_disk_ahead_of_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every byte of a run written from mapped pages is asked for (``WILLNEED``) once, in
    order, before the window holding it is handed out, and never more than ``READ_AHEAD``
    ahead of it."""
    from ckptctl.io import runs

    path = tmp_path / "src.bin"
    path.write_bytes(os.urandom(10 << 20))
    monkeypatch.setattr(runs, "WINDOW", 1 << 20)
    monkeypatch.setattr(runs, "READ_AHEAD", 3 << 20)
    asked: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def record(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_WILLNEED
        asked.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    run = runs.Run(str(path), 4096, (10 << 20) - 8192, "uint8")
    seen = bytearray()
    for view in run.views():
        start = run.offset + len(seen)
        frontier = asked[-1][0] + asked[-1][1]
        assert start + len(view) <= frontier <= start + (3 << 20)
        seen += view
    assert bytes(seen) == path.read_bytes()[4096:-4096]
    assert asked[0][0] == run.offset
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(asked))
    assert asked[-1][0] + asked[-1][1] == run.offset + run.nbytes


@pytest.mark.parametrize("corrupt", [None, 0, 1])
def test_whole_records_appended_to_one_entry_take_one_crc_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, corrupt: int | None
) -> None:
    """A tensor-parallel merge appends whole source records to one entry: each is checked
    against its own CRC-32 as it passes, and the entry's follows from theirs, so every byte
    goes through CRC-32 once. zipfile judges the entry; a flipped byte in either record fails."""
    import zlib

    from ckptctl.errors import CheckpointError
    from ckptctl.formats.torchsave import zip_writer
    from ckptctl.io import runs

    halves = [os.urandom(3 << 20), os.urandom((2 << 20) + 12)]
    path = tmp_path / "shards.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for i, data in enumerate(halves):
            zf.writestr(f"archive/data/{i}", data)
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
    spans = []
    raw = bytearray(path.read_bytes())
    for info, data in zip(infos, halves, strict=True):
        start = raw.index(data, info.header_offset)
        spans.append((start, len(data), info.CRC))
    if corrupt is not None:
        raw[spans[corrupt][0] + 1000] ^= 0x04
        path.write_bytes(bytes(raw))
    passed = [0]
    real = runs.crc32

    def counted(data: memoryview, value: int = 0) -> int:
        passed[0] += len(data)
        return real(data, value)

    monkeypatch.setattr(runs, "crc32", counted)
    monkeypatch.setattr(zip_writer, "crc32", counted)
    monkeypatch.setattr(zipfile, "crc32", counted)
    total = sum(len(d) for d in halves)
    slot = zip_writer.TensorSlot("0", "uint8", (total,))
    out = tmp_path / "merged.pt"

    def produce(_: object) -> list[runs.Run]:
        return [runs.Run(str(path), start, n, "uint8", crc) for start, n, crc in spans]

    with open(out, "wb") as f:
        if corrupt is not None:
            with pytest.raises(CheckpointError, match="fails its CRC-32 check"):
                zip_writer.write_torch_zip(f, slot, [slot], produce)
            return
        zip_writer.write_torch_zip(f, slot, [slot], produce)
    monkeypatch.undo()
    assert total <= passed[0] < total + 4096  # the records once (and a few small entries)
    with zipfile.ZipFile(out) as zf:
        assert zf.testzip() is None
        entry = next(i for i in zf.infolist() if i.filename.endswith("data/0"))
        assert zlib.crc32(b"".join(halves)) == entry.CRC
        assert zf.read(entry) == b"".join(halves)
