"""Planners, pure: the strategy decision table on golden cases, plan coverage for random layouts,
and (through the CLI) estimates against what execution measured and saved plans that refuse a
changed source."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl import synth
from ckptctl.errors import CheckpointError, LayoutError
from ckptctl.formats.megatron_common.layout import megatron_files
from ckptctl.formats.megatron_common.target import MegatronTarget
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.megatron_style import MegatronStyle, OptimizerLayout
from ckptctl.model.plan import COPY, Estimates, coverage_problems
from ckptctl.model.profile import StorageProfile
from ckptctl.model.stored import CheckpointView, Format
from ckptctl.model.target import TargetRequest
from planners.cost import job_seconds, with_time
from planners.strategy import Stored, plan_auto

SPEC = ModelSpec(
    num_layers=8,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=8,
    num_query_groups=4,
    kv_channels=8,
    vocab_size=1100,
)
OPT = OptimizerLayout()
MEGATRON = {
    "target": MegatronTarget(),
    "request": TargetRequest(style=MegatronStyle(optimizer=OPT)),
}
"""Plans for a Megatron legacy target, keeping per-parameter Adam state."""


def stored(layout: ParallelLayout, url: str, lost: frozenset[str] = frozenset()) -> Stored:
    files = megatron_files(SPEC, layout, iteration=7, weight_dtype="bfloat16", optimizer=OPT)
    view = CheckpointView(Format.MEGATRON, SPEC, layout, files, 7, True)
    return Stored(view, url, "f" * 16, {f.path: 1000 for f in files}, lost)


TP2PP2 = ParallelLayout(tp=2, pp=2)
LOST = "iter_0000007/mp_rank_01_001/model_optim_rng.pt"


def test_unchanged_and_intact_loads_directly() -> None:
    plan = plan_auto(stored(TP2PP2, "/nvme"), [], TP2PP2, target_url=None, **MEGATRON)
    assert plan.strategy == "direct" and plan.files == () and plan.estimates.bytes_read == 0
    assert "no data moves" in plan.reason
    copied = plan_auto(stored(TP2PP2, "/nvme"), [], TP2PP2, target_url="/lake", **MEGATRON)
    assert copied.strategy == "direct"
    assert {f.kind for f in copied.files} == {COPY} and len(copied.files) == 4
    assert {a.strategy for a in plan.alternatives} == {
        "shard-to-shard",
        "recovery",
        "full-then-split",
    }


def test_changed_layout_goes_shard_to_shard() -> None:
    plan = plan_auto(
        stored(TP2PP2, "/nvme"), [], ParallelLayout(tp=4, pp=1), target_url="/o", **MEGATRON
    )
    assert plan.strategy == "shard-to-shard"
    assert coverage_problems(plan) == []
    direct = next(a for a in plan.alternatives if a.strategy == "direct")
    assert direct.refused and "not the target's" in direct.refused


def test_lost_shard_with_replica_reads_only_the_lost_file_from_the_replica() -> None:
    sharded = stored(TP2PP2, "/nvme", frozenset({LOST}))
    replica = stored(TP2PP2, "s3://lake/ckpt")
    plan = plan_auto(sharded, [replica], ParallelLayout(tp=1, pp=4), target_url="/o", **MEGATRON)
    assert plan.strategy == "recovery" and "replica" in plan.reason
    assert coverage_problems(plan) == []
    read = {plan.source_files[c.source] for f in plan.files for t in f.tensors for c in t.copies}
    assert LOST not in read
    from_replica = {p for p in read if p.startswith("@0/")}
    assert from_replica == {"@0/" + LOST}
    assert [s.url for s in plan.extra_sources] == ["s3://lake/ckpt"]


def test_lost_shard_with_full_checkpoint_uses_it() -> None:
    sharded = stored(TP2PP2, "/nvme", frozenset({LOST}))
    full = stored(ParallelLayout(), "/lake/full")
    plan = plan_auto(sharded, [full], ParallelLayout(tp=2, pp=4), target_url="/o", **MEGATRON)
    assert plan.strategy in ("recovery", "full-then-split")
    assert coverage_problems(plan) == []
    forced = plan_auto(
        sharded,
        [full],
        ParallelLayout(tp=2, pp=4),
        target_url="/o",
        **MEGATRON,
        strategy="recovery",
    )
    read = {
        forced.source_files[c.source] for f in forced.files for t in f.tensors for c in t.copies
    }
    assert any(p.startswith("@0/") for p in read) and LOST not in read
    assert any(not p.startswith("@") for p in read)  # surviving shards still used


def test_lost_shard_with_nothing_else_is_refused_naming_it() -> None:
    sharded = stored(TP2PP2, "/nvme", frozenset({LOST}))
    with pytest.raises(CheckpointError, match="lost and stored nowhere else: " + LOST):
        plan_auto(sharded, [], ParallelLayout(tp=1), target_url="/o", **MEGATRON)


def test_impossible_target_keeps_its_own_error() -> None:
    with pytest.raises(LayoutError, match="tp=8 does not divide num_query_groups=4"):
        plan_auto(stored(TP2PP2, "/nvme"), [], ParallelLayout(tp=8), target_url="/o", **MEGATRON)


def test_auto_prefers_what_the_cost_model_finds_cheaper() -> None:
    # The same full checkpoint is cheaper to cut than a reshard reading from S3.
    sharded = stored(TP2PP2, "s3://lake/sharded")
    full = stored(ParallelLayout(), "/nvme/full")
    plan = plan_auto(sharded, [full], ParallelLayout(tp=4), target_url="/o", **MEGATRON)
    assert plan.strategy == "full-then-split"
    s2s = next(a for a in plan.alternatives if a.strategy == "shard-to-shard")
    assert s2s.estimates is not None and s2s.estimates.seconds > plan.estimates.seconds


@st.composite
def layouts(draw: st.DrawFn) -> ParallelLayout:
    pp = draw(st.sampled_from([1, 2, 4]))
    return ParallelLayout(
        tp=draw(st.sampled_from([1, 2, 4])),
        pp=pp,
        vpp=draw(st.sampled_from([1, 2])) if pp > 1 else 1,
        dp=draw(st.sampled_from([1, 2, 3])),
        distributed_optimizer=draw(st.booleans()),
    )


@settings(max_examples=40, deadline=None)
@given(source=layouts(), target=layouts())
def test_every_plan_covers_every_target_element_once(source, target) -> None:
    plan = plan_auto(stored(source, "/a"), [], target, target_url="/b", **MEGATRON)
    assert coverage_problems(plan) == []


def test_planning_is_deterministic() -> None:
    """(How fast planning is, bench/bench_plan.py measures.)"""
    a = plan_auto(
        stored(TP2PP2, "/a"), [], ParallelLayout(tp=1, pp=4, vpp=2), target_url="/b", **MEGATRON
    )
    b = plan_auto(
        stored(TP2PP2, "/a"), [], ParallelLayout(tp=1, pp=4, vpp=2), target_url="/b", **MEGATRON
    )
    assert a.fingerprint() == b.fingerprint()


# --- through the CLI, on real files --------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = synth.make_model(synth.tiny_llama_config(num_heads=8, num_kv_heads=4), seed=1)
    out = tmp_path_factory.mktemp("plan") / "src"
    synth.write_megatron(model, synth.adam_step(model, seed=1), out, tp=2, pp=2)
    return out


def test_estimates_match_what_execution_measured(checkpoint: Path, tmp_path: Path, cli) -> None:
    summary = cli.json("reshard", checkpoint, tmp_path / "b", "--tp", "4", "--pp", "1")
    e = summary["estimates"]
    # Bytes are exact; requests too, unless bands split copies (not at the default budget).
    assert summary["bytes_read"] == e["bytes_read"]
    assert summary["read_requests"] == e["read_requests"]
    written = sum(p.stat().st_size for p in (tmp_path / "b").rglob("*.pt"))
    assert e["bytes_written"] <= written <= e["bytes_written"] * 1.05 + 65536  # + pickles, zip


def test_saved_plan_runs_and_refuses_a_changed_source(
    checkpoint: Path, tmp_path: Path, cli
) -> None:
    src = tmp_path / "src"
    for p in checkpoint.rglob("*"):
        if p.is_file():
            (src / p.relative_to(checkpoint)).parent.mkdir(parents=True, exist_ok=True)
            (src / p.relative_to(checkpoint)).write_bytes(p.read_bytes())
    plan_file = tmp_path / "plan.json"
    out = cli("plan", src, tmp_path / "dst", "--tp", "1", "--pp", "4", "--out", plan_file)
    assert "shard-to-shard" in out.stdout
    assert json.loads(plan_file.read_text())["strategy"] == "shard-to-shard"
    cli("reshard", src, tmp_path / "dst", "--plan", plan_file)
    assert (tmp_path / "dst/latest_checkpointed_iteration.txt").exists()
    victim = src / "iter_0000001/mp_rank_00_000/model_optim_rng.pt"
    victim.write_bytes(victim.read_bytes() + b"\0")
    result = cli("reshard", src, tmp_path / "dst", "--plan", plan_file, "--overwrite", code=3)
    assert "changed since the plan was made" in result.stderr


def test_lost_ranks_flag_recovers_from_full(checkpoint: Path, tmp_path: Path, cli) -> None:
    cli("consolidate", checkpoint, tmp_path / "full", "--format", "megatron")
    summary = cli.json(
        "reshard",
        checkpoint,
        tmp_path / "out",
        "--tp",
        "2",
        "--pp",
        "2",
        "--full",
        tmp_path / "full",
        "--lost-ranks",
        "1",
        "--strategy",
        "recovery",
    )
    assert summary["strategy"] == "recovery"
    from tests.pipeline.test_reshard import assert_same_checkpoint

    assert_same_checkpoint(checkpoint, tmp_path / "out")


def test_calibrated_profile_is_saved_and_used_by_plans(
    checkpoint: Path, tmp_path: Path, cli
) -> None:
    before = cli.json("plan", checkpoint, tmp_path / "o", "--tp", "4", "--pp", "1")
    consolidate = ("consolidate", checkpoint, tmp_path / "hf", "--dry-run")
    merged = cli.json(*consolidate)["estimates"]["seconds"]
    assert merged > 0
    measured = cli.json("calibrate", str(checkpoint), "--size", "2MiB")
    assert measured["read_bandwidth"] > 0 and measured["latency"] >= 0
    assert Path(measured["saved_to"]).exists()
    # A deliberately slow measurement for the source changes the plan's time estimate.
    slow = dict(measured, read_bandwidth=1e3, write_bandwidth=1e3)
    slow.pop("saved_to")
    Path(measured["saved_to"]).write_text(json.dumps(slow))
    after = cli.json("plan", checkpoint, tmp_path / "o", "--tp", "4", "--pp", "1")
    assert after["estimates"]["seconds"] > 100 * before["estimates"]["seconds"]
    assert cli.json(*consolidate)["estimates"]["seconds"] > 100 * merged
    assert not any(p.name.startswith(".ckptctl") for p in checkpoint.iterdir())


def test_calibration_times_a_local_write_until_it_is_on_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs flush their outputs before the manifest, so the write bandwidth plans use is the
    durable one: the page cache alone took 4.6 GB/s on a disk that writes 1.7 GB/s."""
    import os

    from ckptctl.io import calibrate

    flushed: list[int] = []
    real = os.fdatasync

    def spy(fd: int) -> None:
        flushed.append(os.fstat(fd).st_size)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", spy)
    profile = calibrate.calibrate(str(tmp_path / "disk"), size=4 << 20, probes=2)
    assert profile.write_bandwidth > 0
    assert 4 << 20 in flushed  # the scratch file, whole, inside the timed write
    assert not any((tmp_path / "disk").iterdir())


