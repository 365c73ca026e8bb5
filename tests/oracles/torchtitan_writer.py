"""Write a torchtitan 0.3.0 checkpoint with torchtitan's own code: its Llama 3 model, FSDP2
applied by its ``parallelize_llama``, its AdamW ``OptimizersContainer`` and LR schedulers,
saved by its ``CheckpointManager`` -- on CPU processes over gloo.

Test oracle for ``ckptctl`` (run in torchtitan's own environment, ``tests/torchtitan_env.py``).
Writes under OUT_DIR::

    checkpoint/step-1/          CheckpointManager.save(curr_step=1) after one AdamW step
    config.json                 the HF LlamaConfig of the same model (what a user passes as
                                --hf-config: torchtitan's hf_assets_path holds one)
    hf_dcp/                     the same trained state in HF names, made by torchtitan's own
                                Llama3StateDictAdapter.to_hf (weights, and each Adam moment
                                put through it like a weight), saved by torch's dcp.save as
                                an FSDP2 run of the HF model saves {"model", "optim"}
    truth.pt                    {"hf": to_hf(full state dict), "input_ids", "logits"}:
                                torchtitan's forward after the step, in float32

CPU shims, none touching what is saved: ``torch._utils._get_available_device_type`` answers
"cpu" (torchtitan assumes "cuda" when it finds no accelerator); the module of GPU kernels of
``minimal_async_ep`` (it imports triton) is replaced by one whose kernels raise if ever
called (none is: no expert parallelism here); FlexAttention has no backward on CPU, so the
step's gradients are seeded random tensors, not backpropagated ones (the optimizer, its state
and the checkpoint are torchtitan's all the same); FSDP keeps float32 parameters
(``mixed_precision_param``) so the forward compares with transformers' to rounding. GPT-OSS
needs two more (``gpt_oss_cpu_shims``): the eager FlexAttention (compiled FlexAttention cannot
return the log-sum-exp its sinks rescale by on CPU), and its bfloat16 experts' output cast to
the float32 tokens' dtype before torchtitan's scatter-add (on GPUs all of it is bfloat16).

Usage::

    python tests/oracles/torchtitan_writer.py OUT_DIR [--world N] [--unfused]
        [--model llama3|qwen3|qwen3_tied|qwen3_moe|deepseek_v3|gpt_oss] [--balanced]

Models: Llama 3 (complex-number RoPE: q/k rows interleaved), Qwen3 (cos/sin RoPE, q/k norms),
Qwen3-MoE (grouped experts) and DeepSeek-V3 (MLA, a dense first layer, MoE with a shared
expert and sigmoid routing, one multi-token prediction layer; its norms at DeepSeek's eps
1e-6) and GPT-OSS (biases, sinks, a sliding window, YaRN, grouped experts with interleaved
gate/up rows; its adapter's HF names miss the experts, so it writes ``truth.pt`` with
torchtitan's own names, ``titan`` and ``moments``, and no ``hf_dcp``), small, untied but for
``qwen3_tied`` (the output layer is
the embedding, as in Qwen3's small releases). ``--balanced``: the MoE layers' load-balancing
expert biases are moved by torchtitan's own hook (counts from a forward before the step).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DIM, HEADS, KV_HEADS, LAYERS, FFN, VOCAB = 64, 4, 2, 2, 96, 301
ROPE_THETA, NORM_EPS = 500000.0, 1e-5
HEAD_DIM, QWEN_THETA = 16, 1000000.0
EXPERTS, TOP_K, EXPERT_FFN = 4, 2, 32
BATCH, SEQ = 2, 12


def cpu_shims() -> None:
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    kernels = types.ModuleType(name)

    def never(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a GPU kernel of minimal_async_ep was called on the CPU")

    for kernel in [
        "copy_full_counts_to_peers_kernel",
        "copy_rows_to_peers_kernel",
        "expand_topk_grad_kernel",
        "fill_combine_metadata_kernel",
        "fill_dispatch_metadata_kernel",
        "invert_flat_indices_kernel",
        "reduce_topk_slots_kernel",
        "topk_scores_grad_kernel",
    ]:
        setattr(kernels, kernel, never)
    sys.modules[name] = kernels
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"


def gpt_oss_cpu_shims() -> None:
    """GPT-OSS's two on CPU. Its sinks need FlexAttention's log-sum-exp, which compiled
    FlexAttention cannot return on CPU: the eager one (the same function, uncompiled) runs.
    Its experts multiply in bfloat16 and return bfloat16, which torchtitan's scatter-add
    into the float32 tokens refuses (on GPUs it trains in bfloat16): cast to the tokens'
    dtype first."""
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common import token_dispatcher
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = flex_attention
    scatter_add = token_dispatcher.deterministic_scatter_add

    def same_dtype(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return scatter_add(out, index, src.to(out.dtype))

    token_dispatcher.deterministic_scatter_add = same_dtype


def model_config(model: str, fused: bool) -> Any:
    if model == "deepseek_v3":
        return deepseek_config()
    if model == GPT_OSS:
        return gpt_oss_config(fused)
    if model != "llama3":
        return qwen3_config(model, fused)
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    return Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM, eps=NORM_EPS),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_llama3_layers(
            n_layers=LAYERS,
            dim=DIM,
            n_heads=HEADS,
            n_kv_heads=KV_HEADS,
            hidden_dim=FFN,
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=ROPE_THETA),
            attn_backend="flex",
            fuse_qkv=fused,
        ),
    )


def qwen3_config(model: str, fused: bool) -> Any:
    """Qwen3 (cos/sin RoPE, q/k norms) or Qwen3-MoE (every layer routed: grouped experts),
    untied, built by torchtitan's own layer builders."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        Qwen3Model,
        _build_qwen3_layers,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )

    rope = CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=64, theta=QWEN_THETA)
    shared = dict(
        n_layers=LAYERS,
        dim=DIM,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        fuse_qkv=fused,
        attn_backend="flex",
        rope=rope,
    )
    if model == "qwen3_moe":
        layers = _build_qwen3_moe_layers(
            **shared,
            moe_hidden_dim=EXPERT_FFN,
            num_experts=EXPERTS,
            top_k=TOP_K,
            moe_comm_backend="standard",
        )
    else:
        layers = _build_qwen3_layers(**shared, hidden_dim=FFN)
    return Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=_qwen3_norm(DIM),
        enable_weight_tying=model == "qwen3_tied",
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=layers,
    )


