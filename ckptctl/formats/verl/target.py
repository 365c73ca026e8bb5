"""verl's FSDP2 actor / critic files as a target: the same run at another world size or HSDP
shard group (``TargetRequest.shard_group``), for a resume on more or fewer GPUs. Each rank's
model and optimizer files hold its ``Shard(0)`` chunk of every parameter and Adam moment
(``torch.chunk``'s cut over its shard group, as FSDP2 cuts them), the plain tensors whole,
Adam's step and the parameter groups as the source's; each new rank's ``extra_state``
(scheduler, RNG) is the source rank's of the same index modulo the source's world size;
``huggingface/`` and ``fsdp_config.json`` beside them. Cut from the source's tensors by stored
name (``HfStateDictFiles.by_name``). Pure."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ckptctl.errors import UsageError
from ckptctl.formats.target import RESHARD, TargetFormat
from ckptctl.formats.torchsave.dtensor import LOCAL, torch_chunk
from ckptctl.formats.verl.layout import (
    EXTRA,
    FSDP_CONFIG,
    HF_DIR,
    MODEL,
    OPTIM,
    extra_file,
    fsdp_config_text,
    model_file,
    optim_file,
)
from ckptctl.formats.verl.meshes import describe_mesh, held_mesh
from ckptctl.model.geometry import chunk_pieces, whole
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.plan import COPY, FileWrite, TextWrite
from ckptctl.model.stored import (
    CheckpointView,
    StoredFile,
    StoredTensor,
    canonical_shapes,
)
from ckptctl.model.target import TargetFiles, TargetPlanner, TargetRequest

if TYPE_CHECKING:
    from ckptctl.formats.base import Checkpoint
    from ckptctl.formats.hf_state_dict_files import HfStateDictFiles

VERL_FILE = "verl"
"""``FileWrite.kind`` of a verl target file: a rank's model or optimizer file, or a file
carried from the source as it is."""


def _cut(tensor: StoredTensor, shape: tuple[int, ...], world: int, rank: int) -> StoredTensor:
    """Rank ``rank``'s part of a stored tensor: a DTensor's ``Shard(0)`` chunk, or (a plain
    tensor) the whole of it."""
    if not tensor.key or tensor.key[-1] != LOCAL or not shape:
        return StoredTensor(tensor.key, tensor.canonical, shape, tensor.dtype, (whole(shape),))
    start, length = torch_chunk(shape[0], world, rank)
    local = (length, *shape[1:])
    offsets = (start,) + (0,) * (len(shape) - 1)
    pieces = chunk_pieces((whole(shape),), offsets, local) if length else ()
    return StoredTensor(tensor.key, tensor.canonical, local, tensor.dtype, pieces)


def _rank0(source: CheckpointView, pattern: re.Pattern[str]) -> StoredFile | None:
    for file in source.files:
        match = pattern.fullmatch(file.path)
        if match is not None and int(match[2]) == 0:
            return file
    return None


def _refuse_other_placements(ckpt: HfStateDictFiles) -> None:
    """Only FSDP2's ``Shard(0)`` on one mesh dimension and HSDP's replicas of it are recut."""
    from ckptctl.formats.torchsave.dtensor import DTensorRef
    from ckptctl.formats.verl.dtensors import PLACEMENTS

    for path, reader in ckpt.readers.items():
        if MODEL.fullmatch(path) is None or not isinstance(reader.tree, dict):
            continue
        for name, value in reader.tree.items():
            if isinstance(value, DTensorRef) and value.placements not in PLACEMENTS:
                raise UsageError(
                    f"--format verl: {ckpt.storage.describe(path)}: {name} is placed "
                    f"{list(value.placements)}; verl files are written at another world size "
                    "from FSDP2's Shard(0), or HSDP's (Replicate(), Shard(0))"
                )
        return


def mesh_of(source: CheckpointView) -> tuple[int, ...]:
    """The device mesh ``source``'s files were written on (``meshes.held_mesh``)."""
    mesh = held_mesh(source.files, source.layout.dp)
    if mesh is None:
        raise UsageError(
            "--format verl: the source's ranks hold their parameters' rows as no FSDP2 or "
            "HSDP mesh cuts them; it is not written at another world size"
        )
    return mesh


def _shard_group(before: tuple[int, ...], world: int, asked: int | None) -> int:
    """The ranks each parameter is cut over at ``world`` ranks: ``asked`` (``--fsdp-size``),
    else the source's: all ranks for FSDP2, HSDP's shard group kept (more or fewer replicas)."""
    if asked is not None:
        if asked > world or world % asked:
            raise UsageError(
                f"--format verl: --fsdp-size {asked} does not divide the world size {world} "
                "(--dp): HSDP's replicas each hold the whole model in shard groups of that size"
            )
        return asked
    if len(before) == 1:
        return world
    group = before[1]
    if world % group or world == group:
        raise UsageError(
            f"--format verl: --dp {world}: the source is {describe_mesh(before)}, written "
            f"with its shard groups kept: give a world size that is a multiple of {group} "
            f"above it (more or fewer replicas), or set the shard group with --fsdp-size "
            f"({world} for one flat FSDP2 mesh)"
        )
    return group