def test_plan_show_draws_the_source_target_map(checkpoint: Path, tmp_path: Path, cli) -> None:
    svg = tmp_path / "map.svg"
    result = cli("plan", checkpoint, "--tp", "1", "--pp", "4", "--show", "--svg", svg)
    assert "source \\ target" in result.stdout and "00_003" in result.stdout
    assert svg.read_text().startswith("<svg")


def test_consolidate_runs_a_saved_plan(checkpoint: Path, tmp_path: Path, cli) -> None:
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(
        cli("consolidate", checkpoint, tmp_path / "hf", "--dry-run", "--json").stdout
    )
    cli("consolidate", checkpoint, tmp_path / "hf", "--plan", plan_file)
    assert (tmp_path / "hf/config.json").exists()
    wrong = cli("reshard", checkpoint, tmp_path / "hf", "--plan", plan_file, code=2)
    assert "is a consolidate plan" in wrong.stderr


def test_via_full_keeps_the_full_checkpoint_and_cuts_from_it(
    checkpoint: Path, tmp_path: Path, cli
) -> None:
    summary = cli.json(
        "reshard",
        checkpoint,
        tmp_path / "out",
        "--tp",
        "1",
        "--pp",
        "4",
        "--via-full",
        tmp_path / "full",
    )
    assert summary["strategy"] == "full-then-split"
    assert (tmp_path / "full/iter_0000001/mp_rank_00/model_optim_rng.pt").exists()
    cli("reshard", tmp_path / "out", tmp_path / "back", "--tp", "2", "--pp", "2")
    from tests.pipeline.test_reshard import assert_same_checkpoint

    assert_same_checkpoint(checkpoint, tmp_path / "back")


