"""HuggingFace decoder safetensors (Llama, Mistral, Qwen2, Qwen3) as geometry over canonical
tensors. Pure. The family (``families.py``) decides which biases and norms exist.

q/k/v come out of the group-interleaved fused QKV (one piece per query group), gate/up are the
two halves of ``linear_fc1``, the vocabulary is the true (unpadded) one, and a tied model has no
``lm_head.weight``.
"""

from __future__ import annotations

import json
import re

from ckptctl.errors import LayoutError
from ckptctl.model import hf_deepseek, hf_gpt_oss, hf_qwen3_next, hf_qwen35
from ckptctl.model.catalog import (
    LAYER_PREFIX,
    MTP_PREFIX,
    POST_ATTENTION_NORM,
    POST_MLP_NORM,
    ROUTER_EXPERT_BIAS,
    expert_name,
    is_state,
    mtp_layer_prefix,
)
from ckptctl.model.geometry import Piece, Shape, nbytes, whole
from ckptctl.model.hf_families import MoeNaming, choose_family
from ckptctl.model.layout import ModelSpec
from ckptctl.model.linear_attention import is_linear_layer
from ckptctl.model.stored import CheckpointView, StoredFile, StoredTensor, canonical_shapes

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
DEFAULT_MAX_SHARD_BYTES = 5 << 30
Entry = tuple[str, str, Shape, tuple[Piece, ...]]
"""(HF name, canonical name, shape, pieces)."""
_GATED_MLP = ("gate_proj", "up_proj", "down_proj")
GROUPED = "grouped"
"""A gated delta net layer whose fused projections HF groups by key head (Qwen3-Next)."""


MODEL_KEY, OPTIMIZER_KEY = "model", "optimizer"
"""Where an HF model's torch state dict keeps its weights and its optimizer state, as torch's
``get_state_dict`` / ``set_state_dict`` (``torch.distributed.checkpoint.state_dict``) name
them: parameters by fully qualified name, Adam state under ``state[name]``."""


def _full(shape: Shape) -> tuple[Piece, ...]:
    return (whole(shape),)


def _qkv_pieces(spec: ModelSpec, part: str, trailing: Shape) -> tuple[Shape, tuple[Piece, ...]]:
    """Rows of q, k or v inside the fused QKV: group g holds r query heads, then k, then v.
    With an output gate, group g holds r query heads, their r gates, k, v; HF's ``q_proj``
    then holds each head's query followed by its gate."""
    d, r, groups = spec.kv_channels, spec.heads_per_group, spec.num_query_groups
    zero = (0,) * len(trailing)
    if spec.attention_output_gate:
        stride = 2 * r + 2
        if part == "q":
            pieces = tuple(
                Piece(
                    ((2 * (g * r + j) + gate) * d, *zero),
                    ((g * stride + gate * r + j) * d, *zero),
                    (d, *trailing),
                )
                for g in range(groups)
                for j in range(r)
                for gate in (0, 1)
            )
            return (2 * groups * r * d, *trailing), pieces
        slot = {"k": 2 * r, "v": 2 * r + 1}[part]
        pieces = tuple(
            Piece((g * d, *zero), ((g * stride + slot) * d, *zero), (d, *trailing))
            for g in range(groups)
        )
        return (groups * d, *trailing), pieces
    rows = r * d if part == "q" else d
    slot = {"q": 0, "k": r, "v": r + 1}[part]
    pieces = tuple(
        Piece((g * rows, *zero), ((g * (r + 2) + slot) * d, *zero), (rows, *trailing))
        for g in range(groups)
    )
    return (groups * rows, *trailing), pieces


