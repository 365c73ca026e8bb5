"""Megatron legacy checkpoints (``--ckpt-format torch``): probe what is stored, build rank files.

Probing reads the tracker, every rank file's pickle (never its tensor bytes) and ``args``, infers
the model spec and layout, and checks every file against the layout: a tensor missing, misshapen
or unexpected is reported with the file that holds it.
"""

from __future__ import annotations

import argparse
import copy
import re
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from ckptctl.errors import CheckpointError, CheckpointNotFoundError, LayoutError
from ckptctl.formats.megatron.layout import (
    DISTOPT_FILE,
    RANK_FILE,
    TRACKER,
    GroupOrder,
    OptimizerLayout,
    iteration_dir,
    megatron_files,
    param_groups,
    rank_dir,
    rank_params,
)
from ckptctl.formats.torchsave.archive import TensorRef, TensorSlot, TorchZipReader
from ckptctl.model.catalog import (
    LAYER_PREFIX,
    Naming,
    layer_suffixes,
    te_layer_suffix,
    uses_local_names,
)
from ckptctl.model.dtypes import dtype_name
from ckptctl.model.layout import ModelSpec, NormKind, ParallelLayout, PositionEmbedding
from ckptctl.model.stored import CheckpointView, Format, KeyPath, StoredFile
from ckptctl.storage import Storage

_ITER_DIR = re.compile(r"^(iter_\d{7}|release)$")
_EXTRA_STATE = "._extra_state"


def resolve(tree: Any, key: KeyPath) -> Any:
    """Follow ``key`` into ``tree``; ``"a|b"`` names a dict key that is a tuple of dtypes (the
    grad-buffer keys of ``distrib_optim.pt``), which JSON plans cannot spell directly."""
    node = tree
    for part in key:
        if isinstance(part, str) and "|" in part and isinstance(node, dict) and part not in node:
            part = next(
                (k for k in node if isinstance(k, tuple) and "|".join(map(dtype_name, k)) == part),
                part,
            )
        node = node[part]
    return node


