"""Writing DCP outputs: ``.distcp`` shards record by record, then the files that describe them
(``.metadata``; for ``torch_dist`` also ``common.pt``), and single-file state dicts.

Record offsets are known only once a shard is written, so the executor collects them per file
(and keeps them in the run log, so a resumed job can describe shards it did not rewrite);
``.metadata`` is built from them after the last shard, before anything says "complete".
"""

from __future__ import annotations

import io
import posixpath
import struct
from collections.abc import Iterator
from functools import cache
from math import prod
from typing import Any

from ckptctl.formats.base import WriteJob, adam_step
from ckptctl.formats.dcp_container.metadata import (
    METADATA_FILE,
    BytesEntry,
    Chunk,
    DcpMetadata,
    StorageInfo,
    TensorEntry,
)
from ckptctl.formats.dcp_container.write import (
    metadata_bytes,
    write_bytes_record,
    write_tensor_record,
)
from ckptctl.formats.megatron_common.distopt_layout import is_bucket_key
from ckptctl.formats.megatron_common.iterations import COMMON
from ckptctl.formats.megatron_common.sharded_keys import model_catalog, record_geometry, split_key
from ckptctl.formats.megatron_common.training_state import group_template, training_state
from ckptctl.formats.torch_dist.dp_reshardable_targets import bucket_groups
from ckptctl.formats.torch_dist.extra_state import extra_state_keys, mtp_extra_state_keys
from ckptctl.formats.torch_dist.model_space import is_model_space_key
from ckptctl.formats.torchsave.zip_writer import TensorSlot, write_torch_zip
from ckptctl.io.byte_streams import ByteStream
from ckptctl.io.runs import Run
from ckptctl.model.catalog import Stage, parameters
from ckptctl.model.dtypes import DTYPES
from ckptctl.model.geometry import Shape
from ckptctl.model.plan import FileWrite, Plan, TensorWrite

Record = list[Any]
"""``[fqn, chunk offsets, byte offset, length]``."""


def write_dcp_shard(job: WriteJob, file: FileWrite, out: ByteStream) -> None:
    """Each tensor of ``file`` as one ``torch.save`` record, streamed band by band; where each
    record lies goes to the report (``.metadata`` is built from it after the last shard)."""
    plan, assemble = job.plan, job.assemble
    name = posixpath.basename(file.path)
    records: list[Record] = []
    assemble.expect(file.tensors)
    for tensor in file.tensors:
        fqn, offsets = str(tensor.key[0]), [int(k) for k in tensor.key[1:]]
        shape = tensor.shape
        if plan.spec is not None:
            _, shape = _record_geometry(plan, tensor)
        slot = TensorSlot("0", tensor.dtype, shape)

        def produce(_: TensorSlot, t: Any = tensor) -> Iterator[memoryview | Run]:
            # A layer chunk is assembled without its leading dimension of 1: same bytes.
            return assemble.chunks(t, file.path)

        info = write_tensor_record(out, name, slot, produce)
        records.append([fqn, offsets, info.offset, info.length])
    if plan.spec is not None and file.rank is not None and file.rank[0] == 0:
        layers = _layers_in(plan.spec, file)
        experts = plan.target_layout.local_experts(plan.spec, file.ep_rank)
        extra = extra_state_keys(plan.spec, layers, experts, dense=file.ep_rank == 0)
        if _holds_mtp(plan.spec, file):
            extra += mtp_extra_state_keys(plan.spec, experts, dense=file.ep_rank == 0)
        for fqn in extra:
            info = write_bytes_record(out, name, _empty_extra_state())
            records.append([fqn, None, info.offset, info.length])
    for fqn, content in bucket_objects(job, file):
        info = write_bytes_record(out, name, content)
        records.append([fqn, None, info.offset, info.length])
    job.report.records[file.path] = records


def _record_geometry(plan: Plan, tensor: TensorWrite) -> tuple[Shape, Shape]:
    """Global shape of the tensor ``tensor`` is a chunk of, and the chunk's record shape: a
    parameter's range of a dp_reshardable bucket is stored flat, in a bucket of its
    ``base_shape``; any other chunk as ``record_geometry`` says."""
    fqn = str(tensor.key[0])
    if is_bucket_key(fqn) and tensor.base_shape:
        return tensor.base_shape, (prod(tensor.shape),)
    if split_key(fqn)[0] is not None and tensor.base_shape:
        # One box of an N-D flattened key: fragment index, then the box's elements flat.
        return tensor.base_shape, (*(1,) * (len(tensor.base_shape) - 1), prod(tensor.shape))
    return record_geometry(fqn, tensor.canonical, tensor.shape, plan.model(), plan.target_layout.tp)


