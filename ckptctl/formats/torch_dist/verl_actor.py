"""verl's Megatron actor / critic checkpoints (``MegatronCheckpointManager`` with
``use_dist_checkpointing``): ``dist_ckpt/`` is megatron-core's ``torch_dist`` directory of
``{"model", "optimizer", "lr_scheduler", "rng_state"}``, without Megatron-LM's ``args``; verl
built the model from ``huggingface/config.json`` (saved beside it) and records the
``TransformerConfig`` it used in ``transformer_config.json``. The model is read from the HF
config (strictly, as any HF config), the config's vocabulary unpadded (verl pads none), the
saved parallel sizes from ``transformer_config.json``, whose model fields must agree with the
HF config (a config that is not the run's is refused by name); then ``dist_ckpt/`` is read as
any ``torch_dist`` checkpoint. Saved through a bridge (``use_dist_checkpointing`` off), the
weights are HF safetensors in ``huggingface/`` and ``dist_ckpt/`` holds the optimizer state
alone: the two are read as one (``apart_from_weights``, ``joined``).

The ``verl`` format reads verl's FSDP checkpoints and refuses its Megatron layouts ckptctl does
not read; this one is megatron-core's ``torch_dist`` described by verl's files, as Megatron-Bridge's
runs are by their ``run_config.yaml`` (``bridge_config``), so it is read here."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import Any, NoReturn

from ckptctl import json_input
from ckptctl.errors import CheckpointError, LayoutError
from ckptctl.formats.base import ProbeRequest, WeightsElsewhere
from ckptctl.formats.dcp_container.files import read_metadata
from ckptctl.formats.dcp_container.metadata import DcpMetadata, TensorEntry
from ckptctl.formats.megatron_common.args import args_for, args_from_spec
from ckptctl.formats.megatron_common.options import ITERATION, TRUE_VOCAB_SIZE
from ckptctl.formats.options import HF_CONFIG, TRUSTED_FIELDS
from ckptctl.formats.torch_dist.checkpoint import TorchDistCheckpoint
from ckptctl.formats.torch_dist.joined import JoinedCheckpoint, awaiting_weights
from ckptctl.formats.torch_dist.reader import Described, probe_torch_dist
from ckptctl.io.storage import Storage
from ckptctl.model.hf_config import spec_from_config
from ckptctl.model.hf_layout import CONFIG
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.windows import from_megatron

DIST_CKPT = "dist_ckpt"
"""The actor's ``torch_dist`` directory (verl's ``MegatronCheckpointManager``)."""
TRANSFORMER_CONFIG = "transformer_config.json"
"""The actor's ``asdict(TransformerConfig)``, beside ``dist_ckpt``."""
HF_DIR = "huggingface"
"""The model's ``config.json`` (and tokenizer), beside ``dist_ckpt``."""
_ADAPTER_DIR = "adapter_checkpoint"
_STEP = re.compile(r"global_step_(\d+)")


def recognised(names: frozenset[str]) -> bool:
    """A Megatron actor's directory: ``dist_ckpt/`` with ``huggingface/`` beside it, holding the
    model (a LoRA run's ``adapter_checkpoint/``, and FSDP rank files, are the ``verl``
    format's to read or refuse; verl 0.9's split layout is ``verl_split``'s)."""
    return (
        DIST_CKPT in names
        and HF_DIR in names
        and _ADAPTER_DIR not in names
        and not any(n.startswith("model_world_size_") for n in names)
    )


def step_of(url: str) -> int | None:
    """The training step a ``global_step_N`` directory in the path names."""
    found = _STEP.findall(url)
    return int(found[-1]) if found else None


