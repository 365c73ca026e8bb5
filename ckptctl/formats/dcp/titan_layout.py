"""torchtitan's DCP checkpoints of Llama 3, Qwen3, Qwen3-MoE, DeepSeek-V3 (its multi-token
prediction layers too) and GPT-OSS as geometry over canonical tensors. Pure.

torchtitan's ``CheckpointManager`` saves the model's state dict at the top level
(``tok_embeddings.weight``, ``layers.<i>.attention.qkv_linear.wq.weight`` -- or
``attention.wq`` without the fused-QKV module -- ``feed_forward.w1/w2/w3``, ``norm``,
``lm_head`` or ``output``) and the optimizer's state under ``optimizer.state.<parameter>``,
keyed by *parameter*: a fused-QKV model's Adam state is ``qkv_linear.wqkv.weight``'s,
group-major like Megatron's fused QKV, while its weights are saved split into ``wq/wk/wv``.
Llama 3's complex-number RoPE keeps q and k rows in Meta's interleaved order, which its HF
adapter permutes into HF's (``rotary_rows``); Qwen3's cos/sin RoPE keeps HF's order. Qwen3's
MoE layers keep each layer's experts in grouped tensors (``moe.routed_experts.inner_experts.
w1_EFD`` ``[E, F, D]``, ``w3_EFD``, ``w2_EDF`` ``[E, D, F]``), each expert's matrix HF's.
GPT-OSS's grouped experts are ``mlp1_weight_EGD`` ``[E, 2F, D]`` (each expert's ``linear_fc1``
with gate and up rows interleaved, as HF's ``gate_up_proj`` columns are: read through a row
map), ``mlp1_bias_EG`` likewise, ``mlp2_weight_EDF`` ``[E, D, F]`` and ``mlp2_bias_ED``
(Megatron's own orientation; HF's packed tensors are their transposes). torchtitan 0.3.0's
own adapter names these ``mlp1_weight`` ... and so leaves them out of its HF export.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ckptctl.model.catalog import state_name
from ckptctl.model.geometry import Piece, Shape, whole
from ckptctl.model.hf_families import choose_family
from ckptctl.model.hf_gpt_oss import MODEL_TYPE as GPT_OSS
from ckptctl.model.hf_layout import Entry, hf_tensors, per_name_tensors, shared_original
from ckptctl.model.layout import ModelSpec
from ckptctl.model.rotary_rows import RotaryRows

ANCHOR = "tok_embeddings.weight"
OPTIMIZER_PREFIX = "optimizer.state."
STATES = ("exp_avg", "exp_avg_sq", "step")

_RENAMES = {
    "model.embed_tokens.weight": ("tok_embeddings.weight",),
    "self_attn.q_proj.weight": ("attention.qkv_linear.wq.weight", "attention.wq.weight"),
    "self_attn.k_proj.weight": ("attention.qkv_linear.wk.weight", "attention.wk.weight"),
    "self_attn.v_proj.weight": ("attention.qkv_linear.wv.weight", "attention.wv.weight"),
    "self_attn.o_proj.weight": ("attention.wo.weight",),
    "mlp.gate_proj.weight": ("feed_forward.w1.weight",),
    "mlp.up_proj.weight": ("feed_forward.w3.weight",),
    "mlp.down_proj.weight": ("feed_forward.w2.weight",),
    "input_layernorm.weight": ("attention_norm.weight",),
    "post_attention_layernorm.weight": ("ffn_norm.weight",),
    "model.norm.weight": ("norm.weight",),
    "lm_head.weight": ("lm_head.weight", "output.weight"),
    "self_attn.q_norm.weight": ("attention.q_norm.weight",),
    "self_attn.k_norm.weight": ("attention.k_norm.weight",),
    "mlp.gate.weight": ("moe.router.gate.weight",),
    # DeepSeek-V3: multi-latent attention, shared experts, the routing bias HF keeps
    "self_attn.q_a_proj.weight": ("attention.wq_a.weight",),
    "self_attn.q_a_layernorm.weight": ("attention.q_norm.weight",),
    "self_attn.q_b_proj.weight": ("attention.wq_b.weight",),
    "self_attn.kv_a_proj_with_mqa.weight": ("attention.wkv_a.weight",),
    "self_attn.kv_a_layernorm.weight": ("attention.kv_norm.weight",),
    "self_attn.kv_b_proj.weight": ("attention.wkv_b.weight",),
    "mlp.shared_experts.gate_proj.weight": ("moe.shared_experts.w1.weight",),
    "mlp.shared_experts.up_proj.weight": ("moe.shared_experts.w3.weight",),
    "mlp.shared_experts.down_proj.weight": ("moe.shared_experts.w2.weight",),
    "mlp.gate.e_score_correction_bias": ("moe.expert_bias_E",),
    # GPT-OSS: biases on attention, learned sinks, a router with a bias
    "self_attn.q_proj.bias": ("attention.qkv_linear.wq.bias",),
    "self_attn.k_proj.bias": ("attention.qkv_linear.wk.bias",),
    "self_attn.v_proj.bias": ("attention.qkv_linear.wv.bias",),
    "self_attn.o_proj.bias": ("attention.wo.bias",),
    "self_attn.sinks": ("attention.sinks",),
    "mlp.router.weight": ("moe.router.gate.weight",),
    "mlp.router.bias": ("moe.router.gate.bias",),
}
_MTP_RENAMES = {
    "enorm.weight": ("enorm.weight",),
    "hnorm.weight": ("hnorm.weight",),
    "eh_proj.weight": ("eh_proj.weight",),
    "shared_head.norm.weight": ("mtp_norm.weight",),
}
"""DeepSeek-V3's multi-token prediction layer ``k`` (HF ``model.layers.<N + k>``) is
torchtitan's ``mtp_layers.<k>``: these of its own, the rest a decoder layer's names."""
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")
"""HF's copies of the embedding and output layer in an MTP layer: torchtitan's MTP layers use
the model's own (no tensors of theirs)."""
_ROTARY = ("self_attn.q_proj.weight", "self_attn.k_proj.weight")
FUSED_QKV = "attention.qkv_linear.wqkv.weight"
FUSED_QKV_BIAS = "attention.qkv_linear.wqkv.bias"
OUTPUT_NAMES = ("lm_head.weight", "output.weight")
EXPERT_BIAS = ".moe.expert_bias_E"
"""torchtitan's load-balancing bias added to router scores to choose experts (a buffer)."""
_GROUPED = {
    "gate_proj": "moe.routed_experts.inner_experts.w1_EFD",
    "up_proj": "moe.routed_experts.inner_experts.w3_EFD",
    "down_proj": "moe.routed_experts.inner_experts.w2_EDF",
}
_PACKED = {
    "mlp.experts.gate_up_proj": "moe.routed_experts.inner_experts.mlp1_weight_EGD",
    "mlp.experts.gate_up_proj_bias": "moe.routed_experts.inner_experts.mlp1_bias_EG",
    "mlp.experts.down_proj": "moe.routed_experts.inner_experts.mlp2_weight_EDF",
    "mlp.experts.down_proj_bias": "moe.routed_experts.inner_experts.mlp2_bias_ED",
}
"""GPT-OSS's packed HF expert tensors (one entry per expert in ``hf_tensors``) and the
grouped torchtitan parameter holding the same experts."""
_INTERLEAVED_GLU = frozenset({"mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"})
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
INTERLEAVED = {
    "llama": True,
    "qwen3": False,
    "qwen3_moe": False,
    "deepseek_v3": False,
    GPT_OSS: False,
}
"""The torchtitan models mapped, by HF ``model_type``, and whether their q/k rows are in
Meta's interleaved order (torchtitan's adapters permute them for Llama 3 only: DeepSeek-V3's
HF checkpoints keep its rotary dimensions interleaved, as torchtitan does)."""
DEEPSEEK = "deepseek_v3"


