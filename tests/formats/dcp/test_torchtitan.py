"""torchtitan's DCP checkpoints, judged by torchtitan: its own training code (Llama 3 model,
``parallelize_llama``'s FSDP2, AdamW container, ``CheckpointManager``; ``oracles/
torchtitan_writer``, in torchtitan 0.3.0's environment, ``tests/torchtitan_env``) writes the
checkpoint after one step, and its own ``Llama3StateDictAdapter.to_hf`` says what the HF
checkpoint holds -- weights, and Adam's moments put through it like weights (``hf_dcp``).
transformers' forward of the output is compared with torchtitan's. The CPU shims the oracle
needs are listed in its docstring."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from tests import torchtitan_env

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
QWEN3 = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "head_dim": 16,
    "mlp_bias": None,  # Llama's field: dropped
}
"""What turns the Llama's config into a Qwen3's of the same sizes (which has q/k norms)."""


@pytest.fixture(scope="module")
def fused(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks, the fused-QKV module torchtitan's Llama 3 flavours use: weights saved as
    wq/wk/wv, Adam's state as the fused wqkv's, every chunk of whole heads."""
    out = tmp_path_factory.mktemp("torchtitan_fused")
    torchtitan_env.write(out)
    return out


@pytest.fixture(scope="module")
def cut(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 ranks, separate q/k/v modules: FSDP's shards cut heads, and rotary pairs, apart."""
    out = tmp_path_factory.mktemp("torchtitan_cut")
    torchtitan_env.write(out, "--world", "3", "--unfused")
    return out


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE: cos/sin RoPE (no permutation), q/k norms, each layer's experts grouped in
    ``[E, F, D]`` tensors that FSDP shards by expert."""
    out = tmp_path_factory.mktemp("torchtitan_moe")
    torchtitan_env.write(out, "--model", "qwen3_moe")
    return out


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3: multi-latent attention (q through its low-rank path), a dense first layer,
    MoE layers with a shared expert and sigmoid routing whose load-balancing biases torchtitan
    moved (HF keeps them: ``e_score_correction_bias``)."""
    out = tmp_path_factory.mktemp("torchtitan_deepseek")
    torchtitan_env.write(out, "--model", "deepseek_v3", "--balanced")
    return out


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3 with its output layer tied to the embedding (its small releases): the checkpoint
    holds both, the optimizer the one parameter."""
    out = tmp_path_factory.mktemp("torchtitan_tied")
    torchtitan_env.write(out, "--model", "qwen3_tied")
    return out


def _truth(run: Path) -> dict[str, Any]:
    return torch.load(run / "truth.pt", weights_only=False)


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


@pytest.mark.parametrize("run", ["fused", "cut", "moe", "tied", "deepseek"])
def test_torchtitan_dcp_becomes_what_its_own_hf_adapter_makes(
    run: str, request: pytest.FixtureRequest, tmp_path: Path, cli
) -> None:
    """Every tensor equals ``to_hf``'s (q/k rows permuted for HF's rotary layout), bit for bit,
    and transformers' logits equal torchtitan's forward to float32 rounding."""
    titan: Path = request.getfixturevalue(run)
    cli("--hf-config", titan / "config.json", "consolidate", titan / "checkpoint", tmp_path / "hf")
    truth = _truth(titan)
    ours = _tensors(tmp_path / "hf")
    # DeepSeek-V3's MTP layer (HF's layer N) holds copies of the embedding and output layer on
    # the hub; torchtitan's shares the model's (its adapter writes none): the copies are equal
    copies = {"embed_tokens.weight": "model.embed_tokens.weight"}
    copies["shared_head.head.weight"] = "lm_head.weight"
    mtp = {f"model.layers.3.{copy}": main for copy, main in copies.items()}
    extra = mtp if run == "deepseek" else {}
    assert sorted(ours) == sorted([*truth["hf"], *extra])
    for name, want in truth["hf"].items():
        assert torch.equal(ours[name], want), name
    for copy, main in extra.items():
        assert torch.equal(ours[copy], truth["hf"][main]), copy
    if run == "deepseek":  # the MTP layer's own tensors came through torchtitan's mtp_layers.0
        assert {"model.layers.3.eh_proj.weight", "model.layers.3.shared_head.norm.weight"} <= set(
            ours
        )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        logits = model(input_ids=truth["input_ids"]).logits
    # torchtitan's complex-number RoPE and FlexAttention against HF's rotate_half and eager
    # attention: the same model, rounded differently.
    torch.testing.assert_close(logits, truth["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("run", "layout"),
    [
        ("fused", ("--tp", "2", "--pp", "2")),
        ("cut", ("--tp", "2", "--pp", "2")),
        ("moe", ("--ep", "2", "--pp", "2", "--dp", "2")),
        ("tied", ("--tp", "2", "--pp", "2")),
        ("deepseek", ("--tp", "2", "--ep", "2", "--dp", "2")),
    ],
)
def test_torchtitan_dcp_reshards_to_megatron_with_its_adam_state(
    run: str, layout: tuple[str, ...], request: pytest.FixtureRequest, tmp_path: Path, cli
) -> None:
    """Megatron TP2 PP2 from the torchtitan checkpoint holds, bit for bit, the weights and Adam
    moments torchtitan's adapter maps to HF (read through ckptctl's HF path, proven against
    FSDP2 of the HF model in test_dcp_hf)."""
    titan: Path = request.getfixturevalue(run)
    cli(
        "--hf-config",
        titan / "config.json",
        "reshard",
        titan / "checkpoint",
        tmp_path / "meg",
        *layout,
    )
    report = cli.json("verify", tmp_path / "meg", "--against", titan / "hf_dcp")
    assert report["ok"]
    assert report["against"]["compared"] == report["against"]["held"][1]
    names = {t["name"] for t in report["tensors"]}
    attention = "linear_kv_up_proj" if run == "deepseek" else "linear_qkv"
    assert {
        f"exp_avg/decoder.layers.0.self_attention.{attention}.weight",
        f"exp_avg_sq/decoder.layers.1.self_attention.{attention}.weight",
    } <= names
    assert all(t["max_abs_diff"] == 0.0 for t in report["tensors"])


def test_inspect_shows_the_train_state_step_and_asks_for_the_config(fused: Path, cli) -> None:
    shown = cli.json("inspect", fused / "checkpoint")
    assert shown["iteration"] == 1  # train_state.step, from the newest step-<n>/ folder
    assert any("--hf-config" in note for note in shown["notes"])
    result = cli("consolidate", fused / "checkpoint", "/nonexistent/out", "--format", "hf", code=2)
    assert "--hf-config" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    missing = cli("inspect", fused / "checkpoint", "--iteration", "7", code=3)
    assert "step-7" in missing.stderr and "step-1" in missing.stderr


@pytest.mark.parametrize(
    ("change", "named", "code"),
    [
        ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "'mistral'", 2),
        (QWEN3, "no tensor holds the configured model's model.layers.0.self_attn.q_norm", 3),
        ({"num_key_value_heads": 4}, "layers.0.attention.qkv_linear.wk.weight has shape", 3),
    ],
)
def test_a_config_that_is_not_the_checkpoints_is_refused_by_name(
    fused: Path, tmp_path: Path, cli, change: dict[str, Any], named: str, code: int
) -> None:
    result = _consolidated_under(fused, fused / "checkpoint", change, tmp_path, cli, code)
    assert named in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()


def _consolidated_under(
    run: Path, source: Path, change: dict[str, Any], tmp_path: Path, cli, code: int
) -> Any:
    """``consolidate SOURCE`` under the run's config changed by ``change`` (``None`` drops a
    field), expecting exit ``code``."""
    base = json.loads((run / "config.json").read_text())
    config = {k: v for k, v in {**base, **change}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    given = ("--hf-config", tmp_path / "config.json")
    return cli(*given, "consolidate", source, tmp_path / "hf", code=code)


def test_an_hf_named_dcp_under_another_models_config_is_refused(
    fused: Path, tmp_path: Path, cli
) -> None:
    """The reference DCP (HF names) of the Llama under a Qwen3 config: the q/k norms the
    config asks for are nowhere, which is said, not an internal error."""
    result = _consolidated_under(fused, fused / "hf_dcp", QWEN3, tmp_path, cli, 3)
    assert "holds no data for" in result.stderr and "q_layernorm" in result.stderr


def test_the_source_is_not_touched(fused: Path, tmp_path: Path, cli) -> None:
    source = tmp_path / "src"
    shutil.copytree(fused / "checkpoint", source)
    before = {p: p.read_bytes() for p in source.rglob("*") if p.is_file()}
    cli("--hf-config", fused / "config.json", "consolidate", source, tmp_path / "hf")
    assert {p: p.read_bytes() for p in source.rglob("*") if p.is_file()} == before


def test_a_moe_whose_load_balancing_biases_moved_is_refused(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, cli
) -> None:
    """torchtitan's aux-loss-free balancing moves a bias that changes which experts a token
    takes; HF's Qwen3-MoE has none, so dropping it would change the model."""
    out = tmp_path_factory.mktemp("torchtitan_balanced")
    torchtitan_env.write(out, "--model", "qwen3_moe", "--balanced")
    result = cli(
        "--hf-config",
        out / "config.json",
        "consolidate",
        out / "checkpoint",
        tmp_path / "hf",
        code=3,
    )
    assert "layers.0.moe.expert_bias_E" in result.stderr and "not zero" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()


