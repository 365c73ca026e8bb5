"""HF safetensors as a target: full tensors named as the hub names them, cut into files of at
most ``--max-shard-size``, with the index and ``config.json`` written last. Pure."""

from __future__ import annotations

import json
from dataclasses import replace

from ckptctl.errors import CheckpointError, UsageError
from ckptctl.formats.hf.fp8 import (
    FP8,
    SCALE_SUFFIX,
    WRITE_BLOCK,
    quantizable,
    quantization_config,
)
from ckptctl.formats.hf.mxfp4_target import mxfp4_files
from ckptctl.formats.target import CONSOLIDATE, TargetFormat, known_model
from ckptctl.model.catalog import is_state
from ckptctl.model.geometry import nbytes, whole
from ckptctl.model.hf_families import hf_config
from ckptctl.model.hf_layout import CONFIG, INDEX, hf_files, hf_tensors, index_text, shard_files
from ckptctl.model.hf_named import GENERATION_CONFIG, HfNamedSource, converts
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.plan import TextWrite
from ckptctl.model.stored import CheckpointView, StoredFile, StoredTensor, canonical_shapes
from ckptctl.model.target import FP8_BLOCK, MXFP4, TargetFiles, TargetRequest

SAFETENSORS = "safetensors"
"""``FileWrite.kind`` of a safetensors file."""
SAFETENSORS_FP8 = "safetensors-fp8-block"
"""A safetensors file whose linear weights its writer quantizes to block-scaled FP8."""


def _unquantized(tensor: StoredTensor, dtypes: dict[str, str]) -> StoredTensor:
    return replace(tensor, dtype=dtypes[str(tensor.key[0])])


def fp8_index_text(files: tuple[StoredFile, ...], quantized: set[str]) -> str:
    """``model.safetensors.index.json`` of files whose ``quantized`` weights are FP8, each
    with its ``weight_scale_inv`` beside it."""
    weight_map: dict[str, str] = {}
    total = 0
    for f in files:
        for t in f.tensors:
            name = str(t.key[0])
            weight_map[name] = f.path
            if name in quantized:
                grid = WRITE_BLOCK.scale_shape((t.shape[0], t.shape[1]))
                weight_map[name + SCALE_SUFFIX] = f.path
                total += nbytes(t.shape, FP8) + nbytes(grid, "float32")
            else:
                total += nbytes(t.shape, t.dtype)
    body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(body, indent=2)


