"""HF safetensors as a target: full tensors named as the hub names them, cut into files of at
most ``--max-shard-size``, with the index and ``config.json`` written last. Pure."""

from __future__ import annotations

import json

from ckptctl.formats.target import CONSOLIDATE, TargetFormat, known_model
from ckptctl.model.hf_families import hf_config
from ckptctl.model.hf_layout import CONFIG, INDEX, hf_files, hf_tensors, index_text
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.plan import TextWrite
from ckptctl.model.stored import CheckpointView
from ckptctl.model.target import TargetFiles, TargetRequest

SAFETENSORS = "safetensors"
"""``FileWrite.kind`` of a safetensors file."""


class HfTarget(TargetFormat):
    name = "hf"
    operations = (CONSOLIDATE,)
    help = "safetensors weights"
    moves_optimizer_state = False

    def target_files(self, source: CheckpointView, request: TargetRequest) -> TargetFiles:
        spec = known_model(source, self.name)
        dtypes = source.canonical_dtypes()
        weight_dtypes = {
            hf: request.dtype or dtypes[canonical] for hf, canonical, _, _ in hf_tensors(spec)
        }
        targets = hf_files(spec, weight_dtypes, request.max_shard_bytes)
        out_dtype = request.dtype or next(iter(weight_dtypes.values()))
        finalize = []
        if len(targets) > 1:
            finalize.append(TextWrite(path=INDEX, content=index_text(targets)))
        config = json.dumps(hf_config(spec, out_dtype), indent=2)
        finalize.append(TextWrite(path=CONFIG, content=config))
        notes: tuple[str, ...] = ()
        if source.has_optimizer:
            notes = ("HF safetensors hold weights only: optimizer state is not written",)
        return TargetFiles(
            files=targets,
            kind=SAFETENSORS,
            layout=ParallelLayout(),
            reason="HF safetensors: full tensors, q/k/v and gate/up split out, vocabulary trimmed",
            finalize=tuple(finalize),
            optimizer_carried=False,
            notes=notes,
        )
