"""Optimizer state saved apart from the weights it belongs to, joined with them: verl's
Megatron actors saved through a bridge keep the weights as HF safetensors (``model/huggingface``)
and the distributed optimizer's ``torch_dist`` shards alone (``optimizer/dist_ckpt``). The
``torch_dist`` reader places the optimizer's state without the model (megatron-core records
each N-D flattened tensor's global shape); the opener reads the weights with their own format
and hands them here. The joined checkpoint is the ``torch_dist`` one, its view holding the
weights' files too (under their directory), whose reads go to the weights' checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from ckptctl.errors import CheckpointError
from ckptctl.formats.base import Checkpoint
from ckptctl.formats.torch_dist.checkpoint import TorchDistCheckpoint
from ckptctl.model.stored import CheckpointView, FlatView, KeyPath, Shape, canonical_shapes

if TYPE_CHECKING:
    import numpy as np

    from ckptctl.io.runs import Span


def joined_view(
    optimizer: CheckpointView, weights: CheckpointView, directory: str
) -> CheckpointView:
    """``optimizer``'s view with ``weights``' files (under ``directory``) added, refused by
    name where they disagree: a state whose parameter the weights lack or shape otherwise, or
    weights that are state's (a checkpoint with optimizer state of its own)."""
    where = f"{directory}/"
    if weights.has_optimizer:
        raise CheckpointError(f"{where}: holds optimizer state of its own beside the weights")
    held = canonical_shapes(weights)
    for name, (shape, _) in sorted(canonical_shapes(optimizer).items()):
        state, _, param = name.partition("/")
        if not param:
            raise CheckpointError(
                f"{where}: the optimizer's directory holds the weight {name} too; ckptctl joins "
                "optimizer state alone with HF weights"
            )
        found = held.get(param)
        if found is None:
            raise CheckpointError(
                f"{where}: holds no {param}, whose {state} the optimizer state has",
                hint="are the HF weights and the optimizer state of the same run?",
            )
        if found[0] != shape:
            raise CheckpointError(
                f"{where}: {param} is {list(found[0])}, its {state} {list(shape)}",
                hint="are the HF weights and the optimizer state of the same run?",
            )
    files = tuple(replace(f, path=f"{directory}/{f.path}") for f in weights.files)
    return replace(
        optimizer,
        files=(*optimizer.files, *files),
        notes=(*optimizer.notes, f"weights: {weights.format} files in {where}"),
        warnings=(*optimizer.warnings, *weights.warnings),
    )


@dataclass
class JoinedCheckpoint(TorchDistCheckpoint):
    """A ``torch_dist`` checkpoint of optimizer state whose weights ``weights`` holds, its
    files under ``weights_dir`` in ``view``."""

    weights: Checkpoint | None = None
    weights_dir: str = ""

    def with_weights(self, weights: Checkpoint, directory: str) -> JoinedCheckpoint:
        view = joined_view(self.view, weights.view, directory)
        return replace(self, view=view, weights=weights, weights_dir=directory.rstrip("/"))

    def _inner(self, path: str) -> str | None:
        prefix = f"{self.weights_dir}/"
        return path[len(prefix) :] if path.startswith(prefix) else None

    def read(
        self,
        path: str,
        key: KeyPath,
        offsets: Shape,
        sizes: Shape,
        view: FlatView = None,
        *,
        transposed: bool = False,
        into: np.ndarray | None = None,
    ) -> np.ndarray:
        inner = self._inner(path)
        if inner is None or self.weights is None:
            return super().read(path, key, offsets, sizes, view, transposed=transposed, into=into)
        return self.weights.read(inner, key, offsets, sizes, view, transposed=transposed)

    def where(
        self, path: str, key: KeyPath, offsets: Shape, sizes: Shape, view: FlatView = None
    ) -> Span | None:
        inner = self._inner(path)
        if inner is None or self.weights is None:
            return super().where(path, key, offsets, sizes, view)
        return self._outer(self.weights.where(inner, key, offsets, sizes, view))

    def extent(
        self, path: str, key: KeyPath, offsets: Shape, sizes: Shape, view: FlatView = None
    ) -> Span | None:
        inner = self._inner(path)
        if inner is None or self.weights is None:
            return super().extent(path, key, offsets, sizes, view)
        return self._outer(self.weights.extent(inner, key, offsets, sizes, view))

    def record_windows(self, path: str) -> list[tuple[int, int]] | None:
        inner = self._inner(path)
        if inner is None or self.weights is None:
            return super().record_windows(path)
        return self.weights.record_windows(inner)

    def _outer(self, span: Span | None) -> Span | None:
        """A span of the weights' checkpoint, relative to this one's root."""
        return None if span is None else replace(span, rel=f"{self.weights_dir}/{span.rel}")


def awaiting_weights(optimizer: TorchDistCheckpoint) -> JoinedCheckpoint:
    """``optimizer`` (opened without its model), to be joined with its weights
    (``with_weights``) once the opener has read them."""
    given = {f.name: getattr(optimizer, f.name) for f in fields(TorchDistCheckpoint) if f.init}
    return JoinedCheckpoint(**given)
