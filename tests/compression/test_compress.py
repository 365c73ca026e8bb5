"""``ckptctl compress`` / ``decompress`` on consecutive checkpoints of a real (tiny) training
run: every format round-trips byte for byte, with and without a base; every command reads the
compressed copy as the original; a base that changed is refused."""

from __future__ import annotations

import filecmp
import json
import os
from pathlib import Path

import pytest
import torch

import ckptctl
from ckptctl.cli.main import app
from ckptctl.synth.model import make_model, tiny_llama_config

STEPS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama trained with AdamW; after each step: a DCP checkpoint (``ckptctl.save``)
    and HF safetensors (transformers' ``save_pretrained``)."""
    out = tmp_path_factory.mktemp("run")
    model = make_model(tiny_llama_config(), seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.manual_seed(2)
    for step in range(STEPS):
        x = torch.randint(0, model.config.vocab_size, (2, 16))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        ckptctl.save(state, checkpoint_id=str(out / f"dcp_{step}"))
        model.save_pretrained(out / f"hf_{step}")
    return out


CONVERSIONS = {
    "megatron": lambda run, step, out: (
        "consolidate", run / f"hf_{step}", out, "--format", "megatron"
    ),
    "torch": lambda run, step, out: (
        "consolidate", run / f"dcp_{step}", out, "--format", "torch"
    ),
    "torch_dist": lambda run, step, out: (
        "reshard", run / f"hf_{step}", out, "--tp", "1", "--pp", "1", "--format", "torch_dist"
    ),
    "universal": lambda run, step, out: (
        "consolidate", run / f"hf_{step}", out, "--format", "deepspeed-universal"
    ),
}  # fmt: skip
"""The other formats' checkpoints of each step, converted from the run's by ckptctl."""


def same_tree(a: Path, b: Path) -> None:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b
    _, mismatch, errors = filecmp.cmpfiles(a, b, [str(f) for f in files_a], shallow=False)
    assert not mismatch and not errors


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize("kind", ["dcp", "hf", "megatron", "torch", "torch_dist", "universal"])
@pytest.mark.parametrize("with_base", [False, True], ids=["alone", "delta"])
def test_round_trip_is_byte_exact_and_commands_read_it(
    run: Path, tmp_path: Path, cli, kind: str, with_base: bool
) -> None:
    src, base = run / f"{kind}_1", run / f"{kind}_0"
    if kind not in ("dcp", "hf"):  # converted from the run's checkpoints by ckptctl itself
        for step in range(STEPS):
            if not (run / f"{kind}_{step}").exists():
                cli(*CONVERSIONS[kind](run, step, run / f"{kind}_{step}"))
    packed, restored = tmp_path / "packed", tmp_path / "restored"
    args = ["compress", src, packed, *(["--base", base] if with_base else []), "--json"]
    report = json.loads(cli(*args).stdout)
    assert report["bytes_in"] == size(src) and report["bytes_out"] < size(src)
    assert (report["delta_files"] > 0) == with_base

    cli("decompress", packed, restored)
    same_tree(src, restored)

    checks = cli.json("verify", packed, "--against", src)
    assert checks["ok"], checks
    assert {c["name"] for c in checks["checks"] if c["status"] == "passed"} >= {
        "compressed",
        "structure",
        "coverage",
    }
    inspected = cli.json("inspect", packed)
    assert inspected["format"] == cli.json("inspect", src)["format"]
    (note,) = [n for n in inspected["notes"] if n.startswith("compressed")]
    assert "lossless" in note and ("against the base" in note) == with_base


def test_consolidating_a_compressed_checkpoint_writes_what_the_original_gives(
    run: Path, tmp_path: Path, cli
) -> None:
    cli("compress", run / "dcp_1", tmp_path / "packed", "--base", run / "dcp_0")
    cli("consolidate", tmp_path / "packed", tmp_path / "from-packed", "--format", "torch")
    cli("consolidate", run / "dcp_1", tmp_path / "from-original", "--format", "torch")
    a, b = tmp_path / "from-packed" / "state_dict.pt", tmp_path / "from-original" / "state_dict.pt"
    assert a.read_bytes() == b.read_bytes()


def test_a_base_that_changed_is_refused_by_name(run: Path, tmp_path: Path, cli) -> None:
    base = tmp_path / "base"
    cli("consolidate", run / "hf_0", base, "--format", "hf")
    cli("compress", run / "hf_1", tmp_path / "packed", "--base", base)
    weights = base / "model.safetensors"
    os.utime(weights, ns=(1, 1))  # same bytes, but not provably the same file any more
    done = cli.runner.invoke(app, ["verify", str(tmp_path / "packed"), "--json"])
    assert done.exit_code != 0
    assert "model.safetensors changed since compression" in done.stdout
    refused = cli.runner.invoke(app, ["decompress", str(tmp_path / "packed"), str(tmp_path / "o")])
    assert refused.exit_code == 3 and "model.safetensors" in refused.output


def test_outputs_never_land_in_a_source_or_the_base(run: Path, cli) -> None:
    done = cli.runner.invoke(app, ["compress", str(run / "hf_1"), str(run / "hf_1" / "packed")])
    assert done.exit_code == 2 and "never writes into" in done.output
    done = cli.runner.invoke(
        app, ["compress", str(run / "hf_1"), str(run / "hf_0" / "x"), "--base", str(run / "hf_0")]
    )
    assert done.exit_code == 2 and "base" in done.output


def test_the_plan_counts_the_cpu_decoding_costs(run: Path, tmp_path: Path, cli) -> None:
    from planners.cost import DECODE_BANDWIDTH

    cli("compress", run / "dcp_1", tmp_path / "packed", "--base", run / "dcp_0")
    args = ("--format", "torch", "--dry-run")
    packed = cli.json("consolidate", tmp_path / "packed", tmp_path / "a", *args)
    plain = cli.json("consolidate", run / "dcp_1", tmp_path / "b", *args)
    assert packed["estimates"]["bytes_read"] == plain["estimates"]["bytes_read"]
    extra = packed["estimates"]["seconds"] - plain["estimates"]["seconds"]
    decoding = packed["estimates"]["bytes_read"] / DECODE_BANDWIDTH
    assert 0.5 * decoding < extra <= decoding  # fewer bytes fetched, then decoded
    assert any("ratio" in n for n in packed["notes"])


@pytest.mark.parametrize("with_base", [False, True], ids=["alone", "delta"])
def test_a_dry_run_measures_the_ratio_the_job_gets_and_writes_nothing(
    run: Path, tmp_path: Path, cli, with_base: bool
) -> None:
    from ckptctl.model.profile import PROFILES
    from planners.cost import compress_seconds

    base = ("--base", run / "dcp_0") if with_base else ()
    plan = cli.json("compress", run / "dcp_1", tmp_path / "packed", *base, "--dry-run")
    assert not (tmp_path / "packed").exists()
    assert plan["bytes_in"] == size(run / "dcp_1") and plan["files"] == 3
    assert plan["delta_files"] == (3 if with_base else 0)
    done = cli.json("compress", run / "dcp_1", tmp_path / "packed", *base)
    # Eight 4 MiB chunks spread over the bytes: most of this small checkpoint.
    assert plan["ratio"] == pytest.approx(done["ratio"], rel=0.05)
    local = PROFILES["local-nvme"]
    expected = compress_seconds(
        plan["bytes_in"], plan["ratio"], 3, local, local, local if with_base else None
    )
    assert plan["estimated_seconds"] == pytest.approx(expected, abs=1e-3)


def test_a_dry_run_refuses_what_the_job_would(run: Path, tmp_path: Path, cli) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "thesis.tex").write_text("years of work")
    done = cli.runner.invoke(
        app, ["compress", str(run / "hf_1"), str(tmp_path / "full"), "--dry-run"]
    )
    assert done.exit_code == 2 and "not empty" in done.output
    done = cli.runner.invoke(
        app, ["compress", str(run / "hf_1"), str(run / "hf_1" / "x"), "--dry-run"]
    )
    assert done.exit_code == 2 and "never writes into" in done.output


def test_a_damaged_chunk_fails_verify_however_the_file_is_checked(
    run: Path, tmp_path: Path, cli
) -> None:
    """Files the manifest pass decodes are not decoded twice; a damaged one still fails the
    compressed check, with the manifest's."""
    cli("compress", run / "dcp_1", tmp_path / "packed", "--base", run / "dcp_0")
    data = tmp_path / "packed/data/__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    done = cli.runner.invoke(app, ["verify", str(tmp_path / "packed"), "--json"])
    assert done.exit_code == 1
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["compressed"]["status"] == "failed"
    assert "__0_0.distcp" in checks["compressed"]["detail"]
