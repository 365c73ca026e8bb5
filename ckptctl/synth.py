"""Synthetic Megatron-LM legacy checkpoints written from a tiny HF Llama, by hand.

This module is a *test oracle*: it must stay independent of the rest of ``ckptctl`` (it imports
only torch, numpy and transformers) so that a bug in ckptctl's readers or writers cannot hide
behind the same bug here. Every layout rule is spelled out in plain torch code, following
``checkpoint-formats.md`` S2 (files, ``args``), S3 (split rules, QKV groups, SwiGLU halves, vocab
padding, tying, PP/VPP placement), S4.8 (non-distributed optimizer), S4.1-S4.5 (distributed
optimizer: ``distrib_optim.pt``, coalesced format, Megatron-Core >= 0.8 buffer layout) and S8.3
(HF name mapping).

Pipeline: :func:`tiny_llama_config` -> :func:`make_model` -> :func:`adam_step` (one real Adam
step, so moments are non-trivial) -> :func:`to_megatron_canonical` (full, TP-merged, vocab-unpadded
tensors under Megatron-Core names with global layer indices) -> :func:`write_megatron` (pad,
split, place, save one ``model_optim_rng.pt`` per (tp, pp) rank, plus ``distrib_optim.pt``
beside it with ``distributed_optimizer=True``).
"""

from __future__ import annotations

import argparse
import math
import os
import random
from collections.abc import Callable

import numpy
import torch
from transformers import LlamaConfig, LlamaForCausalLM

__all__ = [
    "DISTRIB_OPTIM",
    "adam_step",
    "make_model",
    "padded_vocab_size",
    "save_hf",
    "stage_layer_counts",
    "tiny_llama_config",
    "to_megatron_canonical",
    "write_megatron",
]

_ADAM_BETAS = (0.9, 0.999)
_ADAM_EPS = 1e-8
_WEIGHT_DECAY = 0.1
_RNG_SEED = 1234
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")

# Per-layer parameter suffixes in module registration order (TransformerLayer -> SelfAttention
# registers linear_proj before linear_qkv; TE's LayerNormLinear registers layer_norm_weight before
# weight). The local spec has separate norm modules in front of attention and MLP.
_TE_LAYER_KEYS = (
    "self_attention.linear_proj.weight",
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.weight",
    "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
)
_LOCAL_LAYER_KEYS = (
    "input_layernorm.weight",
    "self_attention.linear_proj.weight",
    "self_attention.linear_qkv.weight",
    "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
)
# local-spec suffix -> the TE suffix holding the same tensor in the canonical dict
_LOCAL_TO_TE = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_proj.weight": "self_attention.linear_proj.weight",
    "self_attention.linear_qkv.weight": "self_attention.linear_qkv.weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.weight": "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight": "mlp.linear_fc2.weight",
}

EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"
DISTRIB_OPTIM = "distrib_optim.pt"

