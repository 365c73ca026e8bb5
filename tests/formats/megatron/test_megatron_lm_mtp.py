"""Multi-token prediction (issue 54) as Megatron-LM's own training code writes it: a DeepSeek-V3
shaped run of the megatron-core 0.19.2 wheel on the CPU (multi-latent attention, a dense first
layer, routed experts with DeepSeek's router, one MTP layer on the last pipeline stage; see
``tests/oracles/megatron_lm.py``), saved legacy and ``torch_dist``, judged by Megatron-LM
resuming from ckptctl's reshards and by transformers loading the MTP layer from HF.

CPU shims: those of ``test_megatron_lm_mla.py`` (none touches a stored tensor). The oracle builds
the MTP block as ``pretrain_gpt`` does (``get_gpt_mtp_block_spec`` over the decoder's spec).
Legacy files of this release keep an MTP layer's transformer layer under ``mtp_model_layer``
(``torch_dist`` keys under ``transformer_layer``), and a pipeline's last stage keeps a copy of
the embedding for the MTP layer.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.formats.megatron.test_megatron_lm import RESUMED_STEPS, SAVED_STEPS, assert_resumes_alike
from tests.formats.megatron.test_megatron_lm_mla import ARGS, DEEPSEEK_MOE
from tests.megatron_lm_env import megatron_python, train

MTP = [*ARGS, *DEEPSEEK_MOE, "--mtp-num-layers", "1"]
"""Two layers (a dense one, then routed experts) and one MTP layer, which megatron-core builds
with the last layer's spec: routed experts, a shared expert, multi-latent attention."""


def _megatron_tensors(rank_file: Path, prefix: str, out: Path) -> dict[str, torch.Tensor]:
    """The tensors of a legacy rank file whose names start with ``prefix``, as torch loads
    them in Megatron-LM's own environment (this one cannot unpickle its ``args``)."""
    script = (
        "import sys, torch\n"
        "m = torch.load(sys.argv[1], weights_only=False)['model']\n"
        "torch.save({k: v for k, v in m.items() if k.startswith(sys.argv[2])"
        " and isinstance(v, torch.Tensor)}, sys.argv[3])\n"
    )
    command = [str(megatron_python()), "-c", script, str(rank_file), prefix, str(out)]
    subprocess.run(command, check=True, capture_output=True, env={"CUDA_VISIBLE_DEVICES": ""})
    tensors: dict[str, torch.Tensor] = torch.load(out, weights_only=True)
    return tensors