def view_ref(ref: TensorRef, offset: int, shape: tuple[int, ...]) -> TensorRef:
    """The slice ``[offset, offset + numel)`` of a flat tensor, viewed with ``shape``."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return TensorRef(
        ref.storage, ref.offset + offset * ref.stride[0], shape, tuple(reversed(stride))
    )


@dataclass
class MegatronCheckpoint:
    """A probed Megatron checkpoint: its view for planners and the open readers for execution."""

    storage: Storage
    view: CheckpointView
    readers: dict[str, TorchZipReader]
    args: argparse.Namespace
    naming: Naming
    layer_order: tuple[str, ...]
    optimizer: OptimizerLayout | None
    extra_state_keys: list[str] = field(default_factory=list)
    group_templates: dict[bool, dict[str, Any]] = field(default_factory=dict)
    lost: frozenset[str] = frozenset()
    """Rank files absent from storage (only with ``allow_missing``)."""

    def read(
        self,
        path: str,
        key: KeyPath,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        view: tuple[int, tuple[int, ...]] | None = None,
    ) -> torch.Tensor:
        reader = self.readers[path]
        ref = resolve(reader.tree, key)
        if view is not None:
            ref = view_ref(ref, *view)
        return reader.read(ref, offsets, sizes)

    def tree(self, path: str) -> Any:
        return self.readers[path].tree

    def read_ref(self, path: str, ref: TensorRef) -> torch.Tensor:
        return self.readers[path].read(ref)


def open_torch_file(storage: Storage, rel: str) -> TorchZipReader:
    """A lazy reader of one ``torch.save`` file; on remote stores its tensor bytes are fetched
    by exact byte range, in parallel when the executor asks for several."""
    fetch = None if storage.is_local else partial(storage.read_range, rel)
    return TorchZipReader(storage.open_read(rel), storage.describe(rel), fetch)


def find_iteration(storage: Storage, iteration: int | None) -> tuple[str, int | None]:
    """The iteration directory (relative) and number the user means."""
    if iteration is not None:
        rel = iteration_dir(iteration)
        if not storage.isdir(rel):
            raise CheckpointNotFoundError(f"{storage.describe(rel)}: no such iteration directory")
        return rel, iteration
    if storage.exists(TRACKER):
        text = storage.read_text(TRACKER).strip()
        if text == "release":
            number = None
        elif text.isdigit():
            number = int(text)
        else:
            raise CheckpointError(
                f"{storage.describe(TRACKER)}: expected an iteration number or 'release', "
                f"found {text[:40]!r}"
            )
        rel = iteration_dir(number)
        if not storage.isdir(rel):
            raise CheckpointNotFoundError(
                f"{storage.describe(TRACKER)} names iteration {text} but {rel}/ is missing; "
                "pass --iteration to pick another"
            )
        return rel, number
    if any(name.startswith("mp_rank_") for name in storage.listdir("")):
        name = storage.url.rstrip("/").rsplit("/", 1)[-1]
        number = int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None
        return "", number
    iters = [n for n in storage.listdir("") if _ITER_DIR.match(n)]
    raise CheckpointNotFoundError(
        f"{storage.url}: no {TRACKER}"
        + (
            f"; found {', '.join(iters)}: pass --iteration"
            if iters
            else "; not a Megatron checkpoint"
        )
    )


def _arg(args: argparse.Namespace, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            return value
    return default


def spec_from_args(args: argparse.Namespace, true_vocab_size: int | None = None) -> ModelSpec:
    """Megatron's argument names (and defaults) to a ``ModelSpec``."""
    for flag in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if getattr(args, flag, False):
            raise LayoutError(f"args.{flag} is set: this pipeline split is not supported yet")
    if getattr(args, "pipeline_model_parallel_layout", None):
        raise LayoutError("args.pipeline_model_parallel_layout is set: not supported yet")
    hidden = _arg(args, "hidden_size")
    heads = _arg(args, "num_attention_heads")
    if hidden is None or heads is None or _arg(args, "num_layers") is None:
        raise CheckpointError("args lacks num_layers / hidden_size / num_attention_heads")
    groups = heads
    if getattr(args, "group_query_attention", False) or getattr(args, "num_query_groups", None):
        groups = _arg(args, "num_query_groups", default=heads)
    padded = _arg(args, "padded_vocab_size")
    vocab = true_vocab_size or _arg(args, "vocab_size", "ckptctl_true_vocab_size", default=padded)
    if vocab is None:
        raise CheckpointError("args has neither padded_vocab_size nor vocab_size")
    norm = str(_arg(args, "normalization", default="LayerNorm"))
    position = str(_arg(args, "position_embedding_type", default="learned_absolute"))
    return ModelSpec(
        num_layers=args.num_layers,
        hidden_size=hidden,
        ffn_hidden_size=_arg(args, "ffn_hidden_size", default=4 * hidden),
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=_arg(args, "kv_channels", default=hidden // heads),
        vocab_size=vocab,
        make_vocab_size_divisible_by=_arg(args, "make_vocab_size_divisible_by", default=128),
        gated_linear_unit=bool(_arg(args, "swiglu", default=False)),
        add_bias_linear=bool(_arg(args, "add_bias_linear", default=True)),
        add_qkv_bias=bool(_arg(args, "add_qkv_bias", default=False)),
        tie_embeddings=not _arg(args, "untie_embeddings_and_output_weights", default=False),
        normalization=NormKind(norm),
        position_embedding=PositionEmbedding(position),
        max_position_embeddings=_arg(args, "max_position_embeddings", default=4096),
        norm_epsilon=float(_arg(args, "norm_epsilon", "layernorm_epsilon", default=1e-5)),
        rotary_base=float(_arg(args, "rotary_base", default=10000)),
        num_experts=_arg(args, "num_experts"),
    )


def layout_from_args(args: argparse.Namespace) -> ParallelLayout:
    if (_arg(args, "expert_model_parallel_size", default=1) or 1) > 1:
        raise LayoutError("expert parallelism (EP > 1) is not yet supported")
    return ParallelLayout(
        tp=_arg(args, "tensor_model_parallel_size", default=1),
        pp=_arg(args, "pipeline_model_parallel_size", default=1),
        dp=_arg(args, "data_parallel_size", default=1),
        vpp=_arg(args, "virtual_pipeline_model_parallel_size", default=1),
        first_stage_layers=_arg(
            args, "num_layers_in_first_pipeline_stage", "decoder_first_pipeline_num_layers"
        ),
        last_stage_layers=_arg(
            args, "num_layers_in_last_pipeline_stage", "decoder_last_pipeline_num_layers"
        ),
        distributed_optimizer=bool(_arg(args, "use_distributed_optimizer", default=False)),
    )


def args_from_spec(spec: ModelSpec) -> argparse.Namespace:
    """Megatron arguments describing ``spec``, for checkpoints cut from a full HF model."""
    return argparse.Namespace(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        group_query_attention=spec.num_query_groups != spec.num_attention_heads,
        kv_channels=spec.kv_channels,
        vocab_size=spec.vocab_size,
        make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by,
        swiglu=spec.gated_linear_unit,
        add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias,
        untie_embeddings_and_output_weights=not spec.tie_embeddings,
        normalization=spec.normalization.value,
        position_embedding_type=spec.position_embedding.value,
        max_position_embeddings=spec.max_position_embeddings,
        norm_epsilon=spec.norm_epsilon,
        rotary_base=spec.rotary_base,
        rotary_percent=1.0,
        num_experts=spec.num_experts,
        data_parallel_size=1,
        world_size=1,
    )


def args_for(
    args: argparse.Namespace, spec: ModelSpec, layout: ParallelLayout
) -> argparse.Namespace:
    """A copy of ``args`` describing ``layout`` (sizes, padded vocabulary, uneven stages)."""
    out = copy.copy(args)
    out.tensor_model_parallel_size = layout.tp
    out.pipeline_model_parallel_size = layout.pp
    out.virtual_pipeline_model_parallel_size = layout.vpp if layout.vpp > 1 else None
    out.num_layers_in_first_pipeline_stage = layout.first_stage_layers
    out.num_layers_in_last_pipeline_stage = layout.last_stage_layers
    out.padded_vocab_size = spec.padded_vocab_size(layout.tp)
    out.use_distributed_optimizer = layout.distributed_optimizer
    if getattr(out, "vocab_size", None) is None:
        out.vocab_size = spec.vocab_size
    if hasattr(out, "data_parallel_size"):
        out.data_parallel_size = layout.dp
    if hasattr(out, "world_size"):
        out.world_size = layout.tp * layout.pp * layout.dp
    return out


def _layer_order(model: dict[str, Any]) -> tuple[str, ...]:
    """Layer-relative parameter names of local layer 0, in stored order, TE spelling."""
    prefix = f"{LAYER_PREFIX}0."
    return tuple(
        te_layer_suffix(k[len(prefix) :])
        for k in model
        if k.startswith(prefix) and not k.endswith(_EXTRA_STATE)
    )


def _optimizer_layout(tree: dict[str, Any], args: argparse.Namespace) -> OptimizerLayout | None:
    opt = tree.get("optimizer")
    if not isinstance(opt, dict):
        return None
    if getattr(args, "use_distributed_optimizer", False):
        return OptimizerLayout(
            states=(),
            master_weights=True,
            wrapped=True,
            distributed=True,
            group_order=GroupOrder.DECAY_FIRST,
            overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
            bucket_size=getattr(args, "ddp_bucket_size", None),
        )
    wrapped = isinstance(opt.get("optimizer"), dict)
    inner = opt["optimizer"] if wrapped else opt
    state = inner.get("state")
    if not state:
        return None
    first = state[min(state)]
    states = tuple(k for k, v in first.items() if isinstance(v, TensorRef))
    return OptimizerLayout(
        states=states, master_weights="fp32_from_fp16_params" in opt, wrapped=wrapped
    )


def probe_megatron(
    storage: Storage,
    *,
    iteration: int | None = None,
    true_vocab_size: int | None = None,
    allow_missing: bool = False,
) -> MegatronCheckpoint:
    """Read-only look at a Megatron legacy checkpoint; raises with every problem found.

    With ``allow_missing`` absent rank directories are recorded in ``lost`` instead (a planner
    may recover them from another copy)."""
    iter_rel, number = find_iteration(storage, iteration)
    ranks = [n for n in storage.listdir(iter_rel) if n.startswith("mp_rank_")]
    if not ranks:
        raise CheckpointNotFoundError(f"{storage.describe(iter_rel)}: no mp_rank_* directories")

    def join(*parts: str) -> str:
        return "/".join(x for x in (iter_rel, *parts) if x)

    first_rel = join(ranks[0], RANK_FILE)
    first = open_torch_file(storage, first_rel)
    args = first.tree.get("args") if isinstance(first.tree, dict) else None
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{storage.describe(first_rel)}: no 'args' namespace in the file")
    spec = spec_from_args(args, true_vocab_size)
    layout = layout_from_args(args)
    layout.check_against(spec)
    expected = {rank_dir(t, p, layout.pp) for t, p in layout.model_parallel_ranks()}
    unexpected = sorted(set(ranks) - expected)
    if unexpected:
        raise CheckpointError(
            f"{storage.describe(iter_rel)}: rank directories {', '.join(unexpected)} do not "
            f"belong to {layout.describe()} (from args); mixed or mislabelled shards?"
        )
    missing = sorted(expected - set(ranks))
    if missing and not allow_missing:
        raise CheckpointNotFoundError(
            f"{storage.describe(iter_rel)}: missing rank directories {', '.join(missing)} "
            f"for {layout.describe()}"
        )
    readers = {first_rel: first}
    problems: list[str] = []
    for name in sorted(expected - set(missing)):
        rel = join(name, RANK_FILE)
        if rel not in readers:
            try:
                readers[rel] = open_torch_file(storage, rel)
            except (CheckpointError, CheckpointNotFoundError):
                if not allow_missing:
                    raise
                missing.append(name)  # unreadable: as good as lost, if a copy can replace it
                continue
        other = readers[rel].tree.get("args")
        for key in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "num_layers",
            "hidden_size",
            "padded_vocab_size",
            "use_distributed_optimizer",
        ):
            if getattr(other, key, None) != getattr(args, key, None):
                problems.append(
                    f"{storage.describe(rel)}: args.{key}={getattr(other, key, None)} disagrees "
                    f"with {getattr(args, key, None)} in {storage.describe(first_rel)}"
                )
    if problems:
        raise CheckpointError("; ".join(problems))
    padded = getattr(args, "padded_vocab_size", None)
    if padded is not None and padded != spec.padded_vocab_size(layout.tp):
        raise CheckpointError(
            f"args.padded_vocab_size={padded} does not match vocab_size={spec.vocab_size} "
            f"padded for tp={layout.tp} ({spec.padded_vocab_size(layout.tp)}); "
            "pass --true-vocab-size"
        )

    trees = {rel: r.tree for rel, r in readers.items()}
    models = [v for t in trees.values() for k, v in t.items() if k.startswith("model")]
    names = [k for m in models for k in m]
    naming = Naming.LOCAL if uses_local_names(names) else Naming.TE
    stored_order = next((o for m in models if (o := _layer_order(m))), ())
    # Unknown names are reported by the file check below, missing ones too: the order keeps the
    # catalog's parameters only, in the order the files store them.
    known = [suffix for suffix, _, _ in layer_suffixes(spec)]
    in_files = [s for s in stored_order if s in known]
    layer_order = tuple(in_files + [s for s in known if s not in in_files])
    extra = sorted({k for k in names if k.endswith(_EXTRA_STATE)})
    some_weight = next(v for m in models for v in m.values() if isinstance(v, TensorRef))
    optimizer = _optimizer_layout(trees[first_rel], args)
    templates: dict[bool, dict[str, Any]] = {}
    if optimizer is not None:
        by_rank = {
            (t, p): trees[join(rank_dir(t, p, layout.pp), RANK_FILE)]
            for t, p in layout.model_parallel_ranks()
            if rank_dir(t, p, layout.pp) not in missing
        }
        optimizer, templates = _match_groups(
            spec, layout, (naming, layer_order), optimizer, by_rank
        )
    notes = []
    if layout.distributed_optimizer and optimizer is None:
        notes.append("no optimizer state in the rank files: weights only")
    if extra:
        notes.append(
            f"{len(extra)} _extra_state entries (TransformerEngine FP8 metadata) are dropped"
        )
    files = megatron_files(
        spec,
        layout,
        iteration=number,
        weight_dtype=dtype_name(some_weight.dtype),
        optimizer=optimizer,
        naming=naming,
        layer_order=layer_order,
    )
    if iter_rel == "":
        files = tuple(replace(f, path=f.path.split("/", 1)[1]) for f in files)
    lost = frozenset(f.path for f in files if f.path.split("/")[-2] in missing)
    if optimizer is not None and optimizer.distributed:
        for f in files:
            if f.path.endswith(DISTOPT_FILE) and f.path not in readers and f.path not in lost:
                readers[f.path] = open_torch_file(storage, f.path)
                trees[f.path] = readers[f.path].tree
    files = tuple(
        f
        if f.path in lost
        else _check_distopt(f, trees[f.path], storage, problems)
        if f.path.endswith(DISTOPT_FILE)
        else _check_file(f, trees[f.path], storage, problems)
        for f in files
    )
    if problems:
        shown = problems[:5] + ([f"... and {len(problems) - 5} more"] if len(problems) > 5 else [])
        raise CheckpointError("; ".join(shown))
    view = CheckpointView(
        Format.MEGATRON,
        spec,
        layout,
        files,
        number,
        optimizer is not None,
        tuple(notes),
        _optimizer_step(readers[first_rel], optimizer),
    )
    return MegatronCheckpoint(
        storage, view, readers, args, naming, layer_order or (), optimizer, extra, templates, lost
    )