# Distributed-optimizer grad-buffer padding (S4.5, megatron-core >= 0.8): every parameter starts
# at a multiple of 64 elements, every bucket ends at a multiple of lcm(dp, 128).
_PARAM_START_ALIGN = 64
_BUCKET_END_ALIGN = 128
# distrib_optim.pt world-tensor key -> per-parameter state key (see to_megatron_canonical)
_DISTRIB_KEYS = {"param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


# --------------------------------------------------------------------------------------------
# Model, one optimizer step, HF output
# --------------------------------------------------------------------------------------------


def tiny_llama_config(
    *,
    vocab_size: int = 1100,
    hidden_size: int = 64,
    num_layers: int = 8,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
) -> LlamaConfig:
    """A small Llama config; ``head_dim=None`` means ``hidden_size // num_heads``."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        head_dim=head_dim if head_dim is not None else hidden_size // num_heads,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        initializer_range=0.1,
        attention_bias=False,
        mlp_bias=False,
    )


def make_model(config: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    """Random fp32 ``LlamaForCausalLM`` in eval mode, deterministic in ``seed``.

    RMSNorm weights are set to ``1 + 0.1*randn`` (HF initialises them to 1, which would hide a
    swapped input/post-attention/final norm).
    """
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.set_attn_implementation("eager")
    norm_gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                noise = torch.randn(param.shape, generator=norm_gen, dtype=torch.float32)
                param.copy_(1.0 + 0.1 * noise)
    model.eval()
    return model


def adam_step(
    model: LlamaForCausalLM, seed: int = 0, lr: float = 1e-3
) -> dict[str, dict[str, torch.Tensor]]:
    """One ``torch.optim.Adam`` step on a random batch; returns per-HF-parameter state clones.

    The model's weights are updated in place. With tied embeddings HF has a single parameter
    ``model.embed_tokens.weight`` (``lm_head`` shares it), so only that name appears.
    """
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
    optimizer = torch.optim.Adam(
        model.parameters(),
        lr=lr,
        betas=_ADAM_BETAS,
        eps=_ADAM_EPS,
        weight_decay=0.0,
        foreach=False,
    )
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    states: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in model.named_parameters():
        state = optimizer.state[param]
        states[name] = {key: state[key].detach().clone() for key in _STATE_KEYS}
    return states


def save_hf(model: LlamaForCausalLM, out_dir: str) -> None:
    """Write the HF model (safetensors) to ``out_dir``."""
    model.save_pretrained(out_dir, safe_serialization=True)


# --------------------------------------------------------------------------------------------
# HF -> canonical Megatron-Core (full tensors, global layer indices, vocab unpadded)
# --------------------------------------------------------------------------------------------


def _fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nq: int, ng: int, d: int
) -> torch.Tensor:
    """Group-interleave: for each kv group g, its r query heads, then k head g, then v head g."""
    r = nq // ng
    rows: list[torch.Tensor] = []
    for g in range(ng):
        for head in range(g * r, g * r + r):
            rows.append(q[head * d : (head + 1) * d])
        rows.append(k[g * d : (g + 1) * d])
        rows.append(v[g * d : (g + 1) * d])
    return torch.cat(rows, dim=0)


def _canonical_tensors(
    config: LlamaConfig, hf: Callable[[str], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Map one kind of per-HF-parameter tensor (weight or one optimizer moment) to canonical."""
    nq = config.num_attention_heads
    ng = config.num_key_value_heads
    d = config.head_dim
    out: dict[str, torch.Tensor] = {EMBEDDING: hf("model.embed_tokens.weight").clone()}
    for i in range(config.num_hidden_layers):
        hp = f"model.layers.{i}."
        mp = f"decoder.layers.{i}."
        out[mp + "self_attention.linear_proj.weight"] = hf(hp + "self_attn.o_proj.weight").clone()
        out[mp + "self_attention.linear_qkv.layer_norm_weight"] = hf(
            hp + "input_layernorm.weight"
        ).clone()
        out[mp + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            hf(hp + "self_attn.q_proj.weight"),
            hf(hp + "self_attn.k_proj.weight"),
            hf(hp + "self_attn.v_proj.weight"),
            nq,
            ng,
            d,
        )
        out[mp + "mlp.linear_fc1.layer_norm_weight"] = hf(
            hp + "post_attention_layernorm.weight"
        ).clone()
        out[mp + "mlp.linear_fc1.weight"] = torch.cat(
            [hf(hp + "mlp.gate_proj.weight"), hf(hp + "mlp.up_proj.weight")], dim=0
        )
        out[mp + "mlp.linear_fc2.weight"] = hf(hp + "mlp.down_proj.weight").clone()
    out[FINAL_NORM] = hf("model.norm.weight").clone()
    if not config.tie_word_embeddings:
        out[OUTPUT] = hf("lm_head.weight").clone()
    return out


def _canonical_sources(config: LlamaConfig) -> dict[str, str]:
    """Canonical name -> one HF parameter it comes from (for the scalar Adam ``step``)."""
    src = {EMBEDDING: "model.embed_tokens.weight", FINAL_NORM: "model.norm.weight"}
    for i in range(config.num_hidden_layers):
        hp = f"model.layers.{i}."
        mp = f"decoder.layers.{i}."
        src[mp + "self_attention.linear_proj.weight"] = hp + "self_attn.o_proj.weight"
        src[mp + "self_attention.linear_qkv.layer_norm_weight"] = hp + "input_layernorm.weight"
        src[mp + "self_attention.linear_qkv.weight"] = hp + "self_attn.q_proj.weight"
        src[mp + "mlp.linear_fc1.layer_norm_weight"] = hp + "post_attention_layernorm.weight"
        src[mp + "mlp.linear_fc1.weight"] = hp + "mlp.gate_proj.weight"
        src[mp + "mlp.linear_fc2.weight"] = hp + "mlp.down_proj.weight"
    if not config.tie_word_embeddings:
        src[OUTPUT] = "lm_head.weight"
    return src


def to_megatron_canonical(
    model: LlamaForCausalLM, states: dict[str, dict[str, torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Full Megatron-Core (TE names) weights and optimizer states, in model order.

    Returns ``(weights, optim)``; ``optim[name]`` holds ``exp_avg``, ``exp_avg_sq``, ``step`` and
    ``fp32_param`` (the fp32 weight itself, not a copy), each transformed exactly like the weight.
    """
    config = model.config
    params = {name: p.detach().to(torch.float32) for name, p in model.named_parameters()}
    if config.tie_word_embeddings:
        params.setdefault("lm_head.weight", params["model.embed_tokens.weight"])
    weights = _canonical_tensors(config, lambda n: params[n])
    exp_avg = _canonical_tensors(config, lambda n: states[n]["exp_avg"])
    exp_avg_sq = _canonical_tensors(config, lambda n: states[n]["exp_avg_sq"])
    sources = _canonical_sources(config)
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for name, weight in weights.items():
        optim[name] = {
            "exp_avg": exp_avg[name],
            "exp_avg_sq": exp_avg_sq[name],
            "step": states[sources[name]]["step"].clone(),
            "fp32_param": weight,  # the same tensor as weights[name]
        }
    return weights, optim


# --------------------------------------------------------------------------------------------
# Layout: vocab padding, TP split, PP/VPP placement
# --------------------------------------------------------------------------------------------


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """``ceil(V0 / (m*tp)) * m*tp`` (Megatron's ``vocab_size_with_padding``)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def stage_layer_counts(
    num_layers: int, pp: int, first: int | None = None, last: int | None = None
) -> list[int]:
    """Layers per pipeline stage: ``first``/``last`` if given, the rest split evenly."""
    counts: list[int | None] = [None] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    fixed = sum(c for c in counts if c is not None)
    free = [s for s in range(pp) if counts[s] is None]
    rest = num_layers - fixed
    if free:
        if rest < 0 or rest % len(free):
            raise ValueError(
                f"{rest} remaining layers cannot be split evenly over {len(free)} stages"
            )
        for s in free:
            counts[s] = rest // len(free)
    elif rest != 0:
        raise ValueError(f"stage layer counts sum to {fixed}, expected {num_layers}")
    return [int(c) for c in counts if c is not None]


def _chunk_layers(counts: list[int], vpp: int) -> list[list[range]]:
    """``[stage][chunk]`` -> global layer range, Megatron's ``get_transformer_layer_offset``."""
    num_layers = sum(counts)
    per_chunk_total = num_layers // vpp
    placement: list[list[range]] = []
    for s, count in enumerate(counts):
        n = count // vpp
        before = sum(counts[:s]) // vpp
        placement.append(
            [
                range(c * per_chunk_total + before, c * per_chunk_total + before + n)
                for c in range(vpp)
            ]
        )
    return placement


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype)
    return torch.cat([t, pad], dim=0)


def _tp_shard(name: str, full: torch.Tensor, rank: int, tp: int, vp: int) -> torch.Tensor:
    """Rank ``rank``'s local shard of one canonical tensor (weight or optimizer state)."""
    if name in (EMBEDDING, OUTPUT):
        padded = _pad_rows(full, vp)
        size = vp // tp
        local = padded[rank * size : (rank + 1) * size]
    elif name.endswith("linear_fc1.weight"):
        f = full.shape[0] // 2
        size = f // tp
        gate = full[:f]
        up = full[f:]
        local = torch.cat(
            [gate[rank * size : (rank + 1) * size], up[rank * size : (rank + 1) * size]], dim=0
        )
    elif name.endswith("linear_qkv.weight"):
        size = full.shape[0] // tp
        local = full[rank * size : (rank + 1) * size]
    elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        size = full.shape[1] // tp
        local = full[:, rank * size : (rank + 1) * size]
    elif full.dim() == 1:
        local = full  # norms: replicated
    else:
        raise ValueError(f"no split rule for {name}")
    # A fresh contiguous tensor: torch.save of a view would write the whole base storage.
    return local.clone(memory_format=torch.contiguous_format)


def _check_layout(
    config: LlamaConfig,
    tp: int,
    pp: int,
    vpp: int,
    counts: list[int],
    naming: str,
    param_group_order: str,
) -> None:
    nq = config.num_attention_heads
    ng = config.num_key_value_heads
    problems: list[str] = []
    if nq % tp:
        problems.append(f"num_heads {nq} % tp {tp} != 0")
    # ng < tp (one group cut over several ranks) is accepted by recent Megatron-Core only (S3.3).
    if ng % tp and tp % ng:
        problems.append(f"num_kv_heads {ng} and tp {tp}: neither divides the other")
    qkv_rows = (nq + 2 * ng) * config.head_dim
    if qkv_rows % tp:
        problems.append(f"linear_qkv rows {qkv_rows} % tp {tp} != 0")
    if config.intermediate_size % tp:
        problems.append(f"intermediate_size {config.intermediate_size} % tp {tp} != 0")
    if vpp > 1 and pp == 1:
        problems.append("vpp > 1 needs pp > 1")
    for s, c in enumerate(counts):
        if c <= 0 or c % vpp:
            problems.append(f"stage {s} has {c} layers, not a positive multiple of vpp {vpp}")
    if naming not in ("te", "local"):
        problems.append(f"naming must be 'te' or 'local', not {naming!r}")
    if param_group_order not in ("appearance", "wd_first"):
        problems.append(
            f"param_group_order must be 'appearance' or 'wd_first', not {param_group_order!r}"
        )
    if problems:
        raise ValueError("; ".join(problems))


def _rope_theta(config: LlamaConfig) -> float:
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" in rope:
        return float(rope["rope_theta"])
    return float(config.rope_theta)


def _megatron_args(
    config: LlamaConfig,
    *,
    tp: int,
    pp: int,
    vpp: int,
    first: int | None,
    last: int | None,
    vp: int,
    divisible_by: int,
    params_dtype: torch.dtype,
    dp: int,
    distributed_optimizer: bool,
    bucket_size: int | None,
) -> argparse.Namespace:
    nq = config.num_attention_heads
    ng = config.num_key_value_heads
    return argparse.Namespace(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=nq,
        num_query_groups=ng,
        group_query_attention=ng < nq,
        kv_channels=config.head_dim,
        padded_vocab_size=vp,
        vocab_size=config.vocab_size,
        make_vocab_size_divisible_by=divisible_by,
        swiglu=True,
        untie_embeddings_and_output_weights=not config.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=_rope_theta(config),
        rotary_percent=1.0,
        normalization="RMSNorm",
        norm_epsilon=config.rms_norm_eps,
        add_bias_linear=False,
        add_qkv_bias=False,
        max_position_embeddings=config.max_position_embeddings,
        num_experts=None,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=False,
        use_distributed_optimizer=distributed_optimizer,
        data_parallel_size=dp,
        world_size=tp * pp * dp,
        # DDP settings that decide the distributed-optimizer buffer layout (S4.5). Megatron-LM
        # forces fp32 grad accumulation for bf16; fp32 grads of fp32 params anyway.
        overlap_grad_reduce=bucket_size is not None,
        ddp_bucket_size=bucket_size,
        ddp_pad_buckets_for_high_nccl_busbw=False,
        accumulate_allreduce_grads_in_fp32=params_dtype == torch.bfloat16,
        seq_length=16,
    )


def _rng_state() -> list[dict[str, object]]:
    # Seeded private generators, not the process-global ones: files must be byte-reproducible.
    return [
        {
            "random_rng_state": random.Random(_RNG_SEED).getstate(),
            "np_rng_state": numpy.random.RandomState(_RNG_SEED).get_state(),
            "torch_rng_state": torch.Generator().manual_seed(_RNG_SEED).get_state(),
            "cuda_rng_state": None,
            "rng_tracker_states": {},
        }
    ]


def _opt_param_scheduler(iteration: int) -> dict[str, object]:
    return {
        "max_lr": 1e-3,
        "lr_warmup_steps": 0,
        "num_steps": iteration,
        "lr_decay_style": "cosine",
        "lr_decay_steps": 1000,
        "min_lr": 1e-5,
        "start_wd": 0.0,
        "end_wd": 0.0,
        "wd_incr_style": "constant",
        "wd_incr_steps": 1000,
    }


def _param_group(no_wd: bool, params: list[int]) -> dict[str, object]:
    return {
        "lr": 1e-3,
        "betas": _ADAM_BETAS,
        "eps": _ADAM_EPS,
        "weight_decay": 0.0 if no_wd else _WEIGHT_DECAY,
        "amsgrad": False,
        "foreach": None,
        "maximize": False,
        "capturable": False,
        "differentiable": False,
        "fused": None,
        "wd_mult": 0.0 if no_wd else 1.0,
        "lr_mult": 1.0,
        "is_expert_parallel": False,
        "is_decoupled_lr": False,
        "params": params,
    }


def _optimizer_state(
    chunks: list[dict[str, torch.Tensor]],
    chunk_states: list[dict[str, dict[str, torch.Tensor]]],
    params_dtype: torch.dtype,
    param_group_order: str,
) -> dict[str, object]:
    """Megatron's non-distributed optimizer state for one rank file (S4.8).

    Megatron walks ``named_parameters()`` of every model chunk in order and puts a parameter in
    the no-weight-decay group iff it is a bias or 1-D. Group order: by first appearance
    (``"appearance"``, megatron-core up to ~0.15, ``params_map`` insertion order) or the default
    (weight-decay) group first (``"wd_first"``: megatron-core 0.16 sorts the group keys with the
    override-free key first; pre-core Megatron-LM also appended the weight-decay group first).
    torch numbers the parameters consecutively over the groups in group order.
    """
    groups: dict[bool, list[tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {}
    if param_group_order == "wd_first":
        groups[False] = []
    for weights, states in zip(chunks, chunk_states, strict=True):
        for name, weight in weights.items():
            no_wd = name.endswith(".bias") or weight.dim() == 1
            groups.setdefault(no_wd, []).append((weight, states[name]))
    groups = {no_wd: members for no_wd, members in groups.items() if members}
    state: dict[int, dict[str, torch.Tensor]] = {}
    param_groups: list[dict[str, object]] = []
    masters: list[list[torch.Tensor]] = []
    index = 0
    for no_wd, members in groups.items():
        indices: list[int] = []
        group_masters: list[torch.Tensor] = []
        for _, st in members:
            state[index] = {
                "step": st["step"].clone(),
                "exp_avg": st["exp_avg"],
                "exp_avg_sq": st["exp_avg_sq"],
            }
            group_masters.append(st["fp32_param"])
            indices.append(index)
            index += 1
        param_groups.append(_param_group(no_wd, indices))
        masters.append(group_masters)
    torch_state = {"state": state, "param_groups": param_groups}
    if params_dtype == torch.float32:
        # FP32Optimizer.state_dict() is the bare torch optimizer state dict.
        return torch_state
    # Float16OptimizerWithFloat16Params; bf16 has no grad scaler, so no 'grad_scaler' key.
    return {"optimizer": torch_state, "fp32_from_fp16_params": masters}


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _grad_buffer_layout(
    numels: list[int], shared: list[bool], dp: int, bucket_size: int | None
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]], list[int]]:
    """Replay megatron-core's ``_ParamAndGradBuffer`` layout with the distributed optimizer (S4.5).

    ``numels`` / ``shared`` describe one buffer's parameters in ``named_parameters()`` order
    (``shared`` = the ``shared_embedding`` attribute). Parameters are placed from last to first
    (backprop order), each start rounded up to a multiple of 64; a bucket is closed once it holds
    ``>= bucket_size`` elements (``None``: never), and its end is padded to a multiple of
    ``lcm(dp, 128)``. A shared embedding gets a bucket of its own: an open bucket is closed at the
    (aligned) position before it, and its own bucket is closed right after it.

    Returns ``(index, buckets, unpadded)``: ``index[i] = (start, end, bucket)`` of parameter ``i``
    in buffer coordinates, ``buckets[b] = (start, padded end)``, ``unpadded[b]`` = bucket size
    before end padding (intra-bucket alignment gaps included).
    """
    end_multiple = math.lcm(dp, _BUCKET_END_ALIGN)
    index: list[tuple[int, int, int]] = [(0, 0, 0)] * len(numels)
    buckets: list[tuple[int, int]] = []
    unpadded: list[int] = []
    bucket_start = 0

    def close(end: int) -> int:
        nonlocal bucket_start
        unpadded.append(end - bucket_start)
        padded_end = _round_up(end, end_multiple)
        buckets.append((bucket_start, padded_end))
        bucket_start = padded_end
        return padded_end

    pos = 0
    is_open = False
    for i in reversed(range(len(numels))):
        pos = _round_up(pos, _PARAM_START_ALIGN)
        if shared[i] and is_open:
            pos = close(pos)
        start, end = pos, pos + numels[i]
        index[i] = (start, end, len(buckets))
        is_open = True
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared[i]:
            pos = close(end)
            is_open = False
        else:
            pos = end
    if is_open:
        close(pos)
    return index, buckets, unpadded


def _distrib_optim_state(
    chunks: list[dict[str, torch.Tensor]],
    chunk_states: list[dict[str, dict[str, torch.Tensor]]],
    *,
    params_dtype: torch.dtype,
    dp: int,
    bucket_sizes: list[int | None],
    shared_names: set[str],
) -> dict[object, object]:
    """``distrib_optim.pt`` of one (tp, pp) rank: the coalesced DP-zero format (S4.2).

    One grad buffer per model chunk (all parameters share one dtype and none is expert-parallel),
    keyed ``(param_dtype, torch.float32)``. Its world tensors are the buckets of
    :func:`_grad_buffer_layout` with their end padding stripped, concatenated: each parameter's
    fp32 master weight, ``exp_avg`` and ``exp_avg_sq`` (local TP shard, flattened row-major) at
    ``[base(bucket) + start - bucket_start, ... + numel)``, zeros in the alignment gaps.
    """
    state: dict[object, object] = {"buckets_coalesced": True}
    for gbuf_idx, (weights, states) in enumerate(zip(chunks, chunk_states, strict=True)):
        names = list(weights)
        index, buckets, unpadded = _grad_buffer_layout(
            [weights[n].numel() for n in names],
            [n in shared_names for n in names],
            dp,
            bucket_sizes[gbuf_idx],
        )
        base = [sum(unpadded[:b]) for b in range(len(unpadded))]
        total = sum(unpadded)
        tensors = {key: torch.zeros(total, dtype=torch.float32) for key in _DISTRIB_KEYS}
        for name, (start, end, b) in zip(names, index, strict=True):
            lo = base[b] + start - buckets[b][0]
            hi = lo + end - start
            for key, source in _DISTRIB_KEYS.items():
                tensor = states[name][source]
                assert tensor.dtype == torch.float32 and tensor.numel() == end - start
                tensors[key][lo:hi] = tensor.reshape(-1)
        world: dict[str, object] = {**tensors, "numel_unpadded": total}
        state[gbuf_idx] = {(params_dtype, torch.float32): world}
    return state


def _distributed_optimizer_state_dict(torch_state: dict[str, object]) -> dict[str, object]:
    """``DistributedOptimizer.state_dict()``: the param groups without ``params`` (S4.1).

    The tensors live in ``distrib_optim.pt``. Megatron stores the common Adam step in each group:
    a float with ``torch.optim.Adam`` (whose group keys these are; ``step.item()``), an ``int``
    with TE / Apex FusedAdam. No ``grad_scaler`` key: megatron-core adds one only when a grad
    scaler exists (fp16, or a constant loss scale), never for bf16 or fp32.
    """
    steps = {float(st["step"]) for st in torch_state["state"].values()}  # type: ignore[union-attr]
    assert len(steps) == 1
    step = steps.pop()
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "step": step}
        for group in torch_state["param_groups"]  # type: ignore[union-attr]
    ]
    return {"optimizer": {"param_groups": groups}}


def _chunk_names(
    placement: list[list[range]], stage: int, chunk: int, naming: str, has_output: bool
) -> list[tuple[str, str]]:
    """``(saved name, canonical name)`` of one model chunk, in ``named_parameters()`` order.

    GPTModel registers embedding, decoder (layers, final_layernorm), output_layer; saved layer
    indices are local to the chunk.
    """
    pp = len(placement)
    vpp = len(placement[0])
    layer_keys = _TE_LAYER_KEYS if naming == "te" else _LOCAL_LAYER_KEYS
    names: list[tuple[str, str]] = []
    if stage == 0 and chunk == 0:
        names.append((EMBEDDING, EMBEDDING))
    for local_i, global_i in enumerate(placement[stage][chunk]):
        for key in layer_keys:
            te_key = key if naming == "te" else _LOCAL_TO_TE[key]
            names.append((f"decoder.layers.{local_i}.{key}", f"decoder.layers.{global_i}.{te_key}"))
    if stage == pp - 1 and chunk == vpp - 1:
        names.append((FINAL_NORM, FINAL_NORM))
        if has_output:
            names.append((OUTPUT, OUTPUT))
    return names


def write_megatron(
    model: LlamaForCausalLM,
    states: dict[str, dict[str, torch.Tensor]],
    out_dir: str,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    naming: str = "te",
    params_dtype: torch.dtype = torch.float32,
    iteration: int = 1,
    make_vocab_size_divisible_by: int = 128,
    with_optimizer: bool = True,
    param_group_order: str = "appearance",
    distributed_optimizer: bool = False,
    dp: int = 1,
    bucket_size: int | None = None,
) -> None:
    """Write ``model`` (after :func:`adam_step`) as a Megatron-LM legacy checkpoint.

    Layout: ``out_dir/latest_checkpointed_iteration.txt`` and
    ``out_dir/iter_{iteration:07d}/mp_rank_TT[_PPP]/model_optim_rng.pt``, one per (tp, pp).
    ``param_group_order`` ("appearance" or "wd_first") only matters when a rank's first
    parameter is 1-D (local-spec names on a stage other than the first); see
    :func:`_optimizer_state`.

    ``distributed_optimizer=True`` writes what ``--use-distributed-optimizer`` saves with ``dp``
    data-parallel ranks: ``model_optim_rng.pt['optimizer']`` is
    ``DistributedOptimizer.state_dict()`` (param groups only), and ``distrib_optim.pt`` beside it
    holds the fp32 master weights and Adam moments (:func:`_distrib_optim_state`).
    ``bucket_size`` is megatron's ``--ddp-bucket-size`` with ``--overlap-grad-reduce`` (``None``:
    overlap off, one bucket per buffer); as in megatron-core it applies only to the first model
    chunk of pipeline stage 0 (DDP turns bucketing off on later stages and, under VPP, for chunks
    after the first). ``dp`` also sets ``args.data_parallel_size`` and ``args.world_size``
    without the distributed optimizer.
    """
    config = model.config
    if pp == 1 and (first_stage_layers is not None or last_stage_layers is not None):
        raise ValueError("first/last stage layer counts need pp > 1")
    if min(tp, pp, vpp, dp) < 1:
        raise ValueError(f"tp, pp, vpp and dp must be >= 1, got {tp}, {pp}, {vpp}, {dp}")
    if bucket_size is not None and (not distributed_optimizer or bucket_size < 1):
        raise ValueError("bucket_size needs distributed_optimizer and must be >= 1")
    counts = stage_layer_counts(config.num_hidden_layers, pp, first_stage_layers, last_stage_layers)
    _check_layout(config, tp, pp, vpp, counts, naming, param_group_order)
    placement = _chunk_layers(counts, vpp)
    tied = bool(config.tie_word_embeddings)
    vp = padded_vocab_size(config.vocab_size, tp, make_vocab_size_divisible_by)
    weights, optim = to_megatron_canonical(model, states)
    if tied and pp > 1:
        # The last stage keeps its own copy of the embedding as output_layer (S3.6).
        weights[OUTPUT] = weights[EMBEDDING]
        optim[OUTPUT] = optim[EMBEDDING]
    args = _megatron_args(
        config,
        tp=tp,
        pp=pp,
        vpp=vpp,
        first=first_stage_layers,
        last=last_stage_layers,
        vp=vp,
        divisible_by=make_vocab_size_divisible_by,
        params_dtype=params_dtype,
        dp=dp,
        distributed_optimizer=distributed_optimizer,
        bucket_size=bucket_size,
    )
    # Tied embeddings with pp > 1: both copies carry megatron's `shared_embedding` attribute.
    shared_names = {EMBEDDING, OUTPUT} if tied and pp > 1 else set()

    iter_dir = os.path.join(out_dir, f"iter_{iteration:07d}")
    for p in range(pp):
        for t in range(tp):
            chunks: list[dict[str, torch.Tensor]] = []
            chunk_states: list[dict[str, dict[str, torch.Tensor]]] = []
            for c in range(vpp):
                chunk: dict[str, torch.Tensor] = {}
                chunk_state: dict[str, dict[str, torch.Tensor]] = {}
                for saved, canonical in _chunk_names(placement, p, c, naming, OUTPUT in weights):
                    chunk[saved] = _tp_shard(canonical, weights[canonical], t, tp, vp)
                    full_state = optim[canonical]
                    local_state = {
                        key: _tp_shard(canonical, full_state[key], t, tp, vp)
                        for key in ("exp_avg", "exp_avg_sq", "fp32_param")
                    }
                    local_state["step"] = full_state["step"].clone()
                    chunk_state[saved] = local_state
                chunks.append(chunk)
                chunk_states.append(chunk_state)

            optimizer: dict[str, object] | None = None
            distrib_optim: dict[object, object] | None = None
            if with_optimizer and distributed_optimizer:
                optimizer = _distributed_optimizer_state_dict(
                    _optimizer_state(chunks, chunk_states, torch.float32, param_group_order)
                )
                distrib_optim = _distrib_optim_state(
                    chunks,
                    chunk_states,
                    params_dtype=params_dtype,
                    dp=dp,
                    bucket_sizes=[bucket_size if p == 0 and c == 0 else None for c in range(vpp)],
                    shared_names=shared_names,
                )
            elif with_optimizer:
                optimizer = _optimizer_state(chunks, chunk_states, params_dtype, param_group_order)
            if params_dtype != torch.float32:
                chunks = [{k: v.to(params_dtype) for k, v in chunk.items()} for chunk in chunks]
            payload: dict[str, object] = {
                "args": args,
                "checkpoint_version": 3.0,
                "iteration": iteration,
            }
            if vpp == 1:
                payload["model"] = chunks[0]
            else:
                for c, chunk in enumerate(chunks):
                    payload[f"model{c}"] = chunk
            if optimizer is not None:
                payload["optimizer"] = optimizer
            payload["opt_param_scheduler"] = _opt_param_scheduler(iteration)
            payload["rng_state"] = _rng_state()
            payload["num_floating_point_operations_so_far"] = 12345.0

            rank_dir = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
            path = os.path.join(iter_dir, rank_dir)
            os.makedirs(path, exist_ok=True)
            torch.save(payload, os.path.join(path, "model_optim_rng.pt"))
            if distrib_optim is not None:
                torch.save(distrib_optim, os.path.join(path, DISTRIB_OPTIM))

    with open(os.path.join(out_dir, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(iteration))
