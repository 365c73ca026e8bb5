"""A conversion's local source streams into the page cache from the process's start
(``read_early``), chosen from the command line before the CLI is imported (``launch``). The
page cache is the judge (``mincore``)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptctl import import_prefetch, read_early
from ckptctl.cli.launch import early_source, reads_whole_source
from tests.page_cache import cold_file, evict, resident

MiB = 1 << 20


def _finish() -> None:
    thread = read_early._thread
    assert thread is not None
    thread.join(timeout=30)
    assert not thread.is_alive()
    read_early.stop()


def test_every_file_of_the_source_is_read_and_links_out_of_it_are_not(tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    (source / "iter_1" / "mp_rank_00").mkdir(parents=True)
    inside = cold_file(source / "iter_1" / "mp_rank_00", 6 * MiB, "model.pt")
    top = cold_file(source, MiB, "latest.txt")
    outside = cold_file(tmp_path, 4 * MiB, "elsewhere.bin")
    (source / "link.bin").symlink_to(outside)
    read_early.start(str(source))
    _finish()
    assert all(resident(inside)) and all(resident(top))
    assert not any(resident(outside))


def test_a_source_over_half_the_free_memory_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = cold_file(tmp_path, 4 * MiB)
    monkeypatch.setattr(read_early, "available_memory", lambda: 7 * MiB)
    read_early.start(str(tmp_path))
    _finish()
    assert not any(resident(path))


def test_stop_ends_the_reading_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(read_early, "EARLY_PIECE", 4 * MiB)  # (a smaller file, as many pieces)
    path = cold_file(tmp_path, 64 * MiB)
    pieces = 64 * MiB // read_early.EARLY_PIECE
    read: list[int] = []

    def slow_read(fd: int, offset: int, nbytes: int, sink: int) -> None:
        read.append(offset)
        time.sleep(0.05)

    monkeypatch.setattr(read_early, "read_into_cache", slow_read)
    read_early.start(str(path))
    _finish()
    assert len(read) == pieces  # left alone, it reads every piece
    read.clear()
    read_early.start(str(path))
    read_early.stop()
    assert read_early._thread is None and len(read) < pieces


def test_the_source_is_the_argument_after_a_conversion_command(tmp_path: Path) -> None:
    src = str(tmp_path)
    assert early_source(["consolidate", src, "out", "--format", "megatron"]) == src
    assert early_source(["--debug", "reshard", src, "out", "--tp", "4"]) == src
    assert early_source(["consolidate", f"file://{src}", "out"]) == src
    assert early_source(["reshard", "--tp", "4", src, "out"]) is None  # not guessed
    assert early_source(["consolidate", src, "out", "--help"]) is None
    assert early_source(["reshard", src, "out", "--tp", "1", "--dry-run"]) is None
    assert early_source(["inspect", src]) is None
    assert early_source(["verify", src]) is None
    assert early_source(["consolidate", "s3://bucket/ckpt", "out"]) is None
    assert early_source(["consolidate", str(tmp_path / "missing"), "out"]) is None
    assert early_source([]) is None


def test_the_entry_starts_reading_before_it_imports_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ckptctl``'s entry imports nothing heavy itself, starts the early read of the source,
    then runs the CLI; under torchrun's variables it reads nothing early (each rank reads its
    planned share). Conversions through the entry run end to end in ``test_workers``."""
    light = subprocess.run(
        [sys.executable, "-c", "import sys, ckptctl.cli.launch; print(sorted(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "ckptctl.cli.main" not in light and "pydantic" not in light and "typer" not in light
    from ckptctl.cli import launch
    from ckptctl.cli import main as cli_main

    calls: list[str] = []
    monkeypatch.setattr(read_early, "start", calls.append)
    monkeypatch.setattr(import_prefetch, "start", lambda: calls.append("prefetch"))

    def cli(on_success=None) -> None:
        calls.append("cli" if on_success is import_prefetch.record else "cli, no record")

    monkeypatch.setattr(cli_main, "main", cli)
    monkeypatch.setattr(sys, "argv", ["ckptctl", "consolidate", str(tmp_path), "out"])
    for variable in launch.RANK_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(launch, "imports_cached", lambda: True)
    launch.main()
    assert calls == [str(tmp_path), "cli"]
    calls.clear()
    # the CLI's modules not cached: their files are asked for first; the source is read early
    # only by a job that reads all of it (a consolidation to HF reads the weights alone)
    monkeypatch.setattr(launch, "imports_cached", lambda: False)
    launch.main()
    assert calls == ["prefetch", "cli"]
    calls.clear()
    monkeypatch.setattr(sys, "argv", ["ckptctl", "reshard", str(tmp_path), "out", "--tp", "2"])
    launch.main()
    assert calls == ["prefetch", str(tmp_path), "cli"]
    calls.clear()
    monkeypatch.setenv("LOCAL_RANK", "0")
    launch.main()
    assert calls == ["cli"]
    calls.clear()
    monkeypatch.setattr(sys, "argv", ["ckptctl", "inspect", str(tmp_path)])
    launch.main()
    assert calls == ["cli, no record"]  # only conversions keep the list


def test_nothing_is_read_early_while_the_cli_itself_must_come_from_the_disk() -> None:
    """With the CLI's compiled modules out of the page cache, the imports need the disk, and
    the early read would queue ahead of them: ``imports_cached`` says no; read back, yes."""
    from importlib.util import cache_from_source

    from ckptctl.cli import launch

    compiled = Path(cache_from_source(str(Path(launch.__file__).with_name("main.py"))))
    if not compiled.exists():
        pytest.skip("the CLI is not compiled here")
    compiled.read_bytes()
    assert launch.imports_cached()
    evict(compiled)
    assert not launch.imports_cached()
    compiled.read_bytes()
    assert launch.imports_cached()


def test_only_jobs_that_read_their_whole_source_read_it_early_past_cold_imports() -> None:
    """With the CLI's modules not cached, early reads delay the imports: worth it only where
    the job needs every byte they read (a consolidation to HF reads the weights alone)."""
    assert reads_whole_source(["reshard", "src", "out", "--tp", "4"])
    assert reads_whole_source(["--debug", "reshard", "src", "out", "--pp", "2"])
    assert reads_whole_source(["consolidate", "src", "out", "--format", "megatron"])
    assert reads_whole_source(["consolidate", "src", "out", "--format=torch"])
    assert reads_whole_source(["consolidate", "src", "out", "--format", "deepspeed-universal"])
    assert not reads_whole_source(["consolidate", "src", "out"])  # HF, the default
    assert not reads_whole_source(["consolidate", "src", "out", "--format", "hf"])
    assert not reads_whole_source(["consolidate", "src", "out", "--format=hf", "--json"])