DSV3 = dict(q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8)
DSV3_V_HEAD, DSV3_LAYERS, DSV3_DENSE, DSV3_THETA, DSV3_EPS = 16, 3, 1, 10000.0, 1e-6
DSV3_MTP = 1


def deepseek_config() -> Any:
    """A small DeepSeek-V3 built by torchtitan's own layer builder: multi-latent attention
    (q through its low-rank path), one dense first layer, then MoE layers with a shared
    expert and sigmoid routing over grouped experts (with load-balancing biases), and a
    multi-token prediction layer (a copy of the last layer's block, as torchtitan builds it)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import (
        DeepSeekV3Model,
        _build_dsv3_layers,
        _build_mtp_layers,
    )

    layers = _build_dsv3_layers(
        n_layers=DSV3_LAYERS,
        n_dense_layers=DSV3_DENSE,
        dim=DIM,
        n_heads=HEADS,
        **DSV3,
        v_head_dim=DSV3_V_HEAD,
        mscale=1.0,
        dense_hidden_dim=FFN,
        moe_hidden_dim=EXPERT_FFN,
        num_experts=EXPERTS,
        num_shared_experts=1,
        router_top_k=TOP_K,
        router_score_func="sigmoid",
        router_route_norm=True,
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=DSV3["qk_rope_head_dim"], max_seq_len=64, theta=DSV3_THETA),
    )
    config = DeepSeekV3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=layers,
        mtp_layers=_build_mtp_layers(layers[-1], dim=DIM, num_mtp_layers=DSV3_MTP),
    )
    return with_norm_eps(config, RMSNorm.Config, DSV3_EPS)


GPT_OSS = "gpt_oss"
OSS_WINDOW, OSS_THETA = 4, 150000.0
OSS_YARN = dict(rope_factor=32.0, beta_fast=32.0, beta_slow=1.0, original_seq_len=4096)


def gpt_oss_config(fused: bool) -> Any:
    """A small GPT-OSS built by torchtitan's own builders: every layer routed (biases on the
    experts and the router), attention with biases and sinks, a sliding window on the even
    layers (4 tokens, so it cuts the test's sequence), YaRN RoPE as its releases have it."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.gpt_oss import (
        GptOssModel,
        _build_gptoss_layers,
        _make_gptoss_attn_config,
    )

    rope = CosSinRoPE.Config(
        dim=HEAD_DIM, max_seq_len=64, theta=OSS_THETA, scaling="yarn", truncate=False, **OSS_YARN
    )
    layers = _build_gptoss_layers(
        dim=DIM,
        n_layers=LAYERS,
        hidden_dim=EXPERT_FFN,
        num_experts=EXPERTS,
        top_k=TOP_K,
        load_balance_coeff=1e-3,
        attn_backend="flex",
        fuse_qkv=fused,
        moe_comm_backend="standard",
        rope=rope,
    )
    for i, layer in enumerate(layers):  # its builder keeps the release's 64 heads, window 128
        layer.attention = _make_gptoss_attn_config(
            dim=DIM,
            layer_id=i,
            attn_backend="flex",
            n_heads=HEADS,
            n_kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            sliding_window_size=OSS_WINDOW if i % 2 == 0 else None,
            fuse_qkv=fused,
            rope=rope,
        )
    return GptOssModel.Config(
        vocab_size=VOCAB,
        dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=layers,
    )


