"""Whether every element of every tensor a checkpoint should hold is held by some stored piece:
each parameter of its model (or, for a model ckptctl does not know, each stored tensor's
bounding box) and, when it keeps optimizer state, Adam's moments of every trained parameter
(not of frozen parameters, nor of persistent buffers such as the router's expert bias)."""

from __future__ import annotations

from math import prod

from ckptctl.model.catalog import parameters
from ckptctl.model.geometry import missing_elements
from ckptctl.model.stored import CheckpointView, Shape, canonical_shapes


def coverage_problems(
    view: CheckpointView, lost: frozenset[str] = frozenset()
) -> tuple[list[str], int]:
    """The tensors with elements no surviving file holds (their counts), and how many
    tensors were looked at."""
    buffers: set[str] = set()
    shapes: dict[str, Shape]
    if view.spec is None:  # unknown model: each stored tensor's bounding box must be full
        shapes = {n: s for n, (s, _) in canonical_shapes(view).items()}
    else:
        shapes = {p.name: p.shape for p in parameters(view.spec)}
        buffers = {p.name for p in parameters(view.spec) if p.buffer}
    pieces: dict[str, list] = {}
    for f in view.files:
        if f.path in lost:
            continue
        for t in f.tensors:
            pieces.setdefault(t.canonical, []).extend(t.pieces)
    problems = []
    for name, shape in shapes.items():
        wanted = [name]
        trained = name not in view.frozen and name not in buffers
        if view.has_optimizer and view.spec is not None and trained:
            wanted += [f"{s}/{name}" for s in ("exp_avg", "exp_avg_sq")]
        for canonical in wanted:
            missing = missing_elements(shape, pieces.get(canonical, []))
            if missing:
                problems.append(f"{canonical}: {missing} of {prod(shape)} elements held nowhere")
    return problems, len(shapes)
