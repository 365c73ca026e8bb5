"""HF weights saved without their config.json (torchtitan's HF export, an accelerate
``save_state`` outside FSDP): refused naming what is missing, read with ``--hf-config``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")


def _saved(directory: Path) -> None:
    config = transformers.Qwen3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    transformers.Qwen3ForCausalLM(config).save_pretrained(str(directory))


def test_weights_without_their_config_need_it_given(tmp_path: Path, cli) -> None:
    _saved(tmp_path / "hf")
    bare = tmp_path / "bare"
    shutil.copytree(tmp_path / "hf", bare)
    (bare / "config.json").unlink()
    (bare / "generation_config.json").unlink()
    result = cli("consolidate", bare, tmp_path / "refused", code=3)
    assert "config.json" in result.stderr and "--hf-config" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    config = tmp_path / "hf" / "config.json"
    cli("--hf-config", config, "reshard", bare, tmp_path / "meg", "--tp", "2")
    cli("consolidate", tmp_path / "meg", tmp_path / "back")
    report = cli.json("verify", tmp_path / "back", "--against", tmp_path / "hf")
    assert report["ok"] and report["against"]["compared"] > 0
    assert not (bare / "config.json").exists()  # the source is never written