def gpt_oss_hf_config() -> dict[str, Any]:
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": GPT_OSS,
        "hidden_size": DIM,
        "intermediate_size": EXPERT_FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "max_position_embeddings": 131072,
        "rope_theta": OSS_THETA,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": OSS_YARN["rope_factor"],
            "beta_fast": OSS_YARN["beta_fast"],
            "beta_slow": OSS_YARN["beta_slow"],
            "original_max_position_embeddings": OSS_YARN["original_seq_len"],
            "truncate": False,
        },
        "rms_norm_eps": NORM_EPS,
        "sliding_window": OSS_WINDOW,
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(LAYERS)
        ],
        "num_local_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "experts_per_token": TOP_K,
        "swiglu_limit": 7.0,
        "attention_bias": True,
        "initial_context_length": OSS_YARN["original_seq_len"],
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def with_norm_eps(node: Any, norm: type, eps: float) -> Any:
    """Every RMSNorm of the config at ``eps`` (DeepSeek-V3's 1e-6; torchtitan's builders
    leave its 1e-5 default)."""
    import dataclasses

    if isinstance(node, norm):
        return dataclasses.replace(node, eps=eps)
    if isinstance(node, list):
        return [with_norm_eps(item, norm, eps) for item in node]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {}
        for field in dataclasses.fields(node):
            value = getattr(node, field.name)
            new = with_norm_eps(value, norm, eps)
            if new is not value:
                changes[field.name] = new
        return dataclasses.replace(node, **changes) if changes else node
    return node


def deepseek_hf_config() -> dict[str, Any]:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": DIM,
        "intermediate_size": FFN,
        "moe_intermediate_size": EXPERT_FFN,
        "num_hidden_layers": DSV3_LAYERS,
        "first_k_dense_replace": DSV3_DENSE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        **DSV3,
        "v_head_dim": DSV3_V_HEAD,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": 1,
        "num_experts_per_tok": TOP_K,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        "rope_theta": DSV3_THETA,
        "rope_scaling": None,
        "rope_interleave": True,
        "rms_norm_eps": DSV3_EPS,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "num_nextn_predict_layers": DSV3_MTP,
        "torch_dtype": "float32",
    }


def hf_config(model: str) -> dict[str, Any]:
    if model == "deepseek_v3":
        return deepseek_hf_config()
    if model == GPT_OSS:
        return gpt_oss_hf_config()
    if model != "llama3":
        return qwen3_hf_config(model)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": DIM,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        "rope_theta": ROPE_THETA,
        "rms_norm_eps": NORM_EPS,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def qwen3_hf_config(model: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": DIM,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        "rope_theta": QWEN_THETA,
        "rms_norm_eps": DSV3_EPS,
        "tie_word_embeddings": model == "qwen3_tied",
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    if model == "qwen3_moe":
        config.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_FFN,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return config


def worker(
    rank: int, world: int, port: int, out: Path, model: str, fused: bool, balanced: bool
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    cpu_shims()
    if model == GPT_OSS:
        gpt_oss_cpu_shims()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run(rank, world, out, model, fused, balanced)
    finally:
        dist.destroy_process_group()


def run(rank: int, world: int, out: Path, model_name: str, fused: bool, balanced: bool) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3
    from torchtitan.models.gpt_oss.parallelize import parallelize_gptoss
    from torchtitan.models.llama3.parallelize import parallelize_llama
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    torch.manual_seed(0)
    config = model_config(model_name, fused)
    parallelize = {
        "llama3": parallelize_llama,
        "deepseek_v3": parallelize_deepseekv3,
        GPT_OSS: parallelize_gptoss,
    }.get(model_name, parallelize_qwen3)
    with torch.device("meta"):
        model = config.build()
    dims = ParallelDims(
        dp_replicate=1,
        dp_shard=world,
        cp=1,
        tp=1,
        pp=1,
        ep=1,
        world_size=world,
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    model = parallelize(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder=str(out),
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=10
    )
    seeded = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=seeded)
    positions = torch.arange(SEQ).repeat(BATCH, 1)
    if balanced:  # torchtitan's aux-loss-free balancing: counts from a forward move the biases
        from torchtitan.components.optimizer import register_moe_load_balancing_hook

        register_moe_load_balancing_hook(optimizers, [model], dims)
        with torch.no_grad():
            model(tokens, positions, model.get_attention_masks(positions))
        for module in model.modules():  # a forward without backward leaves some unsharded
            if isinstance(module, FSDPModule):
                module.reshard()
    for param in model.parameters():
        grad = torch.randn(param.shape, generator=seeded) * 1e-2
        param.grad = distribute_tensor(grad, param.device_mesh, param.placements)
    optimizers.step()
    schedulers.step()
    optimizers.zero_grad()
    with torch.no_grad():
        logits = model(tokens, positions, model.get_attention_masks(positions))
    if isinstance(logits, list):  # with MTP layers: the model's, then each MTP depth's
        logits = logits[0]

    class TrainState:  # the Trainer's own state_dict: {"step", "ntokens_seen"}
        def state_dict(self) -> dict[str, Any]:
            return {"step": 1, "ntokens_seen": BATCH * SEQ}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    manager = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=1, last_save_model_only=False
    ).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": TrainState()},
        sd_adapter=None,
        base_folder=str(out),
    )
    manager.save(curr_step=1)
    manager.close()

    def full(value: Any) -> Any:
        return value.full_tensor() if isinstance(value, DTensor) else value

    weights = {k: full(v) for k, v in model.state_dict().items()}
    if model_name == GPT_OSS:  # its adapter's HF names are MXFP4's: no hf_dcp to compare with
        moments = titan_moments(model, {k: full(v) for k, v in optimizers.state_dict().items()})
        if rank == 0:
            (out / "config.json").write_text(json.dumps(hf_config(model_name), indent=2))
            truth = {"titan": weights, "moments": moments, "input_ids": tokens, "logits": logits}
            torch.save(truth, out / "truth.pt")
        return
    hf = hf_state(model_name, config, weights)
    moments = {k: full(v) for k, v in optimizers.state_dict().items()}
    optim = hf_optimizer(model_name, config, model, optimizers, moments)
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": hf, "optim": optim}, checkpoint_id=str(out / "hf_dcp"))
    if rank == 0:
        (out / "config.json").write_text(json.dumps(hf_config(model_name), indent=2))
        (out / "hf_dcp" / "config.json").write_text(json.dumps(hf_config(model_name), indent=2))
        torch.save({"hf": hf, "input_ids": tokens, "logits": logits}, out / "truth.pt")


