"""Reading Megatron-Core ``torch_dist`` checkpoints: DCP records whose layer-stacked keys are
boxes of the canonical tensors, with ``args`` and training state in ``common.pt``."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from ckptctl.errors import CheckpointError, CheckpointNotFoundError, LayoutError
from ckptctl.formats.dcp_container.files import (
    chunks_placed,
    files_of,
    join,
    merge_metadata,
    read_metadata,
)
from ckptctl.formats.dcp_container.metadata import BytesEntry, DcpMetadata, StorageInfo, TensorEntry
from ckptctl.formats.dcp_container.records import RecordWindow, open_record
from ckptctl.formats.megatron_common.args import (
    check_saved_layout,
    checked_iteration,
    grad_reduce_dtype,
    layout_from_args,
    naming_from_args,
    spec_from_args,
)
from ckptctl.formats.megatron_common.distopt_layout import DP_RESHARDABLE_PREFIX, is_bucket_key
from ckptctl.formats.megatron_common.iterations import COMMON
from ckptctl.formats.megatron_common.sharded_keys import (
    chunk_parts,
    dense_optimizer,
    model_catalog,
)
from ckptctl.formats.megatron_common.target_style import expert_naming_from_args
from ckptctl.formats.torch_dist import dp_reshardable
from ckptctl.formats.torch_dist.bridge_config import RUN_CONFIG, args_from_model, ddp_args, sections
from ckptctl.formats.torch_dist.checkpoint import TorchDistCheckpoint
from ckptctl.formats.torch_dist.lora_shards import BRIDGE_ADAPTER, bridge_lora
from ckptctl.formats.torch_dist.model_space import FORM, flattened_parts, model_space_box
from ckptctl.formats.torchsave.archive import TensorRef, TorchZipReader
from ckptctl.io.storage import Storage
from ckptctl.model.catalog import Naming
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.megatron_style import OptimizerLayout
from ckptctl.model.stored import CheckpointView, Format, StoredTensor


def _common_state(
    storage: Storage, base: str, metadata: DcpMetadata, described: bool = False
) -> tuple[dict[str, Any], float | None, dict[int, Any]]:
    """``common.pt`` (or its byte item), the torch optimizer's ``common_step``, if any, and the
    values of the small tensors the optimizer's entry holds (a grad scaler's loss scale), read
    while the archive is open: they are carried to a target as they are."""
    rel = join(base, COMMON)
    step = None
    tensors: dict[int, Any] = {}
    if storage.exists(rel):
        with storage.open_read(rel) as f:
            reader = TorchZipReader(f, storage.describe(rel))
            tree, step, tensors = _common_parts(reader.tree, reader)
    elif (info := metadata.storage.get(("common_state/shard_0_1", None))) is not None:
        # Megatron-Core >= 0.19 keeps it as a byte item.
        with _object_record(storage, base, info) as (tree, record):
            tree, step, tensors = _common_parts(tree, record)
    else:
        raise CheckpointNotFoundError(
            f"{storage.describe(rel)}: missing; a torch_dist checkpoint keeps its args there"
        )
    if described and isinstance(tree, dict):
        return tree, step, tensors  # the model described beside it (verl's, Megatron-Bridge's)
    if not isinstance(tree, dict) or not isinstance(tree.get("args"), argparse.Namespace):
        raise CheckpointError(
            f"{storage.describe(rel)}: no 'args' namespace, which Megatron-LM saves and ckptctl "
            f"reads the model from, and no Megatron-Bridge {RUN_CONFIG} beside it; a verl "
            "Megatron actor's dist_ckpt is read from its actor directory (beside "
            "huggingface/config.json): give that directory"
        )
    return tree, step, tensors


def _parts_state(
    storage: Storage, parts: tuple[str, ...]
) -> tuple[DcpMetadata, tuple[dict[str, Any], float | None, dict[int, Any]]]:
    """The records of ``parts`` as one checkpoint's, and their common states as one."""
    each = [(part, read_metadata(storage, part)) for part in parts]
    common: dict[str, Any] = {}
    step: float | None = None
    tensors: dict[int, Any] = {}
    for part, part_metadata in each:
        tree, part_step, part_tensors = _common_state(storage, part, part_metadata, described=True)
        tree = tree if isinstance(tree, dict) else {}
        if clash := sorted(set(common) & set(tree)):
            raise CheckpointError(
                f"{storage.describe(join(part, COMMON))}: holds {clash[0]!r} too; the parts of "
                "one state dict cannot share keys"
            )
        common.update(tree)
        step = part_step if step is None else step
        tensors.update(part_tensors)
    return merge_metadata(storage, each, own="common_state"), (common, step, tensors)