def bucket_objects(job: WriteJob, file: FileWrite) -> list[tuple[str, bytes]]:
    """What Megatron keeps beside the dp_reshardable buckets of each model-parallel rank whose
    buckets ``file`` holds: the torch optimizer's parameter groups, and the bucket sizes its
    loader checks (padded and not), each pickled as Megatron's ``ShardedObject`` saves it."""
    sizes = [
        (str(t.key[0]), t.base_shape[0])
        for t in file.tensors
        if t.base_shape and is_bucket_key(str(t.key[0]))
    ]
    if not sizes:
        return []
    plan = job.plan
    state = training_state(job, plan.files[0])
    step = adam_step(state.owner)
    out = []
    for group in bucket_groups(sizes, plan.target_layout):
        kinds, experts = _sub_optimizer_kinds(plan, group.sub)
        entry = _optimizer_entry(state, kinds, step, experts=experts, distributed=True)
        # Megatron keeps each item of the wrapper's state dict (the torch optimizer's groups, a
        # grad scaler) as an object beside the buckets, and the bucket sizes.
        extra = {
            k: v for k, v in entry.items() if k not in ("optimizer", "param_state_sharding_type")
        }
        objects = {
            "optimizer": {"param_groups": entry["optimizer"]["param_groups"]},
            **extra,
            "per_bucket_numel": [_by_dtype(*b) for b in group.padded],
            "per_bucket_numel_unpadded": [_by_dtype(*b) for b in group.unpadded],
        }
        for name, value in objects.items():
            buf = io.BytesIO()
            slots = _carried_in(value, state)
            write_torch_zip(buf, [value], slots, _carried(state))
            out.append((f"{group.prefix}{name}/shard_0_1", buf.getvalue()))
    return out


def _by_dtype(dtype_key: str, sizes: tuple[int, ...]) -> dict[tuple[Any, ...], list[int]]:
    """``{(param dtype, grad dtype): [bucket sizes]}``, the dtypes as torch's."""
    return {tuple(DTYPES[name] for name in dtype_key.split("|")): list(sizes)}


def _sub_optimizer_kinds(plan: Plan, sub: int) -> tuple[tuple[bool, ...], bool]:
    """The parameter-group kinds (no weight decay or not) of sub-optimizer ``sub``."""
    if sub == 0:
        return (False, True), False
    experts = [p for p in parameters(plan.model()) if not p.buffer and p.expert is not None]
    return tuple(sorted({p.no_weight_decay for p in experts})), True


def _layers_in(spec: Any, file: FileWrite) -> list[int]:
    catalog = model_catalog(spec)
    layers = {catalog[t.canonical.split("/", 1)[-1]].layer for t in file.tensors}
    return sorted(layer for layer in layers if layer is not None)


def _holds_mtp(spec: Any, file: FileWrite) -> bool:
    catalog = model_catalog(spec)
    return any(catalog[t.canonical.split("/", 1)[-1]].stage is Stage.MTP for t in file.tensors)


@cache
def _empty_extra_state() -> bytes:
    """What Megatron-Core saves for a layer's ``_extra_state`` without FP8 metadata:
    ``torch.save([None])``."""
    buf = io.BytesIO()
    write_torch_zip(buf, [None], [], lambda _: iter(()))
    return buf.getvalue()


def _carried(state: Any, step: float | None = None) -> Any:
    def produce(slot: TensorSlot) -> Iterator[memoryview]:
        if slot is COMMON_STEP:
            yield memoryview(struct.pack("<f", step))
        else:
            yield state.carried_bytes(slot)

    return produce


def _carried_in(tree: Any, state: Any) -> list[TensorSlot]:
    """The carried tensors ``tree`` holds (the slots of what it keeps, by key)."""
    keys: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, TensorSlot):
            keys.add(node.key)
        elif isinstance(node, dict):
            for value in node.values():
                visit(value)
        elif isinstance(node, list | tuple):
            for value in node:
                visit(value)

    visit(tree)
    return [slot for slot in state.carried_slots() if slot.key in keys]