def hf_state(model: str, config: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchtitan's own adapter of the model (full tensors: its offline path)."""
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    adapters = {"llama3": Llama3StateDictAdapter, "deepseek_v3": DeepSeekV3StateDictAdapter}
    adapter = adapters.get(model, Qwen3StateDictAdapter)
    return adapter(config, None).to_hf(state)


def titan_moments(model: Any, flat: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """Adam's moments by state, in the names of the model's state dict: each put through the
    model's own fused-QKV split, as its weights are when saved."""
    from torchtitan.models.common.attention import FusedQKVLinear

    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        if key.startswith("state.") and not key.endswith(".step"):
            name, _, state = key[len("state.") :].rpartition(".")
            out.setdefault(state, {})[name] = value
    for moments in out.values():
        for module_name, module in model.named_modules():
            if isinstance(module, FusedQKVLinear):
                FusedQKVLinear._split_qkv_on_save(module, moments, f"{module_name}.", None)
    return out


def hf_optimizer(
    model_name: str, config: Any, model: Any, optimizers: Any, flat: dict[str, Any]
) -> dict[str, Any]:
    """Adam's moments in HF names: each moment laid out like its parameter, so put through
    the model's own state-dict hooks (the fused QKV's split) and the adapter like weights."""
    from torchtitan.models.common.attention import FusedQKVLinear

    per_state: dict[str, dict[str, torch.Tensor]] = {}
    steps: dict[str, torch.Tensor] = {}
    for key, value in flat.items():
        if not key.startswith("state."):
            continue
        name, _, state = key[len("state.") :].rpartition(".")
        if state == "step":
            steps[name] = value
        else:
            per_state.setdefault(state, {})[name] = value
    out: dict[str, dict[str, Any]] = {}
    for state, moments in per_state.items():
        for module_name, module in model.named_modules():
            if isinstance(module, FusedQKVLinear):
                FusedQKVLinear._split_qkv_on_save(module, moments, f"{module_name}.", None)
        for hub, value in hf_state(model_name, config, moments).items():
            out.setdefault(hub, {})[state] = value
    step = next(iter(steps.values()))
    for entry in out.values():
        entry["step"] = step.clone()
    group = {k: v for k, v in optimizers.optimizers[0].param_groups[0].items() if k != "params"}
    return {"state": out, "param_groups": [{**group, "params": sorted(out)}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--unfused", action="store_true", help="separate wq/wk/wv modules")
    models = ("llama3", "qwen3", "qwen3_tied", "qwen3_moe", "deepseek_v3", GPT_OSS)
    parser.add_argument("--model", choices=models, default="llama3")
    parser.add_argument(
        "--balanced", action="store_true", help="MoE: torchtitan's load-balancing bias updates"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    spawned = (args.world, free_port(), args.out, args.model, not args.unfused, args.balanced)
    mp.spawn(worker, args=spawned, nprocs=args.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
