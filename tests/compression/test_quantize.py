"""``compress --quantize``: opt-in lossy storage, recorded as lossy, judged by third parties.

transformers loads the decoded HF weights and its logits stay close to the original's;
torch's own DCP loader reads a quantized DCP checkpoint; Python's zipfile finds every CRC-32
of the decoded ``torch.save`` archives right; ``verify --against`` reports each tensor's error
and holds it to the error recorded at compression; nothing is quantized unless asked."""

from __future__ import annotations

import io
import json
import math
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckptctl
from ckptctl import synth
from ckptctl.cli.main import app
from ckptctl.synth.model import make_model, tiny_llama_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama after two AdamW steps: its HF weights and a DCP checkpoint with Adam."""
    out = tmp_path_factory.mktemp("quantize")
    model = make_model(tiny_llama_config(hidden_size=128, intermediate_size=256), seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(5)
    for _ in range(2):
        x = torch.randint(0, model.config.vocab_size, (2, 16))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out / "hf")
    ckptctl.save(
        {"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(out / "dcp")
    )
    return out


def test_quantized_hf_weights_load_in_transformers_within_the_recorded_error(
    trained: Path, tmp_path: Path, cli
) -> None:
    from transformers import LlamaForCausalLM

    report = cli.json("compress", trained / "hf", tmp_path / "q", "--quantize", "weights")
    assert report["ratio"] > 3  # fp32 weights as int8 plus one scale per 256
    index = json.loads((tmp_path / "q/ckptctl.compressed.json").read_text())
    assert index["lossy"] and index["quantize"]["scope"] == "weights"
    assert json.loads((tmp_path / "q/ckptctl.manifest.json").read_text())["lossy"] is True
    note = " ".join(cli.json("inspect", tmp_path / "q")["notes"])
    assert "lossy (weights quantized)" in note
    assert f"ratio {report['ratio']:.2f}" in note  # the codes count in the stored bytes

    cli("decompress", tmp_path / "q", tmp_path / "back")
    original = load_file(trained / "hf/model.safetensors")
    decoded = load_file(tmp_path / "back/model.safetensors")
    rows = index["files"]["model.safetensors"]["quantized"]
    bounds = {row[7]: row[6] for row in rows}  # name in the file -> largest error
    assert set(bounds) == {n for n, t in original.items() if t.numel() >= 4096}
    for name, tensor in original.items():
        diff = (decoded[name].double() - tensor.double()).abs().max().item()
        if name in bounds:
            assert 0 < diff <= bounds[name]
            assert diff <= tensor.abs().max().item() / 127  # half a step of the widest block
        else:
            assert torch.equal(decoded[name], tensor)  # small tensors stay exact

    ids = torch.randint(0, 1100, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = LlamaForCausalLM.from_pretrained(trained / "hf")(ids).logits
        got = LlamaForCausalLM.from_pretrained(tmp_path / "back")(ids).logits
    assert not torch.equal(got, want)
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()

    checks = cli.json("verify", tmp_path / "q", "--against", trained / "hf")
    assert checks["ok"], checks
    compared = {t["name"]: t for t in checks["tensors"]}  # by canonical name
    quantized = {n for n, t in compared.items() if "quantized_max_abs_error" in t}
    assert quantized == {row[4] for row in rows}
    for t in compared.values():
        assert t["equal"] or t["max_abs_diff"] <= t["quantized_max_abs_error"]


def _records_crc_ok(distcp: Path, metadata: Path) -> int:
    """Every zip record of a ``.distcp`` file tested by Python's zipfile (CRC-32 of every
    entry); the number of records."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(metadata)).read_metadata()
    data = distcp.read_bytes()
    records = {(i.offset, i.length) for i in md.storage_data.values()}
    for offset, length in records:
        with zipfile.ZipFile(io.BytesIO(data[offset : offset + length])) as zf:
            assert zf.testzip() is None
    return len(records)