def hf_tensors(spec: ModelSpec) -> list[Entry]:
    """(HF name, canonical name, shape, pieces) for every tensor, in HF state-dict order."""
    family = choose_family(spec)
    h = spec.hidden_size
    out: list[Entry] = []
    out.append(_whole("model.embed_tokens.weight", EMBEDDING, (spec.vocab_size, h)))
    packed = family.name == hf_gpt_oss.MODEL_TYPE
    for i in range(spec.num_layers):
        src, dst = f"{LAYER_PREFIX}{i}.", f"model.layers.{i}."
        linear: bool | str = is_linear_layer(spec, i)
        if linear and family.name == hf_qwen3_next.MODEL_TYPE:
            linear = GROUPED  # its fused projections grouped by key head
        out.extend(_layer_tensors(spec, family.moe, src, dst, spec.is_moe_layer(i), packed, linear))
    out.append(_whole("model.norm.weight", "decoder.final_layernorm.weight", (h,)))
    if not spec.tie_embeddings:
        out.append(_whole("lm_head.weight", OUTPUT, (spec.vocab_size, h)))
    if family.name in QWEN_HYBRIDS:
        out.extend(_qwen_mtp_tensors(spec, family.moe))
        return out
    for k in range(spec.mtp_num_layers):
        out.extend(_mtp_tensors(spec, family.moe, k))
    return out


QWEN_HYBRIDS = (hf_qwen35.MODEL_TYPE, hf_qwen3_next.MODEL_TYPE, hf_qwen3_next.QWEN35_MOE)


def mtp_marker(spec: ModelSpec) -> str:
    """The prefix of the HF names of ``spec``'s first MTP layer: a checkpoint holding none
    was saved without it (transformers drops MTP layers when it saves)."""
    if choose_family(spec).name in QWEN_HYBRIDS:
        return hf_qwen35.MTP_HEAD
    return f"model.layers.{spec.num_layers}."


def _qwen_mtp_tensors(spec: ModelSpec, moe: MoeNaming | None) -> list[Entry]:
    """The Qwen hybrids' MTP layer (``hf_qwen35.mtp_tensors``): a full-attention decoder layer
    under ``mtp.layers.0.`` between its projection's norms and its final norm."""
    if not spec.mtp_num_layers:
        return []
    if spec.mtp_num_layers > 1:
        raise LayoutError(
            f"mtp_num_layers={spec.mtp_num_layers}: the Qwen hybrids' releases share one "
            "mtp.fc and its norms over their MTP layers, Megatron has them per layer; one maps"
        )
    head, src = f"{MTP_PREFIX}0.", mtp_layer_prefix(0)
    own = [_whole(hf, canonical, shape) for hf, canonical, shape in
           hf_qwen35.mtp_tensors(spec, head, src)]  # fmt: skip
    layer = _layer_tensors(spec, moe, src, f"{hf_qwen35.MTP_HEAD}layers.0.", spec.mtp_is_moe)
    return [*own[:3], *layer, own[3]]


def per_name_tensors(spec: ModelSpec, where: str) -> list[Entry]:
    """``hf_tensors`` for readers and writers that take each HF name as one tensor: refused
    for a model whose HF tensors pack several canonical ones (GPT-OSS's experts) or store one
    shifted from its canonical values (Qwen3.5's gated norm), which only the readers that
    place blocks and take shifts off (HF safetensors, DCP, torchtitan, verl, accelerate) and
    the safetensors writer handle."""
    readers = "HF safetensors, DCP, torchtitan, verl and accelerate checkpoints"
    if choose_family(spec).name == hf_gpt_oss.MODEL_TYPE:
        raise LayoutError(
            f"{where}: GPT-OSS's packed experts are read from {readers} and written to HF "
            "safetensors and Megatron only, for now"
        )
    entries = hf_tensors(spec)
    if any(hf_qwen35.value_shift(spec, name) for name, *_ in entries):
        raise LayoutError(
            f"{where}: Qwen3.5's gated norms (one plus Megatron's zero-centred weight) are read "
            f"from {readers} and written to HF safetensors and Megatron only, for now"
        )
    return entries


EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"


def _whole(hf: str, canonical: str, shape: Shape) -> Entry:
    return (hf, canonical, shape, _full(shape))