def _common_parts(tree: Any, reader: Any) -> tuple[Any, float | None, dict[int, Any]]:
    """The common state, its ``common_step`` (if any) and its optimizer's small tensors, read
    while ``reader`` is open."""
    ref = _common_step_ref(tree)
    step = reader.read_number(ref) if isinstance(ref, TensorRef) else None
    return tree, step, _small_tensors(tree, reader)


@contextmanager
def _object_record(storage: Storage, base: str, info: StorageInfo) -> Iterator[tuple[Any, Any]]:
    """A pickled object of the DCP files (Megatron saves each as a one-element list) and its
    record's reader, for the tensors inside, while the file is open."""
    item = join(base, info.relative_path)
    with storage.open_read(item) as f:
        window = RecordWindow(f, info.offset, info.length)
        record = open_record(window, info, storage.describe(item), checks=storage.checks)
        tree = record.tree
        yield (tree[0] if isinstance(tree, list) and tree else tree), record


@dataclass(frozen=True)
class Described:
    """A ``torch_dist`` checkpoint's model and run, described by files saved beside it rather
    than by ``args`` inside it: ``args`` built from them, the iteration, what was read."""

    args: argparse.Namespace
    iteration: int | None
    notes: tuple[str, ...]
    grad_buffers: bool = False
    """The files record how the grad buffers were laid out (Megatron-Bridge's ``ddp``
    section), so ``dp_reshardable`` optimizer state can be placed."""
    parts: tuple[str, ...] = ()
    """``torch_dist`` directories one state dict was saved to apart (verl's model and
    optimizer), relative to the checkpoint's root: read as one."""
    warnings: tuple[str, ...] = ()
    lora: bool = False
    """Trained with Megatron-Bridge's LoRA (verl's ``backend.peft``): its adapter's keys are
    held apart (``Checkpoint.adapter``), the rest is the base."""


DEPRECATED_FORMS = ("dp_zero_gather_scatter", "fully_sharded_bucket_space")
"""Distributed-optimizer forms older than ``fully_sharded_model_space``: one pickled object per
data-parallel group, or buckets without the layout to place them."""


SMALL_TENSOR = 1 << 16
"""Elements of the largest tensor of the common state's optimizer entry read with it."""


def _small_tensors(tree: dict[str, Any], reader: Any) -> dict[int, Any]:
    """Values of the tensors inside ``tree``'s optimizer entry, by the identity of their
    reference (the tree keeps the references alive)."""
    found: dict[int, Any] = {}
    _read_small(tree.get("optimizer") if isinstance(tree, dict) else None, reader, found)
    return found


def _read_small(node: Any, reader: Any, found: dict[int, Any]) -> None:
    if isinstance(node, TensorRef):
        if node.numel <= SMALL_TENSOR:
            found[id(node)] = reader.read(node)
    elif isinstance(node, dict):
        for value in node.values():
            _read_small(value, reader, found)
    elif isinstance(node, list | tuple):
        for value in node:
            _read_small(value, reader, found)


def _common_step_ref(tree: Any) -> Any:
    """megatron-core's per-parameter optimizers keep Adam's step once, as ``common_step``
    (under ``optimizer``, or under ``optimizer[i]`` for a chained dense + expert optimizer; one
    level deeper, under ``optimizer``, for the mixed-precision wrapper of a bf16/fp16 run)."""
    optimizer = dense_optimizer(tree.get("optimizer") if isinstance(tree, dict) else None)
    if "state" not in optimizer and isinstance(optimizer.get("optimizer"), dict):
        optimizer = optimizer["optimizer"]
    state = optimizer.get("state")
    return state.get("common_step") if isinstance(state, dict) else None