class VerlTarget(TargetFormat):
    name = "verl"
    operations = (RESHARD,)
    help = (
        "verl FSDP2 actor / critic files at another world size (--dp) or HSDP shard group "
        "(--fsdp-size), to resume from"
    )
    cuts_by_name = True
    meshed = True

    def planner_for(self, ckpt: Checkpoint) -> tuple[Checkpoint, TargetPlanner]:
        from dataclasses import replace

        from ckptctl.formats.hf_state_dict_files import HfStateDictFiles

        if not isinstance(ckpt, HfStateDictFiles) or ckpt.by_name is None:
            raise UsageError(
                f"--format verl: writes a verl FSDP checkpoint at another world size from a "
                f"verl one; {ckpt.storage.url} is {ckpt.view.format}"
            )
        _refuse_other_placements(ckpt)
        view = ckpt.by_name
        mesh = mesh_of(view)  # said on its rank files, as a target's are (``StoredFile.mesh``)
        files = tuple(
            replace(f, mesh=mesh) if MODEL.fullmatch(f.path) or OPTIM.fullmatch(f.path) else f
            for f in view.files
        )
        return replace(ckpt, view=replace(view, files=files)), self

    def target_files(self, source: CheckpointView, request: TargetRequest) -> TargetFiles:
        layout = request.layout or source.layout
        if layout.tp > 1 or layout.pp > 1 or layout.ep > 1 or layout.vpp > 1:
            raise UsageError(
                "--format verl: verl's FSDP files have no tensor, pipeline or expert "
                "parallelism; --dp sets their world size (--format megatron for Megatron "
                "layouts)"
            )
        world = layout.dp
        # planner_for said it on the rank files; a view it did not see is read again
        before = next((f.mesh for f in source.files if f.mesh), ()) or mesh_of(source)
        cut_over = _shard_group(before, world, request.shard_group)
        mesh = (world // cut_over, cut_over) if cut_over < world else (world,)
        hybrid = len(mesh) == 2
        model, optim = _rank0(source, MODEL), _rank0(source, OPTIM)
        if model is None:
            raise UsageError(f"--format verl: {source.format} source without verl's model files")
        shapes = {name: shape for name, (shape, _) in canonical_shapes(source).items()}
        files = []
        extras = {int(m[2]) for f in source.files if (m := EXTRA.fullmatch(f.path))}
        missing = sorted(set(range(source.layout.dp)) - extras)
        if extras and missing:
            raise UsageError(
                f"--format verl: the source has no extra_state of rank(s) {missing} (scheduler "
                "and RNG state): its files are not one run's"
            )
        extra = bool(extras)
        for rank in range(world):
            chunk = rank % cut_over
            cut = tuple(_cut(t, shapes[t.canonical], cut_over, chunk) for t in model.tensors)
            files.append(StoredFile(model_file(world, rank), cut, mesh=mesh))
            if optim is not None:
                cut = tuple(_cut(t, shapes[t.canonical], cut_over, chunk) for t in optim.tensors)
                files.append(StoredFile(optim_file(world, rank), cut, mesh=mesh))
            if extra:
                files.append(StoredFile(extra_file(world, rank), ()))
        files += [StoredFile(f.path, ()) for f in source.files if f.path.startswith(f"{HF_DIR}/")]
        how = "set by --fsdp-size" if request.shard_group else "the source's shard groups kept"
        return TargetFiles(
            files=tuple(files),
            kind=VERL_FILE,
            layout=ParallelLayout(dp=world),
            reason=f"verl FSDP2 files of {world} ranks: each parameter and Adam moment cut "
            f"on its first dimension as FSDP2 cuts it, {describe_mesh(mesh)}",
            finalize=(TextWrite(path=FSDP_CONFIG, content=fsdp_config_text(world)),),
            optimizer_carried=optim is not None,
            notes=(
                f"device mesh: {describe_mesh(before)} -> {describe_mesh(mesh)}"
                + (f" ({how}: verl's fsdp_size {cut_over})" if hybrid or len(before) == 2 else ""),
                *(
                    (
                        f"extra_state of each new rank: the source rank's of the same index "
                        f"modulo {source.layout.dp} (scheduler and RNG state)",
                    )
                    if extra and world != source.layout.dp
                    else ()
                ),
            ),
        )

    def with_source_state(
        self, source: CheckpointView, files: tuple[FileWrite, ...], layout: ParallelLayout
    ) -> tuple[tuple[FileWrite, ...], int]:
        """Each file names the source file it is made from: rank 0's model or optimizer file
        (its DTensors' spec, the parameter groups); or it is a copy of the extra state of the
        rank it carries, or of the same file beside the tensors."""
        index = {f.path: i for i, f in enumerate(source.files)}
        world = source.layout.dp
        out = []
        for file in files:
            if MODEL.fullmatch(file.path):
                origin = model_file(world, 0)
            elif OPTIM.fullmatch(file.path):
                origin = optim_file(world, 0)
            else:  # carried as it is (the executor's byte copy): extra state, huggingface/
                extra = EXTRA.fullmatch(file.path)
                origin = extra_file(world, int(extra[2]) % world) if extra else file.path
                out.append(file.model_copy(update={"kind": COPY, "copy_of": index[origin]}))
                continue
            out.append(file.model_copy(update={"carry_from": index[origin]}))
        return tuple(out), 0