def test_reads_spread_over_intact_replicas_by_bandwidth() -> None:
    plan = plan_auto(
        stored(TP2PP2, "/nvme"),
        [stored(TP2PP2, "/nvme-copy")],
        ParallelLayout(tp=1, pp=4),
        target_url="/o",
        **MEGATRON,
    )
    assert plan.strategy == "shard-to-shard" and plan.read_workers == 2
    assert coverage_problems(plan) == []
    by_location = {"": 0, "@0/": 0}
    for f in plan.files:
        for t in f.tensors:
            for c in t.copies:
                n = 2 if t.dtype == "bfloat16" else 4
                for size in c.sizes:
                    n *= size
                path = plan.source_files[c.source]
                by_location["@0/" if path.startswith("@0/") else ""] += n
    share = by_location["@0/"] / sum(by_location.values())
    assert 0.4 < share < 0.6  # equal bandwidth: about half each
    # A slow lake copy (S3 profile) takes the smaller share.
    slow = plan_auto(
        stored(TP2PP2, "/nvme"),
        [stored(TP2PP2, "s3://lake/ckpt")],
        ParallelLayout(tp=1, pp=4),
        target_url="/o",
        **MEGATRON,
    )
    lake = sum(
        1
        for f in slow.files
        for t in f.tensors
        for c in t.copies
        if slow.source_files[c.source].startswith("@0/")
    )
    local = sum(
        1
        for f in slow.files
        for t in f.tensors
        for c in t.copies
        if not slow.source_files[c.source].startswith("@0/")
    )
    assert 0 < lake < local


