"""verl FSDP actors on HSDP meshes (``(Replicate(), Shard(0))`` over replicas of shard
groups, verl's ``fsdp_size``), read and written at other shard groups: torch, loading each
rank's files into FSDP2 on the new mesh as verl 0.9.1's ``load_checkpoint`` does, is the judge
(``oracles/verl_fsdp_loader``); the actors come from ``oracles/verl_fsdp_writer`` (FSDP2 on
gloo, the mesh named as verl's ``create_device_mesh`` names it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.formats.verl.actors import (
    ORACLE,
    actor,
    assert_resumed,
    check_against_truth,
    resumed,
    truth,
    values,
)
from tests.oracle_runner import run_oracle

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four ranks: 2 replicas x 2-rank shard groups (the mesh's dimensions ``ddp``, ``fsdp``)."""
    out = tmp_path_factory.mktemp("verl_hsdp")
    run_oracle(ORACLE, "qwen3", out, 4, "hsdp", timeout=300)
    return out


def test_a_hybrid_sharded_actor_checkpoint_reads_each_shard_once(
    hsdp: Path, tmp_path: Path, cli
) -> None:
    """Every shard is on two ranks' files; the output is the trained model, and Megatron holds
    the Adam state bit for bit. Written for 6 ranks, the shard groups kept (3 replicas x 2
    shards), FSDP2 on that HSDP mesh loads it as verl does: the trained weights and Adam state
    bit for bit, a step taken."""
    inspected = cli("inspect", actor(hsdp)).stderr  # a note
    assert "4 ranks, HSDP (2 replicas of 2-rank shard groups)" in inspected
    cli("consolidate", actor(hsdp), tmp_path / "hf")
    check_against_truth(hsdp, tmp_path / "hf")
    cli("reshard", actor(hsdp), tmp_path / "meg", "--tp", "2", "--format", "megatron")
    report = cli.json("verify", tmp_path / "meg", "--against", actor(hsdp))
    assert report["ok"] and any(t["name"].startswith("exp_avg/") for t in report["tensors"])
    for world in ("2", "5"):  # shard groups of 2 kept: a multiple of 2 above it
        result = cli("reshard", actor(hsdp), tmp_path / f"w{world}", "--dp", world, code=2)
        assert "HSDP (2 replicas of 2-rank shard groups)" in result.stderr
        assert "--fsdp-size" in result.stderr
        assert not (tmp_path / f"w{world}").exists()
    summary = cli.json("reshard", actor(hsdp), tmp_path / "w6", "--dp", "6")
    assert any("HSDP (3 replicas of 2-rank shard groups)" in n for n in summary["notes"])
    assert_resumed(truth(hsdp), resumed(tmp_path / "w6", 6, tmp_path, shards=2))


def _meshes(directory: Path) -> dict[str, Any]:
    """Each rank's model file's device mesh as torch unpickles it: ranks, layout, dimension
    and process group names, this rank's coordinates."""
    out = {}
    for file in sorted(directory.glob("model_world_size_*.pt")):
        state = torch.load(file, weights_only=False)
        first = next(v for v in state.values() if hasattr(v, "device_mesh"))
        mesh = first.device_mesh
        out[file.name] = (
            mesh.mesh.tolist(),
            mesh._layout,
            mesh._mesh_dim_names,
            mesh._dim_group_names,
            mesh._coordinate_on_dim,
            first.placements,
        )
    return out