def _optimizer_step(reader: TorchZipReader, optimizer: OptimizerLayout | None) -> float | None:
    """Adam's step count: per parameter group (distributed) or per parameter (torch state)."""
    if optimizer is None:
        return None
    torch_state = resolve(reader.tree, optimizer.torch_state)
    for group in torch_state.get("param_groups", []):
        if "step" in group:
            return float(group["step"])
    for state in torch_state.get("state", {}).values():
        step = state.get("step")
        if isinstance(step, TensorRef):
            return float(reader.read(step).item())
        if step is not None:
            return float(step)
    return None


def _check_distopt(
    file: StoredFile, tree: Any, storage: Storage, problems: list[str]
) -> StoredFile:
    """The flat buffers must exist with the length the replayed layout gives."""
    where = storage.describe(file.path)
    if not isinstance(tree, dict) or not tree.get("buckets_coalesced"):
        problems.append(
            f"{where}: not the coalesced distributed-optimizer format of Megatron-Core >= 0.7; "
            "older per-bucket formats are not supported"
        )
        return file
    for key, length in file.flat:
        try:
            ref = resolve(tree, key)
            stored = int(resolve(tree, (*key[:-1], "numel_unpadded")))
        except (KeyError, IndexError, TypeError):
            problems.append(f"{where}: no buffer {'.'.join(map(str, key))}")
            continue
        if not isinstance(ref, TensorRef) or ref.shape != (stored,) or stored != length:
            got = list(ref.shape) if isinstance(ref, TensorRef) else type(ref).__name__
            problems.append(
                f"{where}: buffer {'.'.join(map(str, key))} holds {got} elements "
                f"(numel_unpadded={stored}) but replaying the layout gives {length}; the bucket "
                "size, padding or parameter order differ from Megatron-Core >= 0.8 rules"
            )
    return file


