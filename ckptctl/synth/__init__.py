"""Synthetic Megatron-LM legacy checkpoints written from a tiny HF Llama, by hand.

This module is a *test oracle*: it must stay independent of the rest of ``ckptctl`` (it imports
only torch, numpy and transformers) so that a bug in ckptctl's readers or writers cannot hide
behind the same bug here. Every layout rule is spelled out in plain torch code, following the
team's format reference (``checkpoint-formats.md``, kept beside the project, not in it) S2
(files, ``args``), S3 (split rules, QKV groups, SwiGLU halves, vocab padding, tying, PP/VPP
placement), S4.8 (non-distributed optimizer), S4.1-S4.5 (distributed optimizer:
``distrib_optim.pt``, coalesced format, Megatron-Core >= 0.8 buffer layout) and S8.3 (HF name
mapping).

Pipeline: :func:`tiny_llama_config` -> :func:`make_model` -> :func:`adam_step` (one real Adam
step, so moments are non-trivial) -> :func:`to_megatron_canonical` (full, TP-merged, vocab-unpadded
tensors under Megatron-Core names with global layer indices) -> :func:`write_megatron` (pad,
split, place, save one ``model_optim_rng.pt`` per (tp, pp) rank, plus ``distrib_optim.pt``
beside it with ``distributed_optimizer=True``).
"""

from ckptctl.synth.megatron import (
    DISTRIB_OPTIM,
    padded_vocab_size,
    stage_layer_counts,
    write_megatron,
)
from ckptctl.synth.model import (
    _LOCAL_LAYER_KEYS,
    _TE_LAYER_KEYS,
    EMBEDDING,
    FINAL_NORM,
    OUTPUT,
    adam_step,
    make_model,
    save_hf,
    tiny_llama_config,
    to_megatron_canonical,
)

__all__ = [
    "DISTRIB_OPTIM",
    "EMBEDDING",
    "FINAL_NORM",
    "OUTPUT",
    "_LOCAL_LAYER_KEYS",
    "_TE_LAYER_KEYS",
    "adam_step",
    "make_model",
    "padded_vocab_size",
    "save_hf",
    "stage_layer_counts",
    "tiny_llama_config",
    "to_megatron_canonical",
    "write_megatron",
]
