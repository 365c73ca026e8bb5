"""The HF Trainer's ``checkpoint-N/`` (and accelerate's ``save_state`` without FSDP): the
weights as HF safetensors, and torch's Adam state in ``optimizer.pt`` (``optimizer.bin``) by
parameter *index*, which names nothing.

The Trainer numbers parameters the way it builds its optimizer: a group of the parameters
that take weight decay, then a group of those that do not (biases and norms), each in the
model's ``named_parameters`` order. ckptctl splits the model's parameters the same way by
dimension (matrices decay, vectors do not) and takes the indices only if every group's size
and every moment's shape agree with that split; anything else (another optimizer, other
groups) is left unread and the summary says so. ``global_step`` in ``trainer_state.json`` is
the iteration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any

from ckptctl.formats.base import SavedTraining
from ckptctl.formats.hf.reader import HFCheckpoint
from ckptctl.formats.hf_state_dict_files import ADAM_STATES
from ckptctl.formats.torchsave.archive import TensorRef, TorchZipReader
from ckptctl.formats.torchsave.refs import open_torch_file, read_box, span_of_box
from ckptctl.io.runs import Span
from ckptctl.io.storage import Storage
from ckptctl.model.catalog import state_name
from ckptctl.model.dtypes import dtype_name
from ckptctl.model.geometry import Piece, Shape
from ckptctl.model.hf_layout import per_name_tensors
from ckptctl.model.megatron_style import TORCH_ADAM, MegatronStyle
from ckptctl.model.stored import FlatView, KeyPath, StoredFile, StoredTensor

OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")


@dataclass
class TrainerCheckpoint(HFCheckpoint):
    """HF weights plus the trainer's optimizer file, read box by box."""

    optimizer_path: str = ""
    optimizer: TorchZipReader | None = None
    groups: tuple[dict[str, Any], ...] = ()

    def read(
        self,
        path: str,
        key: KeyPath,
        offsets: Shape,
        sizes: Shape,
        view: FlatView = None,
        *,
        transposed: bool = False,
        into: Any = None,
    ) -> Any:
        if path == self.optimizer_path and self.optimizer is not None:
            return read_box(self.optimizer, key, offsets, sizes, view, transposed, into)
        return super().read(path, key, offsets, sizes, view, transposed=transposed, into=into)

    def where(
        self, path: str, key: KeyPath, offsets: Shape, sizes: Shape, view: FlatView = None
    ) -> Span | None:
        if path == self.optimizer_path and self.optimizer is not None:
            return span_of_box(self.optimizer, key, offsets, sizes, view)
        return super().where(path, key, offsets, sizes, view)

    @property
    def style(self) -> MegatronStyle:
        """torch's Adam: per-parameter step and moments, the weights their own masters."""
        return MegatronStyle(optimizer=TORCH_ADAM)

    def saved_training(self, path: str) -> SavedTraining:
        """Each group's settings by kind: the Trainer's first group decays, its second not
        (told apart by place, since a weight decay of 0 leaves both at 0)."""
        settings = [{k: v for k, v in g.items() if k != "params"} for g in self.groups]
        if len(settings) == 1:
            return SavedTraining(templates={False: settings[0], True: settings[0]})
        return SavedTraining(templates={False: settings[0], True: settings[1]})


def with_trainer_optimizer(ckpt: HFCheckpoint, storage: Storage, names: frozenset[str]) -> Any:
    """``ckpt`` with its trainer's optimizer state when it is torch's Adam over the Trainer's
    groups; else ``ckpt`` with a note saying the file was left unread (and why)."""
    path = next((n for n in OPTIMIZER_FILES if n in names), None)
    if path is None or ckpt.view.spec is None:
        return _left_out(ckpt, path, "the model is known by name only")
    reader = open_torch_file(storage, path)
    placed = _placed(reader.tree, ckpt)
    if isinstance(placed, str):
        return _left_out(ckpt, path, placed)
    tensors, groups = placed
    view = replace(
        ckpt.view,
        files=(*ckpt.view.files, StoredFile(path, tuple(tensors))),
        has_optimizer=True,
        notes=(
            f"{path}: torch's Adam state of the trainer's {len(groups)} parameter group(s)",
            *(n for n in ckpt.view.notes if not n.startswith("HF checkpoints hold weights")),
        ),
    )
    kept = {f.name: getattr(ckpt, f.name) for f in dataclasses.fields(ckpt) if f.name != "view"}
    return TrainerCheckpoint(
        **kept, view=view, optimizer_path=path, optimizer=reader, groups=tuple(groups)
    )


def _left_out(ckpt: HFCheckpoint, path: str | None, why: str) -> HFCheckpoint:
    if path is None:
        return ckpt
    notes = (
        f"{path} (the trainer's optimizer state) is not read ({why}): only the weights are",
        *(n for n in ckpt.view.notes if not n.startswith("HF checkpoints hold weights")),
    )
    ckpt.view = replace(ckpt.view, notes=notes)
    return ckpt


def _placed(tree: Any, ckpt: HFCheckpoint) -> tuple[list[StoredTensor], list[dict[str, Any]]] | str:
    """The optimizer's tensors placed in the canonical ones, or why they cannot be."""
    state = tree.get("state") if isinstance(tree, dict) else None
    groups = tree.get("param_groups") if isinstance(tree, dict) else None
    if not isinstance(state, dict) or not isinstance(groups, list) or not groups:
        return "not a torch optimizer state dict"
    assert ckpt.view.spec is not None
    params = per_name_tensors(
        ckpt.view.spec, "HF Trainer"
    )  # named_parameters order of the mapped families
    split = [[p for p in params if len(p[2]) >= 2], [p for p in params if len(p[2]) < 2]]
    ordered = [params] if len(groups) == 1 else split if len(groups) == 2 else None
    if ordered is None:
        return f"{len(groups)} parameter groups, not the Trainer's two"
    by_index: dict[Any, tuple[str, str, Shape, tuple[Piece, ...]]] = {}
    for group, members in zip(groups, ordered, strict=True):
        indices = group.get("params") if isinstance(group, dict) else None
        if not isinstance(indices, list) or len(indices) != len(members):
            return "its parameter groups are not the model's decaying and other parameters"
        by_index.update(zip(indices, members, strict=True))
    out: list[StoredTensor] = []
    for index, per_param in state.items():
        if index not in by_index or not isinstance(per_param, dict):
            return f"state of parameter {index!r}, which no group holds"
        if set(per_param) != ADAM_STATES:
            return f"its state is {sorted(map(str, per_param))}, not torch's Adam"
        hf, canonical, shape, pieces = by_index[index]
        for kind, ref in per_param.items():
            if not isinstance(ref, TensorRef):
                return f"{kind} of {hf} is not a tensor"
            want = () if kind == "step" else shape
            if tuple(ref.shape) != want:
                return f"{kind} of parameter {index} is {list(ref.shape)}, {hf}'s is {list(want)}"
            kept = (Piece((), (), ()),) if kind == "step" else pieces
            name = state_name(kind, canonical)
            out.append(
                StoredTensor(("state", index, kind), name, want, dtype_name(ref.dtype), kept)
            )
    return out, [g for g in groups if isinstance(g, dict)]