def test_reshard_with_replica_reads_both_and_is_exact(
    checkpoint: Path, tmp_path: Path, cli
) -> None:
    import shutil

    replica = tmp_path / "replica"
    shutil.copytree(checkpoint, replica)
    summary = cli.json(
        "reshard", checkpoint, tmp_path / "b", "--tp", "1", "--pp", "4", "--replica", replica
    )
    assert "spread over 2 stored copies" in summary["notes"][0] or summary["strategy"]
    cli("reshard", checkpoint, tmp_path / "plain", "--tp", "1", "--pp", "4")
    from tests.pipeline.test_reshard import assert_same_checkpoint

    assert_same_checkpoint(tmp_path / "plain", tmp_path / "b")


def test_unreadable_shard_found_by_probing_is_recovered(
    checkpoint: Path, tmp_path: Path, cli
) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(checkpoint, src)
    victim = src / "iter_0000001/mp_rank_01_001/model_optim_rng.pt"
    victim.write_bytes(victim.read_bytes()[:1000])  # truncated
    cli("consolidate", checkpoint, tmp_path / "full", "--format", "megatron")
    refused = cli("reshard", src, tmp_path / "x", "--tp", "4", code=3)
    assert "mp_rank_01_001/model_optim_rng.pt" in refused.stderr
    summary = cli.json(
        "reshard",
        src,
        tmp_path / "out",
        "--tp",
        "2",
        "--pp",
        "2",
        "--full",
        tmp_path / "full",
        "--strategy",
        "recovery",
    )
    assert summary["strategy"] == "recovery"
    from tests.pipeline.test_reshard import assert_same_checkpoint

    assert_same_checkpoint(checkpoint, tmp_path / "out")


