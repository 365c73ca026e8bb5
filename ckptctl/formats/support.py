"""What ckptctl reads and writes, per format: the table ``ckptctl formats`` prints (pure data)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class FormatSupport:
    name: str
    """The name used by ``--format`` and shown by ``inspect``."""
    description: str
    recognised_by: str
    reads: bool
    writes: str
    """Which commands write it (empty: read only)."""
    supports: str
    checksums: str
    """What ``verify`` can prove about a copy ckptctl did not write."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


FORMATS: tuple[FormatSupport, ...] = (
    FormatSupport(
        "megatron",
        "Megatron-LM legacy (--ckpt-format torch)",
        "latest_checkpointed_iteration.txt, iter_*/mp_rank_*/model_optim_rng.pt",
        True,
        "consolidate --format megatron, reshard (default)",
        "TP/PP/VPP/DP, uneven first/last stages, TE and local names, tied embeddings, GQA, "
        "SwiGLU, per-parameter Adam state and distrib_optim.pt, scheduler and counters",
        "CRC-32 of every zip entry",
    ),
    FormatSupport(
        "torch_dist",
        "Megatron-Core distributed checkpoint (DCP-based)",
        "metadata.json (sharded_backend torch_dist), .metadata, *.distcp, common.pt",
        True,
        "reshard --format torch_dist",
        "layer-stacked keys, fully_reshardable optimizer state (dp_reshardable is refused)",
        "CRC-32 of every tensor record",
    ),
    FormatSupport(
        "dcp",
        "PyTorch Distributed Checkpoint (torchtitan, FSDP2, DTensor)",
        ".metadata, __R_N.distcp",
        True,
        "",
        "any DCP state dict to one torch file; HF Llama models (with config.json) to HF, "
        "Megatron or torch_dist with their Adam state",
        "CRC-32 of every tensor record",
    ),
    FormatSupport(
        "hf",
        "HuggingFace safetensors",
        "config.json, model*.safetensors (+ index)",
        True,
        "consolidate --format hf",
        "Llama family; source of reshard to any Megatron layout",
        "none in the format: headers and sizes only",
    ),
    FormatSupport(
        "torch",
        "one torch.save state dict",
        "state_dict.pt, or a *.pt file named directly",
        True,
        "consolidate --format torch (from DCP / torch_dist)",
        "nested state dicts as dcp_to_torch_save writes them",
        "CRC-32 of every zip entry",
    ),
)

STORES = "local paths, file://, s3:// (S3 and S3-compatible), memory://, any fsspec URL"
