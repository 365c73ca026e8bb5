"""Megatron-Bridge's own training checkpoints (issue 56): ``torch_dist`` without Megatron-LM's
``args``, the model described by ``run_config.yaml`` (its provider's fields), as Megatron-Bridge
0.3.1's ``save_checkpoint`` writes them for the families it trains (here Qwen3-Next: gated delta
net and gated attention, routed experts with a gated shared expert, one MTP layer).

``tests/oracles/megatron_core_gdn.py --moe --mtp --bridge ...`` builds the model on megatron-core
0.16.1 at TP2 (its CPU shims named there), takes 0 or 1 step of megatron-core's Adam and saves
it with Megatron-Bridge's ``save_checkpoint`` (its own shims in
``tests/oracles/megatron_bridge_save.py``), the config's model Megatron-Bridge's
``Qwen3NextModelProvider`` with the model's sizes. ckptctl must read it as that model: to HF
with transformers' logits (and the MTP layer's, run by transformers' modules) equal to
megatron-core's; resharded with its Adam state into ``torch_dist`` that megatron-core's
``dist_checkpointing.load`` takes with bitwise megatron-core's outputs; and a field of the config
it cannot carry refused by name. And the model variants of
``tests/oracles/megatron_core_variants.py`` (GQA off, partial RoPE, biases, q/k norms, GELU,
tied embeddings, sliding windows, Llama 3.1 RoPE, off-by-one softmax), each saved by
Megatron-Bridge's ``save_checkpoint`` with its GPT provider, must read as the same model as
Megatron-LM's ``args`` for it say, every tensor equal; likewise the routed-expert models of
``tests/oracles/megatron_core_moe.py`` (Mixtral-, Qwen2-MoE- and Qwen3-MoE-shaped with the GPT
provider, GPT-OSS with Megatron-Bridge's ``GPTOSSProvider``: sinks, biases, clamped quick GEGLU,
windows, YaRN) trained one Adam step at TP2 EP2, their Adam state too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests import megatron_bridge_peft
from tests.formats.megatron.rank_files import (
    assert_pp2_detour_loses_nothing,
    assert_same_rank_files,
)
from tests.oracle_runner import run_oracle

pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 runs the model")
transformers = pytest.importorskip("transformers")

ORACLE = "megatron_core_gdn.py"
MODEL = ("--moe", "--mtp")
pytestmark = pytest.mark.oracle


def _written(root: Path, steps: str) -> Path:
    bridge = megatron_bridge_peft.oracle_args()
    run_oracle(ORACLE, "write", root, "--format", "torch_dist", "--steps", steps, *MODEL, *bridge)
    return root


@pytest.fixture(scope="module")
def untrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _written(tmp_path_factory.mktemp("bridge_untrained"), "0")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _written(tmp_path_factory.mktemp("bridge_trained"), "1")


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def test_megatron_bridges_checkpoint_holds_no_args_but_its_run_config(untrained: Path) -> None:
    """What makes it Megatron-Bridge's: no ``args`` in ``common.pt``, ``run_config.yaml``."""
    iteration = untrained / "iter_0000001"
    common = torch.load(iteration / "common.pt", weights_only=False)
    assert "args" not in common
    assert "Qwen3NextModelProvider" in (iteration / "run_config.yaml").read_text()


def test_it_becomes_hf_with_megatron_cores_logits(untrained: Path, tmp_path: Path, cli) -> None:
    from tests.formats.hf.qwen_mtp import hf_outputs

    info = cli.json("inspect", untrained)
    assert any("Megatron-Bridge checkpoint" in note for note in info["notes"]), info["notes"]
    spec = info["spec"]
    assert spec["num_experts"] == 4 and spec["moe_shared_expert_gate"]
    assert spec["mtp_num_layers"] == 1 and spec["attention_output_gate"]
    assert spec["linear_attention"]["attention_layers"] == [1, 3]
    assert spec["vocab_size"] == 1000 and not spec["tie_embeddings"]
    hf = tmp_path / "hf"
    cli("consolidate", untrained, hf, "--format", "hf")
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["Qwen3NextForCausalLM"]
    reference = torch.load(untrained / "reference.pt")
    logits, mtp, _ = hf_outputs(hf, reference["input_ids"])
    assert _relative(logits, reference["logits"]) < 1e-5
    assert _relative(mtp, reference["mtp_logits"]) < 1e-5