def test_execution_order_keeps_source_locality_and_commits_last() -> None:
    from planners.graph import execution_order

    plan = plan_auto(
        stored(ParallelLayout(pp=2), "/a"),
        [],
        ParallelLayout(tp=4, pp=2),
        target_url="/b",
        **MEGATRON,
    )
    assert execution_order(plan).files == plan.files  # already applied: idempotent
    # Interleave the stages: stage 0 and stage 1 targets read different source files.
    files = plan.files
    mixed = plan.model_copy(update={"files": tuple(files[i] for i in (0, 4, 1, 5, 2, 6, 3, 7))})
    ordered = execution_order(mixed)
    assert sorted(f.path for f in ordered.files) == sorted(f.path for f in files)
    sources = [frozenset(c.source for t in f.tensors for c in t.copies) for f in ordered.files]
    changes = sum(1 for a, b in pairwise(sources) if a != b)
    assert changes == 1  # all targets of one source, then all of the other
    assert ordered.finalize == plan.finalize  # the commit marker stays last


def test_reads_and_writes_overlap_unless_both_are_on_local_disks() -> None:
    """A job reads ahead of its writer: a network link (or two devices) carries both at once,
    while two local paths may share one device."""
    assert job_seconds(3.0, 2.0, "/nvme/a", "/nvme/b") == 5.0
    assert job_seconds(3.0, 2.0, "file:///nvme/a", "/nvme/b") == 5.0
    assert job_seconds(3.0, 2.0, "s3://lake/a", "s3://lake/b") == 3.0
    assert job_seconds(3.0, 5.0, "/nvme/a", "s3://lake/b") == 5.0
    assert job_seconds(3.0, 2.0, "s3://lake/a", "/nvme/b") == 3.0


def test_overlapped_reads_and_writes_pay_the_pipeline_once() -> None:
    """Writes start once the first window is read and end a window after the last read: on a
    network link the longer direction plus the window at the other end; summed jobs are not
    charged again; a window larger than the job is the job."""
    assert job_seconds(3.0, 3.0, "s3://a", "s3://b", fill=0.5, drain=0.25) == 3.5
    assert job_seconds(3.0, 1.0, "s3://a", "s3://b", fill=0.5, drain=0.25) == 3.25
    assert job_seconds(3.0, 2.0, "/nvme/a", "/nvme/b", fill=0.5, drain=0.25) == 5.0
    link = StorageProfile(name="s3", read_bandwidth=1e6, write_bandwidth=1e6, latency=0.0)
    estimates = Estimates(
        bytes_read=10 * 10**6, bytes_written=10 * 10**6, read_requests=0, peak_memory_bytes=0
    )
    timed = with_time(estimates, link, link, "s3://a/x", "s3://a/y", window=2 * 10**6)
    assert (timed.seconds, timed.pipeline_seconds) == (12.0, 2.0)
    timed = with_time(estimates, link, link, "s3://a/x", "s3://a/y", window=50 * 10**6)
    assert (timed.seconds, timed.pipeline_seconds) == (20.0, 10.0)
    assert with_time(estimates, link, link, "s3://a/x", "s3://a/y").pipeline_seconds == 0.0


def test_a_measured_overlap_of_reads_and_writes_is_the_one_used() -> None:
    """Where calibrate measured how much reads and writes overlap on one storage, a job that
    reads and writes it is charged so: the longer direction, and the part of the shorter that
    does not run during it."""
    assert job_seconds(3.0, 2.0, "/nvme/a", "/nvme/b", overlap=1.0) == 3.0
    assert job_seconds(3.0, 2.0, "/nvme/a", "/nvme/b", overlap=0.25) == 4.5
    assert job_seconds(3.0, 2.0, "s3://lake/a", "s3://lake/b", overlap=0.0) == 5.0
    assert job_seconds(3.0, 2.0, "/nvme/a", "/nvme/b", overlap=1.7) == 3.0  # a noisy measure
    disk = StorageProfile(name="/nvme", read_bandwidth=1e9, write_bandwidth=1e9, latency=0.0)
    both = disk.model_copy(update={"overlap": 1.0})
    estimates = Estimates(
        bytes_read=3 * 10**9, bytes_written=2 * 10**9, read_requests=0, peak_memory_bytes=0
    )
    assert with_time(estimates, disk, disk, "/nvme/a", "/nvme/b").seconds == 5.0
    assert with_time(estimates, both, both, "/nvme/a", "/nvme/b").seconds == 3.0
    # Two storages: each its own device or link, whatever one of them measured alone.
    other = both.model_copy(update={"name": "/other"})
    assert with_time(estimates, both, other, "/nvme/a", "/other/b").seconds == 5.0
