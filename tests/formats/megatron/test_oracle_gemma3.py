"""Gemma 3 in Megatron (issue 56), judged by Megatron-Bridge's own Gemma 3 layers on megatron-core.

``tests/oracles/megatron_bridge_gemma3.py`` builds the model Megatron-Bridge 0.3.1's
``Gemma3ModelProvider`` builds (its attention, rotary embedding, scaled embedding and post-norm
projections, on megatron-core 0.16.1's local layers; the CPU shims are named there) at TP2,
saves it legacy and ``torch_dist``, and records its forward. ckptctl must: consolidate it to HF
with transformers' ``Gemma3ForCausalLM`` logits equal to that forward (and not equal once a
Gemma feature is dropped from the config: each matters on this input); reshard it to TP1 PP2,
which the oracle loads strictly stage by stage with the same logits; and reshard that back to
TP2 bit for bit, its one step of megatron-core's Adam state included.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests import megatron_bridge_peft
from tests.formats.hf.models import tensors
from tests.formats.megatron.rank_files import assert_same_rank_files
from tests.oracle_runner import run_oracle

pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 runs Megatron-Bridge's layers")
transformers = pytest.importorskip("transformers")

ORACLE = "megatron_bridge_gemma3.py"
pytestmark = pytest.mark.oracle


@pytest.fixture(scope="module", params=["legacy", "torch_dist"])
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(f"gemma3_{request.param}")
    site = megatron_bridge_peft.site()
    run_oracle(ORACLE, "write", root, "--format", request.param, "--bridge", site)
    return root


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _hf_logits(root: Path, ids: torch.Tensor, **changes: object) -> torch.Tensor:
    config = transformers.AutoConfig.from_pretrained(root)
    for key, value in changes.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        root, config=config, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return model(ids).logits


def test_transformers_logits_equal_megatron_bridges_forward(
    written: Path, tmp_path: Path, cli
) -> None:
    hf = tmp_path / "hf"
    cli("consolidate", written, hf, "--format", "hf")
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["sliding_window"] == 4  # megatron-core's (3, 0): the last 4 keys
    assert config["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    reference = torch.load(written / "reference.pt")
    ids, want = reference["input_ids"], reference["logits"]
    got = _hf_logits(hf, ids)
    assert got.shape == want.shape
    assert _relative(got, want) < 1e-5
    # each Gemma feature changes these logits: a lost one could not pass the check above
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    for changes in (
        {"sliding_window": 6},
        {"query_pre_attn_scalar": 16},
        {"rope_parameters": rope},  # the global layers' linear x8 dropped
    ):
        assert _relative(_hf_logits(hf, ids, **changes), want) > 1e-3, changes


def test_a_pp2_reshard_loads_into_megatron_bridges_model(
    written: Path, tmp_path: Path, cli
) -> None:
    pp2 = tmp_path / "pp2"
    cli("reshard", written, pp2, "--tp", "1", "--pp", "2", "--format", "megatron")
    out = tmp_path / "logits.pt"
    run_oracle(ORACLE, "forward", pp2, out, "--bridge", megatron_bridge_peft.site())
    want = torch.load(written / "reference.pt")["logits"]
    assert _relative(torch.load(out), want) < 1e-5

    back = tmp_path / "tp2"
    cli("reshard", pp2, back, "--tp", "2", "--pp", "1", "--format", "megatron")
    # the same weights as the source, whatever its format ...
    for root, hf in ((written, tmp_path / "hf_written"), (back, tmp_path / "hf_back")):
        cli("consolidate", root, hf, "--format", "hf")
    mine, theirs = tensors(tmp_path / "hf_back"), tensors(tmp_path / "hf_written")
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[name], tensor) for name, tensor in theirs.items())
    if (written / "iter_0000001" / "mp_rank_00").exists():
        # a legacy source: the same rank files, weights and Adam state, in megatron-core's order
        assert_same_rank_files(back, written)
    else:  # torch_dist: the detour through TP1 PP2 loses nothing of weights or Adam state
        direct = tmp_path / "direct"
        cli("reshard", written, direct, "--tp", "2", "--pp", "1", "--format", "megatron")
        assert cli.json("inspect", direct)["has_optimizer"]
        assert_same_rank_files(back, direct)


def test_a_torch_dist_written_by_ckptctl_loads_into_megatron_bridges_model(
    written: Path, tmp_path: Path, cli
) -> None:
    """ckptctl's ``torch_dist`` of the model (its sharded keys for the post-sublayer norms
    among them) is what megatron-core's ``dist_checkpointing.load`` asks for."""
    pp2, out = tmp_path / "pp2", tmp_path / "torch_dist"
    cli("reshard", written, pp2, "--tp", "1", "--pp", "2", "--format", "torch_dist")
    cli("reshard", pp2, out, "--tp", "2", "--pp", "1", "--format", "torch_dist")
    logits = tmp_path / "logits.pt"
    run_oracle(ORACLE, "load", out, logits, "--bridge", megatron_bridge_peft.site())
    want = torch.load(written / "reference.pt")["logits"]
    assert _relative(torch.load(logits), want) < 1e-5
