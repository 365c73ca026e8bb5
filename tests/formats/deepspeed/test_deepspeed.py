"""Reading DeepSpeed checkpoints (issue 16), judged by DeepSpeed 0.19.8 itself.

DeepSpeed trains a tiny transformers Llama (tied embeddings, a frozen weight, two parameter
groups) two AdamW steps under ZeRO 1, 2 and 3, fp32 and bf16, and ``BF16_Optimizer``, on 2, 3
and 4 gloo processes (``tests/deepspeed_runs.py``); ckptctl reads it as the HF Trainer leaves
it (``config.json`` beside ``latest``), as its tag directory with ``--hf-config``, with
``--tag``, without any config, and from S3. Its HF weights must be exactly
``zero_to_fp32``'s (and give the same transformers logits), its masters and Adam moments
exactly ``ds_to_universal``'s; broken checkpoints are refused in one line.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is the oracle here")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

from tests import deepspeed_runs as runs  # noqa: E402  (after the skips)
from tests.io import test_s3  # noqa: E402  (moto's S3 server fixtures)

pytestmark = pytest.mark.oracle
written = runs.written  # the DeepSpeed runs, written once per session


s3_endpoint, bucket = test_s3.s3_endpoint, test_s3.bucket


@pytest.mark.parametrize("run", runs.ZERO_TO_FP32_RUNS)
def test_consolidated_weights_are_zero_to_fp32s(
    written: dict[str, Path], run: str, tmp_path: Path, cli
) -> None:
    ckpt = written[run]
    info = cli.json("inspect", ckpt)
    assert info["format"] == "deepspeed" and info["layout"]["dp"] == int(runs.RUNS[run][1])
    assert cli.json("verify", ckpt)["ok"]

    cli("consolidate", ckpt, tmp_path / "hf", "--format", "hf")
    ours = safetensors.load_file(tmp_path / "hf" / "model.safetensors")
    theirs = torch.load(ckpt.parent / f"{run}.fp32.pt", weights_only=True)
    # zero_to_fp32 also lists the tied alias lm_head.weight; transformers ties it on load.
    assert set(theirs) - set(ours) == {"lm_head.weight"}
    frozen = "model.layers.0.mlp.down_proj.weight" if "--no-frozen" not in runs.RUNS[run] else None
    if (
        frozen and frozen not in theirs
    ):  # ZeRO 1 records no frozen parameters and zero_to_fp32 drops
        # them; ckptctl takes them from the saved module
        states = next(ckpt.glob("*/mp_rank_00_model_states.pt"))
        theirs[frozen] = torch.load(states, weights_only=False)["module"][frozen]
    for name, tensor in ours.items():
        # Trained parameters are the fp32 masters; a frozen one keeps the module's dtype
        # (zero_to_fp32 upcasts it, exactly).
        assert tensor.dtype == torch.float32 or name == frozen, name
        assert torch.equal(tensor.float(), theirs[name]), name

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    reference = transformers.LlamaForCausalLM(model.config)
    reference.load_state_dict(theirs)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_tag_directory_with_hf_config(written: dict[str, Path], tmp_path: Path, cli) -> None:
    ckpt = written["stage2-dp2"]
    tag = tmp_path / "global_step2"
    shutil.copytree(ckpt / "global_step2", tag)
    # No config beside a bare tag directory: the model is unknown until --hf-config says.
    result = cli("inspect", tag)
    assert "config.json missing" in result.stderr and "--hf-config" in result.stderr
    result = cli("consolidate", tag, tmp_path / "no", "--format", "hf", code=2)
    assert "--hf-config" in result.stderr and "Traceback" not in result.stderr
    info = cli.json("--hf-config", ckpt / "config.json", "inspect", tag)
    assert info["format"] == "deepspeed"
    cli("--hf-config", ckpt / "config.json", "consolidate", tag, tmp_path / "hf", "--format", "hf")
    assert cli.json("verify", tmp_path / "hf", "--against", ckpt, "--weights-only")["ok"]


def test_missing_rank_file_is_refused(written: dict[str, Path], tmp_path: Path, cli) -> None:
    src = tmp_path / "src"
    shutil.copytree(written["stage2-dp4"], src)
    (src / "global_step2" / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    result = cli("consolidate", src, tmp_path / "out", "--format", "hf", code=3)
    assert "dp_world_size=4" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize(
    "run",
    [
        "stage2-dp2", "stage1-dp2", "stage2-bf16-dp2", "stage3-dp2", "stage3-bf16-dp3",
        "bf16-optimizer-dp2",
    ],
)  # fmt: skip
def test_adam_state_is_ds_to_universals(written: dict[str, Path], run: str) -> None:
    """fp32 masters and both Adam moments of every trained parameter, bit for bit as DeepSpeed's
    own ds_to_universal extracts them from the same files."""
    ckpt = written[run]
    names = sorted(p.name for p in (runs.ds_universal(ckpt) / "zero").iterdir() if p.is_dir())
    # every trained parameter; stages 1 and 2 add the frozen one and the tied alias lm_head
    assert len(names) >= 19
    compared = 0
    for state, theirs in (("", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
        ours = runs.by_hf_name(ckpt, state)
        for name in names:
            want = runs.universal_state(ckpt, name, theirs)
            if want is None or name == "lm_head.weight":  # frozen: no Adam state; tied alias
                continue
            got = ours[name]
            if state and name == runs.FROZEN:
                assert got.isnan().all(), "a frozen parameter has no Adam state"
                continue
            assert torch.equal(got, want.view(got.shape)), (state, name)
            compared += 1
    assert compared >= 3 * 18


def test_tag_is_chosen_or_refused(written: dict[str, Path], tmp_path: Path, cli) -> None:
    ckpt = written["stage2-dp2"]
    assert cli.json("--tag", "global_step2", "inspect", ckpt)["format"] == "deepspeed"
    result = cli("--tag", "global_step9", "inspect", ckpt, code=3)
    assert "no such tag" in result.stderr and "global_step2" in result.stderr
    assert "Traceback" not in result.stderr
    # Any other format: --tag would change nothing, so it is refused rather than ignored.
    from ckptctl import synth

    model = synth.make_model(synth.tiny_llama_config(), seed=2)
    synth.write_megatron(model, synth.adam_step(model), str(tmp_path / "megatron"))
    result = cli("--tag", "global_step2", "inspect", tmp_path / "megatron", code=2)
    assert "--tag" in result.stderr and "--iteration" in result.stderr


def test_broken_checkpoints_are_refused(written: dict[str, Path], tmp_path: Path, cli) -> None:
    """Mixed stages, a truncated rank file and param_shapes that disagree with the partitions:
    one line each, naming the file, and nothing written."""
    mixed = tmp_path / "mixed"
    shutil.copytree(written["stage2-dp2"], mixed)
    stage3 = written["stage3-dp2"] / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    shutil.copy(stage3, mixed / "global_step2")
    result = cli("consolidate", mixed, tmp_path / "out1", "--format", "hf", code=3)
    assert "mixed stages" in result.stderr and len(result.stderr.strip().splitlines()) == 1

    truncated = tmp_path / "truncated"
    shutil.copytree(written["stage2-dp2"], truncated)
    victim = truncated / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    result = cli("consolidate", truncated, tmp_path / "out2", "--format", "hf", code=3)
    assert "zero_pp_rank_1" in result.stderr and "truncated" in result.stderr
    assert "Traceback" not in result.stderr

    shapes = tmp_path / "shapes"
    shutil.copytree(written["stage3-dp2"], shapes)
    for states in (shapes / "global_step2").glob("*_model_states.pt"):
        saved = torch.load(states, weights_only=False)
        del saved["param_shapes"][1]["model.norm.weight"]
        torch.save(saved, states)
    result = cli("consolidate", shapes, tmp_path / "out3", "--format", "hf", code=3)
    assert "model.norm.weight" in result.stderr and "Traceback" not in result.stderr
    for out in ("out1", "out2", "out3"):
        assert not (tmp_path / out / "model.safetensors").exists()


def test_without_config_json_torch_and_universal_keep_deepspeeds_names(
    written: dict[str, Path], tmp_path: Path, cli
) -> None:
    """No config.json and no --hf-config: the model is unknown, yet --format torch and
    deepspeed-universal still work, under the module's own parameter names; HF is refused."""
    src = tmp_path / "src"
    shutil.copytree(written["stage3-dp2"], src)
    (src / "config.json").unlink()
    cli("consolidate", src, tmp_path / "t", "--format", "torch")
    state = torch.load(tmp_path / "t" / "state_dict.pt", weights_only=True)
    theirs = torch.load(written["stage3-dp2"].parent / "stage3-dp2.fp32.pt", weights_only=True)
    assert state["model"].keys() == theirs.keys()  # lm_head.weight: the tied alias
    for name, tensor in theirs.items():
        assert torch.equal(state["model"][name], tensor), name
    cli("consolidate", src, tmp_path / "u", "--format", "deepspeed-universal")
    assert not (tmp_path / "u" / "config.json").exists()
    assert cli.json(
        "--hf-config",
        written["stage3-dp2"] / "config.json",
        "verify",
        tmp_path / "u",
        "--against",
        src,
    )["ok"]
    result = cli("consolidate", src, tmp_path / "hf", "--format", "hf", code=2)
    assert "--hf-config" in result.stderr


