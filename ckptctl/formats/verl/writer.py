"""Writing verl's FSDP files at another world size: a rank's model or optimizer file is the
source rank 0's state dict walked in its order, each DTensor rebuilt on the new mesh with this
rank's chunk (``dtensors``), each plain tensor (Adam's step, a buffer) whole, everything else
(the parameter groups) as it was; a file beside the tensors (extra state, ``huggingface/``) is
copied as it is."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from ckptctl.errors import CheckpointError
from ckptctl.formats.base import WriteJob
from ckptctl.formats.hf_state_dict_files import HfStateDictFiles
from ckptctl.formats.torchsave.archive import TensorRef
from ckptctl.formats.torchsave.dtensor import LOCAL, DTensorRef, torch_chunk
from ckptctl.formats.torchsave.zip_writer import TensorSlot, write_torch_zip
from ckptctl.formats.verl.dtensors import RebuiltDTensor, check_placement, mesh_for, mesh_kept
from ckptctl.formats.verl.layout import MODEL, OPTIM
from ckptctl.io.byte_streams import ByteStream
from ckptctl.io.runs import Run
from ckptctl.model.plan import FileWrite, TensorWrite


def write_verl_file(job: WriteJob, file: FileWrite, out: ByteStream) -> None:
    owner, origin = job.source.owner(job.plan.source_files[file.carry_from or 0])
    if not isinstance(owner, HfStateDictFiles):
        raise CheckpointError(f"{file.path}: verl files are written from a verl checkpoint")
    name = MODEL.fullmatch(file.path) or OPTIM.fullmatch(file.path)
    if name is None:
        raise CheckpointError(f"{file.path}: not a verl rank file (others are copied whole)")
    _RankFile(job, file, owner, origin, int(name[1]), int(name[2])).write(out)


class _RankFile:
    def __init__(
        self,
        job: WriteJob,
        file: FileWrite,
        owner: HfStateDictFiles,
        origin: str,
        world: int,
        rank: int,
    ) -> None:
        self.job, self.file, self.owner, self.origin = job, file, owner, origin
        self.world, self.rank = world, rank
        self.where = owner.storage.describe(origin)
        self.writes: dict[tuple[Any, ...], TensorWrite] = {t.key: t for t in file.tensors}
        self.slots: list[TensorSlot] = []
        self.by_slot: dict[str, TensorWrite] = {}
        self.rank_map: TensorSlot | None = None
        self.mesh: Any = None
        self.shape: tuple[int, ...] = file.mesh
        """The mesh's ranks per dimension: ``(world,)`` or HSDP's ``(replicas, shard group)``."""
        self.built: dict[TensorRef, Any] = {}
        self.placed: dict[TensorRef, tuple[Any, ...]] = {}

    def write(self, out: ByteStream) -> None:
        tree = self.owner.readers[self.origin].tree
        self._find_placed(tree, ())
        rebuilt = self._walk(tree, ())
        missing = sorted(set(self.writes) - {tuple(w.key) for w in self.by_slot.values()}, key=str)
        if missing:
            raise CheckpointError(
                f"{self.where}: holds no {missing[0]} to cut for {self.file.path}"
            )
        self.job.assemble.expect(self.by_slot[s.key] for s in self.slots if s.key in self.by_slot)
        write_torch_zip(out, rebuilt, self.slots, self._produce)

    def _find_placed(self, node: Any, path: tuple[Any, ...]) -> None:
        """Where each written tensor sits: a tied name elsewhere holds the same tensor."""
        if isinstance(node, dict):
            for key, value in node.items():
                self._find_placed(value, (*path, key))
        elif isinstance(node, DTensorRef) and (*path, LOCAL) in self.writes:
            self.placed[node.local] = (*path, LOCAL)
        elif isinstance(node, TensorRef) and path in self.writes:
            self.placed[node] = path

    def _walk(self, node: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(node, dict):
            return type(node)((k, self._walk(v, (*path, k))) for k, v in node.items())
        if isinstance(node, list | tuple) and not any(
            isinstance(v, TensorRef | DTensorRef) for v in node
        ):
            return node  # parameter groups, betas: as they were
        if isinstance(node, DTensorRef | TensorRef):
            local = node.local if isinstance(node, DTensorRef) else node
            if local not in self.built:
                self.built[local] = self._tensor(node, path)
            return self.built[local]  # a tied name: the same object, as torch.save keeps it
        if isinstance(node, list | tuple):
            raise CheckpointError(f"{self.where}: {'/'.join(map(str, path))}: tensors in a list")
        return node

    def _tensor(self, node: DTensorRef | TensorRef, path: tuple[Any, ...]) -> Any:
        local = node.local if isinstance(node, DTensorRef) else node
        key = self.placed.get(local)
        if key is None:
            raise CheckpointError(
                f"{self.where}: {'/'.join(map(str, path))} is not carried to {self.file.path}"
            )
        write = self.writes[key]
        slot = TensorSlot(str(len(self.slots)), write.dtype, write.shape)
        self.slots.append(slot)
        self.by_slot[slot.key] = write
        if not isinstance(node, DTensorRef):
            return slot
        check_placement(node, self.where)
        mesh = self._mesh(node)
        parts = self.shape[-1]  # HSDP: cut over each shard group, as planned
        rows = torch_chunk(node.shape[0], parts, self.rank % parts)[1] if node.shape else 0
        if node.shape and write.shape[0] != rows:
            raise CheckpointError(
                f"{self.where}: {'/'.join(map(str, path))} is planned with {write.shape[0]} "
                f"rows in {self.file.path}, where its mesh gives rank {self.rank} {rows}"
            )
        return RebuiltDTensor(node, slot, mesh, len(self.shape), self.where)

    def _mesh(self, node: DTensorRef) -> Any:
        """This rank's mesh, one per file (every DTensor of an FSDP2 model shares it)."""
        if self.mesh is None:
            template = getattr(node.spec, "_state", {}).get("mesh")
            rank_map = getattr(template, "_state", {}).get("_rank_map")
            dtype = rank_map.dtype if isinstance(rank_map, TensorRef) else "int64"
            self.rank_map = TensorSlot("rank_map", dtype, (self.world,))
            self.slots.append(self.rank_map)
            self.shape = self.shape or mesh_kept(template, self.world, self.where)
            if self.world != math.prod(self.shape):
                raise CheckpointError(
                    f"{self.file.path}: planned on a mesh {self.shape} of another world"
                )
            self.mesh = mesh_for(template, self.shape, self.rank, self.rank_map, self.where)
        return self.mesh

    def _produce(self, slot: TensorSlot) -> Iterator[bytes | memoryview | Run]:
        if slot is self.rank_map:
            import numpy as np  # the ranks 0..world-1, as torch's mesh tensor holds them

            from ckptctl.arrays import numpy_dtype

            yield np.arange(self.world, dtype=numpy_dtype(slot.dtype)).tobytes()
            return
        yield from self.job.assemble.chunks(self.by_slot[slot.key], self.file.path)
