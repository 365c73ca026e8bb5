"""``ckptctl calibrate`` on a local disk: a profile of positive figures, read back as a job
reads (one range in flight), with how much reads and writes overlap, saved where later plans
find it, and no scratch file left."""

from __future__ import annotations

from pathlib import Path

from ckptctl.io.calibrate import SCRATCH, calibrate, save_profile, saved_profiles
from planners.cost import profile_for


def test_a_local_disk_is_measured_and_its_profile_used_by_plans(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("CKPTCTL_HOME", str(tmp_path / "home"))
    disk = tmp_path / "disk"
    disk.mkdir()
    profile = calibrate(str(disk), size=4 << 20, probes=4)
    assert profile.read_bandwidth > 0 and profile.write_bandwidth > 0 and profile.latency > 0
    assert profile.concurrency == 1
    assert profile.overlap is not None and 0.0 <= profile.overlap <= 1.0
    assert not (disk / SCRATCH).exists() and list(disk.iterdir()) == []
    save_profile(profile)
    measured = saved_profiles()
    assert profile_for(str(disk / "ckpt"), measured) == profile
    assert profile_for(str(tmp_path / "elsewhere"), measured) != profile
