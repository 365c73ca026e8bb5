"""The Megatron-LM legacy format's registry entry (``--ckpt-format torch``)."""

from __future__ import annotations

from typing import Any

from ckptctl.formats.base import CheckpointFormat, ProbeRequest, lazy
from ckptctl.formats.megatron_common.iterations import recognised
from ckptctl.formats.megatron_common.options import ITERATION, TRUE_VOCAB_SIZE
from ckptctl.formats.megatron_common.target import (
    DISTRIBUTED_OPTIMIZER,
    MEGATRON_RANK,
    MegatronTarget,
)
from ckptctl.formats.options import TRUSTED_FIELDS
from ckptctl.formats.support import FormatSupport
from ckptctl.io.storage import Storage


def _probe(storage: Storage, names: frozenset[str], request: ProbeRequest) -> Any:
    if request.file is not None or not recognised(names):
        return None
    from ckptctl.formats.megatron.reader import probe_megatron

    return probe_megatron(
        storage,
        iteration=request.get(ITERATION),
        true_vocab_size=request.get(TRUE_VOCAB_SIZE),
        allow_missing=request.allow_missing,
        trusted=request.get(TRUSTED_FIELDS),
    )


FORMAT = CheckpointFormat(
    "megatron",
    _probe,
    options=(ITERATION, TRUE_VOCAB_SIZE, TRUSTED_FIELDS),
    support=FormatSupport(
        "megatron",
        "Megatron-LM legacy (--ckpt-format torch)",
        "latest_checkpointed_iteration.txt, iter_*/mp_rank_*/model_optim_rng.pt",
        True,
        "consolidate --format megatron, reshard (default)",
        "TP/PP/VPP/DP/EP, uneven first/last stages, TE and local names, tied embeddings, GQA, "
        "SwiGLU, MoE experts (sequential, TE grouped, GroupedMLP), per-parameter Adam state and "
        "distrib_optim.pt, scheduler and counters",
        "CRC-32 of every zip entry",
    ),
    target=MegatronTarget(),
    writers={
        MEGATRON_RANK: lazy("ckptctl.formats.megatron.writer", "write_rank_file"),
        DISTRIBUTED_OPTIMIZER: lazy("ckptctl.formats.megatron.writer", "write_distopt_file"),
    },
)
