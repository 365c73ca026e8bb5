"""Reading the model description strictly: fields that change the computation or the layout are
read as Megatron-LM reads them (issue 14). Judged by transformers' logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptctl import synth

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 1100, (2, 17), generator=torch.Generator().manual_seed(3))


def _store_mha_as_megatron_lm_does(root: Path) -> None:
    """Megatron-LM saves ``num_query_groups`` as given (default 1) even when
    ``group_query_attention`` is off, and then builds one group per head."""
    for path in root.rglob("model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)
        assert state["args"].num_query_groups == state["args"].num_attention_heads
        state["args"].num_query_groups = 1
        state["args"].group_query_attention = False
        torch.save(state, path)


def test_mha_with_a_stale_num_query_groups_converts_right(tmp_path: Path, cli) -> None:
    config = synth.tiny_llama_config(num_heads=4, num_kv_heads=4)  # MHA
    model = synth.make_model(config, seed=5)
    src = tmp_path / "mha"
    synth.write_megatron(model, synth.adam_step(model, seed=5), src, tp=2, pp=1)
    _store_mha_as_megatron_lm_does(src)
    info = cli.json("inspect", src)
    assert info["spec"]["num_query_groups"] == 4
    cli("consolidate", src, tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, attn_implementation="eager"
    )
    assert loaded.config.num_key_value_heads == 4
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)
    # A reshard keeps every row of the fused QKV (4 groups, not 1) and converts back bit-exactly.
    cli("reshard", src, tmp_path / "tp1", "--tp", "1", "--pp", "2")
    assert cli.json("verify", tmp_path / "tp1", "--against", src)["ok"]
    cli("reshard", tmp_path / "tp1", tmp_path / "back", "--tp", "2", "--pp", "1")
    assert cli.json("verify", tmp_path / "back", "--against", src)["ok"]


def _edit_args(root: Path, **fields: object) -> None:
    for path in root.rglob("model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)
        for name, value in fields.items():
            setattr(state["args"], name, value)
        torch.save(state, path)


@pytest.fixture
def llama(tmp_path: Path) -> Path:
    model = synth.make_model(synth.tiny_llama_config(), seed=6)
    src = tmp_path / "src"
    synth.write_megatron(model, synth.adam_step(model, seed=6), src, tp=2, pp=1)
    return src


def test_partial_rotary_is_carried_through_reshards_and_refused_for_hf(
    llama: Path, tmp_path: Path, cli
) -> None:
    _edit_args(llama, rotary_percent=0.5)
    assert cli.json("inspect", llama)["spec"]["rotary_percent"] == 0.5
    result = cli("consolidate", llama, tmp_path / "hf", code=2)
    assert "rotary_percent=0.5" in result.stderr and "partial rotary" in result.stderr
    assert not (tmp_path / "hf").exists()
    cli("reshard", llama, tmp_path / "tp1", "--tp", "1")
    path = tmp_path / "tp1/iter_0000001/mp_rank_00/model_optim_rng.pt"
    resharded = torch.load(path, weights_only=False)
    assert resharded["args"].rotary_percent == 0.5


@pytest.mark.parametrize("field", ["apply_layernorm_1p", "layernorm_zero_centered_gamma"])
def test_zero_centred_norms_are_carried_and_refused_for_llama(
    llama: Path, tmp_path: Path, field: str, cli
) -> None:
    """Megatron-LM's ``--apply-layernorm-1p`` (``--layernorm-zero-centered-gamma`` in 0.19):
    norms scale by ``1 + weight``; kept through a reshard, refused by name for an HF class
    whose norms scale by the weight."""
    _edit_args(llama, **{field: True})
    assert cli.json("inspect", llama)["spec"]["layernorm_zero_centered_gamma"]
    result = cli("consolidate", llama, tmp_path / "hf", code=2)
    assert "layernorm_zero_centered_gamma" in result.stderr, result.stderr
    assert not (tmp_path / "hf").exists()
    cli("reshard", llama, tmp_path / "tp1", "--tp", "1")
    assert cli.json("inspect", tmp_path / "tp1")["spec"]["layernorm_zero_centered_gamma"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("qk_l2_norm", True),
        ("rotary_interleaved", True),
        ("softmax_type", "sigmoid"),
        ("openai_gelu", True),
        ("apply_residual_connection_post_layernorm", True),
        ("spec", ["my_specs", "custom_layer_spec"]),
    ],
)
def test_unmapped_math_changing_fields_are_refused_by_name(
    llama: Path, tmp_path: Path, field: str, value: object, cli
) -> None:
    _edit_args(llama, **{field: value})
    for command in (["inspect", llama], ["reshard", llama, tmp_path / "out", "--tp", "1"]):
        result = cli(*command, code=2)
        assert f"args.{field}={value!r}" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_an_mla_field_ckptctl_cannot_carry_is_refused_by_name(llama: Path, cli) -> None:
    """Multi-latent attention is read (``test_megatron_lm_mla.py``); its down projections
    fused into one tensor (``--mla-down-proj-fusion``) are not, and say so."""
    _edit_args(llama, multi_latent_attention=True, mla_down_proj_fusion=True)
    result = cli("inspect", llama, code=2)
    assert "args.mla_down_proj_fusion=True" in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("field", "value"), [("mtp_use_repeated_layer", True), ("mtp_hybrid_override_pattern", "M")]
)
def test_an_mtp_field_ckptctl_cannot_carry_is_refused_by_name(
    llama: Path, field: str, value: object, cli
) -> None:
    """Multi-token prediction layers are read (``test_megatron_lm_mtp.py``); one layer shared
    by every depth, or a hybrid MTP block, is not, and says so."""
    _edit_args(llama, mtp_num_layers=1, **{field: value})
    result = cli("inspect", llama, code=2)
    assert f"args.{field}={value!r}" in result.stderr, result.stderr


def test_args_that_call_for_tensors_the_files_lack_are_refused(llama: Path, cli) -> None:
    _edit_args(llama, qk_layernorm=True)
    result = cli("inspect", llama, code=3)
    assert "self_attention.q_layernorm.weight" in result.stderr and "qk_layernorm" in result.stderr


def test_an_unknown_args_field_is_refused_by_name_unless_trusted(
    llama: Path, tmp_path: Path, cli
) -> None:
    """A Megatron feature ckptctl has never heard of must not pass silently."""
    _edit_args(llama, attention_sink_tokens=4)
    for command in (["inspect", llama], ["reshard", llama, tmp_path / "out", "--tp", "1"]):
        result = cli(*command, code=2)
        assert "args.attention_sink_tokens=4: unknown to ckptctl" in result.stderr
        assert "--trust-field" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
    trust = ("--trust-field", "attention_sink_tokens")
    cli(*trust, "reshard", llama, tmp_path / "out", "--tp", "1")
    # The field travels on in the output's args, so reading it again needs the same word.
    assert cli.json(*trust, "verify", tmp_path / "out", "--against", llama)["ok"]


def test_json_error_document_names_the_field(llama: Path, cli) -> None:
    _edit_args(llama, rotary_interleaved=True)
    result = cli("inspect", llama, "--json", code=2)
    assert "args.rotary_interleaved=True" in result.stdout