def _check_file(
    file: StoredFile, tree: dict[str, Any], storage: Storage, problems: list[str]
) -> StoredFile:
    """Check every tensor the layout expects is in ``tree`` with its shape; take stored dtypes."""
    where = storage.describe(file.path)
    expected_model = {t.key for t in file.tensors if str(t.key[0]).startswith("model")}
    for key, value in tree.items():
        if str(key).startswith("model") and isinstance(value, dict):
            for name in value:
                if (key, name) not in expected_model and not name.endswith(_EXTRA_STATE):
                    problems.append(f"{where}: unexpected tensor {key}.{name} for this layout")
    tensors = []
    for t in file.tensors:
        try:
            ref = resolve(tree, t.key)
        except (KeyError, IndexError, TypeError):
            problems.append(f"{where}: missing tensor {'.'.join(map(str, t.key))}")
            continue
        if not isinstance(ref, TensorRef):
            problems.append(f"{where}: {'.'.join(map(str, t.key))} is not a tensor")
            continue
        if not ref.dtype.is_floating_point:
            problems.append(
                f"{where}: tensor {'.'.join(map(str, t.key))} has dtype "
                f"{dtype_name(ref.dtype)}; only floating-point weights are supported"
            )
            continue
        if ref.shape != t.shape:
            problems.append(
                f"{where}: tensor {'.'.join(map(str, t.key))} has shape {list(ref.shape)}, "
                f"expected {list(t.shape)} for this layout"
            )
            continue
        tensors.append(replace(t, dtype=dtype_name(ref.dtype)))
    return replace(file, tensors=tuple(tensors))