@pytest.fixture(scope="module")
def legacy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three steps of the MTP run saved legacy, its logits, and two more steps from it."""
    root = tmp_path_factory.mktemp("megatron-lm-mtp")
    ckpt, logits = root / "legacy", root / "logits.pt"
    save = ["--save", str(ckpt), "--save-interval", "1000", "--ckpt-format", "torch"]
    train(root / "first", [*MTP, *save], steps=SAVED_STEPS, logits=logits)
    resumed = train(root / "resumed", [*MTP, "--load", str(ckpt)], steps=RESUMED_STEPS)
    return {"root": root, "ckpt": ckpt, "logits": logits, "resumed": resumed["losses"]}


def test_an_mtp_run_becomes_deepseek_v3_with_its_mtp_layer(legacy: dict[str, Any], cli) -> None:
    """HF gives Megatron's logits, and transformers' own MTP loader (``MtpModel``) finds every
    weight of the MTP layer under the names ckptctl wrote, equal to Megatron's."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file
    from transformers.modeling_layers import MtpModel

    info = cli.json("inspect", legacy["ckpt"])
    assert info["spec"]["mtp_num_layers"] == 1
    hf = legacy["root"] / "hf"
    cli("consolidate", legacy["ckpt"], hf, "--format", "hf")
    config = json.loads((hf / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    megatron = torch.load(legacy["logits"], weights_only=True)
    with torch.no_grad():
        logits = model(megatron["tokens"]).logits
    torch.testing.assert_close(logits, megatron["logits"][..., :1000], rtol=0, atol=1e-6)

    written = load_file(hf / "model.safetensors")
    # The MTP layer is model.layers.2; transformers' pattern for it names DeepSeek-V3's 61.
    model._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2\..*"]
    mtp = MtpModel.from_pretrained(model).state_dict()
    rank_file = legacy["ckpt"] / "iter_0000003/mp_rank_00/model_optim_rng.pt"
    own = _megatron_tensors(rank_file, "mtp.", legacy["root"] / "mtp.pt")
    inner = "mtp.layers.0.mtp_model_layer."
    experts = [k for k in own if ".local_experts." in k]
    assert len(experts) == 16 and len(own) == 4 + 13 + 16  # 8 experts: fc1 and fc2
    pairs = {
        "layers.0.enorm.weight": "mtp.layers.0.enorm.weight",
        "layers.0.hnorm.weight": "mtp.layers.0.hnorm.weight",
        "layers.0.eh_proj.weight": "mtp.layers.0.eh_proj.weight",
        "layers.0.post_norm.weight": "mtp.layers.0.final_layernorm.weight",
        "layers.0.mtp_block.input_layernorm.weight": inner + "input_layernorm.weight",
        "layers.0.mtp_block.post_attention_layernorm.weight": inner + "pre_mlp_layernorm.weight",
        "layers.0.mtp_block.self_attn.q_a_proj.weight": inner
        + "self_attention.linear_q_down_proj.weight",
        "layers.0.mtp_block.self_attn.q_a_layernorm.weight": inner
        + "self_attention.q_layernorm.weight",
        "layers.0.mtp_block.self_attn.kv_a_layernorm.weight": inner
        + "self_attention.kv_layernorm.weight",
        "layers.0.mtp_block.self_attn.o_proj.weight": inner + "self_attention.linear_proj.weight",
        "layers.0.mtp_block.mlp.gate.weight": inner + "mlp.router.weight",
        "layers.0.mtp_block.mlp.gate.e_score_correction_bias": inner + "mlp.router.expert_bias",
        "layers.0.mtp_block.mlp.shared_experts.down_proj.weight": inner
        + "mlp.shared_experts.linear_fc2.weight",
    }
    for theirs, megatrons in pairs.items():
        assert torch.equal(mtp[theirs], own[megatrons].float()), theirs
    for e in range(8):
        fc1 = own[f"{inner}mlp.experts.local_experts.{e}.linear_fc1.weight"].float()
        assert torch.equal(mtp["layers.0.mtp_block.mlp.experts.gate_up_proj"][e], fc1)
        fc2 = own[f"{inner}mlp.experts.local_experts.{e}.linear_fc2.weight"].float()
        assert torch.equal(mtp["layers.0.mtp_block.mlp.experts.down_proj"][e], fc2)
    # The copies DeepSeek's release keeps of the embedding and the output layer.
    assert torch.equal(
        written["model.layers.2.embed_tokens.weight"], written["model.embed_tokens.weight"]
    )
    assert torch.equal(written["model.layers.2.shared_head.head.weight"], written["lm_head.weight"])
    assert not [k for k in written if re.match(r"model\.layers\.[3-9]", k)]
    # DeepSpeed's universal form names parameters as HF does: the MTP layer's are there, its
    # copies of shared tensors are no parameters, and the router's expert bias has no Adam state
    universal = legacy["root"] / "universal"
    cli("consolidate", legacy["ckpt"], universal, "--format", "deepspeed-universal")
    zero = next(universal.glob("*/zero"))
    assert (zero / "model.layers.2.eh_proj.weight" / "exp_avg.pt").exists()
    assert not (zero / "model.layers.2.embed_tokens.weight").exists()
    bias = zero / "model.layers.2.mlp.gate.e_score_correction_bias"
    assert sorted(p.name for p in bias.iterdir()) == ["fp32.pt"]


def test_an_mtp_pipeline_round_trip_resumes_with_megatrons_own_losses(
    legacy: dict[str, Any], cli
) -> None:
    """PP1 -> PP2 (the MTP layer and a copy of the embedding on the last stage, as
    megatron-core keeps them) -> PP1: every weight and Adam's state come back bit for bit and
    Megatron-LM resumes with its own losses; at PP2 it loads ckptctl's stages strictly and
    trains on with the PP1 losses."""
    pp2, back = legacy["root"] / "pp2", legacy["root"] / "pp1-again"
    cli("reshard", legacy["ckpt"], pp2, "--pp", "2")
    assert (pp2 / "iter_0000003/mp_rank_00_001/model_optim_rng.pt").exists()
    cli("reshard", pp2, back, "--pp", "1")
    assert cli.json("verify", back, "--against", legacy["ckpt"])["ok"]
    load = ["--no-load-rng", "--load"]
    again = train(legacy["root"] / "again", [*MTP, *load, str(back)], steps=RESUMED_STEPS)
    assert again["losses"] == legacy["resumed"]
    at_pp2 = train(
        legacy["root"] / "at-pp2",
        [*MTP, "--pipeline-model-parallel-size", "2", *load, str(pp2)],
        world=2,
        steps=RESUMED_STEPS,
    )
    torch.testing.assert_close(
        torch.tensor(at_pp2["losses"]), torch.tensor(legacy["resumed"]), rtol=1e-5, atol=0
    )


def test_an_mtp_torch_dist_run_reshards_as_megatron_lm_reshards_it(
    tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """Saved as ``torch_dist`` over two pipeline stages: ckptctl's PP1 reshard resumes with
    exactly the losses of Megatron-LM's own reshard on load, optimizer state included; and
    ckptctl writes the MTP layer's keys (with their empty ``_extra_state``) that Megatron-LM
    asks for, so it loads strictly."""
    root = tmp_path_factory.mktemp("megatron-lm-mtp-dist")
    ckpt = root / "torch_dist"
    save = ["--save", str(ckpt), "--save-interval", "1000", "--ckpt-format", "torch_dist"]
    pp2 = ["--pipeline-model-parallel-size", "2"]
    train(root / "first", [*MTP, *pp2, *save], world=2, steps=SAVED_STEPS)
    pp1 = root / "pp1"
    cli("reshard", ckpt, pp1, "--pp", "1")
    load = ["--ckpt-format", "torch_dist", "--no-load-rng", "--load"]
    own = train(root / "own", [*MTP, *load, str(ckpt)], steps=RESUMED_STEPS)
    ours = train(root / "ours", [*MTP, *load, str(pp1)], steps=RESUMED_STEPS)
    assert ours["losses"] == own["losses"]
    # Over expert parallelism the MTP layer's experts go with the decoder's to their EP ranks
    # (Megatron-LM moves no optimizer state into a chained optimizer: both load weights only).
    ep2 = root / "ep2"
    cli("reshard", ckpt, ep2, "--pp", "1", "--ep", "2", "--dp", "2")
    at_ep2 = ["--ckpt-format", "torch_dist", "--expert-model-parallel-size", "2"]
    at_ep2 += ["--global-batch-size", "4", "--no-load-optim", "--no-load-rng", "--load"]
    own = train(root / "own-ep2", [*MTP, *at_ep2, str(ckpt)], world=2, steps=RESUMED_STEPS)
    ours = train(root / "ours-ep2", [*MTP, *at_ep2, str(ep2)], world=2, steps=RESUMED_STEPS)
    assert ours["losses"] == own["losses"]


def test_an_mtp_run_under_the_distributed_optimizer_moves_bit_for_bit(
    tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """Two pipeline stages under the distributed optimizer (``distrib_optim.pt``: the last
    stage's flat buffers hold the embedding's copy and the MTP layer): -> PP1 DP2 -> back
    comes back bit for bit, and Megatron-LM trains on from that with the losses it has from
    its own checkpoint."""
    root = tmp_path_factory.mktemp("megatron-lm-mtp-distopt")
    ckpt = root / "legacy"
    args = [*MTP, "--use-distributed-optimizer", "--pipeline-model-parallel-size", "2"]
    save = ["--save", str(ckpt), "--save-interval", "1000", "--ckpt-format", "torch"]
    train(root / "first", [*args, *save], world=2, steps=SAVED_STEPS)
    dp2, back = root / "pp1-dp2", root / "pp2-again"
    cli("reshard", ckpt, dp2, "--pp", "1", "--dp", "2")
    cli("reshard", dp2, back, "--pp", "2", "--dp", "1")
    assert cli.json("verify", back, "--against", ckpt)["ok"]
    # Each rank's RNG state does not survive a pass through another layout (no dropout here).
    load = [*args, "--ckpt-format", "torch", "--no-load-rng", "--load"]
    assert_resumes_alike(root, load, own=ckpt, ours=back, world=2)
