"""The synthetic model: a tiny HF Llama, one real Adam step, and its canonical tensors (full,
TP-merged, vocabulary unpadded, under Megatron-Core names). Part of the test oracle: imports
only torch and transformers (see ``ckptctl.synth``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

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
    # transformers 4 takes ``rope_theta`` as a field; 5 reads it into ``rope_parameters`` (its
    # signature no longer names it).
    rope: dict[str, Any] = {"rope_theta": 10000.0}
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
        **rope,
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
    model = LlamaForCausalLM(config).float()
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
    nq = config_int(config, "num_attention_heads")
    ng = config_int(config, "num_key_value_heads")
    d = config_int(config, "head_dim")
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


def config_int(config: LlamaConfig, name: str) -> int:
    """A size of the config that ``make_config`` always sets (transformers types it optional)."""
    value = getattr(config, name)
    if not isinstance(value, int):
        raise ValueError(f"the config has no {name}")
    return value