@dataclass(frozen=True, slots=True)
class TitanKey:
    canonical: str
    shape: Shape
    """The stored tensor's shape (``()`` for Adam's step)."""
    pieces: tuple[Piece, ...]
    """Pieces of the whole tensor in HF row order (its coordinates -> canonical ones)."""
    rows: RotaryRows | None = None
    """Set when the stored rows are in Meta's interleaved rotary order."""
    experts: tuple[tuple[str, tuple[Piece, ...]], ...] = ()
    """For a grouped experts tensor ``[E, ...]``: each expert's canonical tensor and the
    pieces of its matrix (``shape[1:]``)."""
    hf: tuple[str, ...] = ()
    """The HF tensors a model (not optimizer) key holds."""


def is_titan(keys: list[str]) -> bool:
    """Whether ``keys`` are a torchtitan model's (at the top level, as it saves them)."""
    return ANCHOR in keys and any(k.endswith(".attention_norm.weight") for k in keys)


def unsupported(spec: ModelSpec) -> str | None:
    """What of the configured model torchtitan's mapped names do not cover, if anything."""
    family = choose_family(spec).name
    if family not in INTERLEAVED:
        return f"model_type {family!r} (mapped: {', '.join(INTERLEAVED)})"
    if family in (DEEPSEEK, GPT_OSS):  # their HF families refuse what they do not hold
        return None
    for field, value in (
        ("attention_bias / mlp_bias", spec.add_bias_linear or spec.add_qkv_bias),
        ("shared experts", bool(spec.moe_shared_expert_intermediate_size)),
        (
            "dense layers among the MoE ones",
            spec.is_moe and not all(spec.is_moe_layer(i) for i in range(spec.num_layers)),
        ),
        ("multi-latent attention", spec.mla is not None),
        ("multi-token prediction layers", bool(spec.mtp_num_layers)),
    ):
        if value:
            return field
    return None


