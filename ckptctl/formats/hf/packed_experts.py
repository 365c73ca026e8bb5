"""GPT-OSS's packed expert tensors in an HF checkpoint (``hf_gpt_oss``): each expert's block
of ``experts.gate_up_proj`` / ``down_proj`` (and their biases) found and checked, stored as
it is or as the release's MXFP4 blocks and scales (read dequantized, ``mxfp4``)."""

from __future__ import annotations

from collections.abc import Callable

from ckptctl.formats.hf import mxfp4
from ckptctl.formats.safetensors_header import SafetensorsEntry
from ckptctl.model import hf_gpt_oss
from ckptctl.model.geometry import Piece, Shape
from ckptctl.model.hf_layout import stored_tensor
from ckptctl.model.layout import ModelSpec
from ckptctl.model.stored import StoredTensor

Parts = tuple[tuple[str, str], tuple[str, str]]
"""(file, name) of an MXFP4 tensor's blocks and of its scales."""
Found = tuple[str, StoredTensor, Parts | None]


def packed_block(
    spec: ModelSpec,
    name: str,
    canonical: str,
    shape: Shape,
    pieces: tuple[Piece, ...],
    entry_of: Callable[[str], tuple[str, SafetensorsEntry | None]],
    dequantize: bool,
) -> Found | str | None:
    """Where expert tensor ``canonical`` lies in packed HF tensor ``name``: (file, the stored
    block, its MXFP4 parts if it is stored so); a problem, said; ``None`` if ``name`` is not
    packed. ``dequantize``: the config announces MXFP4."""
    block = hf_gpt_oss.block(spec, name, canonical, shape) if spec.attention_sinks else None
    if block is None:
        return None
    path, entry = entry_of(name)
    if entry is not None:
        if entry.shape != block.base_shape:
            return f"tensor {name} has shape {list(entry.shape)}, expected {list(block.base_shape)}"
        return path, stored_tensor(spec, name, canonical, shape, entry.dtype, pieces), None
    blocks, scales = name + mxfp4.BLOCKS, name + mxfp4.SCALES
    blocks_path, blocks_entry = entry_of(blocks)
    scales_path, scales_entry = entry_of(scales)
    if not dequantize or blocks_entry is None:
        return f"tensor {name} missing"
    problem = mxfp4.parts_problem(name, block.base_shape, blocks_entry, scales_entry)
    if problem is not None:
        return problem
    tensor = stored_tensor(spec, name, canonical, shape, mxfp4.DEQUANTIZED, pieces)
    return blocks_path, tensor, ((blocks_path, blocks), (scales_path, scales))
