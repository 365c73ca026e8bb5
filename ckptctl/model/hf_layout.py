"""HuggingFace decoder safetensors (Llama, Mistral, Qwen2, Qwen3) as geometry over canonical
tensors. Pure. The family (``families.py``) decides which biases and norms exist.

q/k/v come out of the group-interleaved fused QKV (one piece per query group), gate/up are the
two halves of ``linear_fc1``, the vocabulary is the true (unpadded) one, and a tied model has no
``lm_head.weight``.
"""

from __future__ import annotations

import json

from ckptctl.model import hf_deepseek
from ckptctl.model.catalog import LAYER_PREFIX, ROUTER_EXPERT_BIAS, expert_name, is_state
from ckptctl.model.geometry import Piece, Shape, nbytes, whole
from ckptctl.model.hf_families import MoeNaming, choose_family
from ckptctl.model.layout import ModelSpec
from ckptctl.model.stored import CheckpointView, StoredFile, StoredTensor, canonical_shapes

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
DEFAULT_MAX_SHARD_BYTES = 5 << 30
Entry = tuple[str, str, Shape, tuple[Piece, ...]]
"""(HF name, canonical name, shape, pieces)."""
_GATED_MLP = ("gate_proj", "up_proj", "down_proj")


MODEL_KEY, OPTIMIZER_KEY = "model", "optimizer"
"""Where an HF model's torch state dict keeps its weights and its optimizer state, as torch's
``get_state_dict`` / ``set_state_dict`` (``torch.distributed.checkpoint.state_dict``) name
them: parameters by fully qualified name, Adam state under ``state[name]``."""


def _full(shape: Shape) -> tuple[Piece, ...]:
    return (whole(shape),)


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


def hf_tensors(spec: ModelSpec) -> list[Entry]:
    """(HF name, canonical name, shape, pieces) for every tensor, in HF state-dict order."""
    family = choose_family(spec)
    h, f = spec.hidden_size, spec.ffn_hidden_size
    out: list[Entry] = []

    def whole(hf: str, canonical: str, shape: Shape) -> None:
        out.append((hf, canonical, shape, _full(shape)))

    whole("model.embed_tokens.weight", "embedding.word_embeddings.weight", (spec.vocab_size, h))
    bias = spec.add_bias_linear
    qkv_bias = bias or spec.add_qkv_bias
    d = spec.kv_channels
    for i in range(spec.num_layers):
        src, dst = f"{LAYER_PREFIX}{i}.", f"model.layers.{i}."
        qkv = f"{src}self_attention.linear_qkv."
        if spec.mla is not None:
            out.extend(hf_deepseek.attention_tensors(spec, src, dst))
        for part in ("q", "k", "v") if spec.mla is None else ():
            shape, pieces = _qkv_pieces(spec, part, (h,))
            out.append((f"{dst}self_attn.{part}_proj.weight", qkv + "weight", shape, pieces))
            if qkv_bias:
                shape, pieces = _qkv_pieces(spec, part, ())
                out.append((f"{dst}self_attn.{part}_proj.bias", qkv + "bias", shape, pieces))
        if spec.mla is None:
            whole(
                f"{dst}self_attn.o_proj.weight",
                f"{src}self_attention.linear_proj.weight",
                (h, spec.num_attention_heads * spec.kv_channels),
            )
        if bias:
            whole(f"{dst}self_attn.o_proj.bias", f"{src}self_attention.linear_proj.bias", (h,))
        if spec.qk_layernorm and spec.mla is None:
            whole(f"{dst}self_attn.q_norm.weight", f"{src}self_attention.q_layernorm.weight", (d,))
            whole(f"{dst}self_attn.k_norm.weight", f"{src}self_attention.k_layernorm.weight", (d,))
        if family.moe is not None and spec.is_moe_layer(i):
            out.extend(_moe_tensors(spec, family.moe, src, dst))
            pre_mlp_norm = f"{src}pre_mlp_layernorm.weight"
        else:
            out.extend(
                _mlp_tensors(
                    f"{dst}mlp.", f"{src}mlp.", ("gate_proj", "up_proj", "down_proj"), h, f, bias
                )
            )
            pre_mlp_norm = f"{src}mlp.linear_fc1.layer_norm_weight"
        norm = f"{src}input_layernorm.weight" if spec.mla else qkv + "layer_norm_weight"
        whole(f"{dst}input_layernorm.weight", norm, (h,))
        whole(f"{dst}post_attention_layernorm.weight", pre_mlp_norm, (h,))
    whole("model.norm.weight", "decoder.final_layernorm.weight", (h,))
    if not spec.tie_embeddings:
        whole("lm_head.weight", "output_layer.weight", (spec.vocab_size, h))
    return out


