"""Qwen3.5's HF text family (``Qwen3_5ForCausalLM``, ``model_type: qwen3_5_text``: the text
decoder of Qwen3.5): gated delta net layers between gated-attention layers. Pure.

A layer is ``linear_attention`` or ``full_attention`` (``layer_types``; by default every
``full_attention_interval``-th, 4). Linear layers (``linear_attn``): ``in_proj_qkv`` (queries,
keys, values one after the other), ``in_proj_z`` (the output gate), ``in_proj_b`` /
``in_proj_a`` (beta, alpha: one per value head), a depthwise ``conv1d`` over the q/k/v
channels, ``dt_bias``, ``A_log``, a gated RMSNorm ``norm`` over a value head, ``out_proj``: the
parts of megatron-core's fused ``in_proj`` and its other parameters, in the same order.
Attention layers: ``q_proj`` holds each head's queries then its output gate (megatron-core's
``attention_output_gate`` keeps the gates after each group's queries), q/k RMSNorms, RoPE on
``partial_rotary_factor`` of each head (Megatron's ``rotary_percent``). Every RMSNorm scales by
``1 + weight`` (Megatron's zero-centred norms, the same numbers) except the gated one, which
scales by its weight: HF's weight is Megatron's ``out_norm`` plus one, a shift ckptctl applies
exactly or refuses (``StoredTensor.shift``).

Refused by name: RoPE types other than plain, biases and every feature the family lacks. The
multimodal RoPE sections Qwen3.5's releases carry (``mrope_section``, ``mrope_interleaved``)
are read past: the text model cuts each head's rotary angles into temporal, height and width
sections, which for text alone share one position, so the angles are plain RoPE's (what
Megatron's GPT model applies); they are not written back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptctl.errors import LayoutError
from ckptctl.model.geometry import Piece, Shape, whole
from ckptctl.model.hf_routed import FamilyRules
from ckptctl.model.layout import ModelSpec
from ckptctl.model.linear_attention import SIZE_FIELDS, GatedDeltaNetSpec

MODEL_TYPE = "qwen3_5_text"
TEXT_OF_MULTIMODAL = frozenset({MODEL_TYPE, "qwen3_5_moe_text"})
"""Text decoders of multimodal releases, whose rotary angles come in sections (above)."""
MULTIMODAL_ROPE = ("mrope_section", "mrope_interleaved")
CONFIG_KEYS = frozenset(
    """attention_bias layer_types full_attention_interval linear_conv_kernel_dim
    linear_key_head_dim linear_value_head_dim linear_num_key_heads linear_num_value_heads
    partial_rotary_factor attn_output_gate output_gate_type mamba_ssm_dtype
    mtp_num_hidden_layers mtp_use_dedicated_embeddings use_sliding_window sliding_window
    max_window_layers""".split()  # noqa: SIM905
)
"""Beyond the sizes, what the releases' configs say that transformers' classes do not read:
``attn_output_gate`` and ``output_gate_type`` (gated attention and the gated norm's SiLU, which
the classes always apply: other values refused), ``mamba_ssm_dtype`` (the dtype inference
engines keep the recurrent state in: no weight), and the multi-token prediction layer
(``mtp_num_hidden_layers``: the hub's ``mtp.*`` weights, which transformers does not load,
mapped to Megatron's MTP layer by ``mtp_tensors``; a model saved without them is read without
it: ``mtp_warning``). Qwen2's window fields, which Qwen3-Next's releases keep, are
read at their value of no window (``use_sliding_window: false``) and refused otherwise."""
MTP_LAYERS = "mtp_num_hidden_layers"
DEFAULT_INTERVAL = 4
DEFAULT_PARTIAL_ROTARY = 0.25
GATED_NORM = "linear_attn.norm.weight"
"""HF's gated norm of a linear layer: Megatron's zero-centred ``out_norm`` plus one."""


def family_problems(spec: ModelSpec, cls: str, routed: bool = False) -> list[str]:
    """What in ``spec`` ``Qwen3_5ForCausalLM`` (``routed``: Qwen3-Next, its layers' MLPs
    routed experts, judged by ``hf_qwen3_next``) cannot hold."""
    problems = []
    if not (spec.qk_layernorm and spec.layernorm_zero_centered_gamma):
        problems.append(
            f"{cls} has q/k norms and norms scaling by 1 + weight (qk_layernorm, "
            "layernorm_zero_centered_gamma)"
        )
    if not spec.attention_output_gate:
        problems.append(f"{cls}'s attention has an output gate (attention_output_gate)")
    if spec.add_bias_linear or spec.add_qkv_bias:
        problems.append(f"{cls} has no biases")
    if spec.mla is not None or spec.attention_sinks:
        problems.append(f"{cls} has no multi-latent attention or sinks")
    if spec.mtp_num_layers > 1:
        problems.append(
            f"{cls}'s releases share one mtp.fc and its norms over their MTP layers, Megatron "
            f"has them per layer: one MTP layer maps, not {spec.mtp_num_layers} "
            "(mtp_num_hidden_layers; Megatron's mtp_num_layers)"
        )
    if spec.is_moe and not routed:
        problems.append(f"{cls} has no experts (Qwen3NextForCausalLM has)")
    if spec.rope_scaling is not None:
        problems.append(f"{cls} reads plain RoPE only here, not {spec.rope_scaling.kind}")
    return problems


def config(spec: ModelSpec) -> dict[str, Any]:
    """The family's keys of ``config.json`` for ``spec``."""
    gdn = spec.linear_attention
    attention = set(gdn.attention_layers) if gdn is not None else set(range(spec.num_layers))
    out: dict[str, Any] = {
        "attention_bias": False,
        "layer_types": [
            "full_attention" if i in attention else "linear_attention"
            for i in range(spec.num_layers)
        ],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": spec.rotary_base,
            "partial_rotary_factor": spec.rotary_percent,
        },
    }
    if spec.mtp_num_layers:
        out[MTP_LAYERS] = spec.mtp_num_layers
        out["mtp_use_dedicated_embeddings"] = False
    # transformers' sizes where no layer is linear
    out |= {
        key: getattr(gdn, field) if gdn is not None else default
        for field, (key, default) in SIZE_FIELDS.items()
    }
    return out


