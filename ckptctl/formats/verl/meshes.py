"""The device mesh verl's FSDP files were written on, read off the rows each rank holds. Pure."""

from __future__ import annotations

from collections.abc import Iterable

from ckptctl.formats.torchsave.dtensor import LOCAL, torch_chunk
from ckptctl.formats.verl.layout import MODEL
from ckptctl.model.stored import KeyPath, StoredFile


def held_mesh(files: Iterable[StoredFile], world: int) -> tuple[int, ...] | None:
    """``(world,)`` for one flat FSDP2 mesh, or HSDP's ``(replicas, shard group)`` (rank ``r``
    holds chunk ``r % S`` of each parameter, as ranks ``r`` and ``r + S`` hold the same rows);
    ``None`` where the ranks' rows of their longest parameter fit neither."""
    rows: dict[KeyPath, dict[int, tuple[int, int]]] = {}
    for file in files:
        match = MODEL.fullmatch(file.path)
        if match is None:
            continue
        for tensor in file.tensors:
            if tensor.key and tensor.key[-1] == LOCAL and tensor.pieces:
                piece = tensor.pieces[0]
                box = (piece.canonical[0], piece.sizes[0])
                rows.setdefault(tensor.key, {})[int(match[2])] = box
    if not rows:
        return (world,)
    key = max(rows, key=lambda k: max(start + length for start, length in rows[k].values()))
    held = rows[key]
    total = max(start + length for start, length in held.values())
    for group in (g for g in range(1, world + 1) if world % g == 0):
        chunks = [torch_chunk(total, group, r % group) for r in range(world)]
        if all(held.get(r, (0, 0)) == chunks[r] or chunks[r][1] == 0 for r in range(world)):
            return (world // group, group) if group < world else (world,)
    return None


def describe_mesh(mesh: tuple[int, ...]) -> str:
    if len(mesh) == 1:
        return f"FSDP2 over {mesh[0]} ranks"
    return f"HSDP ({mesh[0]} replicas of {mesh[1]}-rank shard groups)"
