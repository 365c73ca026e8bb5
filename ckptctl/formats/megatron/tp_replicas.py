"""The TP copies of a weight megatron-core replicates over TP but does not keep equal: gated
delta net's ``out_norm`` (over each rank's own value heads) gets a partial gradient per rank
and no TP all-reduce unless sequence parallelism is on (megatron-core 0.16-0.19), so its copies
in a legacy checkpoint's TP rank files drift apart with training and the TP > 1 model has one
norm per group of heads, which no other TP size can express. A conversion reads one copy: the
others are registered as replicas of it and compared bit for bit before any output counts as
complete. (Weights megatron-core does keep equal are not compared: reading every copy of every
norm and router would cost reads for nothing.) Pure."""

from __future__ import annotations

from ckptctl.model.layout import ModelSpec
from ckptctl.model.linear_attention import TP_DRIFTING
from ckptctl.model.stored import Replica, StoredFile, StoredTensor

_WHY = (
    "TP ranks hold different copies of a weight Megatron replicates over TP: the model cannot "
    "be re-cut to another TP size without changing its math; gated delta net's out_norm drifts "
    "so when trained with TP > 1 without --sequence-parallel"
)


def tp_replicas(
    spec: ModelSpec, files: tuple[StoredFile, ...], lost: frozenset[str] = frozenset()
) -> tuple[Replica, ...]:
    """Each drifting weight (``TP_DRIFTING``) of a TP rank > 0 file as a replica of the same
    weight in the TP rank 0 file of its pipeline and expert ranks (files in ``lost`` aside)."""
    if spec.linear_attention is None:
        return ()
    originals: dict[tuple[int, int, str], tuple[str, StoredTensor]] = {}
    copies: list[tuple[tuple[int, int, str], str, StoredTensor]] = []
    for file in files:
        if file.rank is None or file.path in lost:
            continue
        tp, pp = file.rank
        for tensor in file.tensors:
            if not tensor.canonical.endswith(TP_DRIFTING):
                continue
            where = (pp, file.ep_rank, tensor.canonical)
            if tp == 0:
                originals[where] = (file.path, tensor)
            else:
                copies.append((where, file.path, tensor))
    out = []
    for where, path, tensor in copies:
        if where not in originals:
            continue
        original_path, original = originals[where]
        if original.pieces != tensor.pieces:
            continue  # not a copy: another cut of the tensor
        out.append(Replica(original_path, original.key, original.shape, path, tensor.key, _WHY))
    return tuple(out)
