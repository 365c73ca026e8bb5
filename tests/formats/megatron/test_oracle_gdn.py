"""Gated delta net layers and gated attention in Megatron (issue 56: Qwen3.5's and Qwen3-Next's
hybrid), judged by megatron-core's own ``GatedDeltaNet`` and gated ``SelfAttention``, and by
transformers' ``Qwen3_5ForCausalLM``.

``tests/oracles/megatron_core_gdn.py`` builds a Qwen3.5-shaped GPTModel (gated delta net on
layers 0 and 2, gated attention on 1 and 3, q/k norms, zero-centred norms, RoPE on a quarter of
each head; the CPU shims are named there) at TP2, takes one Adam step and saves it legacy and
``torch_dist``, with its forward. ckptctl must read it as that model, reshard it to TP1 PP2,
which megatron-core loads strictly stage by stage with the same logits, and back to TP2 bit for
bit, Adam state included; its ``torch_dist`` of the model must be what megatron-core's
``dist_checkpointing.load`` asks for (every part key of ``in_proj`` and ``conv1d``), with the
same logits; and, written before the step, the model must become HF with transformers' logits
equal to megatron-core's, and come back from HF into megatron-core with them. The same holds
with routed experts and a gated shared expert in every layer (``--moe``: Qwen3-Next, which
becomes ``Qwen3NextForCausalLM``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.formats.megatron.rank_files import (
    assert_pp2_detour_loses_nothing,
    assert_same_rank_files,
)
from tests.oracle_runner import run_oracle

pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 is the oracle")

ORACLE = "megatron_core_gdn.py"
pytestmark = pytest.mark.oracle


@pytest.fixture(scope="module", params=["legacy", "torch_dist"])
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(f"gdn_{request.param}")
    run_oracle(ORACLE, "write", root, "--format", request.param)
    return root


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def test_it_reads_as_the_hybrid_model(written: Path, cli) -> None:
    """... and, trained in fp32, is refused for HF by name: one plus its zero-centred gated
    norm is no fp32 number (HF stores that sum), and ckptctl does not round."""
    spec = cli.json("inspect", written)["spec"]
    assert spec["attention_output_gate"] is True
    assert spec["qk_layernorm"] and spec["layernorm_zero_centered_gamma"]
    assert spec["rotary_percent"] == 0.25
    assert spec["linear_attention"] == {
        "num_key_heads": 2,
        "num_value_heads": 4,
        "key_head_dim": 16,
        "value_head_dim": 8,
        "conv_kernel_dim": 4,
        "attention_layers": [1, 3],
    }
    result = cli("consolidate", written, written.parent / "hf", "--format", "hf", code=3)
    assert "model.layers.0.linear_attn.norm.weight: element" in result.stderr
    assert "is not exact in float32" in result.stderr and "Traceback" not in result.stderr


def test_a_pp2_reshard_loads_into_megatron_cores_model(written: Path, tmp_path: Path, cli) -> None:
    pp2 = tmp_path / "pp2"
    cli("reshard", written, pp2, "--tp", "1", "--pp", "2", "--format", "megatron")
    out = tmp_path / "logits.pt"
    run_oracle(ORACLE, "forward", pp2, out)
    want = torch.load(written / "reference.pt")["logits"]
    assert _relative(torch.load(out), want) < 1e-5

    back = tmp_path / "tp2"
    cli("reshard", pp2, back, "--tp", "2", "--pp", "1", "--format", "megatron")
    if (written / "iter_0000001" / "mp_rank_00").exists():
        # a legacy source: the same rank files, weights and Adam state, in megatron-core's order
        assert_same_rank_files(back, written)
    else:  # torch_dist: the detour through TP1 PP2 loses nothing of weights or Adam state
        direct = tmp_path / "direct"
        cli("reshard", written, direct, "--tp", "2", "--pp", "1", "--format", "megatron")
        assert cli.json("inspect", direct)["has_optimizer"]
        assert_same_rank_files(back, direct)


def _torch_dist_loads_alike(written: Path, tmp_path: Path, cli, *model: str) -> None:
    """ckptctl's ``torch_dist`` of ``written`` at TP1, and from that at TP2, each loaded by
    megatron-core's ``dist_checkpointing.load`` into the oracle's TP2 model (``model``: its
    flags) with bitwise the logits the oracle wrote."""
    want = torch.load(written / "reference.pt")["logits"]
    src = written
    for tp in ("1", "2"):
        out = tmp_path / f"tp{tp}"
        cli("reshard", src, out, "--tp", tp, "--pp", "1", "--format", "torch_dist")
        src = out
        logits = tmp_path / f"logits{tp}.pt"
        run_oracle(ORACLE, "load", out, logits, *model)
        assert torch.equal(torch.load(logits), want)


def test_ckptctls_torch_dist_loads_through_megatron_cores_dist_checkpointing(
    written: Path, tmp_path: Path, cli
) -> None:
    """At TP1 (megatron-core cuts it to TP2 itself on load) and, from that, at TP2: every part
    key of ``in_proj`` / ``conv1d`` and its box where megatron-core's split factory looks."""
    _torch_dist_loads_alike(written, tmp_path, cli)