def _mtp_tensors(spec: ModelSpec, moe: MoeNaming | None, k: int) -> list[Entry]:
    """MTP layer ``k`` as DeepSeek-V3 releases it: one more decoder layer
    ``model.layers.<num_hidden_layers + k>`` with the MTP norms and projection, and copies of the
    embedding and output layer it shares with the model (``embed_tokens``,
    ``shared_head.head``), as the hub's checkpoints hold them."""
    h, v = spec.hidden_size, spec.vocab_size
    head, dst = f"{MTP_PREFIX}{k}.", f"model.layers.{spec.num_layers + k}."
    output = EMBEDDING if spec.tie_embeddings else OUTPUT
    return [
        _whole(f"{dst}embed_tokens.weight", EMBEDDING, (v, h)),
        _whole(f"{dst}enorm.weight", f"{head}enorm.weight", (h,)),
        _whole(f"{dst}hnorm.weight", f"{head}hnorm.weight", (h,)),
        _whole(f"{dst}eh_proj.weight", f"{head}eh_proj.weight", (h, 2 * h)),
        *_layer_tensors(spec, moe, mtp_layer_prefix(k), dst, spec.mtp_is_moe),
        _whole(f"{dst}shared_head.norm.weight", f"{head}final_layernorm.weight", (h,)),
        _whole(f"{dst}shared_head.head.weight", output, (v, h)),
    ]


SHARED_COPIES = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "shared_head.head.weight": "lm_head.weight",
}
"""An MTP layer's copies of the embedding and output layer, and the tensors they copy: written
to both; read from the original, the copy checked to hold the same bytes."""


def shared_original(spec: ModelSpec, name: str) -> str | None:
    """The tensor HF tensor ``name`` is an MTP layer's copy of, if it is one."""
    for k in range(spec.mtp_num_layers):
        prefix = f"model.layers.{spec.num_layers + k}."
        copy = name[len(prefix) :] if name.startswith(prefix) else None
        if copy in SHARED_COPIES:
            original = SHARED_COPIES[copy]
            tied = spec.tie_embeddings and original == "lm_head.weight"
            return "model.embed_tokens.weight" if tied else original
    return None


def _layer_tensors(
    spec: ModelSpec,
    moe: MoeNaming | None,
    src: str,
    dst: str,
    routed: bool,
    packed: bool = False,
    linear: bool | str = False,
) -> list[Entry]:
    """One decoder layer: canonical prefix ``src`` (a decoder or MTP layer's), HF ``dst``;
    ``packed``: GPT-OSS's (sinks, packed experts); ``linear``: a gated delta net layer's."""
    h, f, d = spec.hidden_size, spec.ffn_hidden_size, spec.kv_channels
    bias = spec.add_bias_linear
    qkv_bias = bias or spec.add_qkv_bias
    out: list[Entry] = []

    def whole(hf: str, canonical: str, shape: Shape) -> None:
        out.append(_whole(hf, canonical, shape))

    qkv = f"{src}self_attention.linear_qkv."
    if linear:
        out.extend(hf_qwen35.linear_tensors(spec, src, dst, grouped=linear == GROUPED))
    elif spec.mla is not None:
        out.extend(hf_deepseek.attention_tensors(spec, src, dst))
    for part in ("q", "k", "v") if spec.mla is None and not linear else ():
        shape, pieces = _qkv_pieces(spec, part, (h,))
        out.append((f"{dst}self_attn.{part}_proj.weight", qkv + "weight", shape, pieces))
        if qkv_bias:
            shape, pieces = _qkv_pieces(spec, part, ())
            out.append((f"{dst}self_attn.{part}_proj.bias", qkv + "bias", shape, pieces))
    if spec.mla is None and not linear:
        whole(
            f"{dst}self_attn.o_proj.weight",
            f"{src}self_attention.linear_proj.weight",
            (h, spec.num_attention_heads * spec.kv_channels),
        )
    if bias:
        whole(f"{dst}self_attn.o_proj.bias", f"{src}self_attention.linear_proj.bias", (h,))
    if spec.qk_layernorm and spec.mla is None and not linear:
        whole(f"{dst}self_attn.q_norm.weight", f"{src}self_attention.q_layernorm.weight", (d,))
        whole(f"{dst}self_attn.k_norm.weight", f"{src}self_attention.k_layernorm.weight", (d,))
    if packed:
        out.append(hf_gpt_oss.attention_sinks(src, dst, spec.num_attention_heads))
        out.extend(hf_gpt_oss.moe_tensors(spec, src, dst))
        pre_mlp_norm = f"{src}pre_mlp_layernorm.weight"
    elif moe is not None and routed:
        out.extend(_moe_tensors(spec, moe, src, dst))
        pre_mlp_norm = f"{src}pre_mlp_layernorm.weight"
    else:
        out.extend(_mlp_tensors(f"{dst}mlp.", f"{src}mlp.", _GATED_MLP, h, f, bias))
        pre_mlp_norm = f"{src}mlp.linear_fc1.layer_norm_weight"
    norm = f"{src}input_layernorm.weight" if spec.mla else qkv + "layer_norm_weight"
    if linear:
        norm = f"{src}self_attention.in_proj.layer_norm_weight"
    whole(f"{dst}input_layernorm.weight", norm, (h,))
    if spec.post_sublayer_norms:  # Gemma 3: a norm after each sublayer too
        whole(f"{dst}post_attention_layernorm.weight", src + POST_ATTENTION_NORM, (h,))
        whole(f"{dst}pre_feedforward_layernorm.weight", pre_mlp_norm, (h,))
        whole(f"{dst}post_feedforward_layernorm.weight", src + POST_MLP_NORM, (h,))
        return out
    whole(f"{dst}post_attention_layernorm.weight", pre_mlp_norm, (h,))
    return out


