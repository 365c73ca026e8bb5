"""Multi-latent attention (issue 54) as Megatron-LM's own training code writes it, judged by
Megatron-LM and transformers' ``DeepseekV3ForCausalLM``: ``--multi-latent-attention`` runs of the
megatron-core 0.19.2 wheel on the CPU (``tests/oracles/megatron_lm.py``), saved legacy and
``torch_dist``, converted to HF with Megatron's logits, resharded over TP and resumed.

CPU shims: those of ``test_megatron_lm.py`` (none touches a stored tensor), and one more for
multi-latent attention: megatron-core's MLA builds its core attention with ``k_channels`` /
``v_channels``, which only TransformerEngine's fused attention takes, so plain PyTorch causal
attention with MLA's softmax scale stands in for it (``mcore_cpu.MlaCoreAttention``: no
parameters). The local layer spec splits MLA's q / kv down projections over TP (TE duplicates
them): the TP2 runs below load ckptctl's split strictly.

The model: 2 layers, hidden 64, 4 heads, q rank 32, kv rank 16, head dims 8 + 8 (RoPE) and v 8,
q / kv norms, SwiGLU, untied; Megatron-LM's default rope type for MLA (YaRN with a stretch of 1);
norm epsilon 1e-6, which transformers uses for the compressed q / kv norms whatever
``rms_norm_eps`` says.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.formats.megatron.test_megatron_lm import (
    CPU,
    RESUMED_STEPS,
    SAVED_STEPS,
    TRAINING,
    assert_resumes_alike,
)
from tests.megatron_lm_env import train

MODEL = """
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
    --multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 8
    --qk-pos-emb-head-dim 8 --v-head-dim 8 --qk-layernorm --norm-epsilon 1e-6
    --seq-length 16 --max-position-embeddings 32
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights
    --vocab-size 1000 --make-vocab-size-divisible-by 128 --tokenizer-type NullTokenizer
"""
ARGS = shlex.split(MODEL + TRAINING + CPU)
DEEPSEEK_MOE = shlex.split(
    "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
    "--moe-shared-expert-intermediate-size 32 --moe-router-score-function sigmoid "
    "--moe-router-enable-expert-bias --moe-router-num-groups 2 --moe-router-group-topk 1 "
    "--moe-router-topk-scaling-factor 2.5 --moe-router-load-balancing-type none "
    "--moe-aux-loss-coeff 0 --moe-token-dispatcher-type allgather --moe-layer-freq [0]+[1]"
)
"""DeepSeek-V3's shape: a dense first layer, then routed experts with DeepSeek's router
(sigmoid scores, a score-correction bias updated as it trains, the best group of two, weights
scaled by 2.5) and a shared expert (the ``allgather`` dispatcher: ``alltoall`` needs CUDA
stream events)."""


def _hf_logits(hf: Path, tokens: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        return model(tokens).logits


@pytest.fixture(scope="module")
def legacy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three steps of an MLA run saved legacy, its logits, and two more steps from it."""
    root = tmp_path_factory.mktemp("megatron-lm-mla")
    ckpt, logits = root / "legacy", root / "logits.pt"
    save = ["--save", str(ckpt), "--save-interval", "1000", "--ckpt-format", "torch"]
    train(root / "first", [*ARGS, *save], steps=SAVED_STEPS, logits=logits)
    resumed = train(root / "resumed", [*ARGS, "--load", str(ckpt)], steps=RESUMED_STEPS)
    return {"root": root, "ckpt": ckpt, "logits": logits, "resumed": resumed["losses"]}


def test_an_mla_run_becomes_deepseek_v3_with_megatrons_logits(legacy: dict[str, Any], cli) -> None:
    info = cli.json("inspect", legacy["ckpt"])
    assert info["spec"]["mla"]["kv_lora_rank"] == 16 and info["spec"]["mla"]["rope_type"] == "yarn"
    hf = legacy["root"] / "hf"
    cli("consolidate", legacy["ckpt"], hf, "--format", "hf")
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["first_k_dense_replace"] == 2  # every layer dense
    megatron = torch.load(legacy["logits"], weights_only=True)
    logits = _hf_logits(hf, megatron["tokens"])
    torch.testing.assert_close(logits, megatron["logits"][..., :1000], rtol=0, atol=1e-6)


