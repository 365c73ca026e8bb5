"""The training-loop API (``ckptctl.save`` / ``async_save`` / ``load``), judged by torch itself:
its DCP flattening names, its ``dcp.load`` reading what ckptctl saved, and a real FSDP2 training
job (tests/training/worker.py, torchrun, gloo) that must continue exactly as without a restart,
or exactly as when torch's own ``dcp.load`` restores it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

import ckptctl
from ckptctl.checksums.manifest import INCOMPLETE, MANIFEST
from ckptctl.cli.main import app
from ckptctl.errors import CheckpointError
from ckptctl.training import Checkpointer
from ckptctl.training.state import flatten

WORKER = Path(__file__).parent / "worker.py"
PLACEMENTS = Path(__file__).parent / "placements.py"
STEPS = 4


def nested_state() -> dict:
    torch.manual_seed(3)
    return {
        "model": {"w": torch.randn(4, 6), "b": torch.randn(6).to(torch.bfloat16)},
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 6)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}],
        },
        "ids": torch.arange(5, dtype=torch.int64),
        "tensors": [torch.ones(2), {"deep": torch.zeros(3, dtype=torch.float16)}],
        "numbers": [1, 2, 3],
        "pair": (1, "a"),
        "step": 17,
    }


def zeros_like(tree: object) -> object:
    if isinstance(tree, dict):
        return {k: zeros_like(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [zeros_like(v) for v in tree]
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    return None


def same(a: object, b: object) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_names_are_the_ones_torchs_dcp_gives() -> None:
    ours = {name: leaf.path for name, leaf in flatten(nested_state()).items()}
    theirs = flatten_state_dict(nested_state())[1]
    assert ours == theirs


def test_a_save_loads_with_torchs_dcp_and_back_with_ckptctl(tmp_path: Path, cli) -> None:
    state, out = nested_state(), tmp_path / "ckpt"
    report = ckptctl.save(state, checkpoint_id=str(out))
    assert report.files == [".metadata", "__0_0.distcp", MANIFEST]
    assert not (out / INCOMPLETE).exists()

    by_torch = zeros_like(state)
    dcp.load(by_torch, checkpoint_id=str(out))  # torch reads ckptctl's layout
    assert same(by_torch, state)

    by_us = zeros_like(state)
    loaded = ckptctl.load(by_us, checkpoint_id=str(out))
    assert same(by_us, state)
    assert loaded.strategy == "direct" and loaded.files == ["__0_0.distcp"]

    verified = cli.json("verify", str(out))
    assert all(c["status"] != "failed" for c in verified["checks"])


def test_ckptctl_loads_what_torchs_dcp_saved(tmp_path: Path) -> None:
    state, out = nested_state(), tmp_path / "by-torch"
    dcp.save(state, checkpoint_id=str(out))
    by_us = zeros_like(state)
    assert ckptctl.load(by_us, checkpoint_id=str(out)).strategy == "direct"
    assert same(by_us, state)


def test_a_template_of_another_dtype_is_refused_by_name(tmp_path: Path) -> None:
    ckptctl.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "c"))
    with pytest.raises(CheckpointError, match=r"w: the checkpoint holds float32 \[3\].*bfloat16"):
        ckptctl.load({"w": torch.zeros(3, dtype=torch.bfloat16)}, checkpoint_id=str(tmp_path / "c"))


def test_the_in_memory_copy_serves_a_load_in_the_same_process(tmp_path: Path) -> None:
    saver = Checkpointer(keep_in_memory=True)
    state, out = nested_state(), tmp_path / "ckpt"
    saver.async_save(state, checkpoint_id=str(out)).result()
    shutil.rmtree(out)  # memory, not storage, must serve it
    again = zeros_like(state)
    report = saver.load(again, checkpoint_id=str(out))
    assert report.strategy == "memory" and report.files == []
    assert same(again, state)
    with pytest.raises(CheckpointError):  # another checkpoint is not in memory
        saver.load(zeros_like(state), checkpoint_id=str(tmp_path / "other"))
    saver.close()


def test_the_in_memory_copy_is_bounded(tmp_path: Path) -> None:
    saver = Checkpointer(keep_in_memory=True, memory_limit=64)
    state, out = nested_state(), tmp_path / "ckpt"
    saver.save(state, checkpoint_id=str(out))
    again = zeros_like(state)
    assert saver.load(again, checkpoint_id=str(out)).strategy == "direct"  # from storage
    assert same(again, state)
    saver.close()


def test_a_checkpoint_whose_save_never_finished_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    ckptctl.save({"w": torch.ones(3)}, checkpoint_id=str(out))
    (out / INCOMPLETE).write_text("{}")
    with pytest.raises(CheckpointError, match="never finished"):
        ckptctl.load({"w": torch.zeros(3)}, checkpoint_id=str(out))


def _close_and_save_again(rank: int, store: str, out: str, results: object) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    saver = Checkpointer()
    saver.save({"w": torch.arange(6.0)}, checkpoint_id=f"{out}/a")
    coordinator = saver.coordinator()
    group = coordinator._group
    saver.close()
    try:
        dist.get_process_group_ranks(group)
        destroyed = False
    except KeyError:
        destroyed = True
    try:  # a closed group must not answer as a job of one rank would
        coordinator.gather(rank)
        destroyed = False
    except RuntimeError:
        pass
    saver.save({"w": torch.arange(6.0) + 1}, checkpoint_id=f"{out}/b")  # a new group
    again = {"w": torch.zeros(6)}
    saver.load(again, checkpoint_id=f"{out}/b")
    saver.close()
    results.put((rank, destroyed, again["w"].tolist()))
    dist.destroy_process_group()


def test_closing_tears_down_the_ranks_group_and_a_later_save_makes_a_new_one(
    tmp_path: Path,
) -> None:
    """Left for the interpreter's exit, a gloo group can abort a finished job; ``close``
    destroys it on every rank, and the checkpointer stays usable."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    results = context.Queue()
    ranks = [
        context.Process(
            target=_close_and_save_again,
            args=(rank, str(tmp_path / "store"), str(tmp_path), results),
        )
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    got = sorted(results.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
    assert [process.exitcode for process in ranks] == [0, 0]
    assert got == [(0, True, [1.0, 2, 3, 4, 5, 6]), (1, True, [1.0, 2, 3, 4, 5, 6])]


# --- a real FSDP2 training job under torchrun --------------------------------------------------


TORCH_ABORT = "terminate called without an active exception"
"""What a rank of torch's own ``dcp.load`` run printed when gloo's C++ side aborted it (once in
CI on 2026-11-28, 4 ranks on 2 loaded cores; not reproduced in 3 runs alone)."""


def torchrun(
    workers: int,
    *args: object,
    check: bool = True,
    script: Path = WORKER,
    oracle: bool = False,
) -> subprocess.CompletedProcess:
    """``script`` under torchrun. ``oracle``: the run is torch's own side, the judge, not
    ckptctl's; a rank aborted inside torch's C++ is retried once, since the judge crashing
    says nothing of what is judged."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", str(workers), str(script), *map(str, args)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if oracle and done.returncode != 0 and TORCH_ABORT in done.stderr:
        return torchrun(workers, *args, check=check, script=script)
    if check:
        assert done.returncode == 0, done.stderr[-4000:]
    return done


def result(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two ranks, FSDP2, AdamW: an asynchronous save after every step."""
    out = tmp_path_factory.mktemp("training")
    torchrun(2, out, "train", STEPS)
    return out


def test_async_saves_during_training_are_complete(trained: Path, cli) -> None:
    """Every async save is whole and verifies. (How little a save blocks the training loop is
    a timing: bench/bench_training.py measures it.)"""
    run = result(trained / "train_2.json")
    for step in range(STEPS):
        ckpt = trained / f"step_{step}"
        assert (ckpt / MANIFEST).exists() and not (ckpt / INCOMPLETE).exists()
        assert run["files"][step] == [".metadata", "__0_0.distcp", "__1_0.distcp", MANIFEST]
    cli("verify", str(trained / f"step_{STEPS - 1}"))


def test_resuming_the_same_layout_reads_each_ranks_own_shard(trained: Path) -> None:
    torchrun(2, trained, "resume", "step_1", 1, STEPS, "ckptctl")
    resumed, uninterrupted = (
        result(trained / "resume_ckptctl_2.json"),
        result(trained / "train_2.json"),
    )
    assert resumed["step"] == 1
    assert resumed["losses"] == uninterrupted["losses"][2:]  # bit for bit
    for rank, decision in enumerate(resumed["decisions"]):
        assert decision["strategy"] == "direct", decision
        own = decision["bytes_by_file"].pop(f"__{rank}_0.distcp")
        # Only the few replicated tensors (Adam's step counters) stored by the other rank.
        assert sum(decision["bytes_by_file"].values()) < own / 1000, decision


def test_resuming_on_another_number_of_ranks_matches_torchs_own_load(trained: Path) -> None:
    torchrun(4, trained, "resume", "step_1", 1, STEPS, "ckptctl")
    torchrun(4, trained, "resume", "step_1", 1, STEPS, "torch", oracle=True)
    ours, torchs = (
        result(trained / "resume_ckptctl_4.json"),
        result(trained / "resume_torch_4.json"),
    )
    assert ours["state"] == torchs["state"]
    assert ours["losses"] == torchs["losses"]
    assert {d["strategy"] for d in ours["decisions"]} == {"reshard"}
    # The records each rank read half of are checked from the parts the ranks read together:
    # no rank reads another's half for it.
    read = [d["read_for_record_checks"] for d in ours["decisions"]]
    assert read == [{"records": 0, "bytes": 0}] * 4

    # Each of the four ranks reads half of a record the two saved: a flipped byte in one
    # fails the load, naming the record (no read of a part can check it).
    corrupt = trained / "step_1_corrupt"
    shutil.copytree(trained / "step_1", corrupt)
    stored = FileSystemReader(str(corrupt)).read_metadata().storage_data
    info = max(stored.values(), key=lambda i: i.length)
    raw = bytearray((corrupt / info.relative_path).read_bytes())
    raw[info.offset + info.length // 4] ^= 0x10
    (corrupt / info.relative_path).write_bytes(bytes(raw))
    failed = torchrun(4, trained, "resume", "step_1_corrupt", 1, STEPS, "ckptctl", check=False)
    assert failed.returncode != 0 and "fails its CRC-32 check" in failed.stderr


def test_lost_shards_are_cut_from_the_full_checkpoint(trained: Path, cli) -> None:
    full = trained / "full"
    cli("consolidate", str(trained / "step_1"), str(full), "--format", "torch")
    lost = trained / "step_1_lost"
    shutil.copytree(trained / "step_1", lost)
    (lost / "__1_0.distcp").unlink()

    failed = torchrun(2, trained, "resume", "step_1_lost", 1, STEPS, "ckptctl", check=False)
    assert failed.returncode != 0 and "__1_0.distcp" in failed.stderr

    torchrun(2, trained, "resume", "step_1_lost", 1, STEPS, "ckptctl", full / "state_dict.pt")
    resumed = result(trained / "resume_ckptctl_2.json")
    assert resumed["losses"] == result(trained / "train_2.json")["losses"][2:]
    assert {d["strategy"] for d in resumed["decisions"]} == {"from-full"}
    rank1 = resumed["decisions"][1]["bytes_by_file"]
    assert "__1_0.distcp" not in rank1 and "full:state_dict.pt" in rank1

    # Each rank reads half of every record of the full file, so no read can check one: a
    # flipped byte must still fail the load, naming the record, on the rank that reads it.
    corrupt = trained / "corrupt" / "state_dict.pt"
    corrupt.parent.mkdir()
    raw = bytearray((full / "state_dict.pt").read_bytes())
    with zipfile.ZipFile(full / "state_dict.pt") as archive:
        biggest = max(archive.infolist(), key=lambda e: e.file_size)
    header = raw[biggest.header_offset : biggest.header_offset + 30]
    start = biggest.header_offset + 30 + int.from_bytes(header[26:28], "little")
    start += int.from_bytes(header[28:30], "little")
    raw[start + biggest.file_size // 4] ^= 0x10  # in the first rank's half
    corrupt.write_bytes(bytes(raw))
    failed = torchrun(
        2, trained, "resume", "step_1_lost", 1, STEPS, "ckptctl", corrupt, check=False
    )
    assert failed.returncode != 0
    assert f"storage record {biggest.filename.rsplit('/', 1)[1]} fails its CRC-32" in failed.stderr


def test_a_rank_killed_mid_save_leaves_it_incomplete_and_the_previous_one_loads(
    tmp_path: Path, cli
) -> None:
    killed = torchrun(2, tmp_path, "kill", STEPS, 2, check=False)
    assert killed.returncode != 0
    assert (tmp_path / "step_1" / MANIFEST).exists()
    assert not (tmp_path / "step_2" / MANIFEST).exists()
    refused = cli.runner.invoke(app, ["verify", str(tmp_path / "step_2")])
    assert refused.exit_code != 0, refused.output
    with pytest.raises(CheckpointError, match="never finished"):
        ckptctl.load({"step": 0}, checkpoint_id=str(tmp_path / "step_2"))

    torchrun(2, tmp_path, "resume", "step_1", 1, STEPS, "ckptctl")
    uninterrupted = torchrun_losses(tmp_path)
    assert result(tmp_path / "resume_ckptctl_2.json")["losses"] == uninterrupted[2:]


def torchrun_losses(tmp_path: Path) -> list[float]:
    """The losses of an uninterrupted run of the same job."""
    out = tmp_path / "uninterrupted"
    out.mkdir()
    torchrun(2, out, "train", STEPS)
    return result(out / "train_2.json")["losses"]


def test_dtensors_of_any_placement_load_into_any_other(tmp_path: Path) -> None:
    """A 2x2 mesh: row, column and 3-D shards, replicated on one mesh dimension, uneven splits,
    FSDP2-over-TP strided shards (saved from and loaded into: the 2-D layout every torchtitan
    run has);
    loaded into other placements, each rank's shards equal what torch's ``distribute_tensor``
    cuts, and what torch's own ``dcp.load`` fills from the same checkpoint. A packed strided
    shard (transformers' ``packed_colwise``: two strips per rank) is refused by name, saving and
    loading."""
    torchrun(4, tmp_path, script=PLACEMENTS)
    for rank in range(4):
        found = result(tmp_path / f"rank{rank}.json")
        assert found["ours_wrong"] == [] and found["torchs_wrong"] == [], (rank, found)
        assert found["strategy"] == "reshard"
        assert found["packed_refused"] == [["save", True], ["load", True]], (rank, found)


def test_a_rank_that_cannot_write_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    torchrun(2, tmp_path, "fail")
    for rank in range(2):
        error = result(tmp_path / f"fail_{rank}.json")["error"]
        assert error and "failed on rank 1" in error and "__1_0.distcp" in error, error
    assert not (tmp_path / "step_0" / MANIFEST).exists()
    assert (tmp_path / "step_0" / INCOMPLETE).exists()
