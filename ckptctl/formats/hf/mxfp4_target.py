"""GPT-OSS as HF safetensors with its expert weights in MXFP4 (``--dtype mxfp4``): the
release's names, shapes and ``quantization_config``; each expert's block laid out as the
release stores it (rows are outputs, gate and up rows interleaved), for the MXFP4 writer
(``mxfp4_writer``) to quantize as it streams. Pure."""

from __future__ import annotations

import json
from dataclasses import replace

from ckptctl.errors import UsageError
from ckptctl.formats.hf import mxfp4
from ckptctl.model import hf_gpt_oss
from ckptctl.model.catalog import is_state
from ckptctl.model.geometry import nbytes
from ckptctl.model.hf_families import choose_family, hf_config
from ckptctl.model.hf_layout import CONFIG, INDEX, hf_files, hf_tensors
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.plan import TextWrite
from ckptctl.model.stored import CheckpointView, StoredFile, StoredTensor
from ckptctl.model.target import TargetFiles, TargetRequest

SAFETENSORS_MXFP4 = "safetensors-mxfp4"
"""A safetensors file whose expert weights its writer quantizes to MXFP4."""
NOT_CONVERTED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]
"""What OpenAI's releases keep unquantized (their ``modules_to_not_convert``)."""


def quantized_name(name: str) -> bool:
    """Whether HF tensor ``name`` is one GPT-OSS releases in MXFP4 (an expert weight)."""
    return name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))


def _as_released(tensor: StoredTensor) -> StoredTensor:
    """An expert's block of a quantized weight in the release's orientation: ``[out, in]``
    (Megatron's), not transposed as transformers holds it; gate and up rows interleaved."""
    if not quantized_name(str(tensor.key[0])) or tensor.base_shape is None:
        return tensor
    return replace(tensor, transposed=False, base_shape=(tensor.base_shape[0], *tensor.shape))


def mxfp4_files(source: CheckpointView, spec: ModelSpec, request: TargetRequest) -> TargetFiles:
    family = choose_family(spec)
    if family.name != hf_gpt_oss.MODEL_TYPE:
        raise UsageError(
            f"--dtype {mxfp4.METHOD}: writes GPT-OSS's expert weights as OpenAI releases them; "
            f"{family.architecture} has none (fp8-block quantizes the linear weights of others)"
        )
    odd = sorted({n for n in (spec.hidden_size, spec.expert_ffn_size) if n % mxfp4.BLOCK})
    if odd:
        raise UsageError(
            f"--dtype {mxfp4.METHOD}: MXFP4 scales blocks of {mxfp4.BLOCK} inputs; the hidden "
            f"and expert sizes ({spec.hidden_size}, {spec.expert_ffn_size}) are not multiples"
        )
    dtypes = source.canonical_dtypes()
    weight_dtypes = {hf: dtypes[canonical] for hf, canonical, _, _ in hf_tensors(spec)}
    targets = hf_files(spec, weight_dtypes, request.max_shard_bytes)
    targets = tuple(replace(f, tensors=tuple(map(_as_released, f.tensors))) for f in targets)
    out_dtype = next(d for c, d in dtypes.items() if not is_state(c))
    finalize = []
    if len(targets) > 1:
        finalize.append(TextWrite(path=INDEX, content=_index_text(targets)))
    config = hf_config(spec, out_dtype)
    config["quantization_config"] = {
        "modules_to_not_convert": NOT_CONVERTED,
        "quant_method": mxfp4.METHOD,
    }
    finalize.append(TextWrite(path=CONFIG, content=json.dumps(config, indent=2)))
    quantized = {str(t.key[0]) for f in targets for t in f.tensors if quantized_name(str(t.key[0]))}
    notes: tuple[str, ...] = (
        f"{len(quantized)} expert weights written in MXFP4 (E2M1 codes, a power-of-two scale "
        "per 32 inputs, the smallest that clips none); each expert's largest error goes to the "
        "manifest",
    )
    if source.has_optimizer:
        notes = ("HF safetensors hold weights only: optimizer state is not written", *notes)
    return TargetFiles(
        files=targets,
        kind=SAFETENSORS_MXFP4,
        layout=ParallelLayout(),
        reason="HF safetensors as OpenAI releases GPT-OSS: expert weights in MXFP4",
        finalize=tuple(finalize),
        optimizer_carried=False,
        notes=notes,
    )


def _index_text(files: tuple[StoredFile, ...]) -> str:
    """``model.safetensors.index.json``: each quantized weight as its blocks and scales."""
    weight_map: dict[str, str] = {}
    total = 0
    for f in files:
        for t in f.tensors:
            name = str(t.key[0])
            if quantized_name(name):
                weight_map[name + mxfp4.BLOCKS] = weight_map[name + mxfp4.SCALES] = f.path
                total += nbytes(t.shape, "uint8") // 2 + nbytes(t.shape, "uint8") // mxfp4.BLOCK
            else:
                weight_map[name] = f.path
                total += nbytes(t.shape, t.dtype)
    body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(body, indent=2)