def test_out_norm_replicas_that_drifted_apart_are_refused(tmp_path: Path, cli) -> None:
    """Trained at TP2 without sequence parallelism, megatron-core lets each rank's copy of
    ``out_norm`` drift (its gradient covers the rank's own heads only): the model then has one
    norm per half of its heads, which TP1 cannot hold. Refused by name, never resharded."""
    src, out = tmp_path / "drift", tmp_path / "out"
    run_oracle(ORACLE, "write", src, "--format", "legacy", "--drift")
    result = cli("reshard", src, out, "--tp", "1", "--pp", "2", code=3)
    assert "mp_rank_01/model_optim_rng.pt: decoder.layers.0.self_attention.out_norm" in (
        result.stderr
    )
    assert "TP ranks hold different copies" in result.stderr
    assert "Traceback" not in result.stderr
    assert (out / "ckptctl.incomplete").exists()


@pytest.fixture(scope="module")
def untrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model as written before any step: its norms rounded to bfloat16's precision, as a
    bf16-trained model's are, so HF's ``1 + w`` is exact in fp32."""
    root = tmp_path_factory.mktemp("gdn_untrained")
    run_oracle(ORACLE, "write", root, "--format", "legacy", "--steps", "0")
    return root


def test_transformers_logits_equal_megatron_cores_forward(
    untrained: Path, tmp_path: Path, cli
) -> None:
    import transformers

    hf = tmp_path / "hf"
    cli("consolidate", untrained, hf, "--format", "hf")
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["layer_types"] == ["linear_attention", "full_attention"] * 2
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.25
    reference = torch.load(untrained / "reference.pt")
    ids, want = reference["input_ids"], reference["logits"]

    def hf_logits(**changes: object) -> torch.Tensor:
        loaded = transformers.AutoConfig.from_pretrained(hf)
        for key, value in changes.items():
            setattr(loaded, key, value)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            hf, config=loaded, dtype=torch.float32
        ).eval()
        with torch.no_grad():
            return model(ids).logits

    assert _relative(hf_logits(), want) < 1e-5
    # the rotated share matters on this input: a lost one could not pass the check above
    whole = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    assert _relative(hf_logits(rope_parameters=whole), want) > 1e-3

    # ... and back from HF into megatron-core's own stages, strictly, with its logits
    pp2, out = tmp_path / "pp2", tmp_path / "logits.pt"
    cli("reshard", hf, pp2, "--tp", "1", "--pp", "2", "--format", "megatron")
    run_oracle(ORACLE, "forward", pp2, out)
    assert _relative(torch.load(out), want) < 1e-5


REAL_ARGS = """--num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
    --group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 16
    --max-position-embeddings 64 --position-embedding-type rope --rotary-percent 0.25
    --normalization RMSNorm --apply-layernorm-1p --qk-layernorm --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights --vocab-size 1000 --make-vocab-size-divisible-by 128
    --tokenizer-type NullTokenizer --micro-batch-size 2 --global-batch-size 2 --train-iters 10
    --lr 1e-3 --mock-data --transformer-impl transformer_engine --tensor-model-parallel-size 2
    --experimental-attention-variant gated_delta_net --linear-attention-freq 2
    --attention-output-gate --linear-num-key-heads 2 --linear-num-value-heads 4
    --linear-key-head-dim 16 --linear-value-head-dim 8 --linear-conv-kernel-dim 4""".split()  # noqa: SIM905
"""The model's Megatron-LM 0.19.2 command line (a Qwen3.5-style hybrid)."""


def test_megatron_lms_own_args_for_the_hybrid_are_read_without_flags(
    written: Path, tmp_path: Path, cli
) -> None:
    """The args Megatron-LM 0.19.2's own ``parse_args`` + ``validate_args`` save for this model
    (its ~600 fields, the exit signal among them) describe the same model, and the checkpoint
    with them reshards to TP1 PP2 into the same tensors as with the oracle's args (which
    megatron-core loads with the same logits: above; 0.16.1 cannot unpickle 0.19's args)."""
    if not (written / "iter_0000001" / "mp_rank_00").exists():
        pytest.skip("Megatron-LM's args are stamped onto legacy rank files (the legacy case)")
    from tests.megatron_lm_env import stamp_args

    src = tmp_path / "src"
    shutil.copytree(written, src)
    stamp_args(src, REAL_ARGS, world=2)
    assert cli.json("inspect", src)["spec"] == cli.json("inspect", written)["spec"]
    mine, theirs = tmp_path / "pp2", tmp_path / "pp2_oracle_args"
    cli("reshard", src, mine, "--tp", "1", "--pp", "2")
    cli("reshard", written, theirs, "--tp", "1", "--pp", "2")
    assert_same_rank_files(mine, theirs)