def spec_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """``ModelSpec`` fields of a Qwen3.5 text ``config.json`` beyond the common ones."""
    problems = []
    if config.get("attention_bias"):
        problems.append("attention_bias=true: Megatron cannot hold biases on attention only")
    layers = config["num_hidden_layers"]
    kinds = config.get("layer_types")
    if kinds is None:
        interval = config.get("full_attention_interval", DEFAULT_INTERVAL)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise LayoutError(f"full_attention_interval={interval!r} is not a layer count")
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(layers)]  # fmt: skip
    allowed = {"full_attention", "linear_attention"}
    if not isinstance(kinds, list) or len(kinds) != layers or set(kinds) - allowed:
        raise LayoutError(
            f"layer_types={kinds!r}: give full_attention or linear_attention for each of "
            f"the {layers} layers"
        )
    sizes = {}
    for field, (key, default) in SIZE_FIELDS.items():
        value = config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{key}={value!r} is not an integer")
        sizes[field] = value
    rotary = _partial_rotary(config, problems)
    if config.get("attn_output_gate", True) is not True:
        problems.append(
            f"attn_output_gate={config['attn_output_gate']!r}: transformers' class gates "
            "every attention output"
        )
    if config.get("output_gate_type", "swish") not in ("swish", "silu"):
        problems.append(
            f"output_gate_type={config['output_gate_type']!r}: the gated norm's gate is "
            "SiLU (swish) in transformers' class"
        )
    if config.get("use_sliding_window"):
        problems.append(
            "use_sliding_window=true: transformers' gated delta net classes have no sliding windows"
        )
    mtp = config.get(MTP_LAYERS, 0)
    if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
        problems.append(f"{MTP_LAYERS}={mtp!r} is not a layer count")
    if mtp and config.get("mtp_use_dedicated_embeddings", False) is not False:
        problems.append(
            "mtp_use_dedicated_embeddings=true: Megatron's MTP layer shares the model's "
            "embedding; ckptctl maps none of its own"
        )
    if problems:
        raise LayoutError(problems)
    attention = tuple(i for i, kind in enumerate(kinds) if kind == "full_attention")
    linear = (
        GatedDeltaNetSpec(**sizes, attention_layers=attention) if len(attention) < layers else None
    )
    return {
        "layernorm_zero_centered_gamma": True,
        "attention_output_gate": True,
        "rotary_percent": rotary,
        "linear_attention": linear,
        "rope_scaling": None,
        "mtp_num_layers": mtp if isinstance(mtp, int) else 0,
    }