_HUB_EXPERT = re.compile(r"(.*\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def packed_expert(spec: ModelSpec, hub_name: str) -> tuple[str, Shape, int] | None:
    """Where transformers 5 keeps hub expert tensor ``hub_name`` in memory (and in checkpoints
    saved from its state dict): ``(packed name, its shape, element offset)`` in
    ``experts.gate_up_proj`` ``[E, 2F, H]`` (gate rows, then up rows) or ``experts.down_proj``
    ``[E, H, F]``; ``None`` for a tensor that is no expert's gate, up or down projection."""
    match = _HUB_EXPERT.fullmatch(hub_name)
    if match is None:
        return None
    prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
    e, f, h = spec.num_experts or 0, spec.expert_ffn_size, spec.hidden_size
    if part == "down_proj":
        return f"{prefix}down_proj", (e, h, f), expert * h * f
    return f"{prefix}gate_up_proj", (e, 2 * f, h), (2 * expert + (part == "up_proj")) * f * h


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
    tensors = [
        stored_tensor(spec, hf, canonical, shape, dtypes[hf], pieces)
        for hf, canonical, shape, pieces in hf_tensors(spec)
    ]
    return shard_files(tensors, max_shard_bytes)


def stored_tensor(
    spec: ModelSpec, hf: str, canonical: str, shape: Shape, dtype: str, pieces: tuple[Piece, ...]
) -> StoredTensor:
    """HF tensor ``hf`` (or, packed, its block that is ``canonical``) as stored."""
    block = hf_gpt_oss.block(spec, hf, canonical, shape) if spec.attention_sinks else None
    if block is None:
        shift = hf_qwen35.value_shift(spec, hf)
        return StoredTensor((hf,), canonical, shape, dtype, pieces, shift=shift)
    return StoredTensor(
        (hf,),
        canonical,
        shape,
        dtype,
        pieces,
        block.offset,
        transposed=block.transposed,
        base_shape=block.base_shape,
        interleaved=block.interleaved,
    )


def shard_files(
    tensors: list[StoredTensor], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> tuple[StoredFile, ...]:
    """Tensors (keyed by their HF names) cut greedily, in order, into safetensors files."""
    shards: list[list[StoredTensor]] = [[]]
    size = 0
    for tensor in tensors:
        tensor_bytes = nbytes(tensor.shape, tensor.dtype)
        # the blocks of one packed tensor stay in one file
        same = shards[-1] and tensor.base_shape and shards[-1][-1].key == tensor.key
        if shards[-1] and not same and size + tensor_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
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
        return per_name_tensors(source.spec, "this target")
    out: list[tuple[str, str, Shape, tuple[Piece, ...]]] = []
    for name, (shape, _) in canonical_shapes(source).items():
        if not is_state(name):
            out.append((name, name, shape, (whole(shape),)))
    return out
