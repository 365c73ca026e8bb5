"""Reading a Megatron-Bridge ``run_config.yaml`` model section into Megatron-LM's ``args``
(``ckptctl.formats.torch_dist.bridge_config``), field by field. The sections here are cut down
from what Megatron-Bridge 0.3.1's ``ConfigContainer.to_yaml`` writes (the whole files are read
in ``tests/formats/megatron/test_megatron_bridge.py``, written by its ``save_checkpoint``)."""

from __future__ import annotations

from typing import Any

import pytest

from ckptctl.errors import CheckpointError, LayoutError
from ckptctl.formats.megatron_common.args import spec_from_args
from ckptctl.formats.torch_dist.bridge_config import (
    args_from_model,
    ddp_args,
    model_section,
    sections,
)

WHERE = "iter_0000001/run_config.yaml"
SILU = {"_call_": False, "_target_": "torch.nn.functional.silu"}


def _model(**changes: Any) -> dict[str, Any]:
    model: dict[str, Any] = {
        "_target_": "megatron.bridge.models.qwen.qwen_provider.Qwen3ModelProvider",
        "num_layers": 2,
        "hidden_size": 64,
        "ffn_hidden_size": 128,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "kv_channels": 16,
        "vocab_size": 1000,
        "should_pad_vocab": False,
        "make_vocab_size_divisible_by": 128,
        "share_embeddings_and_output_weights": True,
        "normalization": "RMSNorm",
        "layernorm_epsilon": 1e-6,
        "gated_linear_unit": True,
        "activation_func": SILU,
        "add_bias_linear": False,
        "qk_layernorm": True,
        "position_embedding_type": "rope",
        "rotary_base": 1000000,
        "seq_length": 4096,
        "params_dtype": {"_call_": False, "_target_": "torch.bfloat16"},
        "init_method": None,
        "tp_comm_overlap_disable_qkv": False,
        "transformer_layer_spec": {
            "_call_": False,
            "_target_": "megatron.bridge.models.gpt_provider.default_layer_spec",
        },
    }
    return model | changes


def test_a_providers_fields_become_megatron_lms_args() -> None:
    args = args_from_model(_model(), WHERE)
    assert args.swiglu is True and args.transformer_impl == "transformer_engine"
    assert args.untie_embeddings_and_output_weights is False and args.num_experts is None
    assert args.max_position_embeddings == 4096  # GPTModel's max_sequence_length
    spec = spec_from_args(args)
    assert (spec.vocab_size, spec.padded_vocab_size(tp=2)) == (1000, 1000)  # not padded
    assert spec.tie_embeddings and spec.qk_layernorm and spec.num_query_groups == 2
    padded = spec_from_args(args_from_model(_model(should_pad_vocab=True), WHERE))
    assert padded.padded_vocab_size(tp=2) == 1024  # to 128 x TP, as Megatron-LM pads


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"_target_": "megatron.bridge.models.llama.llama_provider.Llama4ModelProvider"},
         "model._target_="),
        ({"activation_func": {"_target_": "torch.nn.functional.relu"}},
         "model.activation_func='torch.nn.functional.relu'"),
        ({"fp8_param": True}, "model.fp8_param=True changes the model"),
        ({"init_method": {"_target_": "custom.init"}, "generation_config": None,
          "custom_layer": {"_target_": "my.Layer"}}, "model.custom_layer is 'my.Layer'"),
        ({"transformer_layer_spec": {"_target_": "my.spec"}},
         "model.transformer_layer_spec='my.spec'"),
    ],
)  # fmt: skip
def test_what_ckptctl_cannot_judge_is_refused_by_name(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(LayoutError) as refused:
        args_from_model(_model(**changes), WHERE)
    assert str(refused.value).startswith(WHERE) and message in str(refused.value)


def test_a_file_that_is_not_megatron_bridges_config_is_refused_naming_it() -> None:
    with pytest.raises(CheckpointError, match=f"{WHERE}: not YAML"):
        model_section("model: [unclosed", WHERE)
    with pytest.raises(CheckpointError, match="no 'model' section"):
        model_section("train:\n  train_iters: 10\n", WHERE)
    # safe_load: a tag that would build an object is refused, never run
    with pytest.raises(CheckpointError, match="not YAML"):
        model_section("model: !!python/object/apply:os.system ['true']\n", WHERE)


DDP = """model:
  _target_: megatron.bridge.models.gpt_provider.GPTModelProvider
ddp:
  grad_reduce_in_fp32: true
  overlap_grad_reduce: true
  bucket_size: 40000
  use_distributed_optimizer: true
  pad_buckets_for_high_nccl_busbw: false
"""


def test_the_ddp_section_lays_out_the_grad_buffers_in_megatron_lms_terms() -> None:
    """The settings that place ``dp_reshardable`` state; a section missing one of them, or
    padding buckets for NCCL's bus bandwidth (not replayed), places none."""
    assert ddp_args(sections(DDP, WHERE)) == {
        "overlap_grad_reduce": True,
        "ddp_bucket_size": 40000,
        "accumulate_allreduce_grads_in_fp32": True,
        "use_distributed_optimizer": True,
    }
    assert ddp_args(sections(DDP.replace("  bucket_size: 40000\n", ""), WHERE)) is None
    padded = DDP.replace("busbw: false", "busbw: true")
    assert ddp_args(sections(padded, WHERE)) is None
    assert ddp_args(sections(DDP.split("ddp:")[0], WHERE)) is None