@pytest.fixture(scope="module")
def moe_untrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-Next's shape (``--moe``): routed experts and a gated shared expert in every layer."""
    root = tmp_path_factory.mktemp("gdn_moe_untrained")
    run_oracle(ORACLE, "write", root, "--format", "legacy", "--steps", "0", "--moe")
    return root


@pytest.fixture(scope="module")
def moe_trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gdn_moe_trained")
    run_oracle(ORACLE, "write", root, "--format", "torch_dist", "--moe")
    return root


def test_qwen3_next_logits_equal_megatron_cores_forward(
    moe_untrained: Path, tmp_path: Path, cli
) -> None:
    """megatron-core's hybrid with experts becomes ``Qwen3NextForCausalLM`` (its projections
    grouped by key head, its gated shared expert) with megatron-core's logits, and reshards
    to TP1 PP2 that megatron-core loads strictly with them."""
    import transformers

    hf = tmp_path / "hf"
    cli("consolidate", moe_untrained, hf, "--format", "hf")
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["Qwen3NextForCausalLM"]
    reference = torch.load(moe_untrained / "reference.pt")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(reference["input_ids"]).logits
    assert _relative(got, reference["logits"]) < 1e-5
    pp2, out = tmp_path / "pp2", tmp_path / "logits.pt"
    cli("reshard", moe_untrained, pp2, "--tp", "1", "--pp", "2")
    run_oracle(ORACLE, "forward", pp2, out, "--moe")
    assert _relative(torch.load(out), reference["logits"]) < 1e-5


def test_the_hybrid_with_experts_moves_with_its_adam_state(
    moe_trained: Path, tmp_path: Path, cli
) -> None:
    """``torch_dist`` with experts in numbered layers: to TP1 and back to TP2, each loading
    through ``dist_checkpointing.load`` with megatron-core's logits; through legacy TP1 PP2 and
    back, the same rank files as the direct conversion, Adam state included."""
    _torch_dist_loads_alike(moe_trained, tmp_path, cli, "--moe")
    assert_pp2_detour_loses_nothing(moe_trained, tmp_path, cli)


@pytest.fixture(scope="module")
def mtp_untrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-Next's shape with one MTP layer (``--moe --mtp``), saved ``torch_dist``."""
    root = tmp_path_factory.mktemp("gdn_mtp_untrained")
    run_oracle(ORACLE, "write", root, "--format", "torch_dist", "--steps", "0", "--moe", "--mtp")
    return root


def test_the_mtp_layer_becomes_the_releases_mtp_with_megatron_cores_logits(
    mtp_untrained: Path, tmp_path: Path, cli
) -> None:
    """megatron-core's MTP layer becomes the hub's ``mtp.*`` (``tests/formats/hf/qwen_mtp.py``):
    transformers' modules, run as vLLM runs the releases' MTP layer on transformers' own final
    hidden states, give megatron-core's MTP logits (and a swap of its two norms would not);
    back from HF through legacy TP1 PP2 (the MTP layer on the last stage) to ``torch_dist``
    TP2, megatron-core's ``dist_checkpointing.load`` finds every MTP key and gives bitwise its
    logits, MTP logits and hidden states."""
    from safetensors.torch import load_file, save_file

    from tests.formats.hf.qwen_mtp import hf_outputs, mtp_logits

    hf = tmp_path / "hf"
    cli("consolidate", mtp_untrained, hf, "--format", "hf")
    assert json.loads((hf / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    reference = torch.load(mtp_untrained / "reference.pt")
    ids = reference["input_ids"]
    logits, mtp, hidden = hf_outputs(hf, ids)
    assert _relative(logits, reference["logits"]) < 1e-5
    assert _relative(mtp, reference["mtp_logits"]) < 1e-5
    weights = load_file(hf / "model.safetensors")
    embedding, hidden_norm = "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"
    weights[embedding], weights[hidden_norm] = weights[hidden_norm], weights[embedding]
    swapped = tmp_path / "swapped"
    shutil.copytree(hf, swapped)
    save_file(weights, swapped / "model.safetensors", metadata={"format": "pt"})
    assert _relative(mtp_logits(swapped, ids, hidden), reference["mtp_logits"]) > 1e-3

    pp2, back, out = tmp_path / "pp2", tmp_path / "back", tmp_path / "outputs.pt"
    cli("reshard", hf, pp2, "--tp", "1", "--pp", "2", "--format", "megatron")
    assert (pp2 / "release" / "mp_rank_00_001").is_dir()
    cli("reshard", pp2, back, "--tp", "2", "--pp", "1", "--format", "torch_dist")
    run_oracle(ORACLE, "load", back, out, "--moe", "--mtp")
    outputs = torch.load(out)
    for key in ("logits", "mtp_logits", "hidden"):
        assert torch.equal(outputs[key], reference[key]), key
