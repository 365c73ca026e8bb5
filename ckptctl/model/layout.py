"""The layout model: what the network is (``ModelSpec``) and how it is split (``ParallelLayout``).

Pure: no torch, no I/O. Both models are frozen pydantic values that validate on construction and
serialise to JSON, so plans can record them and users can supply them in files.
"""

from __future__ import annotations

from enum import StrEnum
from math import ceil

from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt, model_validator

from ckptctl.errors import LayoutError
from ckptctl.model import linear_attention
from ckptctl.model.gemma_features import describe_features, feature_problems
from ckptctl.model.linear_attention import GatedDeltaNetSpec
from ckptctl.model.mla import MlaSpec, mla_problems
from ckptctl.model.moe_spec import moe_description, moe_problems
from ckptctl.model.rope_scaling import RopeScaling
from ckptctl.model.windows import describe as describe_window
from ckptctl.model.windows import window_problems


class NormKind(StrEnum):
    RMSNORM = "RMSNorm"
    LAYERNORM = "LayerNorm"


class PositionEmbedding(StrEnum):
    ROPE = "rope"
    LEARNED = "learned_absolute"
    NONE = "none"


class Activation(StrEnum):
    """The MLP's activation (Megatron: ``--swiglu`` gates SiLU, ``--squared-relu``, else GELU)."""

    SILU = "silu"
    GELU = "gelu"
    SQUARED_RELU = "squared_relu"
    QUICK_GELU = "quick_gelu"
    """``x * sigmoid(1.702 x)`` (Megatron's ``--quick-geglu`` gates it; GPT-OSS's experts)."""
    GELU_TANH = "gelu_tanh"
    """GELU's tanh approximation (Megatron's ``--openai-gelu``; Gemma's ``gelu_pytorch_tanh``)."""