def _group_kind(group: dict[str, Any]) -> bool | None:
    """Whether a stored parameter group is the no-weight-decay one, when it says so."""
    if "wd_mult" in group:
        return group["wd_mult"] == 0
    return None


def _match_groups(
    spec: ModelSpec,
    layout: ParallelLayout,
    style: tuple[Naming, tuple[str, ...] | None],
    optimizer: OptimizerLayout,
    trees: dict[tuple[int, int], dict[str, Any]],
) -> tuple[OptimizerLayout, dict[bool, dict[str, Any]]]:
    """Find the parameter-group order every rank file follows, and each group's settings.

    Megatron-Core changed the order in 0.16 (weight-decay group first); we try both and take the
    one whose group sizes and ``wd_mult`` agree with every file.
    """
    for order in GroupOrder:
        templates: dict[bool, dict[str, Any]] = {}
        for (tp_rank, pp_rank), tree in trees.items():
            try:
                stored = resolve(tree, optimizer.torch_state)["param_groups"]
            except (KeyError, IndexError, TypeError):
                kind = "distributed optimizer's" if optimizer.distributed else "torch optimizer's"
                raise CheckpointError(
                    f"the optimizer state of rank (tp, pp) = ({tp_rank}, {pp_rank}) is not the "
                    f"{kind} layout its args announce (use_distributed_optimizer); cannot map it"
                ) from None
            expected = param_groups(rank_params(spec, layout, pp_rank, *style), order)
            if len(stored) != len(expected):
                break
            fits = all(
                len(group.get("params", members)) == len(members)
                and _group_kind(group) in (None, kind)
                for group, (kind, members) in zip(stored, expected, strict=True)
            )
            if not fits:
                break
            for group, (kind, _) in zip(stored, expected, strict=True):
                templates.setdefault(kind, {k: v for k, v in group.items() if k != "params"})
        else:
            return replace(optimizer, group_order=order), templates
    raise CheckpointError(
        "the optimizer's parameter groups match neither of Megatron's orders (weight decay / no "
        "weight decay by first appearance, or weight decay first); cannot map its state"
    )