def test_quantized_dcp_with_adam_state_is_read_by_torchs_own_loader(
    trained: Path, tmp_path: Path, cli
) -> None:
    import torch.distributed.checkpoint as dcp

    cli("compress", trained / "dcp", tmp_path / "q", "--quantize", "all")
    cli("decompress", tmp_path / "q", tmp_path / "back")
    assert _records_crc_ok(tmp_path / "back/__0_0.distcp", tmp_path / "back") > 10
    report = cli.json("verify", tmp_path / "back")
    assert report["ok"], report  # the restored manifest describes the lossy copy
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["checksums"]["status"] == "passed"  # ckptctl's own CRC check agrees
    assert "LOSSY copy: all quantized" in checks["manifest"]["detail"]

    model = make_model(tiny_llama_config(hidden_size=128, intermediate_size=256), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    template = {"model": model.state_dict(), "optim": _adam_template(model)}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(template, checkpoint_id=str(tmp_path / "back"))
    reference = {"model": model.state_dict(), "optim": _adam_template(model)}
    ckptctl.load(reference, checkpoint_id=str(trained / "dcp"))
    moments = 0
    for key, state in template["optim"]["state"].items():
        want = reference["optim"]["state"][key]
        for name in ("exp_avg", "exp_avg_sq"):
            got = state[name]
            if got.numel() >= 4096:
                moments += 1
                assert not torch.equal(got, want[name])
                # half a step of the widest block; for the second moment, stored as its
                # square root, (s + e)^2 - s^2 with |e| <= max(s) / 254
                if name == "exp_avg":
                    bound = want[name].abs().max() / 254 * 1.01
                else:
                    bound = want[name].max() / 127 * 1.01
                assert (got - want[name]).abs().max() <= bound
            if name == "exp_avg_sq":
                assert (got >= 0).all()
        assert torch.equal(state["step"], want["step"])
    assert moments >= 10
    del opt


def _adam_template(model: torch.nn.Module) -> dict:
    return {
        "state": {
            i: {
                "step": torch.zeros(()),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
            for i, p in enumerate(model.parameters())
        },
        "param_groups": [
            {
                "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                "amsgrad": False, "foreach": None, "maximize": False, "capturable": False,
                "differentiable": False, "fused": None, "decoupled_weight_decay": True,
                "params": list(range(len(list(model.parameters())))),
            }
        ],
    }  # fmt: skip


def test_quantized_megatron_files_are_valid_zips_and_convert(tmp_path: Path, cli) -> None:
    model = synth.make_model(synth.tiny_llama_config(hidden_size=128, num_layers=2), seed=6)
    src = tmp_path / "ck"
    synth.write_megatron(model, synth.adam_step(model, seed=6), src, tp=2, pp=1)
    cli("compress", src, tmp_path / "q", "--quantize", "all")
    cli("decompress", tmp_path / "q", tmp_path / "back")
    for path in (tmp_path / "back").rglob("*.pt"):
        with zipfile.ZipFile(path) as zf:
            assert zf.testzip() is None, path
    checks = cli.json("verify", tmp_path / "q", "--against", src)
    assert checks["ok"], checks
    quantized = [t for t in checks["tensors"] if "quantized_max_abs_error" in t]
    assert any(t["name"].startswith("exp_avg_sq/") for t in quantized)
    assert any(not t["name"].startswith("exp_avg") for t in quantized)
    # Every command reads it as it is: a consolidation equal, within the errors, to the source's.
    cli("consolidate", tmp_path / "q", tmp_path / "hf", "--format", "hf")
    report = cli.json("verify", tmp_path / "hf", "--against", tmp_path / "back", "--weights-only")
    assert report["ok"] and report["against"]["compared"] == report["against"]["held"][0]


def test_a_tensor_holding_nan_stays_exact(trained: Path, tmp_path: Path, cli) -> None:
    import shutil

    src = Path(shutil.copytree(trained / "hf", tmp_path / "src"))
    tensors = load_file(src / "model.safetensors")
    poisoned = "model.layers.0.mlp.up_proj.weight"
    tensors[poisoned][3, 5] = math.nan
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    cli("compress", src, tmp_path / "q", "--quantize", "weights")
    cli("decompress", tmp_path / "q", tmp_path / "back")
    decoded = load_file(tmp_path / "back/model.safetensors")
    assert torch.equal(decoded[poisoned].nan_to_num(), tensors[poisoned].nan_to_num())
    assert decoded[poisoned].isnan()[3, 5]
    other = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(decoded[other], tensors[other])


def test_nothing_is_quantized_unless_asked(trained: Path, tmp_path: Path, cli) -> None:
    report = cli.json("compress", trained / "hf", tmp_path / "plain")
    index = json.loads((tmp_path / "plain/ckptctl.compressed.json").read_text())
    assert not index["lossy"] and report["ratio"] < 1.5
    assert all("quantized" not in f for f in index["files"].values())
    done = cli.runner.invoke(
        app,
        ["compress", str(trained / "hf"), str(tmp_path / "x"), "--quantize", "weights",
         "--base", str(trained / "hf")],
    )  # fmt: skip
    assert done.exit_code == 2 and "--quantize with --base" in done.output
    done = cli.runner.invoke(
        app,
        ["compress", str(trained / "hf"), str(tmp_path / "y"), "--quantize", "half"],
    )
    assert done.exit_code == 2 and "choose weights or all" in done.output


def test_a_quantizing_dry_run_estimates_what_the_job_stores(
    trained: Path, tmp_path: Path, cli
) -> None:
    for scope in ("weights", "all"):
        plan = cli.json(
            "compress", trained / "dcp", tmp_path / scope, "--quantize", scope, "--dry-run"
        )
        assert not (tmp_path / scope).exists() and plan["quantize"] == scope
        done = cli.json("compress", trained / "dcp", tmp_path / scope, "--quantize", scope)
        assert plan["estimated_bytes_out"] == pytest.approx(done["bytes_out"], rel=0.1)
    weights = cli.json(
        "compress", trained / "dcp", tmp_path / "x", "--quantize", "weights", "--dry-run"
    )
    every = cli.json("compress", trained / "dcp", tmp_path / "x", "--quantize", "all", "--dry-run")
    assert 0 < weights["quantized_bytes"] < every["quantized_bytes"] < every["bytes_in"]