def _partial_rotary(config: Mapping[str, Any], problems: list[str]) -> float:
    """``partial_rotary_factor`` of plain RoPE (in ``rope_parameters``, or at the top level
    in configs written before transformers 5)."""
    parameters = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling")
    if isinstance(scaling, Mapping):
        parameters |= scaling
    factor = parameters.pop(
        "partial_rotary_factor", config.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)
    )
    kind = parameters.pop("rope_type", parameters.pop("type", "default"))
    parameters.pop("rope_theta", None)
    if config.get("model_type") in TEXT_OF_MULTIMODAL:
        for key in MULTIMODAL_ROPE:
            parameters.pop(key, None)
    if kind != "default" or parameters:
        problems.append(
            f"rope_parameters={config.get('rope_parameters')!r}: ckptctl reads plain RoPE "
            "(rope_theta, partial_rotary_factor) for this family"
        )
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
        problems.append(f"partial_rotary_factor={factor!r} must lie in (0, 1]")
        return 1.0
    return float(factor)


MTP_HEAD = "mtp."
"""Where the releases keep their multi-token prediction layer."""


def mtp_tensors(spec: ModelSpec, head: str, layer: str) -> list[tuple[str, str, Shape]]:
    """(HF name, canonical name, shape) of the MTP layer's own tensors around its transformer
    layer (HF ``mtp.layers.0.``, canonical ``layer``), as the releases name them (and vLLM and
    Megatron-Bridge read them): ``fc`` is Megatron's ``eh_proj`` (the normed embedding's half
    first, then the hidden state's), ``pre_fc_norm_embedding`` / ``pre_fc_norm_hidden`` its
    ``enorm`` / ``hnorm``, ``norm`` its final norm. The embedding and output layer are the
    model's own (no copies)."""
    h = spec.hidden_size
    return [
        (f"{MTP_HEAD}fc.weight", f"{head}eh_proj.weight", (h, 2 * h)),
        (f"{MTP_HEAD}pre_fc_norm_embedding.weight", f"{head}enorm.weight", (h,)),
        (f"{MTP_HEAD}pre_fc_norm_hidden.weight", f"{head}hnorm.weight", (h,)),
        (f"{MTP_HEAD}norm.weight", f"{head}final_layernorm.weight", (h,)),
    ]


def mtp_warning(count: int, where: str) -> str:
    """What to say of a Qwen3.5 / Qwen3-Next config announcing multi-token prediction layers
    when no ``mtp.*`` weight is read (transformers saved the model, or ``--text-only`` left
    them out): the model is whole without them, as transformers loads it."""
    return (
        f"{where} announces {count} multi-token prediction layer(s) ({MTP_LAYERS}) but the "
        "checkpoint holds no mtp.* weights (transformers drops them when it saves): read, and "
        "written, without them"
    )