def probe_torch_dist(
    storage: Storage,
    base: str,
    iteration: int | None,
    true_vocab_size: int | None,
    trusted: frozenset[str] = frozenset(),
    described: Described | None = None,
    metadata: DcpMetadata | None = None,
) -> TorchDistCheckpoint:
    """``described``: the model and the run as saved beside a checkpoint whose common state
    holds no Megatron-LM ``args`` (verl's Megatron actor), in ``args``' terms; its ``parts``,
    the directories under ``base`` one state dict was saved to apart, are read as one.
    ``metadata``: ``base``'s ``.metadata``, if the caller has read it already."""
    if described is not None and described.parts:
        metadata, (common, common_step, common_tensors) = _parts_state(storage, described.parts)
        bridge = False
    else:
        metadata = metadata or read_metadata(storage, base)
        bridge = described is None and storage.exists(join(base, RUN_CONFIG))
        common, common_step, common_tensors = _common_state(
            storage, base, metadata, described is not None or bridge
        )
    if bridge and not isinstance(common.get("args"), argparse.Namespace):
        described = _bridge_run(storage, base, common)
    args = common["args"] if described is None else _with_optimizer(described.args, common)
    try:
        spec = spec_from_args(args, true_vocab_size, trusted)
    except LayoutError as err:
        if not bridge:
            raise
        where = storage.describe(join(base, RUN_CONFIG))  # its fields, by their names there
        raise LayoutError(
            [f"{where}: {p.replace('args.', 'model.')}" for p in err.problems]
        ) from None
    layout = layout_from_args(args)
    where = storage.describe(join(base, COMMON))
    check_saved_layout(args, spec, layout, where)
    if described is not None:
        saved_iteration = described.iteration
    else:
        number = _directory_number(base)
        saved_iteration = checked_iteration(common.get("iteration"), where, number)
    catalog = model_catalog(spec)
    notes: list[str] = list(described.notes) if described is not None else []
    warnings: list[str] = list(described.warnings) if described is not None else []
    placed: list[tuple[StorageInfo, StoredTensor]] = []
    adapter: list[tuple[StorageInfo, StoredTensor]] = []
    unknown: list[str] = []
    objects: set[str] = set()
    buckets: dict[str, TensorEntry] = {}
    sharding = dense_optimizer(common.get("optimizer")).get("param_state_sharding_type")
    if sharding in DEPRECATED_FORMS:
        # Unverified against a writer here: taking them for dp_reshardable buckets could misplace
        # values, so they are left out, said plainly.
        warnings.append(
            f"optimizer state is {sharding}, an older form of megatron-core's that ckptctl does "
            "not read: only the weights can be taken from it (to keep Adam's state, load it with "
            "the release that wrote it and save it as fully_sharded_model_space)"
        )
    model_space = sharding == FORM
    for fqn, entry in metadata.entries.items():
        if isinstance(entry, BytesEntry):
            if not fqn.startswith("common_state"):
                objects.add(fqn.split("/")[0].rsplit(".", 1)[-1])
            continue
        if described is not None and described.lora and BRIDGE_ADAPTER in fqn:
            adapter.extend(chunks_placed(metadata, fqn, entry, fqn))
            continue
        if is_bucket_key(fqn):
            if sharding not in DEPRECATED_FORMS:
                buckets[fqn] = entry
            continue
        flattened = model_space_box(fqn, entry, metadata) if model_space else None
        for chunk in entry.chunks:
            if flattened is None:
                parts = chunk_parts(fqn, chunk.offsets, chunk.sizes, catalog)
            else:
                parts = flattened_parts(fqn, flattened, chunk.offsets, chunk.sizes, catalog)
            if parts is None:
                unknown.append(fqn)
                break
            info = metadata.storage[(fqn, chunk.offsets)]
            placed.extend(
                (
                    info,
                    StoredTensor(
                        (fqn, *chunk.offsets),
                        part.canonical,
                        part.shape,
                        entry.dtype,
                        part.pieces,
                        part.view_offset,
                        padded_origin=part.padded_origin,
                    ),
                )
                for part in parts
            )
    if unknown:
        adapters = any(".adapter.linear_" in fqn for fqn in unknown)
        raise CheckpointError(
            f"{storage.describe(base)}: tensors {', '.join(sorted(set(unknown))[:5])} are not "
            f"parameters of the model its args describe ({spec.num_layers} layers, hidden "
            f"{spec.hidden_size})",
            hint=(
                "they are Megatron-Bridge's LoRA adapters (verl's Megatron LoRA saved with "
                "dist checkpointing), not read from here: merge the actor's adapter_checkpoint/ "
                "into the model the run started from with ckptctl merge-lora BASE ACTOR DST "
                "--lora-alpha A"
                if adapters
                else "is this the checkpoint the args (or config) describe?"
            ),
        )
    optimizer = dense_optimizer(common.get("optimizer"))
    if model_space:
        notes.append(
            "optimizer state is fully_sharded_model_space (megatron-core <= 0.14): its N-D "
            "flattened boxes are read as the parameters they flatten"
        )
    if buckets and described is not None and not described.grad_buffers:
        warnings.append(
            "optimizer state is dp_reshardable, whose buckets follow the run's DDP settings, "
            "which this checkpoint does not record: only the weights can be taken from it"
            + (
                " (Megatron-Bridge saves Adam's state readably with "
                "checkpoint.dist_ckpt_optim_fully_reshardable: true)"
                if bridge
                else " (verl saves Adam's state readably with the actor's "
                "megatron.dist_ckpt_optim_fully_reshardable: true)"
            )
        )
    elif buckets:
        weight_dtype = next(t.dtype for _, t in placed if "/" not in t.canonical)
        try:
            mapped = place_buckets(buckets, spec, layout, args, weight_dtype)
        except CheckpointError as err:
            warnings.append(
                f"optimizer state is dp_reshardable and could not be mapped ({err}): only the "
                "weights can be taken from it"
            )
        else:
            placed += [(metadata.storage[(str(t.key[0]), (int(t.key[1]),))], t) for t in mapped]
            objects -= {"optimizer", "per_bucket_numel", "per_bucket_numel_unpadded"}
            notes.append(
                "optimizer state is dp_reshardable: its grad-buffer buckets are mapped by "
                "replaying Megatron's buffer layout"
            )
            # The parameter groups (and Adam's step) are kept beside the buckets: where the
            # other forms keep them, so that every reader of ``common`` finds them there.
            common["optimizer"], taken = _with_bucket_param_groups(
                common.get("optimizer"), storage, base, metadata, common_tensors
            )
            objects -= taken
            optimizer = dense_optimizer(common["optimizer"])
    elif sharding == "dp_reshardable":
        warnings.append(
            "optimizer state is dp_reshardable, but the checkpoint holds no bucket tensors: "
            "only the weights can be taken from it"
        )
    has_optimizer = any(t.canonical.startswith("exp_avg/") for _, t in placed)
    if objects:
        # Pickled objects (RNG state, TransformerEngine FP8 metadata) have no reshardable form.
        warnings.append(f"not carried: {', '.join(sorted(objects))} (pickled objects)")
    step = _optimizer_step(optimizer) if common_step is None else common_step
    view = CheckpointView(
        Format.TORCH_DIST,
        spec,
        layout,
        files_of(base, placed),
        iteration if iteration is not None else saved_iteration,
        has_optimizer,
        tuple(notes),
        optimizer_step=step if has_optimizer else None,
        warnings=tuple(warnings),
    )
    lora = None
    if described is not None and described.lora:
        lora = bridge_lora(files_of(base, adapter), spec, storage.describe(base))
    return TorchDistCheckpoint(
        storage,
        replace(view, notes=(*view.notes, *lora.notes)) if lora else view,
        base,
        metadata,
        adapter=lora.adapter if lora else None,
        args=args,
        common=common,
        common_tensors=common_tensors,
    )


