"""The CLI's module files are asked of the disk at once on a cold start: the list is what the
last successful conversion imported, and the page cache is the judge (``mincore``) of the
files it names coming in."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptctl import import_prefetch, synth
from tests.page_cache import cold_file, resident


@pytest.fixture()
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def _ckptctl(*argv: object, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "ckptctl", *map(str, argv)],
        capture_output=True,
        text=True,
        env=env,
    )


def test_a_successful_conversion_records_the_files_it_imported(
    tmp_path: Path, cache_home: Path
) -> None:
    model = synth.make_model(synth.tiny_llama_config(num_heads=4, num_kv_heads=2), seed=3)
    src = tmp_path / "megatron"
    synth.write_megatron(model, synth.adam_step(model, seed=3), src, tp=2, pp=1)
    (tmp_path / "empty").mkdir()

    assert _ckptctl("inspect", src, cache=cache_home).returncode == 0
    failed = _ckptctl("consolidate", tmp_path / "empty", tmp_path / "x", cache=cache_home)
    assert failed.returncode != 0
    assert not cache_home.exists()  # neither a command that converts nothing, nor a failure

    done = _ckptctl("consolidate", src, tmp_path / "out", "--format", "megatron", cache=cache_home)
    assert done.returncode == 0, done.stderr
    lists = list((cache_home / "ckptctl").iterdir())
    assert len(lists) == 1 and lists[0].name.startswith("imports-")
    listed = lists[0].read_text().splitlines()
    assert all(os.path.isabs(line) for line in listed)
    megatron_reader = Path(synth.__file__).parents[1] / "formats" / "megatron" / "reader.py"
    assert str(megatron_reader) in listed
    import numpy

    assert numpy.__file__ in listed


def test_listed_files_come_into_the_page_cache(tmp_path: Path, cache_home: Path) -> None:
    files = [cold_file(tmp_path, 3 << 20, f"module{i}.pyc") for i in range(5)]
    target = import_prefetch.list_path()
    assert target is not None and target.startswith(str(cache_home))
    os.makedirs(os.path.dirname(target))
    missing = tmp_path / "gone.pyc"
    Path(target).write_text("\n".join(map(str, [*files, missing])) + "\nrelative/ignored.pyc\n")

    assert not any(any(resident(path)) for path in files)
    threads = import_prefetch.start()
    assert threads
    for thread in threads:
        thread.join(timeout=30)
    deadline = time.monotonic() + 10  # the reads were asked, not waited for
    while not all(all(resident(path)) for path in files) and time.monotonic() < deadline:
        time.sleep(0.01)
    for path in files:
        assert all(resident(path)), path


def test_without_a_list_nothing_is_asked(cache_home: Path) -> None:
    assert import_prefetch.start() == []


def test_the_list_is_written_only_when_it_changes(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import_prefetch.record()
    target = Path(import_prefetch.list_path() or "")
    assert target.read_text().splitlines() == import_prefetch.module_files()
    replaced: list[str] = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append(b), real_replace(a, b)))
    import_prefetch.record()  # the same modules: nothing written
    assert replaced == []
    import json  # noqa: F401  (a module more: the list is replaced whole)

    monkeypatch.setitem(sys.modules, "ckptctl_test_extra", type(sys)("ckptctl_test_extra"))
    sys.modules["ckptctl_test_extra"].__file__ = str(cache_home / "extra.py")
    import_prefetch.record()
    assert replaced == [str(target)]
    assert str(cache_home / "extra.py") in target.read_text().splitlines()
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no partial file left


def test_a_cache_folder_that_cannot_be_written_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    import_prefetch.record()  # no error
    assert import_prefetch.start() == []
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # ignored, as XDG says
    assert import_prefetch.list_path() == os.path.join(
        os.path.expanduser("~"), ".cache", "ckptctl", Path(import_prefetch.list_path()).name
    )
