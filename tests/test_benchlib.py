"""The benches' shared timing loop runs end to end: a bench that cannot run measures nothing.
(A loop variable once shadowed ``benchlib.attempt`` and every ``measure`` caller failed on its
first row; only ``bench_ab`` had been run.)"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"

pytestmark = pytest.mark.skipif(
    not Path("/usr/bin/time").exists() or shutil.which("sync") is None,
    reason="the benches time runs with /usr/bin/time",
)


@pytest.fixture()
def benchlib(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("benchlib", None)
    import benchlib

    monkeypatch.setattr(benchlib, "PRIME_BYTES", 16 << 20)  # prime, but only a little
    yield benchlib
    sys.modules.pop("benchlib", None)


def test_measure_times_every_run_and_keeps_only_what_it_is_told(benchlib, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x" * 300_000)
    (src / "b.bin").write_bytes(b"y" * 100_000)
    size = benchlib.du(src)
    first, second = tmp_path / "first", tmp_path / "second"
    runs = [
        ("cp -r", ["cp", "-r", str(src), str(first)], first),
        ("cp -r again", ["cp", "-r", str(src), str(second)], second),
    ]

    rows = benchlib.measure(runs, size, repeat=2, keep=[second])

    assert [row[0] for row in rows] == ["cp -r", "cp -r again"]
    for _, seconds, inner, written, rate, _, rss in rows:
        assert seconds > 0 and rate == pytest.approx(size / seconds)
        assert inner is None  # no --json: no time of its own to report
        assert written == size
        assert rss > 0
    assert rows[0][5] == 1.0
    assert not first.exists()  # removed after every attempt
    assert sorted(p.name for p in second.iterdir()) == ["a.bin", "b.bin"]  # the kept one


def test_attempt_starts_from_a_removed_output(benchlib, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale").write_text("from an earlier attempt")
    timing = benchlib.attempt(["mkdir", str(out)], out)  # fails if the output was left
    assert timing.seconds > 0 and out.is_dir() and not (out / "stale").exists()


def test_priming_covers_what_a_run_brings_into_memory(
    benchlib, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A run that needs more pages than ``PRIME_BYTES`` gets them primed (a 7.9 GB cold copy
    ran 2.5x slower past the primed 8 GiB); priming never reaches into the page cache."""
    if benchlib.free_memory() < 2 << 30:
        pytest.skip("priming leaves 1 GiB free: this needs more free memory than that")
    touched: list[tuple[int, Path]] = []
    monkeypatch.setattr(benchlib, "fill_page_cache", lambda n, where: touched.append((n, where)))
    benchlib.prime_memory(where=tmp_path)
    benchlib.prime_memory(need=64 << 20, where=tmp_path)
    benchlib.prime_memory(need=1 << 60)  # more than the machine has: what is free, less 1 GiB
    free = benchlib.free_memory()
    assert touched[:2] == [(16 << 20, tmp_path), (64 << 20, tmp_path)]
    assert touched[2][0] < free - (1 << 30) + (256 << 20)  # (free memory moves a little)
    assert touched[2][0] > 64 << 20


def test_priming_reads_through_the_page_cache_and_leaves_nothing(
    benchlib, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The primer's file is read whole and removed: nothing is left in the output's folder,
    which a bench then times the run's output in."""
    reads: list[int] = []
    real_preadv = os.preadv

    def counted(fd: int, buffers: list, offset: int) -> int:
        got = real_preadv(fd, buffers, offset)
        reads.append(got)
        return got

    monkeypatch.setattr(benchlib.os, "preadv", counted)
    benchlib.fill_page_cache((40 << 20) + 123, tmp_path)
    assert sum(reads) == (40 << 20) + 123
    assert list(tmp_path.iterdir()) == []


def test_each_side_of_an_ab_imports_its_own_checkout(
    benchlib, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started from this checkout's root, the old side must still run the old tree: ``python -m``
    puts the working directory first on ``sys.path`` unless told not to, and once made every A/B
    compare this checkout with itself."""
    other = tmp_path / "other"
    for package in ("ckptctl", "planners"):
        shutil.copytree(benchlib.ROOT / package, other / package)
    monkeypatch.chdir(benchlib.ROOT)
    assert benchlib.imported_checkout(benchlib.checkout_env(other)) == other.resolve()
    assert benchlib.imported_checkout(benchlib.checkout_env(benchlib.ROOT)) == benchlib.ROOT


def resident_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache: ``mincore`` of a private mapping of it (its pages
    untouched, so they are the file's own)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
    libc = ctypes.CDLL(None, use_errno=True)
    with path.open("rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as view:
        start = ctypes.c_char.from_buffer(view)
        failed = libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vec)
        del start  # the mapping cannot close while a ctypes object holds it
    assert failed == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def test_a_cold_source_start_evicts_the_source_and_nothing_else(benchlib, tmp_path: Path) -> None:
    """``--cold-source``: the source's pages leave the page cache (any user can do it), the
    other files' pages stay."""
    source, other = tmp_path / "src", tmp_path / "other.bin"
    (source / "sub").mkdir(parents=True)
    for path in (source / "a.bin", source / "sub" / "b.bin", other):
        path.write_bytes(os.urandom(4 << 20))
    benchlib.read_all(tmp_path)
    before = [resident_pages(p) for p in (source / "a.bin", source / "sub" / "b.bin", other)]
    assert min(before) > 0
    benchlib.Cold(source, everything=False).start()
    assert resident_pages(source / "a.bin") == resident_pages(source / "sub" / "b.bin") == 0
    assert resident_pages(other) == before[2]


def test_attempt_refuses_a_file_system_too_full_to_time(benchlib, tmp_path: Path) -> None:
    """A nearly full disk times its allocator: the run is refused, naming where and how much
    to free, before anything runs."""
    out = tmp_path / "not-yet" / "out"
    free = shutil.disk_usage(tmp_path).free
    marker = tmp_path / "ran"
    cmd = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    benchlib.FREE_MARGIN = free + (1 << 30)
    with pytest.raises(SystemExit, match=rf"{tmp_path}: .* GB free.*free at least"):
        benchlib.attempt(cmd, out, prime=False)
    assert not marker.exists()
    benchlib.FREE_MARGIN = 0
    benchlib.attempt(cmd, out, prime=False)
    assert marker.exists()


def test_the_runner_keeps_every_table_a_suite_prints_and_renders_it_again() -> None:
    import importlib

    runner = importlib.import_module("bench.__main__")
    printed = (
        "generating...\nsource: 1.0 GB of something\n\n| run | seconds |\n|---|---:|\n"
        "| cp -r | 2.00 |\n| ckptctl | 1.00 |\n\nfootnote\n| other | x |\n|---|---|\n| a | b |\n"
    )
    tables = runner.tables_of(printed)
    assert [t["caption"] for t in tables] == ["source: 1.0 GB of something", "footnote"]
    assert tables[0]["header"] == ["run", "seconds"]
    assert tables[0]["rows"] == [["cp -r", "2.00"], ["ckptctl", "1.00"]]
    result = {"suite": "x", "command": "python bench/bench_x.py", "started": "2026-11-29T00:00:00Z"}
    document = {"machine": {"cpus": 2}, "results": [{**result, "tables": tables, "output": ""}]}
    rendered = runner.render(document)
    assert "| cp -r | 2.00 |" in rendered and "| a | b |" in rendered
    assert runner.tables_of(rendered)[0]["rows"] == tables[0]["rows"]
    assert set(runner.suites()) >= {"large", "convert", "s3", "workers"}