# --- writing ----------------------------------------------------------------------------------


def carried_state(tree: dict[str, Any]) -> dict[str, Any]:
    """Training state a rank file carries besides model and optimizer tensors; RNG is dropped
    because it cannot be resharded (Megatron's ``--no-load-rng``)."""
    skip = {"args", "checkpoint_version", "iteration", "optimizer", "rng_state"}
    out = {k: v for k, v in tree.items() if k not in skip and not str(k).startswith("model")}
    out["checkpoint_version"] = tree.get("checkpoint_version", 3.0)
    out["iteration"] = tree.get("iteration", 0)
    opt = tree.get("optimizer")
    if isinstance(opt, dict) and isinstance(opt.get("optimizer"), dict):
        out["optimizer_extra"] = {
            k: v for k, v in opt.items() if k not in ("optimizer", "fp32_from_fp16_params")
        }
    return out


def _without_step(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "step"}


def distributed_optimizer_entry(
    kinds: list[bool],
    group_templates: dict[bool, dict[str, Any]],
    step: float | None,
    carried: dict[str, Any],
) -> dict[str, Any]:
    """``model_optim_rng.pt['optimizer']`` under the distributed optimizer: group settings only
    (weight-decay group first, as Megatron-Core 0.16), Adam's step kept per group."""
    groups = []
    for kind in sorted(set(kinds)):
        group = dict(group_templates.get(kind, {}))
        if "step" not in group and step is not None:
            group["step"] = step
        groups.append(group)
    return {"optimizer": {"param_groups": groups}, **carried.get("optimizer_extra", {})}


