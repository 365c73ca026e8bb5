"""DeepSpeed ZeRO stage 1/2/3 checkpoints, written and judged by DeepSpeed 0.19.8 itself (issue 16).

DeepSpeed trains a tiny transformers Llama (tied embeddings, a frozen weight, two parameter
groups) two AdamW steps on 2 and 4 gloo processes and saves it; ckptctl reads it as the HF
Trainer leaves it (``config.json`` beside ``latest``) or as its tag directory with
``--hf-config``. Its HF consolidation must hold exactly the fp32 weights DeepSpeed's own
``get_fp32_state_dict_from_zero_checkpoint`` (``zero_to_fp32.py``) gives, and give transformers'
logits of a model loaded with those. On CPU the first DeepSpeed run compiles a communication op
(about 90 s, cached under ~/.cache/torch_extensions).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is the oracle here")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

ORACLE = Path(__file__).parent / "oracles" / "deepspeed_zero.py"
pytestmark = pytest.mark.oracle
RUNS = {
    "stage2-dp2": ("2", "2", "fp32"),
    "stage1-dp2": ("1", "2", "fp32"),
    "stage2-dp4": ("2", "4", "fp32"),
    # bf16 weights, fp32 masters: the same ZeRO keys in bf16_zero_pp_rank_* files
    "stage2-bf16-dp2": ("2", "2", "bf16"),
    # every parameter partitioned on its own; DP 3 pads the last rank's share of each
    "stage3-dp2": ("3", "2", "fp32"),
    "stage3-bf16-dp3": ("3", "3", "bf16"),
}


def _oracle(*args: object) -> None:
    subprocess.run(
        [sys.executable, str(ORACLE), *map(str, args)], check=True, capture_output=True, timeout=900
    )


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepspeed")
    out = {}
    for name, (stage, dp, dtype) in RUNS.items():
        _oracle("write", root / name, "--stage", stage, "--dp", dp, "--dtype", dtype)
        _oracle("fp32", root / name, root / f"{name}.fp32.pt")
        out[name] = root / name
    return out


@pytest.mark.parametrize("run", list(RUNS))
def test_consolidated_weights_are_zero_to_fp32s(
    written: dict[str, Path], run: str, tmp_path: Path, cli
) -> None:
    ckpt = written[run]
    info = cli.json("inspect", ckpt)
    assert info["format"] == "deepspeed" and info["layout"]["dp"] == int(RUNS[run][1])
    assert cli.json("verify", ckpt)["ok"]

    cli("consolidate", ckpt, tmp_path / "hf", "--format", "hf")
    ours = safetensors.load_file(tmp_path / "hf" / "model.safetensors")
    theirs = torch.load(ckpt.parent / f"{run}.fp32.pt", weights_only=True)
    # zero_to_fp32 also lists the tied alias lm_head.weight; transformers ties it on load.
    assert set(theirs) - set(ours) == {"lm_head.weight"}
    frozen = "model.layers.0.mlp.down_proj.weight"
    if frozen not in theirs:  # ZeRO 1 records no frozen parameters and zero_to_fp32 drops
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
    result = cli("inspect", tag, code=3)
    assert "config.json" in result.stderr and "--hf-config" in result.stderr
    assert "Traceback" not in result.stderr
    info = cli.json("--hf-config", ckpt / "config.json", "inspect", tag)
    assert info["format"] == "deepspeed"
    cli("--hf-config", ckpt / "config.json", "consolidate", tag, tmp_path / "hf", "--format", "hf")
    assert cli.json("verify", tmp_path / "hf", "--against", ckpt)["ok"]


def test_missing_rank_file_is_refused(written: dict[str, Path], tmp_path: Path, cli) -> None:
    src = tmp_path / "src"
    shutil.copytree(written["stage2-dp4"], src)
    (src / "global_step2" / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    result = cli("consolidate", src, tmp_path / "out", "--format", "hf", code=3)
    assert "dp_world_size=4" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()


def _by_hf_name(path: Path, state: str) -> dict[str, torch.Tensor]:
    """Every HF parameter's weight (``state`` empty) or Adam state as ckptctl reads it: stored
    fragments placed into canonical tensors, canonical tensors cut into HF names."""
    from ckptctl.formats.hf.layout import hf_tensors
    from ckptctl.model.catalog import parameters, state_name
    from ckptctl.probe import open_checkpoint

    ckpt = open_checkpoint(str(path))
    spec = ckpt.view.spec
    wanted = {
        (state_name(state, p.name) if state else p.name): torch.full(p.shape, float("nan"))
        for p in parameters(spec)
    }
    for file in ckpt.view.files:
        for t in file.tensors:
            if t.canonical not in wanted:
                continue
            view = None if t.view_offset is None else (t.view_offset, t.shape)
            data = ckpt.read(file.path, t.key, (0,) * len(t.shape), t.shape, view)
            for p in t.pieces:
                dst = tuple(slice(o, o + n) for o, n in zip(p.canonical, p.sizes, strict=True))
                src = tuple(slice(o, o + n) for o, n in zip(p.local, p.sizes, strict=True))
                wanted[state_name(state, t.canonical.split("/")[-1]) if state else t.canonical][
                    dst
                ] = data[src].float()
    out = {}
    for hf, canonical, shape, pieces in hf_tensors(spec):
        full = wanted[state_name(state, canonical) if state else canonical]
        tensor = torch.empty(shape)
        for p in pieces:
            dst = tuple(slice(o, o + n) for o, n in zip(p.local, p.sizes, strict=True))
            src = tuple(slice(o, o + n) for o, n in zip(p.canonical, p.sizes, strict=True))
            tensor[dst] = full[src]
        out[hf] = tensor
    return out


@pytest.mark.parametrize(
    "run", ["stage2-dp2", "stage1-dp2", "stage2-bf16-dp2", "stage3-dp2", "stage3-bf16-dp3"]
)
def test_adam_state_is_ds_to_universals(written: dict[str, Path], run: str, tmp_path: Path) -> None:
    """fp32 masters and both Adam moments of every trained parameter, bit for bit as DeepSpeed's
    own ds_to_universal extracts them from the same files."""
    ckpt = written[run]
    universal = tmp_path / "universal"
    subprocess.run(
        [
            sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
            "--input_folder", str(ckpt / "global_step2"), "--output_folder", str(universal),
            "--inject_missing_state",
        ],
        check=True, capture_output=True, timeout=600, env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )  # fmt: skip
    names = sorted(p.name for p in (universal / "zero").iterdir() if p.is_dir())
    assert len(names) == 21  # every HF parameter and the tied alias lm_head.weight
    compared = 0
    for state, theirs in (("", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
        ours = _by_hf_name(ckpt, state)
        for name in names:
            path = universal / "zero" / name / f"{theirs}.pt"
            if not path.exists():  # the frozen parameter has no Adam state
                continue
            if name == "lm_head.weight":  # the tied alias (upcast from the 16-bit module)
                continue
            want = torch.load(path, weights_only=False)["param"]
            got = ours[name]
            if state and name == "model.layers.0.mlp.down_proj.weight":
                assert got.isnan().all(), "a frozen parameter has no Adam state"
                continue
            assert torch.equal(got, want), (state, name)
            compared += 1
    assert compared >= 3 * 18