def test_an_mla_tp_round_trip_resumes_with_megatrons_own_losses(
    legacy: dict[str, Any], cli
) -> None:
    """TP1 -> TP2 -> TP1: every weight, Adam's state and the padding rows come back; Megatron-LM
    resumes with the losses it has from its own checkpoint. At TP2 it loads ckptctl's split of
    the down projections strictly and trains on with the TP1 losses up to the rounding of a TP2
    all-reduce."""
    tp2, back = legacy["root"] / "tp2", legacy["root"] / "tp1-again"
    cli("reshard", legacy["ckpt"], tp2, "--tp", "2")
    cli("reshard", tp2, back, "--tp", "1")
    assert cli.json("verify", back, "--against", legacy["ckpt"])["ok"]
    load = ["--no-load-rng", "--load"]
    again = train(legacy["root"] / "again", [*ARGS, *load, str(back)], steps=RESUMED_STEPS)
    assert again["losses"] == legacy["resumed"]
    at_tp2 = train(
        legacy["root"] / "at-tp2",
        [*ARGS, "--tensor-model-parallel-size", "2", *load, str(tp2)],
        world=2,
        steps=RESUMED_STEPS,
    )
    torch.testing.assert_close(
        torch.tensor(at_tp2["losses"]), torch.tensor(legacy["resumed"]), rtol=1e-5, atol=0
    )


