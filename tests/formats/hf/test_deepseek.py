"""DeepSeek-V3's HF family (issue 54): models built by transformers' ``DeepseekV3ForCausalLM``
(multi-latent attention; dense layers first, routed ones with a shared expert and DeepSeek's
sigmoid router after) go to Megatron layouts and back bit for bit with the original's logits;
what ckptctl does not carry yet is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.formats.hf.routed_models import randomised_and_saved, safetensors_of, with_mtp_layer

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")

IDS = torch.randint(0, 1000, (2, 13), generator=torch.Generator().manual_seed(5))


def _make(root: Path, *, moe: bool, dense_first: int = 1, **extra: object) -> torch.nn.Module:
    sizes: dict[str, object] = dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=2,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        routed_scaling_factor=2.5,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        first_k_dense_replace=dense_first if moe else 4,
        num_nextn_predict_layers=0,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    config = transformers.DeepseekV3Config(**(sizes | extra))
    torch.manual_seed(12)
    return randomised_and_saved(transformers.DeepseekV3ForCausalLM(config), root)


@pytest.mark.parametrize(
    ("moe", "dense_first", "layout"),
    [
        (False, 4, ("--tp", "2", "--pp", "2")),
        (True, 0, ("--tp", "2", "--ep", "2", "--dp", "2")),
        (True, 1, ("--tp", "2", "--pp", "2", "--ep", "2", "--dp", "2")),
    ],
    ids=["dense", "moe", "dense-first-moe"],
)
def test_deepseek_v3_goes_to_megatron_and_back_bit_exactly(
    moe: bool, dense_first: int, layout: tuple[str, ...], tmp_path: Path, cli
) -> None:
    """Every layer dense; every layer routed; and DeepSeek-V3's own shape, dense layers first
    (here one, on the first pipeline stage with a routed one)."""
    src = tmp_path / "hf"
    model = _make(src, moe=moe, dense_first=dense_first)
    megatron = tmp_path / "megatron"
    cli("reshard", src, megatron, *layout)
    info = cli.json("inspect", megatron)
    assert info["spec"]["mla"]["q_lora_rank"] == 32 and info["spec"]["mla"]["v_head_dim"] == 16
    assert info["spec"]["num_experts"] == (8 if moe else None)
    assert info["spec"]["dense_layers"] == list(range(dense_first if moe else 0))
    back = tmp_path / "back"
    cli("consolidate", megatron, back, "--format", "hf")
    config = json.loads((back / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    mine, theirs = safetensors_of(back), safetensors_of(src)
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)


@pytest.mark.parametrize(
    "layout",
    [
        ("--tp", "2", "--pp", "2", "--ep", "2", "--dp", "2"),
        ("--pp", "2", "--vpp", "2"),
        ("--pp", "2", "--pp-first-stage-layers", "3", "--pp-last-stage-layers", "1"),
    ],
    ids=["tp-pp-ep", "virtual-pipeline", "uneven-stages"],
)
def test_an_mtp_layer_goes_to_megatron_and_back_bit_exactly(
    layout: tuple[str, ...], tmp_path: Path, cli
) -> None:
    """DeepSeek-V3 as released: one MTP layer kept as ``model.layers.<num_hidden_layers>``
    (a routed layer with its norms, projection and copies of the embedding and output layer)
    lands on the last pipeline stage (its last virtual chunk) and its EP ranks, and comes back
    bit for bit; transformers' own MTP loader reads it from the result."""
    from transformers.modeling_layers import MtpModel

    src = tmp_path / "hf"
    model = _make(src, moe=True, num_nextn_predict_layers=1)
    theirs = with_mtp_layer(transformers.DeepseekV3ForCausalLM, model.config, src, layers=4)
    megatron = tmp_path / "megatron"
    cli("reshard", src, megatron, *layout)
    assert cli.json("inspect", megatron)["spec"]["mtp_num_layers"] == 1
    back = tmp_path / "back"
    cli("consolidate", megatron, back, "--format", "hf")
    assert json.loads((back / "config.json").read_text())["num_nextn_predict_layers"] == 1
    mine = safetensors_of(back)
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)
    loaded._keys_to_ignore_on_load_unexpected = [r"model\.layers\.4\..*"]
    mtp = MtpModel.from_pretrained(loaded).state_dict()
    assert torch.equal(mtp["layers.0.eh_proj.weight"], theirs["model.layers.4.eh_proj.weight"])
    assert torch.equal(
        mtp["layers.0.post_norm.weight"], theirs["model.layers.4.shared_head.norm.weight"]
    )
    gate = mtp["layers.0.mtp_block.mlp.experts.gate_up_proj"][3, :32]
    assert torch.equal(gate, theirs["model.layers.4.mlp.experts.3.gate_proj.weight"])