class RouterScore(StrEnum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


PLAUSIBLE = {
    "num_layers": 1 << 12,
    "hidden_size": 1 << 20,
    "ffn_hidden_size": 1 << 22,
    "num_attention_heads": 1 << 14,
    "num_query_groups": 1 << 14,
    "kv_channels": 1 << 16,
    "vocab_size": 1 << 26,
    "make_vocab_size_divisible_by": 1 << 20,
    "max_position_embeddings": 1 << 30,
    "num_experts": 1 << 14,
    "moe_router_topk": 1 << 14,
    "moe_ffn_hidden_size": 1 << 22,
    "moe_shared_expert_intermediate_size": 1 << 22,
}
"""Largest values a model description may hold: far past any model trained (4096 layers, a
million-wide hidden size, 67M-token vocabularies), yet small enough that a description read
from an untrusted checkpoint cannot make ckptctl enumerate billions of tensors."""

MOST_RANKS = 1 << 20
"""Largest size of any parallel axis."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelSpec(_Frozen):
    """A decoder of the GPT/Llama family, in Megatron-Core's vocabulary."""

    num_layers: StrictInt
    hidden_size: StrictInt
    ffn_hidden_size: StrictInt
    num_attention_heads: StrictInt
    num_query_groups: StrictInt
    """Key/value heads; equal to ``num_attention_heads`` without grouped-query attention."""
    kv_channels: StrictInt
    """Head dimension; ``hidden_size // num_attention_heads`` unless set otherwise."""
    vocab_size: StrictInt
    """The true vocabulary (V0). Megatron pads it per TP size; the padding is never a real token."""
    make_vocab_size_divisible_by: StrictInt = 128
    gated_linear_unit: bool = True
    """Gated MLP: ``linear_fc1`` holds gate and up halves, each split over TP separately."""
    activation: Activation | None = None
    """The MLP's activation; unset means SiLU when gated (SwiGLU) and GELU when not."""
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    tie_embeddings: bool = False
    normalization: NormKind = NormKind.RMSNORM
    position_embedding: PositionEmbedding = PositionEmbedding.ROPE
    max_position_embeddings: StrictInt = 4096
    norm_epsilon: StrictFloat = 1e-5
    rotary_base: StrictFloat = 10000.0
    rotary_percent: StrictFloat = 1.0
    """Share of each head's dimensions that RoPE rotates (Megatron's ``--rotary-percent``)."""
    qk_layernorm: bool = False
    """A norm over each query and key head before RoPE (``q_layernorm`` / ``k_layernorm``)."""
    hf_family: str | None = None
    """The HF model family the model came from (``llama``, ``mistral``, ``qwen2``, ...), kept
    so that converting back to HF picks the same class; unset: chosen from the other fields."""
    num_experts: StrictInt | None = None
    """Routed experts of every layer's MoE MLP (Megatron's ``--num-experts``); unset: dense."""
    moe_ffn_hidden_size: StrictInt | None = None
    """One expert's FFN size; unset means ``ffn_hidden_size``."""
    moe_router_topk: StrictInt = 2
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before top-k (Qwen2-MoE, no renormalisation) instead of a
    softmax over the chosen k (Mixtral)."""
    moe_router_score_function: RouterScore = RouterScore.SOFTMAX
    moe_router_expert_bias: bool = False
    """A per-expert routing bias buffer (``mlp.router.expert_bias``, aux-loss-free balancing)."""
    moe_shared_expert_intermediate_size: StrictInt | None = None
    """FFN size of the always-on shared expert(s) of each MoE layer; unset: none."""
    moe_shared_expert_gate: bool = False
    """A sigmoid gate (``gate_weight``, one row) scaling the shared experts' output."""
    dense_layers: tuple[StrictInt, ...] = ()
    """Layers whose MLP is dense although the model has experts (Megatron's ``moe_layer_freq``
    0 entries; DeepSeek-V3's first three, ``first_k_dense_replace``)."""
    moe_router_num_groups: StrictInt | None = None
    """Group-limited routing (DeepSeek-V3): experts in this many groups, tokens routed within
    the ``moe_router_group_topk`` best groups only; unset: no groups."""
    moe_router_group_topk: StrictInt | None = None
    moe_router_topk_scaling_factor: StrictFloat | None = None
    """The routed experts' weights scaled by this (DeepSeek-V3's ``routed_scaling_factor``)."""
    mla: MlaSpec | None = None
    """Multi-latent attention in place of (grouped-query) attention; ``qk_layernorm`` then
    says whether the compressed queries and keys/values are normed."""
    mtp_num_layers: StrictInt = 0
    """Multi-token prediction layers after the decoder (DeepSeek-V3's one): each an embedding
    norm, a hidden-state norm, a ``[h, 2h]`` projection, a transformer layer of the last
    layer's kind and a final norm; they share the embedding and output layer."""
    glu_linear_offset: StrictFloat = 0.0
    """Added to the gated MLP's linear half before the product (GPT-OSS: 1)."""
    activation_clamp: StrictFloat | None = None
    """The gated MLP's halves clamped first: the activated one from above, the linear one both
    ways (Megatron's ``activation_func_clamp_value``; GPT-OSS's ``swiglu_limit``)."""
    attention_sinks: bool = False
    """A learned logit per head in every softmax's denominator (megatron-core's
    ``softmax_type="learnable"``: ``core_attention.softmax_offset``; GPT-OSS's sinks)."""
    rope_scaling: RopeScaling | None = None
    """RoPE stretched past the pretraining context (llama3 or YaRN) for attention that is not
    multi-latent (whose YaRN is ``mla``'s); unset: plain RoPE."""
    window_size: tuple[StrictInt, StrictInt] | None = None
    """Sliding-window attention, megatron-core's ``(left, right)``: a query attends to keys
    ``left`` before to ``right`` after it (-1: unbounded); unset: full causal attention."""
    full_attention_layers: tuple[StrictInt, ...] = ()
    """Layers exempt from the window (``window_attn_skip_freq``; HF's ``full_attention``)."""
    layernorm_zero_centered_gamma: bool = False
    """Norms scale by ``1 + weight`` (megatron-core's name; Megatron-LM's ``--apply-layernorm-1p``;
    Gemma's RMSNorm): the stored weights are the same numbers either side."""
    post_sublayer_norms: bool = False
    """A norm on the output of attention and of the MLP too, before each residual add (Gemma 2/3;
    Megatron-Bridge's ``linear_proj.post_layernorm`` and ``linear_fc2.post_layernorm``)."""
    scaled_embedding: bool = False
    """The embedding's output multiplied by ``sqrt(hidden_size)`` (Gemma)."""
    softmax_scale: StrictFloat | None = None
    """Attention scores scaled by this instead of ``kv_channels ** -0.5`` (megatron-core's
    ``softmax_scale``; Gemma 3's ``query_pre_attn_scalar ** -0.5``)."""
    local_rotary_base: StrictFloat | None = None
    """RoPE base of the windowed layers (Gemma 3's ``rope_local_base_freq``); they then take
    no ``rope_scaling``."""
    softmax_off_by_one: bool = False
    """A 1 in each softmax's denominator (``softmax_type="off-by-one"``; no tensor, no HF)."""
    attention_output_gate: bool = False
    """A sigmoid gate per query head on attention's output (``linear_qkv`` holds it after each
    group's queries; Qwen3-Next's gated attention)."""
    linear_attention: GatedDeltaNetSpec | None = None
    """Gated delta net layers (Qwen3-Next); unset: every layer is an attention layer."""

    @model_validator(mode="before")
    @classmethod
    def _default_activation(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("activation") is None:
            gated = data.get("gated_linear_unit", True)
            data = {**data, "activation": Activation.SILU if gated else Activation.GELU}
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        problems = []
        # the first seven PLAUSIBLE fields are the sizes that must be positive
        for field in (*list(PLAUSIBLE)[:7], "make_vocab_size_divisible_by"):
            if getattr(self, field) <= 0:
                problems.append(f"{field}={getattr(self, field)} must be positive")
        for field, most in PLAUSIBLE.items():
            value = getattr(self, field)
            if value is not None and value > most:
                problems.append(f"{field}={value} is implausible (at most {most})")
        problems.extend(moe_problems(self))
        problems.extend(window_problems(self))
        problems.extend(feature_problems(self))
        if not self.gated_linear_unit and (self.glu_linear_offset or self.activation_clamp):
            problems.append("glu_linear_offset / activation_clamp need a gated MLP")
        if self.attention_sinks and (self.mla is not None or self.softmax_off_by_one):
            problems.append("attention sinks with MLA or an off-by-one softmax: not supported")
        if self.rope_scaling is not None and (
            self.mla is not None or self.position_embedding is not PositionEmbedding.ROPE
        ):
            problems.append(
                "rope_scaling needs RoPE position embeddings without multi-latent attention"
            )
        problems.extend(mla_problems(self))
        problems.extend(linear_attention.linear_problems(self))
        if not 0 <= self.mtp_num_layers <= self.num_layers:
            problems.append(
                f"mtp_num_layers={self.mtp_num_layers} must lie in 0..num_layers={self.num_layers}"
            )
        if self.num_query_groups > 0 and self.num_attention_heads % self.num_query_groups:
            problems.append(
                f"num_query_groups={self.num_query_groups} does not divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if problems:
            raise LayoutError(problems)
        return self

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is routed experts."""
        return self.num_experts is not None and layer not in self.dense_layers

    @property
    def mtp_is_moe(self) -> bool:
        """Whether the multi-token prediction layers' MLP is routed experts: megatron-core
        builds them with the last decoder layer's spec."""
        return self.is_moe_layer(self.num_layers - 1)

    @property
    def expert_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def describe(self) -> str:
        """Every field that shapes the tensors or the math, in words (``inspect``)."""
        bias = (
            "biases on every linear layer"
            if self.add_bias_linear
            else "q/k/v biases only"
            if self.add_qkv_bias
            else "no biases"
        )
        position = str(self.position_embedding)
        if self.position_embedding is PositionEmbedding.ROPE:
            share = "" if self.rotary_percent == 1.0 else f", {self.rotary_percent:g} of head dims"
            scaled = f", {self.rope_scaling.describe()}" if self.rope_scaling else ""
            position = f"RoPE (base {self.rotary_base:g}{share}{scaled})"
        heads = (
            f"heads {self.num_attention_heads}, {self.mla.describe()}"
            if self.mla is not None
            else f"heads {self.num_attention_heads} (query groups {self.num_query_groups}, "
            f"head dim {self.kv_channels})"
        )
        parts = [
            f"{self.num_layers} layers, hidden {self.hidden_size}, ffn {self.ffn_hidden_size}",
            heads,
            f"vocab {self.vocab_size}",
            self.mlp_name,
            *([moe_description(self)] if self.is_moe else []),
            f"{self.normalization} (eps {self.norm_epsilon:g})",
            *(["q/k layernorm"] if self.qk_layernorm else []),
            *(["attention sinks"] if self.attention_sinks else []),
            *(["off-by-one softmax"] if self.softmax_off_by_one else []),
            bias,
            position,
            *([describe_window(self)] if self.window_size is not None else []),
            *describe_features(self),
            *linear_attention.describe(self),
            f"{'tied' if self.tie_embeddings else 'untied'} embeddings",
            *([self._mtp_description()] if self.mtp_num_layers else []),
            *([f"from HF {self.hf_family}"] if self.hf_family else []),
        ]
        return ", ".join(parts)

    def _mtp_description(self) -> str:
        n = self.mtp_num_layers
        return f"{n} multi-token prediction layer{'s' if n > 1 else ''}"

    @property
    def mlp_name(self) -> str:
        """How people call the MLP: SwiGLU, GEGLU, GELU MLP, ..."""
        act = self.activation or Activation.SILU
        if not self.gated_linear_unit:
            return f"{act.value} MLP"
        name = {
            Activation.SILU: "SwiGLU",
            Activation.GELU: "GEGLU",
            Activation.GELU_TANH: "GEGLU (tanh)",
        }.get(act, f"gated {act}")
        if self.activation_clamp is not None or self.glu_linear_offset:
            clamp, offset = self.activation_clamp, self.glu_linear_offset
            name += f" (clamped at {clamp}, linear half + {offset:g})"
        return name

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def qkv_rows(self) -> int:
        gates = self.num_attention_heads if self.attention_output_gate else 0
        return (self.num_attention_heads + gates + 2 * self.num_query_groups) * self.kv_channels

    @property
    def fc1_rows(self) -> int:
        return 2 * self.ffn_hidden_size if self.gated_linear_unit else self.ffn_hidden_size

    def padded_vocab_size(self, tp: int) -> int:
        """Megatron's padding: the next multiple of ``make_vocab_size_divisible_by * tp``."""
        multiple = self.make_vocab_size_divisible_by * tp
        return ceil(self.vocab_size / multiple) * multiple


class ParallelLayout(_Frozen):
    """How the model is cut over tensor, pipeline, virtual-pipeline and data parallelism."""

    tp: StrictInt = 1
    pp: StrictInt = 1
    dp: StrictInt = 1
    vpp: StrictInt = 1
    """Model chunks per pipeline stage (Megatron's virtual pipeline); 1 means none."""
    first_stage_layers: StrictInt | None = None
    last_stage_layers: StrictInt | None = None
    distributed_optimizer: bool = False
    ep: StrictInt = 1
    """Expert parallelism: each EP rank holds ``num_experts / ep`` experts of every MoE layer."""
    etp: StrictInt | None = None
    """Expert tensor parallelism (Megatron's ``--expert-tensor-parallel-size``); unset: ``tp``."""

    @model_validator(mode="after")
    def _check(self) -> ParallelLayout:
        axes = ("tp", "pp", "dp", "vpp", "ep", "expert_tp")
        problems = [
            f"{axis}={getattr(self, axis)} must be at least 1"
            for axis in axes
            if getattr(self, axis) < 1
        ]
        problems += [
            f"{axis}={getattr(self, axis)} is implausible (at most {MOST_RANKS})"
            for axis in axes
            if getattr(self, axis) > MOST_RANKS
        ]
        if not problems and (self.tp * self.dp) % (self.ep * self.expert_tp):
            # Megatron carves the expert groups out of the same ranks: tp*dp = etp*ep*edp.
            problems.append(
                f"ep={self.ep} x etp={self.expert_tp} does not divide tp={self.tp} x "
                f"dp={self.dp}: the experts need that many ranks per pipeline stage (pass --dp)"
            )
        if self.pp == 1 and self.vpp > 1:
            problems.append(f"vpp={self.vpp} needs pp > 1")
        if self.pp == 1 and (self.first_stage_layers or self.last_stage_layers):
            problems.append("uneven first/last stage layer counts need pp > 1")
        if problems:
            raise LayoutError(problems)
        return self

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Data-parallel replicas of each expert shard (Megatron's expert data parallelism)."""
        return self.tp * self.dp // (self.ep * self.expert_tp)

    @property
    def is_sharded(self) -> bool:
        return self.tp > 1 or self.pp > 1 or self.ep > 1

    def check_against(self, spec: ModelSpec) -> None:
        """Raise ``LayoutError`` listing every way this layout cannot split ``spec``."""
        problems = []
        t = self.tp
        if spec.num_query_groups % t:
            problems.append(f"tp={t} does not divide num_query_groups={spec.num_query_groups}")
        if spec.num_attention_heads % t:
            problems.append(
                f"tp={t} does not divide num_attention_heads={spec.num_attention_heads}"
            )
        if spec.ffn_hidden_size % t and (not spec.is_moe or spec.dense_layers):
            problems.append(f"tp={t} does not divide ffn_hidden_size={spec.ffn_hidden_size}")
        problems.extend(self._expert_problems(spec))
        if spec.mtp_num_layers and spec.tie_embeddings and self.pp > 1:
            # megatron-core then keeps an output layer weight on the last stage that no forward
            # uses and no sharded checkpoint holds
            problems.append(
                "tied embeddings with multi-token prediction layers over pp > 1: not supported yet"
            )
        try:
            self._stage_layer_counts(spec.num_layers)
        except LayoutError as err:
            problems.extend(err.problems)
        if problems:
            raise LayoutError(problems)

    def _expert_problems(self, spec: ModelSpec) -> list[str]:
        if spec.num_experts is None:
            if self.ep > 1 or self.etp is not None:
                return [f"ep={self.ep} / etp={self.etp} need a mixture-of-experts model"]
            return []
        problems = []
        if spec.num_experts % self.ep:
            problems.append(f"ep={self.ep} does not divide num_experts={spec.num_experts}")
        if spec.expert_ffn_size % self.expert_tp:
            problems.append(
                f"etp={self.expert_tp} does not divide the expert ffn size {spec.expert_ffn_size}"
            )
        if spec.add_bias_linear and self.expert_tp > 1:
            problems.append(
                f"etp={self.expert_tp}: megatron-core holds expert biases (add_bias_linear) "
                "only with expert TP 1 (pass --etp 1)"
            )
        shared = spec.moe_shared_expert_intermediate_size
        if shared and shared % self.tp:
            problems.append(
                f"tp={self.tp} does not divide moe_shared_expert_intermediate_size={shared}"
            )
        return problems

    def local_experts(self, spec: ModelSpec, ep_rank: int) -> range:
        """Global indices of the experts EP rank ``ep_rank`` holds (``ep_rank * n_local + j``)."""
        if spec.num_experts is None:
            return range(0)
        n_local = spec.num_experts // self.ep
        return range(ep_rank * n_local, (ep_rank + 1) * n_local)

    def _stage_layer_counts(self, num_layers: int) -> tuple[int, ...]:
        p, v = self.pp, self.vpp
        fixed = {}
        if self.first_stage_layers is not None:
            fixed[0] = self.first_stage_layers
        if self.last_stage_layers is not None:
            fixed[p - 1] = self.last_stage_layers
        rest = num_layers - sum(fixed.values())
        free = p - len(fixed)
        if rest < 0 or (free == 0 and rest != 0):
            raise LayoutError(
                f"first/last stage layers {self.first_stage_layers}/{self.last_stage_layers} "
                f"do not fit num_layers={num_layers} over pp={p}"
            )
        if free and rest % free:
            what = "the middle stages" if fixed else f"pp={p}"
            raise LayoutError(
                f"{what} cannot split the remaining {rest} of num_layers={num_layers} evenly"
            )
        counts = tuple(fixed.get(s, rest // free if free else 0) for s in range(p))
        for stage, count in enumerate(counts):
            if count % v:
                raise LayoutError(
                    f"vpp={v} does not divide the {count} layers of pipeline stage {stage}"
                )
        return counts

    def chunk_layers(self, num_layers: int) -> dict[tuple[int, int], range]:
        """Global layer indices held by each (pipeline stage, virtual chunk).

        Chunk ``c`` of stage ``s`` starts at ``c * L/v`` plus the per-chunk share of the stages
        before ``s`` (Megatron's ``get_transformer_layer_offset``, uneven stages included).
        """
        counts = self._stage_layer_counts(num_layers)
        v = self.vpp
        per_chunk_total = num_layers // v
        out: dict[tuple[int, int], range] = {}
        for chunk in range(v):
            start = chunk * per_chunk_total
            for stage, count in enumerate(counts):
                out[(stage, chunk)] = range(start, start + count // v)
                start += count // v
        return out

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}", f"DP{self.dp}"]
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        if self.ep > 1 or self.etp is not None:
            parts.append(f"EP{self.ep}")
        if self.etp is not None and self.etp != self.tp:
            parts.append(f"ETP{self.etp}")
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            parts.append(f"stages {self.first_stage_layers}/../{self.last_stage_layers}")
        if self.distributed_optimizer:
            parts.append("dist-opt")
        return " ".join(parts)