def test_on_s3(written: dict[str, Path], bucket: str, tmp_path: Path, cli) -> None:
    """The rank files read by byte range from an object store, a universal checkpoint written
    to it: the same bytes as from local disk."""
    ckpt = written["stage3-bf16-dp3"]
    test_s3._upload(ckpt, f"{bucket}/ds")
    cli("consolidate", f"{bucket}/ds", tmp_path / "from-s3", "--format", "hf")
    cli("consolidate", ckpt, tmp_path / "local", "--format", "hf")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "from-s3" / name).read_bytes() == (
            tmp_path / "local" / name
        ).read_bytes()
    cli("consolidate", f"{bucket}/ds", f"{bucket}/universal", "--format", "deepspeed-universal")
    assert cli.json("verify", f"{bucket}/universal", "--against", ckpt)["ok"]


@pytest.mark.parametrize("run", ["stage2-bf16-dp2", "stage3-dp2", "bf16-optimizer-dp2"])
def test_inspect_and_dry_runs_do_not_import_torch(
    written: dict[str, Path], run: str, tmp_path: Path
) -> None:
    from tests.cli.test_startup import run as in_fresh_interpreter

    ckpt = written[run]
    assert in_fresh_interpreter("inspect", ckpt, "--json") == "torch not imported"
    dry_run = ("consolidate", ckpt, tmp_path / "hf", "--dry-run")
    assert in_fresh_interpreter(*dry_run) == "torch not imported"


