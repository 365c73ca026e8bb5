"""HuggingFace ``LlamaForCausalLM`` safetensors as geometry over canonical tensors. Pure.

q/k/v come out of the group-interleaved fused QKV (one piece per query group), gate/up are the
two halves of ``linear_fc1``, the vocabulary is the true (unpadded) one, and a tied model has no
``lm_head.weight``.
"""

from __future__ import annotations

import json
from typing import Any

from ckptctl.errors import LayoutError
from ckptctl.model.catalog import LAYER_PREFIX
from ckptctl.model.geometry import Piece, Shape, nbytes
from ckptctl.model.layout import ModelSpec, NormKind, PositionEmbedding
from ckptctl.model.stored import StoredFile, StoredTensor

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
DEFAULT_MAX_SHARD_BYTES = 5 << 30


def check_llama(spec: ModelSpec) -> None:
    problems = []
    if not spec.gated_linear_unit:
        problems.append("HF Llama needs a gated (SwiGLU) MLP; this model has none")
    if spec.normalization is not NormKind.RMSNORM:
        problems.append(f"HF Llama needs RMSNorm, this model uses {spec.normalization}")
    if spec.position_embedding is not PositionEmbedding.ROPE:
        problems.append(f"HF Llama needs RoPE, this model uses {spec.position_embedding}")
    if spec.add_qkv_bias and not spec.add_bias_linear:
        problems.append("HF Llama cannot hold QKV-only biases (attention_bias covers o_proj too)")
    if spec.rotary_percent != 1.0:
        problems.append(
            f"rotary_percent={spec.rotary_percent}: HF Llama rotates every head dimension and "
            "cannot express partial rotary embeddings; keep it as Megatron (reshard, "
            "consolidate --format megatron)"
        )
    if problems:
        raise LayoutError(problems)


def _full(shape: Shape) -> tuple[Piece, ...]:
    zero = (0,) * len(shape)
    return (Piece(zero, zero, shape),)


def _qkv_pieces(spec: ModelSpec, part: str, trailing: Shape) -> tuple[Shape, tuple[Piece, ...]]:
    """Rows of q, k or v inside the fused QKV: group g holds r query heads, then k, then v."""
    d, r, groups = spec.kv_channels, spec.heads_per_group, spec.num_query_groups
    rows = r * d if part == "q" else d
    slot = {"q": 0, "k": r, "v": r + 1}[part]
    zero = (0,) * len(trailing)
    pieces = tuple(
        Piece((g * rows, *zero), ((g * (r + 2) + slot) * d, *zero), (rows, *trailing))
        for g in range(groups)
    )
    return (groups * rows, *trailing), pieces


def hf_tensors(spec: ModelSpec) -> list[tuple[str, str, Shape, tuple[Piece, ...]]]:
    """(HF name, canonical name, shape, pieces) for every tensor, in HF state-dict order."""
    check_llama(spec)
    h, f = spec.hidden_size, spec.ffn_hidden_size
    out: list[tuple[str, str, Shape, tuple[Piece, ...]]] = []

    def whole(hf: str, canonical: str, shape: Shape) -> None:
        out.append((hf, canonical, shape, _full(shape)))

    whole("model.embed_tokens.weight", "embedding.word_embeddings.weight", (spec.vocab_size, h))
    bias = spec.add_bias_linear
    for i in range(spec.num_layers):
        src, dst = f"{LAYER_PREFIX}{i}.", f"model.layers.{i}."
        qkv = f"{src}self_attention.linear_qkv."
        for part in ("q", "k", "v"):
            shape, pieces = _qkv_pieces(spec, part, (h,))
            out.append((f"{dst}self_attn.{part}_proj.weight", qkv + "weight", shape, pieces))
            if bias:
                shape, pieces = _qkv_pieces(spec, part, ())
                out.append((f"{dst}self_attn.{part}_proj.bias", qkv + "bias", shape, pieces))
        whole(
            f"{dst}self_attn.o_proj.weight",
            f"{src}self_attention.linear_proj.weight",
            (h, spec.num_attention_heads * spec.kv_channels),
        )
        if bias:
            whole(f"{dst}self_attn.o_proj.bias", f"{src}self_attention.linear_proj.bias", (h,))
        fc1 = f"{src}mlp.linear_fc1."
        for name, start in (("gate_proj", 0), ("up_proj", f)):
            for kind, trailing in (("weight", (h,)), ("bias", ())):
                if kind == "bias" and not bias:
                    continue
                zero = (0,) * len(trailing)
                piece = Piece((0, *zero), (start, *zero), (f, *trailing))
                out.append((f"{dst}mlp.{name}.{kind}", fc1 + kind, (f, *trailing), (piece,)))
        whole(f"{dst}mlp.down_proj.weight", f"{src}mlp.linear_fc2.weight", (h, f))
        if bias:
            whole(f"{dst}mlp.down_proj.bias", f"{src}mlp.linear_fc2.bias", (h,))
        whole(f"{dst}input_layernorm.weight", qkv + "layer_norm_weight", (h,))
        whole(f"{dst}post_attention_layernorm.weight", fc1 + "layer_norm_weight", (h,))
    whole("model.norm.weight", "decoder.final_layernorm.weight", (h,))
    if not spec.tie_embeddings:
        whole("lm_head.weight", "output_layer.weight", (spec.vocab_size, h))
    return out