def _with_optimizer(args: argparse.Namespace, common: dict[str, Any]) -> argparse.Namespace:
    """Described ``args`` saying whether the distributed optimizer ran: its saved state
    names its sharding."""
    sharding = dense_optimizer(common.get("optimizer")).get("param_state_sharding_type")
    return argparse.Namespace(**{**vars(args), "use_distributed_optimizer": sharding is not None})


def _bridge_run(storage: Storage, base: str, common: dict[str, Any]) -> Described:
    """A Megatron-Bridge checkpoint's run, from its ``run_config.yaml`` (``bridge_config``)."""
    where = storage.describe(join(base, RUN_CONFIG))
    config = sections(storage.read_text(join(base, RUN_CONFIG)), where)
    model = config["model"]
    args = args_from_model(model, where)
    ddp = ddp_args(config)
    for name, value in (ddp or {}).items():
        setattr(args, name, value)
    number = _directory_number(base)
    iteration = checked_iteration(
        common.get("iteration"), storage.describe(join(base, COMMON)), number
    )
    note = f"Megatron-Bridge checkpoint: the model from {RUN_CONFIG} ({model.get('_target_')})"
    return Described(args, iteration, (note,), grad_buffers=ddp is not None)


def _directory_number(base: str) -> int | None:
    """The iteration an ``iter_0000123`` directory is named for (``None`` for another)."""
    name = base.rstrip("/").rsplit("/", 1)[-1]
    digits = name.removeprefix("iter_")
    return int(digits) if name.startswith("iter_") and digits.isdigit() else None


