"""The view of an HF model's DCP checkpoint (FSDP2 / DTensor training of a family ckptctl
maps): each stored chunk of an HF tensor placed in the canonical tensors by the HF mapping.

Three kinds of key: an HF tensor by its name (``key_table``); transformers 5's in-memory packing
of per-expert hub tensors (``packed_table``: Qwen3-MoE's ``experts.gate_up_proj``); and
GPT-OSS's packed experts, which transformers holds as its hub checkpoints store them
(``block_table``): each expert's block a view of the chunk, read transposed and, for
``gate_up``, with its interleaved gate and up rows put apart (``DcpCheckpoint.blocks``).
"""

from __future__ import annotations

from ckptctl.errors import CheckpointError
from ckptctl.formats.dcp.hf_passthrough import tied_copies
from ckptctl.formats.dcp_container.files import files_of
from ckptctl.formats.dcp_container.metadata import DcpMetadata, StorageInfo, TensorEntry
from ckptctl.model.geometry import chunk_pieces
from ckptctl.model.hf_families import choose_family
from ckptctl.model.hf_state_dict import (
    block_chunk,
    block_table,
    key_table,
    packed_chunk,
    packed_table,
)
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.stored import CheckpointView, Format, KeyPath, StoredTensor


def hf_named_view(
    where: str,
    base: str,
    metadata: DcpMetadata,
    iteration: int | None,
    spec: ModelSpec,
    found: tuple[str, str | None],
) -> CheckpointView:
    """The checkpoint's view under ``spec`` (``found``: its model and optimizer key prefixes):
    GPT-OSS's expert blocks declared transposed / interleaved and Qwen3.5's gated norms
    shifted, which the reader takes from it."""
    model_prefix, optim_prefix = found
    table = key_table(spec, model_prefix, optim_prefix)
    blocks = block_table(spec, model_prefix, optim_prefix)
    held_under = (model_prefix,) if optim_prefix is None else (model_prefix, optim_prefix)
    packed = packed_table(table, spec, held_under) if spec.num_experts else {}
    placed: list[tuple[StorageInfo, StoredTensor]] = []
    problems: list[str] = []
    # a tied model's state dict names its embedding twice: the output alias is a copy
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if spec.tie_embeddings else {}
    entries = {k: e for k, e in metadata.entries.items() if isinstance(e, TensorEntry)}
    for fqn, entry in entries.items():
        if fqn[len(model_prefix) :] in tied and fqn.startswith(model_prefix):
            continue  # checked equal to the embedding below, never written
        key = table.get(fqn)
        wanted = key.shape if key is not None else None
        if key is None and fqn in packed:  # transformers 5's in-memory experts
            wanted = packed[fqn].shape
        elif key is None and fqn in blocks:  # GPT-OSS's packed experts
            wanted = blocks[fqn].shape
        if wanted is None:
            problems.append(f"{fqn} is not a parameter (or Adam state) of the configured model")
            continue
        if entry.shape != wanted:
            problems.append(f"{fqn} has shape {list(entry.shape)}; config says {list(wanted)}")
            continue
        for chunk in entry.chunks:
            info = metadata.storage[(fqn, chunk.offsets)]
            if key is not None:
                pieces = chunk_pieces(key.pieces, chunk.offsets, chunk.sizes)
                stored_at: KeyPath = (fqn, *chunk.offsets)
                tensor = StoredTensor(
                    stored_at, key.canonical, chunk.sizes, entry.dtype, pieces, shift=key.shift
                )
                placed.append((info, tensor))
            elif fqn in packed:
                for part in packed_chunk(fqn, packed[fqn], chunk.offsets, chunk.sizes, entry.dtype):
                    placed.append((info, part))
            else:
                views = block_chunk(fqn, blocks[fqn], chunk.offsets, chunk.sizes, entry.dtype)
                if views is None:
                    problems.append(f"{fqn} is saved cut inside an expert's block")
                    break
                placed.extend((info, view) for view in views)
    replicas = tied_copies(metadata, entries, model_prefix, tied, base, problems)
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems[:5]))
    view = CheckpointView(
        Format.DCP,
        spec,
        ParallelLayout(),
        files_of(base, placed),
        iteration,
        optim_prefix is not None,
        (f"PyTorch DCP checkpoint of an HF {choose_family(spec).architecture}",),
        replicas=replicas,
    )
    return view