class HfTarget(TargetFormat):
    name = "hf"
    operations = (CONSOLIDATE,)
    help = "safetensors weights"
    moves_optimizer_state = False

    block_quantized = True

    def target_files(self, source: CheckpointView, request: TargetRequest) -> TargetFiles:
        if source.spec is None and source.hf_named is not None:
            return named_files(source, source.hf_named, request)
        spec = known_model(source, self.name)
        dtypes = source.canonical_dtypes()
        absent = sorted({c for _, c, _, _ in hf_tensors(spec) if c not in dtypes})
        if absent:  # a config of another model than the checkpoint's
            more = f" and {len(absent) - 5} more" if len(absent) > 5 else ""
            raise CheckpointError(f"the source holds no data for {', '.join(absent[:5])}{more}")
        if request.dtype == MXFP4:
            return mxfp4_files(source, spec, request)
        fp8 = request.dtype == FP8_BLOCK
        if fp8 and spec.attention_sinks:  # its experts are packed: blocks of one tensor
            raise UsageError(
                f"--dtype {FP8_BLOCK}: GPT-OSS's experts are packed, as OpenAI releases them "
                "in MXFP4 (--dtype mxfp4)"
            )
        kept = None if fp8 else request.dtype
        weight_dtypes = {hf: kept or dtypes[canonical] for hf, canonical, _, _ in hf_tensors(spec)}
        quantized = {hf for hf, _, shape, _ in hf_tensors(spec) if fp8 and quantizable(hf, shape)}
        # Files are cut by the bytes they will hold (FP8 and scales); the plan reads the
        # quantized weights in their own dtype, which the FP8 writer quantizes.
        sizing = {hf: FP8 if hf in quantized else d for hf, d in weight_dtypes.items()}
        targets = hf_files(spec, sizing, request.max_shard_bytes)
        if quantized:
            targets = tuple(
                replace(f, tensors=tuple(_unquantized(t, weight_dtypes) for t in f.tensors))
                for f in targets
            )
        notes: tuple[str, ...] = ()
        if request.round_shifted:
            targets = tuple(replace(f, tensors=tuple(_rounding(t) for t in f.tensors))
                            for f in targets)  # fmt: skip
            notes += (
                "gated norms stored as one plus Megatron's zero-centred weight are rounded "
                "where that sum is no number of their dtype (--allow-rounding); each one's "
                "largest error goes to the manifest",
            )
        out_dtype = kept or next(iter(weight_dtypes.values()))
        finalize = []
        if len(targets) > 1:
            text = fp8_index_text(targets, quantized) if quantized else index_text(targets)
            finalize.append(TextWrite(path=INDEX, content=text))
        config = hf_config(spec, out_dtype)
        if quantized:
            config["quantization_config"] = quantization_config(WRITE_BLOCK)
        finalize.append(TextWrite(path=CONFIG, content=json.dumps(config, indent=2)))
        if source.has_optimizer:
            notes += ("HF safetensors hold weights only: optimizer state is not written",)
        if quantized:
            notes += (
                f"{len(quantized)} linear weights written in FP8 (e4m3, 128x128 blocks, "
                "weight_scale_inv beside each); each one's largest error goes to the manifest",
            )
        return TargetFiles(
            files=targets,
            kind=SAFETENSORS_FP8 if quantized else SAFETENSORS,
            layout=ParallelLayout(),
            reason="HF safetensors: full tensors, q/k/v and gate/up split out, vocabulary trimmed",
            finalize=tuple(finalize),
            optimizer_carried=False,
            notes=notes,
        )


def _rounding(tensor: StoredTensor) -> StoredTensor:
    return replace(tensor, shift_rounds=True) if tensor.shift else tensor


def named_files(
    source: CheckpointView, carried: HfNamedSource, request: TargetRequest
) -> TargetFiles:
    """An HF model known by its names: each tensor whole under its hub name, in the model's
    order, the source's config files carried (their dtype set when ``--dtype`` converts)."""
    if request.dtype in (FP8_BLOCK, MXFP4):
        raise UsageError(
            f"--dtype {request.dtype} quantizes the weights of a model family ckptctl maps; "
            f"{carried.model.architecture} is carried by name only"
        )
    held = {n: v for n, v in canonical_shapes(source).items() if not is_state(n)}
    order = [carried.model.hub_name(n) for n, _ in carried.model.tensors]
    names = [n for n in order if n in held] + sorted(set(held) - set(order))
    tensors = []
    for name in names:
        shape, dtype = held[name]
        if request.dtype is not None and converts(dtype):
            dtype = request.dtype
        tensors.append(StoredTensor((name,), name, shape, dtype, (whole(shape),)))
    targets = shard_files(tensors, request.max_shard_bytes)
    finalize = []
    if len(targets) > 1:
        finalize.append(TextWrite(path=INDEX, content=index_text(targets)))
    finalize.append(TextWrite(path=CONFIG, content=carried.config_for(request.dtype)))
    if carried.generation_config is not None:
        finalize.append(TextWrite(path=GENERATION_CONFIG, content=carried.generation_config))
    notes: tuple[str, ...] = ()
    if source.has_optimizer:
        notes = ("HF safetensors hold weights only: optimizer state is not written",)
    return TargetFiles(
        files=targets,
        kind=SAFETENSORS,
        layout=ParallelLayout(),
        reason=f"HF safetensors of {carried.model.architecture}: every tensor by its hub name, "
        "config.json carried",
        finalize=tuple(finalize),
        optimizer_carried=False,
        notes=notes,
    )