def test_it_reshards_with_its_adam_state_into_megatron_core(
    trained: Path, tmp_path: Path, cli
) -> None:
    """To ``torch_dist`` TP1 (megatron-core cuts it to TP2 on load) with bitwise megatron-core's
    logits, MTP logits and hidden states; through legacy TP1 PP2 and back, the rank files of
    the direct conversion, Adam state included."""
    assert cli.json("inspect", trained)["has_optimizer"]
    tp1, out = tmp_path / "tp1", tmp_path / "outputs.pt"
    cli("reshard", trained, tp1, "--tp", "1", "--format", "torch_dist")
    run_oracle(ORACLE, "load", tp1, out, *MODEL)
    reference, outputs = torch.load(trained / "reference.pt"), torch.load(out)
    for key in ("logits", "mtp_logits", "hidden"):
        assert torch.equal(outputs[key], reference[key]), key
    assert_pp2_detour_loses_nothing(trained, tmp_path, cli)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("  softmax_scale: null", "  softmax_scale: 0.25", "model.softmax_scale=0.25"),
        ("  qk_l2_norm: false", "  qk_l2_norm: true", "model.qk_l2_norm=True"),
        (
            "_target_: megatron.bridge.models.qwen.qwen_provider.Qwen3NextModelProvider",
            "_target_: megatron.bridge.models.gemma.gemma3_provider.Gemma3ModelProvider",
            "model._target_='megatron.bridge.models.gemma.gemma3_provider.Gemma3ModelProvider'",
        ),
        ("_target_: torch.nn.functional.silu", "_target_: torch.nn.functional.relu",
         "model.activation_func='torch.nn.functional.relu'"),
        (
            "get_transformer_block_with_experimental_attention_variant_spec",
            "get_gpt_heterogeneous_layer_spec",
            "model.transformer_layer_spec=",
        ),
    ],
)  # fmt: skip
def test_a_field_ckptctl_cannot_carry_is_refused_by_name(
    untrained: Path, tmp_path: Path, cli, old: str, new: str, message: str
) -> None:
    src = tmp_path / "src"
    shutil.copytree(untrained, src)
    config = src / "iter_0000001" / "run_config.yaml"
    text = config.read_text()
    assert old in text
    config.write_text(text.replace(old, new, 1))
    result = cli("reshard", src, tmp_path / "out", "--tp", "1", code=2)
    assert message in result.stderr and "Traceback" not in result.stderr
    assert "iter_0000001/run_config.yaml: " in result.stderr