def test_an_mtp_copy_that_differs_from_what_it_copies_stops_the_conversion(
    tmp_path: Path, cli
) -> None:
    """The MTP layer's copies of the embedding and output layer are read from the originals
    (Megatron shares one tensor); a copy that differs would be lost, so the conversion checks
    each copy and stops before its output counts as complete."""
    from safetensors.torch import save_file

    src = tmp_path / "hf"
    model = _make(src, moe=True, num_nextn_predict_layers=1)
    tensors = with_mtp_layer(transformers.DeepseekV3ForCausalLM, model.config, src, layers=4)
    tensors["model.layers.4.shared_head.head.weight"][700, 3] += 1.0
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    result = cli("reshard", src, tmp_path / "out", "--tp", "2", code=3)
    assert "model.layers.4.shared_head.head.weight should copy lm_head.weight" in result.stderr
    assert "rows 0-999" in result.stderr, result.stderr
    assert not (tmp_path / "out" / "ckptctl.manifest.json").exists()
    checks = json.loads(cli("verify", src, "--json", code=1).stdout)["checks"]
    assert [c["status"] for c in checks if c["name"] == "replicas"] == ["failed"], checks


def test_a_model_saved_by_transformers_without_its_mtp_layer_is_read_without_it(
    tmp_path: Path, cli
) -> None:
    """transformers never loads an MTP layer and saves a fine-tuned DeepSeek-V3 without one,
    keeping ``num_nextn_predict_layers``: such a checkpoint is the whole main model; it is read
    without MTP, and the conversion says so."""
    src = tmp_path / "hf"
    _make(src, moe=True, num_nextn_predict_layers=1)
    assert json.loads((src / "config.json").read_text())["num_nextn_predict_layers"] == 1
    info = cli.json("inspect", src)
    assert info["spec"]["mtp_num_layers"] == 0
    assert any("holds none" in w for w in info["warnings"]), info
    result = cli("reshard", src, tmp_path / "megatron", "--tp", "2")
    assert "num_nextn_predict_layers" in result.stderr + result.stdout


def test_an_mtp_layer_its_config_does_not_announce_is_refused_not_dropped(
    tmp_path: Path, cli
) -> None:
    """The failure users of other tools report ("the converted model is one layer short"):
    tensors the config has no place for stop the conversion, named."""
    src = tmp_path / "hf"
    model = _make(src, moe=True, num_nextn_predict_layers=1)
    with_mtp_layer(transformers.DeepseekV3ForCausalLM, model.config, src, layers=4)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    result = cli("reshard", src, tmp_path / "out", "--tp", "2", code=3)
    assert "model.layers.4.eh_proj.weight" in result.stderr, result.stderr
    assert "would drop them" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_transformers_5_in_memory_expert_names_are_read(tmp_path: Path, cli) -> None:
    """A checkpoint saved from the model's state dict as transformers 5 holds it (every
    layer's experts packed: ``mlp.experts.gate_up_proj`` ``[E, 2F, H]``, ``down_proj``
    ``[E, H, F]``) converts like the hub's per-expert spelling, and is written back in it."""
    from safetensors.torch import save_file

    hub = tmp_path / "hub"
    model = _make(hub, moe=True)
    packed = tmp_path / "packed"
    packed.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, packed / "model.safetensors", metadata={"format": "pt"})
    (packed / "config.json").write_text((hub / "config.json").read_text())
    megatron, back = tmp_path / "megatron", tmp_path / "back"
    cli("reshard", packed, megatron, "--tp", "2", "--ep", "2", "--dp", "2")
    cli("consolidate", megatron, back, "--format", "hf")
    mine, theirs = safetensors_of(back), safetensors_of(hub)
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name


def test_yarn_and_uncompressed_queries_are_carried(tmp_path: Path, cli) -> None:
    """YaRN's settings (DeepSeek-V3's long context) and queries without compression
    (``q_lora_rank`` unset: one ``q_proj``) survive HF -> Megatron -> HF."""
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    src = tmp_path / "hf"
    model = _make(
        src, moe=False, q_lora_rank=None, rope_parameters=yarn, max_position_embeddings=16384
    )
    megatron, back = tmp_path / "megatron", tmp_path / "back"
    cli("reshard", src, megatron, "--tp", "2")
    cli("consolidate", megatron, back, "--format", "hf")
    config = json.loads((back / "config.json").read_text())
    assert config["q_lora_rank"] is None
    assert {k: config["rope_parameters"][k] for k in yarn} == yarn
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"rope_interleave": False}, "rope_interleave=False"),
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
        ({"norm_topk_prob": False}, "norm_topk_prob=false"),
        ({"num_experts_per_tok": 1}, "norm_topk_prob=true with 1 expert(s) per token"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
        # Megatron-LM's MLA config takes YaRN's original context from no argument
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32,
                }
            },
            "original_max_position_embeddings=32",
        ),
    ],
)
def test_what_ckptctl_does_not_carry_yet_is_refused_by_name(
    edit: dict[str, object], named: str, tmp_path: Path, cli
) -> None:
    src = tmp_path / "hf"
    _make(src, moe=True)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **edit}))
    result = cli("reshard", src, tmp_path / "out", "--tp", "2", code=2)
    assert named in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()