def titan_entries(spec: ModelSpec) -> list[Entry]:
    """The HF tensors of ``spec`` torchtitan's names stand for: GPT-OSS's packed experts too
    (one entry per expert; torchtitan groups them alike)."""
    if choose_family(spec).name == GPT_OSS:
        return hf_tensors(spec)
    return per_name_tensors(spec, "torchtitan")


def key_table(spec: ModelSpec) -> dict[str, TitanKey]:
    """Every key a torchtitan checkpoint of ``spec`` may hold (model and Adam state)."""
    d = spec.kv_channels
    heads = RotaryRows(d, d, d) if INTERLEAVED[choose_family(spec).name] else None
    params: dict[str, TitanKey] = {}
    grouped: dict[str, list[tuple[str, Shape, tuple[Piece, ...], str]]] = {}
    by_hf: dict[str, list[str]] = {}
    glu = RotaryRows(2 * spec.expert_ffn_size, 2 * spec.expert_ffn_size, 2 * spec.expert_ffn_size)
    grouped_rows: dict[str, RotaryRows] = {}
    for name, canonical, shape, pieces in titan_entries(spec):
        _, _, local = name.partition(".layers.")
        prefix, suffix = ("", name)
        renames = _RENAMES
        if local:
            number, _, suffix = local.partition(".")
            prefix = f"layers.{number}."
            if int(number) >= spec.num_layers:  # a multi-token prediction layer
                if suffix in _MTP_SHARED:  # held by the model's own tensor
                    for original in by_hf[shared_original(spec, name) or ""]:
                        params[original] = replace(
                            params[original], hf=(*params[original].hf, name)
                        )
                    continue
                prefix = f"mtp_layers.{int(number) - spec.num_layers}."
                renames = {**_RENAMES, **_MTP_RENAMES}
        if suffix in _PACKED:  # GPT-OSS: the experts of a packed HF tensor, in order
            matrix = (canonical, shape, pieces, name)
            grouped.setdefault(prefix + _PACKED[suffix], []).append(matrix)
            if suffix in _INTERLEAVED_GLU:  # gate row i at 2i, up row i at 2i + 1
                grouped_rows[prefix + _PACKED[suffix]] = glu
            continue
        expert = _EXPERT.fullmatch(suffix)
        if expert is not None:  # experts in HF order: expert 0's three, then expert 1's, ...
            matrix = (canonical, shape, pieces, name)
            grouped.setdefault(prefix + _GROUPED[expert[2]], []).append(matrix)
            continue
        rows = heads if suffix in _ROTARY else None
        for titan in renames[suffix]:
            params[prefix + titan] = TitanKey(canonical, shape, pieces, rows, hf=(name,))
            by_hf.setdefault(name, []).append(prefix + titan)
    for name, matrices in grouped.items():
        shape = (len(matrices), *matrices[0][1])
        each = tuple((canonical, pieces) for canonical, _, pieces, _ in matrices)
        names = tuple(hf for *_, hf in matrices)
        params[name] = TitanKey("", shape, (), grouped_rows.get(name), experts=each, hf=names)
    qkv_rows = (spec.heads_per_group + 2) * d
    fused = RotaryRows(d, qkv_rows, qkv_rows - d) if heads is not None else None
    qkv_shape = (spec.num_query_groups * qkv_rows, spec.hidden_size)
    for i in range(spec.num_layers if spec.mla is None else 0):
        canonical = params[f"layers.{i}.attention.wq.weight"].canonical
        params[f"layers.{i}.{FUSED_QKV}"] = TitanKey(
            canonical, qkv_shape, (whole(qkv_shape),), fused
        )
        bias = params.get(f"layers.{i}.attention.qkv_linear.wq.bias")
        if bias is not None and fused is None:  # GPT-OSS: the fused module's bias, alike
            fused_bias = TitanKey(bias.canonical, qkv_shape[:1], (whole(qkv_shape[:1]),))
            params[f"layers.{i}.{FUSED_QKV_BIAS}"] = fused_bias
    table = dict(params)
    for name, key in params.items():
        for state in STATES:
            experts = tuple((state_name(state, c), p) for c, p in key.experts)
            if state == "step":  # Adam's count, one 0-d tensor per parameter
                step = TitanKey(state_name("step", key.canonical), (), (Piece((), (), ()),))
                if experts:  # a grouped parameter's one count: each expert's
                    step = replace(step, canonical="", experts=experts)
                table[f"{OPTIMIZER_PREFIX}{name}.step"] = step
            else:
                table[f"{OPTIMIZER_PREFIX}{name}.{state}"] = TitanKey(
                    state_name(state, key.canonical), key.shape, key.pieces, key.rows, experts
                )
    return table