def _holds(tree: Any, slot: TensorSlot) -> bool:
    if tree is slot:
        return True
    if isinstance(tree, dict):
        return any(_holds(v, slot) for v in tree.values())
    return isinstance(tree, list | tuple) and any(_holds(v, slot) for v in tree)


def fp32_weights(plan: Plan) -> bool:
    """Whether the target's weights are fp32 (Megatron's ``FP32Optimizer``: no separate
    masters) rather than bf16/fp16 (the mixed-precision wrapper, fp32 masters)."""
    return all(
        t.dtype == "float32" for f in plan.files for t in f.tensors if "/" not in t.canonical
    )


def dcp_metadata(plan: Plan, records: dict[str, list[Record]]) -> DcpMetadata:
    """``.metadata`` contents for the shards of ``plan``: every chunk, where its record is."""
    chunks: dict[str, list[Chunk]] = {}
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    storage: dict[tuple[str, tuple[int, ...] | None], StorageInfo] = {}
    objects: dict[str, BytesEntry] = {}
    flattened: dict[str, Shape] = {}
    for file in plan.files:
        by_key = {(r[0], tuple(r[1])): r for r in records.get(file.path, []) if r[1] is not None}
        name = posixpath.basename(file.path)
        for tensor in file.tensors:
            fqn, offsets = str(tensor.key[0]), tuple(int(k) for k in tensor.key[1:])
            global_shape, sizes = _record_geometry(plan, tensor)
            shapes[fqn] = (global_shape, tensor.dtype)
            if split_key(fqn)[0] is not None and tensor.base_shape and not is_bucket_key(fqn):
                flattened[fqn] = record_geometry(
                    fqn, tensor.canonical, tensor.shape, plan.model(), plan.target_layout.tp
                )[0]
            chunks.setdefault(fqn, []).append(Chunk(offsets=offsets, sizes=sizes))
            _, _, offset, length = by_key[(fqn, offsets)]
            storage[(fqn, offsets)] = StorageInfo(relative_path=name, offset=offset, length=length)
        for fqn, offsets, offset, length in records.get(file.path, []):
            if offsets is None:  # a byte item
                objects[fqn] = BytesEntry()
                storage[(fqn, None)] = StorageInfo(relative_path=name, offset=offset, length=length)
    entries: dict[str, TensorEntry | BytesEntry] = {
        fqn: TensorEntry(dtype=shapes[fqn][1], shape=shapes[fqn][0], chunks=tuple(chunks[fqn]))
        for fqn in chunks
    }
    entries.update(objects)
    if not flattened:
        return DcpMetadata(entries=entries, storage=storage)
    # fully_sharded_model_space: its loader looks every key up, the flattened ones' shapes too.
    mcore: dict[str, dict[str, Shape]] = {fqn: {} for fqn in chunks} | {
        fqn: {"nd_reformulated_orig_global_shape": shape} for fqn, shape in flattened.items()
    }
    return DcpMetadata(entries=entries, storage=storage, mcore_data=mcore)


def _optimizer_entry(
    state: Any,
    kinds: tuple[bool, ...],
    step: float | None,
    experts: bool = False,
    *,
    distributed: bool = True,
    fp32_weights: bool = False,
    form: str = "fully_reshardable",
) -> dict[str, Any]:
    """One optimizer's common state: its parameter groups (weight-decay group first).

    The distributed optimizer (``fully_reshardable``) keeps Adam's step per group. Megatron's
    other optimizers keep it once, as a tensor ``common_step`` beside the per-parameter state
    (``COMMON_STEP``): ``FP32Optimizer`` as torch's state dict itself, the mixed-precision
    wrapper under ``optimizer`` (its fp32 masters are the ``fp32_param`` tensors). What the
    source's wrapper kept beside the torch optimizer (a grad scaler) is carried as it was."""
    extra = dict(state.carried.get("optimizer_extra") or {})
    groups = []
    for no_decay in kinds:
        if no_decay in state.templates:
            group = group_template(state.templates, no_decay, experts)
        else:
            group = {"wd_mult": 0.0 if no_decay else 1.0, "lr_mult": 1.0}
        if step is not None and distributed:
            group["step"] = step
        group.pop("params", None)  # the loading optimizer's own (Megatron merges them in)
        groups.append(group)
    if distributed:
        return {
            "optimizer": {"param_groups": groups},
            "param_state_sharding_type": form,
            **extra,
        }
    torch_state: dict[str, Any] = {"state": {}, "param_groups": groups}
    if step is not None:
        torch_state["state"]["common_step"] = COMMON_STEP
    return torch_state if fp32_weights else {"optimizer": torch_state, **extra}