def _mlp_tensors(
    dst: str, src: str, parts: tuple[str, str, str], h: int, f: int, bias: bool
) -> list[Entry]:
    """A gated MLP: gate and up are the halves of ``linear_fc1``, down is ``linear_fc2``."""
    gate, up, down = parts
    out: list[Entry] = []
    for name, start in ((gate, 0), (up, f)):
        for kind, trailing in (("weight", (h,)), ("bias", ())):
            if kind == "bias" and not bias:
                continue
            zero = (0,) * len(trailing)
            piece = Piece((0, *zero), (start, *zero), (f, *trailing))
            out.append((f"{dst}{name}.{kind}", f"{src}linear_fc1.{kind}", (f, *trailing), (piece,)))
    out.append((f"{dst}{down}.weight", f"{src}linear_fc2.weight", (h, f), _full((h, f))))
    if bias:
        out.append((f"{dst}{down}.bias", f"{src}linear_fc2.bias", (h,), _full((h,))))
    return out


def _moe_tensors(spec: ModelSpec, moe: MoeNaming, src: str, dst: str) -> list[Entry]:
    """Router, then every expert, then the gated shared expert (hub order)."""
    h, e = spec.hidden_size, spec.num_experts or 0
    block = f"{dst}{moe.block}."
    out: list[Entry] = [(f"{block}gate.weight", f"{src}mlp.router.weight", (e, h), _full((e, h)))]
    if moe.router_bias is not None:
        out.append((block + moe.router_bias, f"{src}{ROUTER_EXPERT_BIAS}", (e,), _full((e,))))
    for expert in range(e):
        out.extend(
            _mlp_tensors(
                f"{block}experts.{expert}.",
                expert_name(src, expert, ""),
                moe.parts,
                h,
                spec.expert_ffn_size,
                False,
            )
        )
    shared = spec.moe_shared_expert_intermediate_size
    if moe.shared_experts is not None and shared:
        parts = ("gate_proj", "up_proj", "down_proj")
        out.extend(
            _mlp_tensors(
                f"{block}{moe.shared_experts}.",
                f"{src}mlp.shared_experts.",
                parts,
                h,
                shared,
                False,
            )
        )
    if moe.shared_gated_expert and shared:
        parts = ("gate_proj", "up_proj", "down_proj")
        out.extend(
            _mlp_tensors(
                f"{dst}mlp.shared_expert.", f"{src}mlp.shared_experts.", parts, h, shared, False
            )
        )
        gate = f"{src}mlp.shared_experts.gate_weight"
        out.append((f"{dst}mlp.shared_expert_gate.weight", gate, (1, h), _full((1, h))))
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


def index_text(files: tuple[StoredFile, ...]) -> str:
    """``model.safetensors.index.json``: total tensor bytes and the file of every tensor."""
    total = sum(nbytes(t.shape, t.dtype) for f in files for t in f.tensors)
    weight_map = {str(t.key[0]): f.path for f in files for t in f.tensors}
    body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(body, indent=2)


def named_weights(source: CheckpointView) -> list[tuple[str, str, Shape, tuple[Piece, ...]]]:
    """(name, canonical, shape, pieces) of every weight: HF names cut from the canonical
    tensors, or, for a model ckptctl does not know (a DeepSpeed run without ``config.json``),
    the canonical tensors themselves, whole, under the names the source gives them."""
    if source.spec is not None:
        return hf_tensors(source.spec)
    out: list[tuple[str, str, Shape, tuple[Piece, ...]]] = []
    for name, (shape, _) in canonical_shapes(source).items():
        if not is_state(name):
            out.append((name, name, shape, (whole(shape),)))
    return out