def hf_files(
    spec: ModelSpec, dtypes: dict[str, str], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> tuple[StoredFile, ...]:
    """Shard the HF tensors greedily, in order, into files of at most ``max_shard_bytes``.

    ``dtypes`` maps HF names to dtype names. One file is named ``model.safetensors``, several
    ``model-0000i-of-0000N.safetensors``, as ``save_pretrained`` does.
    """
    shards: list[list[StoredTensor]] = [[]]
    size = 0
    for hf, canonical, shape, pieces in hf_tensors(spec):
        dtype = dtypes[hf]
        tensor_bytes = nbytes(shape, dtype)
        if shards[-1] and size + tensor_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(StoredTensor((hf,), canonical, shape, dtype, pieces))
        size += tensor_bytes
    if len(shards) == 1:
        return (StoredFile(SINGLE, tuple(shards[0])),)
    n = len(shards)
    return tuple(
        StoredFile(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(s))
        for i, s in enumerate(shards)
    )


def hf_config(spec: ModelSpec, dtype: str) -> dict[str, Any]:
    """``config.json`` of ``LlamaForCausalLM`` for ``spec``."""
    check_llama(spec)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_query_groups,
        "head_dim": spec.kv_channels,
        "num_hidden_layers": spec.num_layers,
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.norm_epsilon,
        "rope_theta": spec.rotary_base,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_embeddings,
        "attention_bias": spec.add_bias_linear,
        "mlp_bias": spec.add_bias_linear,
        "hidden_act": "silu",
        "torch_dtype": dtype,
    }
    return config


def spec_from_config(config: dict[str, Any], make_vocab_size_divisible_by: int = 128) -> ModelSpec:
    """A ``ModelSpec`` from a Llama ``config.json``."""
    model_type = config.get("model_type")
    if model_type not in ("llama", None):
        raise LayoutError(f"config.json model_type={model_type!r}: only 'llama' is supported")
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    rope = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    bias = bool(config.get("attention_bias", False))
    if bias != bool(config.get("mlp_bias", False)):
        raise LayoutError("attention_bias and mlp_bias differ: Megatron has one add_bias_linear")
    return ModelSpec(
        num_layers=config["num_hidden_layers"],
        hidden_size=hidden,
        ffn_hidden_size=config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        kv_channels=config.get("head_dim") or hidden // heads,
        vocab_size=config["vocab_size"],
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        gated_linear_unit=True,
        add_bias_linear=bias,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        rotary_base=float(rope or 10000.0),
    )


def index_text(files: tuple[StoredFile, ...]) -> str:
    """``model.safetensors.index.json``: total tensor bytes and the file of every tensor."""
    total = sum(nbytes(t.shape, t.dtype) for f in files for t in f.tensors)
    weight_map = {str(t.key[0]): f.path for f in files for t in f.tensors}
    body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(body, indent=2)