COMMON_STEP = TensorSlot("common_step", "float32", ())
"""Adam's step of a non-distributed optimizer, as torch keeps it (a float32 scalar tensor)."""


def common_state(plan: Plan, state: Any) -> dict[str, Any]:
    """``common.pt`` of a torch_dist checkpoint: args, counters, scheduler, and the optimizer's
    parameter groups with ``fully_reshardable`` per-parameter state."""
    args = state.args
    args.ckpt_format = "torch_dist"
    # No RNG state is written (it is per rank of the grid it was saved in): said so, as a run
    # saved with --no-save-rng says it, so that Megatron-LM's loader does not ask for it.
    args.no_save_rng = True
    carried = {k: v for k, v in state.carried.items() if k != "optimizer_extra"}
    tree: dict[str, Any] = {"args": args, **carried}
    has_optimizer = any(t.canonical.startswith("exp_avg/") for f in plan.files for t in f.tensors)
    content: dict[str, Any] = {"singleton_local_shards": False}
    if has_optimizer:
        step = adam_step(state.owner)
        form: dict[str, Any] = {
            "distributed": plan.target_layout.distributed_optimizer,
            "fp32_weights": fp32_weights(plan),
            "form": "fully_sharded_model_space" if _model_space(plan) else "fully_reshardable",
        }
        if plan.target_layout.ep > 1:  # chained: dense, then expert parameters
            experts = [p for p in parameters(plan.model()) if not p.buffer and p.expert is not None]
            expert_kinds = sorted({p.no_weight_decay for p in experts})
            tree["optimizer"] = {
                0: _optimizer_entry(state, (False, True), step, **form),
                1: _optimizer_entry(state, tuple(expert_kinds), step, experts=True, **form),
            }
        else:
            tree["optimizer"] = _optimizer_entry(state, (False, True), step, **form)
        if plan.target_layout.distributed_optimizer:
            content["distrib_optim_sharding_type"] = form["form"]
            if _holds_buckets(plan):
                # The parameter groups are kept beside the buckets (``bucket_objects``).
                # (one dict per sub-optimizer: Megatron's loader fills each in place)
                kept = [{"param_state_sharding_type": "dp_reshardable"} for _ in range(2)]
                tree["optimizer"] = dict(enumerate(kept)) if plan.target_layout.ep > 1 else kept[0]
                content["distrib_optim_sharding_type"] = "dp_reshardable"
    tree["content_metadata"] = content
    return tree


def _model_space(plan: Plan) -> bool:
    return plan.target_layout.distributed_optimizer and any(
        is_model_space_key(str(t.key[0])) and t.base_shape for f in plan.files for t in f.tensors
    )


def _holds_buckets(plan: Plan) -> bool:
    return any(is_bucket_key(str(t.key[0])) for f in plan.files for t in f.tensors)


def torch_dist_directory_names(plan: Plan) -> tuple[str, str]:
    """Paths of ``common.pt`` and ``.metadata``, next to the shards."""
    base = posixpath.dirname(plan.files[0].path)
    common, metadata = (f"{base}/{n}" if base else n for n in (COMMON, METADATA_FILE))
    return common, metadata


def torch_dist_directory_files(job: WriteJob) -> list[tuple[str, bytes]]:
    """``common.pt`` and ``.metadata``, next to the shards, once every shard is written."""
    plan, records = job.plan, job.report.records
    state = training_state(job, plan.files[0])
    common_path, metadata_path = torch_dist_directory_names(plan)
    common = io.BytesIO()
    tree = common_state(plan, state)
    slots = _carried_in(tree, state)
    step = adam_step(state.owner)
    if step is not None and _holds(tree, COMMON_STEP):
        slots.append(COMMON_STEP)
    write_torch_zip(common, tree, slots, _carried(state, step))
    return [
        (common_path, common.getvalue()),
        (metadata_path, metadata_bytes(dcp_metadata(plan, records))),
    ]