def test_an_hsdp_actor_resumes_on_other_shard_groups_and_back(
    hsdp: Path, tmp_path: Path, cli
) -> None:
    """2 x 2 -> 2 replicas of 3 (``--dp 6 --fsdp-size 3``) and -> one flat FSDP2 mesh of the
    same 4 ranks (``--fsdp-size 4``): torch loads each at its mesh, the trained weights and
    Adam state bit for bit. Back from the flat mesh to 2 x 2: every value, placement and
    mesh field as the source's (process group names as a fresh run's, which the oracle's
    is)."""
    summary = cli.json("reshard", actor(hsdp), tmp_path / "g3", "--dp", "6", "--fsdp-size", "3")
    assert (
        "device mesh: HSDP (2 replicas of 2-rank shard groups) -> HSDP (2 replicas of 3-rank "
        "shard groups) (set by --fsdp-size: verl's fsdp_size 3)" in summary["notes"]
    )
    assert_resumed(truth(hsdp), resumed(tmp_path / "g3", 6, tmp_path, shards=3))
    summary = cli.json("reshard", actor(hsdp), tmp_path / "flat", "--fsdp-size", "4")
    assert not summary.get("nothing_to_change") and summary["target_layout"]["dp"] == 4
    assert any(
        n.endswith("-> FSDP2 over 4 ranks (set by --fsdp-size: verl's fsdp_size 4)")
        for n in summary["notes"]
    )
    assert_resumed(truth(hsdp), resumed(tmp_path / "flat", 4, tmp_path))

    cli("reshard", tmp_path / "flat", tmp_path / "back", "--fsdp-size", "2")
    before, after = values(actor(hsdp)), values(tmp_path / "back")
    assert before.keys() == after.keys()
    for path, value in before.items():
        if isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor):
            assert torch.equal(value[0], after[path][0]) and value[1:] == after[path][1:], path
        elif isinstance(value, torch.Tensor):
            assert torch.equal(value, after[path]), path
    assert _meshes(tmp_path / "back") == _meshes(actor(hsdp))
    assert _meshes(tmp_path / "flat") != _meshes(actor(hsdp))


def test_what_no_mesh_can_be_is_refused(hsdp: Path, tmp_path: Path, cli) -> None:
    """A shard group that does not divide the world, ``--fsdp-size`` for a format without a
    device mesh; the source's own shard group: nothing to change, nothing written."""
    result = cli("reshard", actor(hsdp), tmp_path / "a", "--fsdp-size", "3", code=2)
    assert "--fsdp-size 3 does not divide the world size 4" in result.stderr
    result = cli(
        "reshard", actor(hsdp), tmp_path / "b", "--format", "megatron", "--fsdp-size", "2", code=2
    )
    assert "--format megatron places no tensor on a device mesh" in result.stderr
    summary = cli.json("reshard", actor(hsdp), tmp_path / "c", "--fsdp-size", "2")
    assert summary["nothing_to_change"]
    assert not any((tmp_path / name).exists() for name in "abc")


def test_a_saved_plan_keeps_its_mesh(hsdp: Path, tmp_path: Path, cli) -> None:
    """``plan --out`` then ``reshard --plan``: the plan's mesh is written; another
    ``--fsdp-size`` beside it is refused, not ignored."""
    plan = tmp_path / "plan.json"
    cli("plan", actor(hsdp), tmp_path / "out", "--fsdp-size", "4", "--out", plan)
    result = cli(
        "reshard", actor(hsdp), tmp_path / "out", "--plan", plan, "--fsdp-size", "2", code=2
    )
    assert "--fsdp-size 2 (the plan: 4)" in result.stderr
    assert json.loads(plan.read_text())["source_mesh"] == [2, 2]
    result = cli("reshard", actor(hsdp), tmp_path / "out", "--plan", plan)
    # The summary says the mesh before and after, the layout (DP 4) being unchanged.
    assert "on an HSDP mesh of 2 replicas x 2 shards) ->" in result.stdout
    assert "on one FSDP2 mesh of 4" in result.stdout
    assert "changed: device mesh 2x2 -> 4" in result.stdout
    meshes = _meshes(tmp_path / "out")
    assert len(meshes) == 4 and {m[2] for m in meshes.values()} == {("fsdp",)}


def test_a_flat_actor_becomes_hsdp(tmp_path: Path, cli) -> None:
    """3 ranks on one FSDP2 mesh -> 2 replicas of 2-rank shard groups (``--dp 4 --fsdp-size
    2``): the mesh named as verl names an HSDP one; torch loads it, bit for bit."""
    run = tmp_path / "flat"
    run_oracle(ORACLE, "qwen3", run, 3, timeout=300)
    cli("reshard", actor(run), tmp_path / "hsdp", "--dp", "4", "--fsdp-size", "2")
    meshes = _meshes(tmp_path / "hsdp")
    assert {m[2] for m in meshes.values()} == {("ddp", "fsdp")}
    assert_resumed(truth(run), resumed(tmp_path / "hsdp", 4, tmp_path, shards=2))
