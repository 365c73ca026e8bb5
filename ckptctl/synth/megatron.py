"""Writing the synthetic model as Megatron-LM legacy rank files, by hand: padding, TP splits,
PP/VPP placement, ``args``, the torch and distributed optimizer states. Part of the test oracle:
imports only torch, numpy and transformers (see ``ckptctl.synth``)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ckptctl.synth.distopt import (
    _distrib_optim_state,
    _distributed_optimizer_state_dict,
)
from ckptctl.synth.megatron_state import _opt_param_scheduler, _optimizer_state, _rng_state
from ckptctl.synth.model import (
    _LOCAL_LAYER_KEYS,
    _LOCAL_TO_TE,
    _TE_LAYER_KEYS,
    DISTRIB_OPTIM,
    EMBEDDING,
    FINAL_NORM,
    OUTPUT,
    config_int,
    to_megatron_canonical,
)

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
    nq = config_int(config, "num_attention_heads")
    ng = config_int(config, "num_key_value_heads")
    problems: list[str] = []
    if nq % tp:
        problems.append(f"num_heads {nq} % tp {tp} != 0")
    # ng < tp (one group cut over several ranks) is accepted by recent Megatron-Core only (S3.3).
    if ng % tp and tp % ng:
        problems.append(f"num_kv_heads {ng} and tp {tp}: neither divides the other")
    qkv_rows = (nq + 2 * ng) * config_int(config, "head_dim")
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
    nq = config_int(config, "num_attention_heads")
    ng = config_int(config, "num_key_value_heads")
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
    **layout: Any,
) -> None:
    """Write ``model`` (after :func:`adam_step`) as a Megatron-LM legacy checkpoint, laid out
    by the keyword options of :func:`write_megatron_canonical`."""
    weights, optim = to_megatron_canonical(model, states)
    write_megatron_canonical(model.config, weights, optim, out_dir, **layout)


def write_megatron_canonical(
    config: LlamaConfig,
    weights: Mapping[str, torch.Tensor],
    optim: Mapping[str, Mapping[str, torch.Tensor]],
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
    """Write canonical tensors (``to_megatron_canonical``'s ``weights`` and ``optim``) as a
    Megatron-LM legacy checkpoint. Each is looked up once per rank file that holds it, so a
    mapping that makes its tensors when asked (``ckptctl.synth.large``) writes a checkpoint no
    memory holds whole, rank file by rank file.

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
    if tied and pp > 1:
        # The last stage keeps its own copy of the embedding as output_layer (S3.6).
        weights = {**weights, OUTPUT: weights[EMBEDDING]}
        optim = {**optim, OUTPUT: optim[EMBEDDING]}
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