@pytest.mark.parametrize("with_base", [False, True], ids=["alone", "delta"])
def test_compressed_zero_checkpoints_round_trip_and_read_as_the_original(
    written: dict[str, Path], tmp_path: Path, cli, with_base: bool
) -> None:
    """compress (issue 20) of a real ZeRO checkpoint, as a delta against another run with the
    same files or alone: restored byte for byte, and read by every command as the original."""
    import filecmp

    src, base = written["stage2-bf16-dp2"], written["stage2-bf16-dp2-all"]
    cli("compress", src, tmp_path / "packed", *(["--base", base] if with_base else []))
    cli("decompress", tmp_path / "packed", tmp_path / "back")
    files = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    assert sorted(str(p.relative_to(tmp_path / "back")) for p in (tmp_path / "back").rglob("*")
                  if p.is_file()) == files  # fmt: skip
    _, mismatch, errors = filecmp.cmpfiles(src, tmp_path / "back", files, shallow=False)
    assert not mismatch and not errors
    assert cli.json("verify", tmp_path / "packed", "--against", src)["ok"]
    cli("consolidate", tmp_path / "packed", tmp_path / "hf-packed", "--format", "hf")
    cli("consolidate", src, tmp_path / "hf-plain", "--format", "hf")
    a = (tmp_path / "hf-packed/model.safetensors").read_bytes()
    assert a == (tmp_path / "hf-plain/model.safetensors").read_bytes()


def test_quantized_zero_checkpoint_stays_within_its_recorded_errors(
    written: dict[str, Path], tmp_path: Path, cli
) -> None:
    """--quantize all of ZeRO's flat fp32 partitions (masters and moments) and bf16 module:
    each tensor within the error recorded at compression, and DeepSpeed's own files valid."""
    import zipfile

    src = written["stage2-bf16-dp2"]
    cli("compress", src, tmp_path / "q", "--quantize", "all")
    checks = cli.json("verify", tmp_path / "q", "--against", src)
    assert checks["ok"], checks
    assert sum("quantized_max_abs_error" in t for t in checks["tensors"]) >= 3
    cli("decompress", tmp_path / "q", tmp_path / "back")
    for path in (tmp_path / "back").rglob("*.pt"):
        with zipfile.ZipFile(path) as zf:
            assert zf.testzip() is None, path


@pytest.mark.parametrize("run", ["stage2-bf16-dp2-all", "stage3-dp2", "stage1-dp2"])
def test_universal_conversion_moves_every_byte_by_kernel_copy(
    written: dict[str, Path], run: str, tmp_path: Path
) -> None:
    """A universal checkpoint holds the masters and moments exactly as the rank files do:
    every byte moves by kernel copy (fragments split between ranks included, however small)
    and the ``step`` files are written from their value, so the job needs no numpy (its
    import is ~60 ms of a ~1 s job). (Runs whose frozen weights are bf16 need torch: the
    universal ``fp32`` file of a frozen weight is a cast.) That the files are right is proven
    above and by DeepSpeed resuming from them (test_deepspeed_targets)."""
    import json
    import subprocess
    import sys

    from tests.cli.test_startup import DRIVER, imported

    ckpt = written[run]
    argv = ("consolidate", ckpt, tmp_path / "u", "--format", "deepspeed-universal", "--json")
    assert imported(*argv) == set()
    report = json.loads(
        subprocess.run(
            [sys.executable, "-c", DRIVER, *map(str, argv[:2]), tmp_path / "v", *argv[3:]],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    # (by the kernel's copy, or from mapped pages where the file system copies through a pipe)
    (moved,) = report["bytes_copied_without_passing_through"].values()
    assert moved == report["bytes_read"]