def linear_tensors(
    spec: ModelSpec, src: str, dst: str, grouped: bool = False
) -> list[tuple[str, str, Shape, tuple[Piece, ...]]]:
    """A gated delta net layer's attention part: (HF name, canonical name, shape, pieces), in
    transformers' order; ``grouped``: Qwen3-Next's two projections, grouped by key head."""
    gdn = spec.linear_attention
    assert gdn is not None
    h, attn, mine = spec.hidden_size, f"{dst}linear_attn.", f"{src}self_attention."
    qk, v, nv = gdn.qk_dim, gdn.v_dim, gdn.num_value_heads
    conv = (2 * qk + v, 1, gdn.conv_kernel_dim)

    def rows(start: int, count: int) -> tuple[Piece, ...]:
        return (Piece((0, 0), (start, 0), (count, h)),)

    out: list[tuple[str, str, Shape, tuple[Piece, ...]]] = [
        (f"{attn}dt_bias", f"{mine}dt_bias", (nv,), (whole((nv,)),)),
        (f"{attn}A_log", f"{mine}A_log", (nv,), (whole((nv,)),)),
        (f"{attn}conv1d.weight", f"{mine}conv1d.weight", conv, (whole(conv),)),
        (f"{attn}norm.weight", f"{mine}out_norm.weight", (gdn.value_head_dim,),
         (whole((gdn.value_head_dim,)),)),
        (f"{attn}out_proj.weight", f"{mine}out_proj.weight", (h, v), (whole((h, v)),)),
    ]  # fmt: skip
    in_proj = f"{mine}in_proj.weight"
    if grouped:
        out.extend(_grouped_in_proj(gdn, h, attn, in_proj))
        return out
    start = 0
    for name, count in (("qkv", 2 * qk + v), ("z", v), ("b", nv), ("a", nv)):
        out.append((f"{attn}in_proj_{name}.weight", in_proj, (count, h), rows(start, count)))
        start += count
    return out


def _grouped_in_proj(
    gdn: GatedDeltaNetSpec, h: int, attn: str, in_proj: str
) -> list[tuple[str, str, Shape, tuple[Piece, ...]]]:
    """Qwen3-Next's ``in_proj_qkvz`` (per key head: its query, its key, then the values and
    gates of the value heads it serves) and ``in_proj_ba`` (per key head: those value heads'
    betas, then their alphas), as pieces of Megatron's part-major ``in_proj``."""
    dk, dv, nk = gdn.key_head_dim, gdn.value_head_dim, gdn.num_key_heads
    r, qk, v, nv = gdn.num_value_heads // nk, gdn.qk_dim, gdn.v_dim, gdn.num_value_heads
    group = 2 * dk + 2 * r * dv
    qkvz: list[Piece] = []
    ba: list[Piece] = []
    for g in range(nk):
        at = g * group
        for local, canonical, rows in (
            (at, g * dk, dk),
            (at + dk, qk + g * dk, dk),
            (at + 2 * dk, 2 * qk + g * r * dv, r * dv),
            (at + 2 * dk + r * dv, 2 * qk + v + g * r * dv, r * dv),
        ):
            qkvz.append(Piece((local, 0), (canonical, 0), (rows, h)))
        for local, canonical in (
            (2 * g * r, 2 * qk + 2 * v + g * r),
            (2 * g * r + r, 2 * qk + 2 * v + nv + g * r),
        ):
            ba.append(Piece((local, 0), (canonical, 0), (r, h)))
    return [
        (f"{attn}in_proj_qkvz.weight", in_proj, (nk * group, h), tuple(qkvz)),
        (f"{attn}in_proj_ba.weight", in_proj, (2 * nv, h), tuple(ba)),
    ]


def value_shift(spec: ModelSpec, name: str) -> float:
    """What HF tensor ``name`` holds beyond the canonical values: one on a zero-centred
    model's gated norm, nothing elsewhere."""
    if spec.linear_attention is None or not spec.layernorm_zero_centered_gamma:
        return 0.0
    return 1.0 if name.startswith("model.layers.") and name.endswith(GATED_NORM) else 0.0


RULES = FamilyRules(
    holds=(
        "gated delta net layers between gated-attention layers (layer_types), q/k norms, "
        "partial RoPE, SwiGLU, norms scaling by 1 + weight (the gated norm by its weight: "
        "shifted by one, exactly), tied or untied embeddings, the hub's MTP layer (mtp.*) as "
        "Megatron's"
    ),
    problems=family_problems,
    config=config,
    spec_fields=spec_fields,
)