def test_an_expert_parallel_stage_without_moe_layers_keeps_empty_expert_groups(
    deepseek: Path, tmp_path: Path, cli
) -> None:
    """Under EP megatron-core chains a dense and an expert optimizer on every rank and gives
    every rank the parameter groups of every rank: the dense first layer alone on stage 0 has
    an expert optimizer of one empty group (``test_oracle_dense_first_moe`` has megatron-core
    load that form). Written so, read back bit for bit, through another layout and back; the
    distributed optimizer, which megatron-core cannot save there, is refused by name."""
    args = ("--hf-config", deepseek / "config.json", "reshard", deepseek / "checkpoint")
    layout = ("--ep", "2", "--dp", "2", "--pp", "2", "--pp-first-stage-layers", "1")
    cli(*args, tmp_path / "meg", *layout, "--format", "megatron")
    assert cli.json("verify", tmp_path / "meg", "--against", deepseek / "hf_dcp")["ok"]
    step = next((tmp_path / "meg").glob("iter_*"))
    for ep in (0, 1):
        dense = torch.load(
            step / f"mp_rank_00_000_{ep:03d}" / "model_optim_rng.pt", weights_only=False
        )
        experts = dense["optimizer"][1]["param_groups"]
        assert len(dense["optimizer"]) == 2 and [len(g["params"]) for g in experts] == [0]
    cli("reshard", tmp_path / "meg", tmp_path / "one", "--pp", "1", "--ep", "2", "--dp", "2")
    assert cli.json("verify", tmp_path / "one", "--against", deepseek / "hf_dcp")["ok"]
    cli("reshard", tmp_path / "one", tmp_path / "again", *layout)
    assert cli.json("verify", tmp_path / "again", "--against", tmp_path / "meg")["ok"]
    distributed = (*layout, "--format", "megatron", "--distributed-optimizer")
    result = cli(*args, tmp_path / "dist", *distributed, code=2)
    assert "stage(s) [0] hold no MoE layer" in result.stderr
    assert not (tmp_path / "dist").exists()
