"""One ``torch.save`` file as a target: every tensor whole at its key path (what torch's
``dcp_to_torch_save`` writes, without holding the model in memory), or, for an HF model trained
under another framework, its weights and Adam state by HF name as ``set_state_dict`` takes
them. Pure."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptctl.errors import UsageError
from ckptctl.formats.target import CONSOLIDATE, TargetFormat
from ckptctl.formats.torch_file.names import STATE_DICT_FILE
from ckptctl.model.catalog import state_name
from ckptctl.model.geometry import whole
from ckptctl.model.hf_layout import MODEL_KEY, OPTIMIZER_KEY, named_weights
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.stored import CheckpointView, StoredFile, StoredTensor, canonical_shapes
from ckptctl.model.target import TargetFiles, TargetPlanner, TargetRequest

if TYPE_CHECKING:
    from ckptctl.formats.base import Checkpoint

TORCH_SAVE = "torch-save"
"""``FileWrite.kind`` of one ``torch.save`` file of a whole state dict (keys: key paths)."""


def hf_state_dict_tensors(source: CheckpointView, dtype: str | None = None) -> StoredFile:
    """The tensors of an HF model's torch state dict: every weight at ``model.<HF name>``
    (``dtype`` converts weights only) and, for trained parameters, Adam's moments at
    ``optimizer.state.<HF name>``, each cut from the canonical tensors like the safetensors."""
    dtypes = source.canonical_dtypes()
    frozen = set(source.frozen)
    tensors = []
    for hf, canonical, shape, pieces in named_weights(source):
        weight_dtype = dtype or dtypes[canonical]
        tensors.append(StoredTensor((MODEL_KEY, hf), canonical, shape, weight_dtype, pieces))
        if not source.has_optimizer or canonical in frozen:
            continue
        for state in ("exp_avg", "exp_avg_sq"):
            name = state_name(state, canonical)
            key = (OPTIMIZER_KEY, "state", hf, state)
            tensors.append(StoredTensor(key, name, shape, dtypes[name], pieces))
    return StoredFile(STATE_DICT_FILE, tuple(tensors))


class TorchTarget(TargetFormat):
    """Every stored tensor whole at its key (``dcp_to_torch_save``'s output)."""

    name = "torch"
    operations = (CONSOLIDATE,)
    help = "one state_dict.pt (DCP, torch_dist and DeepSpeed sources)"
    moves_optimizer_state = False

    def target_files(self, source: CheckpointView, request: TargetRequest) -> TargetFiles:
        tensors = tuple(
            StoredTensor((name,), name, shape, dtype, (whole(shape),))
            for name, (shape, dtype) in sorted(canonical_shapes(source).items())
        )
        return TargetFiles(
            files=(StoredFile(STATE_DICT_FILE, tensors),),
            kind=TORCH_SAVE,
            layout=ParallelLayout(),
            reason="one torch.save file: every tensor whole at its key path, other items as stored",
        )

    def planner_for(self, ckpt: Checkpoint) -> tuple[Checkpoint, TargetPlanner]:
        if ckpt.state_dict_items() is not None:
            return ckpt, HfStateDictTarget()
        if (generic := ckpt.as_generic()) is not None:  # DCP: every stored key
            return generic, self
        if ckpt.view.spec is None:  # a checkpoint of named tensors
            return ckpt, self
        raise UsageError("--format torch consolidates DCP, torch_dist or DeepSpeed checkpoints")


class HfStateDictTarget(TorchTarget):
    """An HF model trained under another framework (DeepSpeed): weights and Adam state by HF
    name; the source adds Adam's step and the parameter groups."""

    def target_files(self, source: CheckpointView, request: TargetRequest) -> TargetFiles:
        return TargetFiles(
            files=(hf_state_dict_tensors(source, request.dtype),),
            kind=TORCH_SAVE,
            layout=ParallelLayout(),
            reason="one torch.save file: HF-named weights and per-parameter Adam state",
        )