@pytest.fixture(scope="module")
def distributed_saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One run trained with megatron-core's distributed Adam, saved by Megatron-Bridge in
    either form of its state (the run is deterministic on CPU: the same weights and moments)."""
    out = {}
    for form in ("fully_reshardable", "dp_reshardable"):
        root = out[form] = tmp_path_factory.mktemp(f"bridge_{form}")
        bridge = megatron_bridge_peft.oracle_args()
        run_oracle(ORACLE, "write", root, "--format", "torch_dist", *MODEL, *bridge,
                   "--distopt", form)  # fmt: skip
    return out


def test_fully_reshardable_state_reshards_and_loads_into_megatron_core(
    distributed_saves: dict[str, Path], tmp_path: Path, cli
) -> None:
    """``fully_reshardable`` state (per parameter) reshards through TP1 PP2 and back to the
    direct conversion's rank files, Adam state included, and its weights load into
    megatron-core with its outputs."""
    distributed = distributed_saves["fully_reshardable"]
    assert cli.json("inspect", distributed)["has_optimizer"]
    assert_pp2_detour_loses_nothing(distributed, tmp_path, cli)
    tp1, out = tmp_path / "tp1", tmp_path / "outputs.pt"
    cli("reshard", distributed, tp1, "--tp", "1", "--format", "torch_dist")
    run_oracle(ORACLE, "load", tp1, out, *MODEL)
    reference, outputs = torch.load(distributed / "reference.pt"), torch.load(out)
    assert torch.equal(outputs["logits"], reference["logits"])


def test_dp_reshardable_state_is_placed_by_the_runs_ddp_settings(
    distributed_saves: dict[str, Path], tmp_path: Path, cli
) -> None:
    """``dp_reshardable`` state lies in the grad buffers, laid out by the DDP settings that
    Megatron-Bridge records in ``run_config.yaml``'s ``ddp`` section (the data-parallel size
    only pads a bucket's end, which the buckets are saved without): replayed, every weight and
    Adam moment equals the ``fully_reshardable`` save of the same run, and it reshards through
    TP1 PP2 without loss. A run config whose ``ddp`` section is gone leaves the weights only,
    saying which setting saves the state readably."""
    dp, fully = distributed_saves["dp_reshardable"], distributed_saves["fully_reshardable"]
    info = cli.json("inspect", dp)
    assert info["has_optimizer"], info["warnings"]
    report = cli.json("verify", dp, "--against", fully)
    assert report["ok"] and report["against"]["compared"] == report["against"]["held"][1]
    names = {t["name"] for t in report["tensors"]}
    assert any(n.startswith("exp_avg_sq/") and "experts" in n for n in names), names
    assert all(t["max_abs_diff"] == 0.0 for t in report["tensors"])
    assert_pp2_detour_loses_nothing(dp, tmp_path, cli)
    # to TP1 in the source's form: buckets again, the alignment gaps between a gated delta
    # net's small parameters written as zeros, as Megatron's own save holds them
    tp1, out = tmp_path / "tp1", tmp_path / "outputs.pt"
    result = cli("reshard", dp, tp1, "--tp", "1", "--format", "torch_dist")
    assert "dp_reshardable" in result.stdout + result.stderr
    assert cli.json("verify", tp1, "--against", dp)["ok"]
    run_oracle(ORACLE, "load", tp1, out, *MODEL)
    reference, outputs = torch.load(dp / "reference.pt"), torch.load(out)
    assert torch.equal(outputs["logits"], reference["logits"])
    bare = tmp_path / "no_ddp"
    shutil.copytree(dp, bare)
    config = next(bare.glob("iter_*/run_config.yaml"))
    text = config.read_text()
    config.write_text(_without_section(text, "ddp"))
    info = cli.json("inspect", bare)
    assert not info["has_optimizer"]
    assert "dist_ckpt_optim_fully_reshardable: true" in " ".join(info["warnings"])
    result = cli("reshard", bare, tmp_path / "pp2", "--tp", "1", code=2)
    assert "checkpoint.dist_ckpt_optim_fully_reshardable: true" in result.stderr


def _without_section(text: str, name: str) -> str:
    """A YAML document's text without its top-level mapping ``name`` (its key and the lines
    indented under it)."""
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        if line.startswith(f"{name}:"):
            skipping = True
            continue
        if skipping and (line.startswith((" ", "\t")) or not line.strip()):
            continue
        skipping = False
        out.append(line)
    return "".join(out)


VARIANTS = ("mha", "partial_rope", "qkv_bias", "qk_layernorm", "gelu", "tied", "sliding_window",
            "window_pattern", "off_by_one", "llama3_rope")  # fmt: skip
"""``megatron_core_variants.py``'s variants but YaRN (Megatron-Bridge's GPT provider has no YaRN
fields)."""


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(Megatron-Bridge's saves, Megatron-LM-style saves) of every variant, ``torch_dist``."""
    bridge, megatron = tmp_path_factory.mktemp("bridge_variants"), tmp_path_factory.mktemp("mlm")
    oracle = "megatron_core_variants.py"
    run_oracle(
        oracle, "write", bridge, "--format", "torch_dist", *megatron_bridge_peft.oracle_args()
    )
    run_oracle(oracle, "write", megatron, "--format", "torch_dist")
    return bridge, megatron


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_gpt_providers_run_reads_as_megatron_lms_args_say(
    variants: tuple[Path, Path], variant: str, cli
) -> None:
    bridge, megatron = (root / variant for root in variants)
    assert not (megatron / "iter_0000001" / "run_config.yaml").exists()
    assert cli.json("inspect", bridge)["spec"] == cli.json("inspect", megatron)["spec"]
    against = cli.json("verify", bridge, "--against", megatron)
    assert against["ok"] and against["against"]["only_here"] == []
    assert against["against"]["compared"] == len(against["tensors"]) > 0


MOE_VARIANTS = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")


@pytest.fixture(scope="module")
def moe_variants(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(Megatron-Bridge's saves, Megatron-LM-style saves), ``torch_dist`` TP2 EP2 ETP1."""
    bridge, megatron = tmp_path_factory.mktemp("bridge_moe"), tmp_path_factory.mktemp("mlm_moe")
    cut = ["--format", "torch_dist", "--tp", "2", "--ep", "2", "--etp", "1"]
    oracle = "megatron_core_moe.py"
    run_oracle(oracle, "write", bridge, *cut, *megatron_bridge_peft.oracle_args())
    run_oracle(oracle, "write", megatron, *cut)
    return bridge, megatron


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_a_routed_experts_run_reads_as_megatron_lms_args_say_adam_state_too(
    moe_variants: tuple[Path, Path], variant: str, tmp_path: Path, cli
) -> None:
    bridge, megatron = (root / variant for root in moe_variants)
    assert cli.json("inspect", bridge)["spec"] == cli.json("inspect", megatron)["spec"]
    assert cli.json("verify", bridge, "--against", megatron)["ok"]
    mine, theirs = tmp_path / "bridge", tmp_path / "megatron"
    for src, out in ((bridge, mine), (megatron, theirs)):
        cli("reshard", src, out, "--tp", "1", "--ep", "1", "--etp", "1", "--format", "megatron")
    assert cli.json("inspect", mine)["has_optimizer"]
    assert_same_rank_files(mine, theirs)