def test_an_mla_torch_dist_run_reshards_as_megatron_lm_reshards_it(
    tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """Saved as ``torch_dist`` (the local spec's own key spelling for MLA): it becomes
    DeepSeek-V3 with Megatron's logits, and ckptctl's TP2 reshard resumes with exactly the
    losses of Megatron-LM's own TP2 reshard on load."""
    root = tmp_path_factory.mktemp("megatron-lm-mla-dist")
    ckpt, logits = root / "torch_dist", root / "logits.pt"
    save = ["--save", str(ckpt), "--save-interval", "1000", "--ckpt-format", "torch_dist"]
    train(root / "first", [*ARGS, *save], steps=SAVED_STEPS, logits=logits)
    hf = root / "hf"
    cli("consolidate", ckpt, hf, "--format", "hf")
    megatron = torch.load(logits, weights_only=True)
    logits_hf = _hf_logits(hf, megatron["tokens"])
    torch.testing.assert_close(logits_hf, megatron["logits"][..., :1000], rtol=0, atol=1e-6)
    tp2 = root / "tp2"
    cli("reshard", ckpt, tp2, "--tp", "2")
    at_tp2 = ["--ckpt-format", "torch_dist", "--tensor-model-parallel-size", "2", "--load"]
    own = train(root / "own", [*ARGS, *at_tp2, str(ckpt)], world=2, steps=RESUMED_STEPS)
    ours = train(root / "ours", [*ARGS, *at_tp2, str(tp2)], world=2, steps=RESUMED_STEPS)
    assert ours["losses"] == own["losses"]


def test_a_deepseek_style_moe_run_becomes_deepseek_v3_with_megatrons_logits(
    tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """MLA, a dense first layer and MoE after it with DeepSeek-V3's router and a shared expert:
    HF gives Megatron's logits, and an EP round trip comes back bit for bit."""
    root = tmp_path_factory.mktemp("megatron-lm-mla-moe")
    ckpt, logits = root / "legacy", root / "logits.pt"
    save = ["--save", str(ckpt), "--save-interval", "1000", "--ckpt-format", "torch"]
    train(root / "first", [*ARGS, *DEEPSEEK_MOE, *save], steps=SAVED_STEPS, logits=logits)
    spec = cli.json("inspect", ckpt)["spec"]
    assert spec["moe_router_num_groups"] == 2 and spec["moe_router_topk_scaling_factor"] == 2.5
    assert spec["dense_layers"] == [0]
    hf = root / "hf"
    cli("consolidate", ckpt, hf, "--format", "hf")
    config = json.loads((hf / "config.json").read_text())
    assert (config["n_group"], config["topk_group"], config["n_shared_experts"]) == (2, 1, 1)
    assert config["first_k_dense_replace"] == 1
    megatron = torch.load(logits, weights_only=True)
    logits_hf = _hf_logits(hf, megatron["tokens"])
    # the experts' outputs are summed in another order: equal to fp32 rounding
    torch.testing.assert_close(logits_hf, megatron["logits"][..., :1000], rtol=0, atol=1e-6)
    ep2, back = root / "ep2", root / "ep1-again"
    cli("reshard", ckpt, ep2, "--ep", "2", "--dp", "2")
    cli("reshard", ep2, back, "--ep", "1", "--dp", "1")
    assert cli.json("verify", back, "--against", ckpt)["ok"]


def test_a_deepseek_style_torch_dist_run_reshards_as_megatron_lm_reshards_it(
    tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """The same model saved as ``torch_dist`` (its dense and MoE layers stacked under shared
    keys): HF gives Megatron's logits, and ckptctl's EP2 reshard resumes with exactly the
    losses of Megatron-LM's own EP2 reshard on load (MoE at TP2 needs sequence parallelism,
    which Megatron-LM asks for; Megatron-LM moves no optimizer state from one optimizer to a
    chained one, so both load the weights only)."""
    root = tmp_path_factory.mktemp("megatron-lm-mla-moe-dist")
    ckpt, logits = root / "torch_dist", root / "logits.pt"
    save = ["--save", str(ckpt), "--save-interval", "1000", "--ckpt-format", "torch_dist"]
    args = [*ARGS, *DEEPSEEK_MOE]
    train(root / "first", [*args, *save], steps=SAVED_STEPS, logits=logits)
    hf = root / "hf"
    cli("consolidate", ckpt, hf, "--format", "hf")
    megatron = torch.load(logits, weights_only=True)
    logits_hf = _hf_logits(hf, megatron["tokens"])
    torch.testing.assert_close(logits_hf, megatron["logits"][..., :1000], rtol=0, atol=1e-6)
    ep2 = root / "ep2"
    cli("reshard", ckpt, ep2, "--ep", "2", "--dp", "2")
    at_ep2 = ["--ckpt-format", "torch_dist", "--expert-model-parallel-size", "2"]
    at_ep2 += ["--global-batch-size", "4", "--no-load-optim", "--no-load-rng", "--load"]
    own = train(root / "own", [*args, *at_ep2, str(ckpt)], world=2, steps=RESUMED_STEPS)
    ours = train(root / "ours", [*args, *at_ep2, str(ep2)], world=2, steps=RESUMED_STEPS)
    assert ours["losses"] == own["losses"]


def test_an_mla_run_with_the_distributed_optimizer_moves_bit_for_bit(
    tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """MLA under the distributed optimizer (DP2, ``distrib_optim.pt``: flat buffers in the
    local spec's parameter order, MLA's q / kv norms after the projections): DP2 -> DP1 without
    it -> DP2 with it comes back bit for bit, and Megatron-LM trains on from that with the
    losses it has from its own checkpoint."""
    root = tmp_path_factory.mktemp("megatron-lm-mla-distopt")
    ckpt = root / "legacy"
    args = [*ARGS, "--use-distributed-optimizer", "--global-batch-size", "4"]
    save = ["--save", str(ckpt), "--save-interval", "1000", "--ckpt-format", "torch"]
    train(root / "first", [*args, *save], world=2, steps=SAVED_STEPS)
    plain, back = root / "dp1", root / "dp2-again"
    cli("reshard", ckpt, plain, "--dp", "1", "--no-distributed-optimizer")
    cli("reshard", plain, back, "--dp", "2", "--distributed-optimizer")
    assert cli.json("verify", back, "--against", ckpt)["ok"]
    load = [*args, "--ckpt-format", "torch", "--load"]
    assert_resumes_alike(root, load, own=ckpt, ours=back, world=2)


GLM_MODEL = """
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
    --group-query-attention --num-query-groups 2 --kv-channels 16 --add-qkv-bias --qk-layernorm
    --rotary-percent 0.5 --seq-length 16 --max-position-embeddings 32
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights
    --vocab-size 1000 --make-vocab-size-divisible-by 128 --tokenizer-type NullTokenizer
"""


def test_a_glm_style_run_becomes_glm4_moe_with_megatrons_logits(
    tmp_path_factory: pytest.TempPathFactory, cli
) -> None:
    """DeepSeek-V3's routed layers under grouped-query attention with q/k/v biases, q/k norms
    and RoPE over half of each head (GLM-4.5's shape): HF's ``Glm4MoeForCausalLM`` gives
    Megatron's logits."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("megatron-lm-glm")
    ckpt, logits = root / "legacy", root / "logits.pt"
    args = [*shlex.split(GLM_MODEL + TRAINING + CPU), *DEEPSEEK_MOE]
    save = ["--save", str(ckpt), "--save-interval", "1000", "--ckpt-format", "torch"]
    train(root / "first", [*args, *save], steps=SAVED_STEPS, logits=logits)
    hf = root / "hf"
    cli("consolidate", ckpt, hf, "--format", "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    megatron = torch.load(logits, weights_only=True)
    with torch.no_grad():
        got = model(megatron["tokens"]).logits
    # the experts' outputs are summed in another order: equal to fp32 rounding
    torch.testing.assert_close(got, megatron["logits"][..., :1000], rtol=0, atol=1e-6)