def _model_fields(spec: ModelSpec) -> dict[str, Any]:
    """``TransformerConfig`` fields verl derives from the HF config, as the model has them."""
    fields: dict[str, Any] = {
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "ffn_hidden_size": spec.ffn_hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_query_groups": spec.num_query_groups,
        "kv_channels": spec.kv_channels,
        "normalization": spec.normalization.value,
        "layernorm_epsilon": spec.norm_epsilon,
        "gated_linear_unit": spec.gated_linear_unit,
        "add_bias_linear": spec.add_bias_linear,
        "add_qkv_bias": spec.add_qkv_bias,
        "qk_layernorm": spec.qk_layernorm,
        "num_moe_experts": spec.num_experts if spec.is_moe else None,
        "multi_latent_attention": spec.mla is not None,
        "rotary_interleaved": False,
        "mtp_num_layers": spec.mtp_num_layers or None,
    }
    if spec.is_moe:
        fields["moe_router_topk"] = spec.moe_router_topk
        fields["moe_ffn_hidden_size"] = spec.expert_ffn_size
    return fields


def _same(saved: Any, wanted: Any) -> bool:
    if isinstance(wanted, float) and isinstance(saved, int | float):
        return abs(saved - wanted) <= 1e-12 * max(1.0, abs(wanted))
    if wanted is None:
        return saved in (None, 0)
    return bool(saved == wanted)


def layout_of(saved: dict[str, Any], where: str) -> ParallelLayout:
    """The parallel layout a run's saved ``TransformerConfig`` (verl's
    ``transformer_config.json``) says."""

    def size(name: str, default: int | None = 1) -> Any:
        value = saved.get(name, default)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise CheckpointError(f"{where}: {name} is {value!r}, not a size")
        return value

    tp = size("tensor_model_parallel_size")
    etp = size("expert_tensor_parallel_size", None)
    ep = size("expert_model_parallel_size")
    # The run's DP size is not saved: the fewest DP ranks that hold the experts (no form read
    # here depends on it).
    dp = math.lcm(tp, ep * (etp or tp)) // tp
    return ParallelLayout(
        tp=tp,
        dp=dp,
        pp=size("pipeline_model_parallel_size"),
        vpp=size("virtual_pipeline_model_parallel_size", None) or 1,
        ep=ep,
        etp=None if etp in (None, tp) else etp,
        first_stage_layers=size("num_layers_in_first_pipeline_stage", None),
        last_stage_layers=size("num_layers_in_last_pipeline_stage", None),
    )


def described(
    storage: Storage,
    config: dict[str, Any],
    request: ProbeRequest,
    config_from: str = f"{HF_DIR}/{CONFIG}",
    step: int | None = None,
) -> Described:
    """The run as ``args`` would say it: the model from the HF config (read from
    ``config_from``), the layout from ``transformer_config.json``, checked against each
    other; ``step`` the saved one (else the ``global_step_N`` of the path)."""
    where = storage.describe(TRANSFORMER_CONFIG)
    try:
        spec = spec_from_config(
            config, make_vocab_size_divisible_by=1, trusted=request.get(TRUSTED_FIELDS)
        )
    except LayoutError as err:
        raise CheckpointError(
            f"{storage.url}: a verl Megatron checkpoint of a model ckptctl has no Megatron "
            f"mapping for: {err}"
        ) from None
    notes = [f"verl Megatron checkpoint: the model from {config_from}"]
    if storage.exists(TRANSFORMER_CONFIG):
        saved = json_input.parse_object(storage.read_text(TRANSFORMER_CONFIG), where)
        wrong = [
            f"{name} is {saved[name]!r} there, {wanted!r} by the HF config"
            for name, wanted in _model_fields(spec).items()
            if name in saved and not _same(saved[name], wanted)
        ]
        windows = from_megatron(
            saved.get("window_size"), saved.get("window_attn_skip_freq"), spec.num_layers, where
        )
        if (
            windows.get("window_size") != spec.window_size
            or windows.get("full_attention_layers", ()) != spec.full_attention_layers
        ):
            wrong.append(
                f"window_size/window_attn_skip_freq are {saved.get('window_size')!r}/"
                f"{saved.get('window_attn_skip_freq')!r} there, not the HF config's window"
            )
        if wrong:
            raise CheckpointError(
                f"{where}: " + "; ".join(wrong[:4]) + f" (is {config_from} this run's?)"
            )
        layout = layout_of(saved, where)
    else:
        layout = ParallelLayout()
        notes.append(f"{TRANSFORMER_CONFIG} missing: the saved parallel layout is unknown")
    args: argparse.Namespace = args_for(args_from_spec(spec), spec, layout)
    args.data_parallel_size = 1  # not saved by verl; no form ckptctl reads depends on it
    # (whether the distributed optimizer ran: ``probe_torch_dist`` sees its saved state)
    return Described(args, step_of(storage.url) if step is None else step, tuple(notes))


