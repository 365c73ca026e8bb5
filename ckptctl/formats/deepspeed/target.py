"""DeepSpeed's universal checkpoint as a target: every parameter's fp32 weight and Adam state
whole, one file each, which a DeepSpeed engine of any DP size loads with
``load_universal_checkpoint`` (layout: ``ckptctl.formats.deepspeed.layout``). Pure."""

from __future__ import annotations

import json

from ckptctl.errors import UsageError
from ckptctl.formats.deepspeed.layout import (
    LATEST_UNIVERSAL,
    PARAM_KEY,
    STEP_KEY,
    UNIVERSAL_MODEL_STATES,
    UNIVERSAL_OPTIMIZER_STATE,
    universal_tag,
)
from ckptctl.formats.target import CONSOLIDATE, TargetFormat
from ckptctl.model.catalog import parameters, state_name
from ckptctl.model.geometry import whole
from ckptctl.model.hf_families import hf_config
from ckptctl.model.hf_layout import CONFIG, named_weights, shared_original
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.plan import TextWrite
from ckptctl.model.stored import CheckpointView, StoredFile, StoredTensor
from ckptctl.model.target import TargetFiles, TargetRequest

DEEPSPEED_UNIVERSAL = "deepspeed-universal"
"""``FileWrite.kind`` of one file of a universal checkpoint: a parameter's state, Adam's step,
the optimizer's global state or the model states."""


def universal_files(source: CheckpointView) -> tuple[str, tuple[StoredFile, ...]]:
    """The tag and the per-parameter files: ``fp32.pt`` from the fp32 masters where the source
    keeps them apart (Megatron mixed precision), else from the weights (converted to fp32);
    Adam's moments and step for trained parameters when the source has optimizer state. An MTP
    layer's copies of the embedding and output layer are no parameters of the HF model, and a
    buffer (the router's expert bias) has no Adam state."""
    tag = universal_tag(source.iteration)
    frozen = set(source.frozen)
    held = source.canonical_dtypes()
    spec = source.spec
    untrained = {p.name for p in parameters(spec) if p.buffer} if spec is not None else set()
    out = []
    for hf, canonical, shape, pieces in named_weights(source):
        if spec is not None and shared_original(spec, hf) is not None:
            continue
        folder = f"{tag}/zero/{hf}"
        master = state_name("fp32_param", canonical)
        weight = master if master in held else canonical
        fp32 = StoredTensor(PARAM_KEY, weight, shape, "float32", pieces)
        out.append(StoredFile(f"{folder}/fp32.pt", (fp32,)))
        if not source.has_optimizer or canonical in frozen or canonical in untrained:
            continue
        for state in ("exp_avg", "exp_avg_sq"):
            tensor = StoredTensor(PARAM_KEY, state_name(state, canonical), shape, "float32", pieces)
            out.append(StoredFile(f"{folder}/{state}.pt", (tensor,)))
        step = StoredTensor(STEP_KEY, state_name("step", canonical), (), "float32", (whole(()),))
        out.append(StoredFile(f"{folder}/step.pt", (step,)))
    return tag, tuple(out)


class UniversalTarget(TargetFormat):
    name = "deepspeed-universal"
    operations = (CONSOLIDATE,)
    help = "DeepSpeed's universal checkpoint (fp32 weights and Adam state per parameter)"

    def target_files(self, source: CheckpointView, request: TargetRequest) -> TargetFiles:
        if source.spec is None and source.format != "deepspeed":
            # (A DeepSpeed run without config.json names its parameters as the module does.)
            raise UsageError(
                "the source's model family is unknown; a universal checkpoint names parameters as "
                "the HF model does: pass --hf-config CONFIG.json"
            )
        if source.has_optimizer and source.optimizer_step is None:
            raise UsageError(
                "the source's optimizer state has no Adam step; a universal checkpoint needs one"
            )
        tag, targets = universal_files(source)
        # The HF Trainer's layout: the model's config beside the checkpoint.
        config: list[TextWrite] = []
        if source.spec is not None:
            text = json.dumps(hf_config(source.spec, "float32"), indent=2)
            config.append(TextWrite(path=CONFIG, content=text))
        # The optimizer's global state and the model states hold no tensors: the writer
        # builds them.
        untensored = (
            StoredFile(f"{tag}/{UNIVERSAL_OPTIMIZER_STATE}", ()),
            *(StoredFile(f"{tag}/{name}", ()) for name in UNIVERSAL_MODEL_STATES),
        )
        return TargetFiles(
            files=(*untensored, *targets),
            kind=DEEPSPEED_UNIVERSAL,
            layout=ParallelLayout(),
            reason="DeepSpeed universal checkpoint: each parameter's fp32 weight and Adam state "
            "whole",
            finalize=(*config, TextWrite(path=LATEST_UNIVERSAL, content=tag + "\n")),
        )