def _optimizer_step(optimizer: dict[str, Any]) -> float | None:
    groups = (optimizer.get("optimizer") or {}).get("param_groups") if optimizer else None
    if isinstance(groups, list) and groups and isinstance(groups[0], dict):
        step = groups[0].get("step")
        return float(step) if step is not None else None
    return None


def place_buckets(
    buckets: dict[str, TensorEntry],
    spec: ModelSpec,
    layout: ParallelLayout,
    args: argparse.Namespace,
    weight_dtype: str,
) -> list[StoredTensor]:
    """The ``dp_reshardable`` bucket tensors placed by the grad-buffer layout ``args`` give."""
    optimizer = OptimizerLayout(
        states=(),
        distributed=True,
        overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
        bucket_size=getattr(args, "ddp_bucket_size", None),
        grad_dtype=grad_reduce_dtype(args),
        chained=any(fqn.startswith("chained_") for fqn in buckets),
    )
    naming = naming_from_args(args) or Naming.TE
    return dp_reshardable.place(
        buckets, spec, layout, optimizer, weight_dtype, naming, expert_naming_from_args(args)
    )


def _with_bucket_param_groups(
    common_optimizer: Any,
    storage: Storage,
    base: str,
    metadata: DcpMetadata,
    tensors: dict[int, Any],
) -> tuple[Any, set[str]]:
    """``common``'s optimizer entry with each (sub-)optimizer's parameter groups and what
    Megatron's wrapper keeps beside them (a grad scaler), as the other forms keep them:
    ``dp_reshardable`` state keeps them as objects beside the buckets instead. Also the names
    of the objects so taken; their small tensors' values go into ``tensors``."""
    chained = isinstance(common_optimizer, dict) and 0 in common_optimizer
    entries = common_optimizer if chained else {None: common_optimizer}
    out: dict[Any, Any] = {}
    taken: set[str] = set()
    for sub, entry in entries.items():
        prefix = "" if sub is None else f"chained_{sub}."
        objects = _bucket_objects(storage, base, metadata, prefix, tensors)
        entry = entry if isinstance(entry, dict) else {}
        inner = objects.pop("optimizer", None)
        groups = inner.get("param_groups") if isinstance(inner, dict) else None
        if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
            entry = {**entry, "optimizer": {"param_groups": groups}, **objects}
            taken |= {"optimizer", *objects}
        out[sub] = entry
    return (out if chained else out[None]), taken


BESIDE_BUCKETS = ("per_bucket_numel", "per_bucket_numel_unpadded")
"""Objects kept beside the buckets that describe them (read by the layout replay's checks)."""


def _bucket_objects(
    storage: Storage, base: str, metadata: DcpMetadata, prefix: str, tensors: dict[int, Any]
) -> dict[str, Any]:
    """The objects kept beside one sub-optimizer's buckets (model-parallel rank 0's: they are
    the same on every rank), by name: the torch optimizer's state dict without its state, and
    whatever else Megatron's wrapper keeps (a grad scaler)."""
    name = f"{prefix}{DP_RESHARDABLE_PREFIX}dp_group_idx_0."
    out: dict[str, Any] = {}
    for (fqn, offsets), info in metadata.storage.items():
        if offsets is not None or not fqn.startswith(name):
            continue
        key = fqn[len(name) :].split("/", 1)[0]
        if "." in key or key in BESIDE_BUCKETS or key.startswith("gbuf_idx_"):
            continue
        with _object_record(storage, base, info) as (tree, record):
            _read_small(tree, record, tensors)
        out[key] = tree
    return out