def rank_tree(
    file: StoredFile,
    *,
    args: argparse.Namespace,
    carried: dict[str, Any],
    group_templates: dict[bool, dict[str, Any]],
    no_weight_decay: dict[str, bool],
    optimizer_entry: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], list[TensorSlot]]:
    """The object tree of one rank file; its tensors are slots, in ``file.tensors`` order.

    ``carried`` is ``carried_state`` of a source file; ``no_weight_decay`` maps canonical
    parameter names to their parameter-group kind.
    """
    tree: dict[str, Any] = {
        "args": args,
        "checkpoint_version": carried["checkpoint_version"],
        "iteration": carried["iteration"],
    }
    slots = []
    index_kind: dict[int, bool] = {}
    for n, t in enumerate(file.tensors):
        slot = TensorSlot(str(n), getattr(torch, t.dtype), t.shape)
        slots.append(slot)
        node = tree
        for part in t.key[:-1]:
            node = node.setdefault(part, {})
        node[t.key[-1]] = slot
        if "state" in t.key and t.key[0] == "optimizer":
            index_kind[int(t.key[t.key.index("state") + 1])] = no_weight_decay[
                t.canonical.split("/", 1)[1]
            ]
    if "optimizer" in tree:
        opt = tree["optimizer"]
        torch_state = opt if "state" in opt else opt["optimizer"]  # bare or wrapped
        # torch packs state in parameter-index order (group after group), not model order.
        torch_state["state"] = dict(sorted(torch_state["state"].items()))
        members: dict[bool, list[int]] = {}
        for index in sorted(index_kind):
            members.setdefault(index_kind[index], []).append(index)
        # Adam's step lives per parameter here, so a group-level step (distributed) is dropped.
        torch_state["param_groups"] = [
            {**_without_step(group_templates[kind]), "params": indices}
            for kind, indices in members.items()
        ]
        if "fp32_from_fp16_params" in opt:
            masters = opt["fp32_from_fp16_params"]
            opt["fp32_from_fp16_params"] = [
                [masters[g][i] for i in sorted(masters[g])] for g in sorted(masters)
            ]
        opt.update(carried.get("optimizer_extra", {}))
    if optimizer_entry is not None:
        tree["optimizer"] = optimizer_entry
    for key, value in carried.items():
        if key not in tree and key != "optimizer_extra":
            tree[key] = value
    return tree, slots
