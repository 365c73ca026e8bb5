"""The HF safetensors format's registry entry."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ckptctl.checksums.integrity import Targets
from ckptctl.errors import CheckpointError
from ckptctl.formats.base import CheckpointFormat, ProbeRequest, lazy
from ckptctl.formats.hf.mxfp4_target import SAFETENSORS_MXFP4
from ckptctl.formats.hf.target import SAFETENSORS, SAFETENSORS_FP8, HfTarget
from ckptctl.formats.options import ALLOW_ROUNDING, HF_CONFIG, TEXT_ONLY, TRUSTED_FIELDS
from ckptctl.formats.support import FormatSupport
from ckptctl.io.storage import Storage
from ckptctl.model.hf_layout import CONFIG, INDEX, SINGLE
from ckptctl.model.stored import CheckpointView


def _probe(storage: Storage, names: frozenset[str], request: ProbeRequest) -> Any:
    if request.file is not None:
        return None
    weights = INDEX in names or SINGLE in names
    if CONFIG not in names:
        if not weights:
            return None
        if request.get(HF_CONFIG) is None:  # e.g. torchtitan's HF export: weights only
            raise CheckpointError(
                f"{storage.describe(CONFIG)}: missing beside the safetensors weights; the "
                "model they hold is unknown without it",
                hint="give the model's config.json with --hf-config",
            )
    from ckptctl.formats.hf.reader import probe_hf

    option = request.get(HF_CONFIG)
    given = dict(option) if CONFIG not in names and option else None
    ckpt = probe_hf(
        storage,
        trusted=request.get(TRUSTED_FIELDS),
        config=given,
        text_only=request.get(TEXT_ONLY),
        round_shifted=request.get(ALLOW_ROUNDING),
    )
    return _as_trainer_checkpoint(ckpt, storage, names)


def _as_trainer_checkpoint(ckpt: Any, storage: Storage, names: frozenset[str]) -> Any:
    """An HF Trainer ``checkpoint-N/`` (or accelerate ``save_state``) directory: its
    ``global_step`` is the iteration, its optimizer file read where it can be."""
    from ckptctl.formats.hf.trainer import with_trainer_optimizer
    from ckptctl.formats.hf_state_dict_files import trainer_step

    step = trainer_step(storage)
    if step is not None:
        ckpt.view = replace(ckpt.view, iteration=step)
    return with_trainer_optimizer(ckpt, storage, names)


def _checksums(ckpt: Any) -> Targets:
    return Targets(safetensors=[f.path for f in ckpt.view.files])


def _description(storage: Storage, view: CheckpointView) -> list[str]:
    return [CONFIG] if storage.exists(CONFIG) else []


FORMAT = CheckpointFormat(
    "hf",
    _probe,
    options=(HF_CONFIG, TRUSTED_FIELDS, TEXT_ONLY, ALLOW_ROUNDING),
    support=FormatSupport(
        "hf",
        "HuggingFace safetensors",
        "config.json, model*.safetensors (+ index)",
        True,
        "consolidate --format hf",
        "any architecture transformers builds, by name (HF -> HF, verify); to and from every "
        "Megatron layout: Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, Mixtral, GPT-OSS, "
        "Gemma 3 text, Qwen3.5, Qwen3-Next, DeepSeek-V3, GLM-4.5; FP8 and MXFP4 releases read",
        "none in the format: headers and sizes only",
    ),
    target=HfTarget(),
    writers={
        SAFETENSORS: lazy("ckptctl.formats.hf.writer", "write_safetensors_file"),
        SAFETENSORS_FP8: lazy("ckptctl.formats.hf.fp8_writer", "write_fp8_safetensors_file"),
        SAFETENSORS_MXFP4: lazy("ckptctl.formats.hf.mxfp4_writer", "write_mxfp4_safetensors_file"),
    },
    description_files=_description,
    integrity=_checksums,
)