def hf_config(
    storage: Storage, request: ProbeRequest, rel: str
) -> tuple[dict[str, Any], str] | None:
    """The HF config the model is read from and where it came from: ``--hf-config``, else the
    one verl saved at ``rel``; ``None`` if neither."""
    given = request.get(HF_CONFIG)
    if given is not None:
        return dict(given), "the config given (--hf-config)"
    if not storage.exists(rel):
        return None
    return json_input.parse_object(storage.read_text(rel), storage.describe(rel)), rel


def _config(storage: Storage, request: ProbeRequest) -> tuple[dict[str, Any], str]:
    rel = f"{HF_DIR}/{CONFIG}"
    found = hf_config(storage, request, rel)
    if found is None:
        raise CheckpointError(
            f"{storage.describe(rel)}: missing; verl saves the model's config there",
            hint="give the model's config.json with --hf-config",
        )
    return found


def _optimizer_only(metadata: DcpMetadata) -> bool:
    """verl's checkpoints with a bridge (``use_dist_checkpointing`` off) keep the weights as HF
    safetensors in ``huggingface/`` and only the optimizer, scheduler and RNG state in
    ``dist_ckpt``, whose optimizer keys name parameters it does not hold."""
    tensors = [k for k, e in metadata.entries.items() if isinstance(e, TensorEntry)]
    return bool(tensors) and all(k.startswith("optimizer.") for k in tensors)


def apart_from_weights(
    storage: Storage,
    weights: str,
    optimizer: str | None,
    step: int | None,
    open_optimizer: Callable[[], TorchDistCheckpoint] | None = None,
) -> NoReturn:
    """A verl actor whose bridge saved the weights as HF safetensors in ``weights`` and the
    optimizer state apart, in ``optimizer`` (opened by ``open_optimizer``): the caller reads
    the weights there and joins the optimizer state with them (``WeightsElsewhere``); without
    safetensors there, refused (the save kept no weights). Optimizer state that cannot be read
    without its model is said not carried, the weights read all the same."""
    found = storage.isdir(weights) and any(
        n.endswith(".safetensors") for n in storage.listdir(weights)
    )
    if not found:
        raise CheckpointError(
            f"{storage.describe(optimizer or weights)}: holds the optimizer state alone, not "
            f"the model: verl saves this Megatron actor's weights as HF safetensors in "
            f"{weights}/ (through a bridge, use_dist_checkpointing off)",
            hint=f"{weights}/ holds no weights either: this save kept only the optimizer state",
        )
    rest: JoinedCheckpoint | None = None
    warnings: tuple[str, ...] = ()
    if open_optimizer is not None:
        try:
            rest = awaiting_weights(open_optimizer())
        except CheckpointError as err:
            warnings = (f"not carried: optimizer state ({optimizer}/: {err})",)
    raise WeightsElsewhere(
        f"{storage.url}: verl saved this Megatron actor's weights as HF safetensors in "
        f"{weights}/ (through a bridge, use_dist_checkpointing off)"
        + (f", the optimizer state in {optimizer}/" if rest is not None else ""),
        directory=weights,
        iteration=step,
        warnings=warnings,
        rest=rest,
    )


def probe_verl_actor(storage: Storage, request: ProbeRequest) -> Any:
    metadata = read_metadata(storage, DIST_CKPT)

    def opened() -> TorchDistCheckpoint:
        config, config_from = _config(storage, request)
        return probe_torch_dist(
            storage,
            DIST_CKPT,
            request.get(ITERATION),
            request.get(TRUE_VOCAB_SIZE),
            request.get(TRUSTED_FIELDS),
            described(storage, config, request, config_from),
            metadata,
        )

    if _optimizer_only(metadata):
        apart_from_weights(storage, HF_DIR, DIST_CKPT, step_of(storage.url), opened)
    return opened()
