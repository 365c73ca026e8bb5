"""Megatron legacy checkpoints (``--ckpt-format torch``): probe what is stored, build rank files.

Probing reads the tracker, every rank file's pickle (never its tensor bytes) and ``args``, infers
the model spec and layout, and checks every file against the layout: a tensor missing, misshapen
or unexpected is reported with the file that holds it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ckptctl.errors import CheckpointError, CheckpointNotFoundError, LayoutError
from ckptctl.formats.base import SavedTraining
from ckptctl.formats.megatron.optimizer_groups import (
    carried_state,
    match_groups,
    optimizer_layout,
    optimizer_step,
)
from ckptctl.formats.megatron.tp_replicas import tp_replicas
from ckptctl.formats.megatron_common.args import (
    check_saved_layout,
    checked_iteration,
    eod_row_note,
    layout_from_args,
    spec_from_args,
)
from ckptctl.formats.megatron_common.iterations import find_iteration
from ckptctl.formats.megatron_common.layout import (
    DISTOPT_FILE,
    MTP_LEGACY_INNER,
    RANK_FILE,
    megatron_files,
)
from ckptctl.formats.megatron_common.ranks import saving_ranks
from ckptctl.formats.megatron_common.target_style import style_for_args
from ckptctl.formats.torchsave.archive import TensorRef
from ckptctl.formats.torchsave.refs import TorchFiles, open_torch_file, resolve
from ckptctl.io.storage import Storage
from ckptctl.model.catalog import (
    EXPERTS,
    GROUPED_MLP_NAMES,
    LAYER_PREFIX,
    MTP_INNER,
    MTP_PREFIX,
    ExpertNaming,
    Naming,
    mtp_layer_prefix,
    suffix_order,
    te_layer_suffix,
    uses_local_names,
)
from ckptctl.model.dtypes import dtype_name
from ckptctl.model.megatron_style import MegatronStyle, OptimizerLayout
from ckptctl.model.stored import CheckpointView, Format, StoredFile

if TYPE_CHECKING:
    import numpy as np

_EXTRA_STATE = "._extra_state"


@dataclass
class MegatronCheckpoint(TorchFiles):
    """A probed Megatron checkpoint: its view for planners and the open readers for execution."""

    args: argparse.Namespace
    naming: Naming
    layer_order: tuple[str, ...]
    optimizer: OptimizerLayout | None
    extra_state_keys: list[str] = field(default_factory=list)
    group_templates: dict[bool, dict[str, Any]] = field(default_factory=dict)
    lost: frozenset[str] = frozenset()
    """Rank files absent from storage (only with ``allow_missing``)."""
    expert_naming: ExpertNaming = ExpertNaming.SEQUENTIAL
    mtp_inner: str = MTP_LEGACY_INNER

    def tree(self, path: str) -> Any:
        return self.readers[path].tree

    def read_ref(self, path: str, ref: TensorRef) -> np.ndarray:
        return self.readers[path].read(ref)

    @property
    def style(self) -> MegatronStyle:
        """Spelling, layer order and optimizer format, kept when writing Megatron again."""
        style = MegatronStyle(
            self.naming, self.layer_order, self.optimizer, self.expert_naming, self.mtp_inner
        )
        return style_for_args(style, self.args)

    def saved_training(self, path: str) -> SavedTraining:
        """Counters, scheduler and ``args`` as rank file ``path`` keeps them."""
        step = self.view.optimizer_step if self.view.has_optimizer else None
        tree = self.tree(path)
        return SavedTraining(
            carried_state(tree), self.args, self.group_templates, step, tree.get("rng_state")
        )


def _state_dict(value: Any) -> bool:
    """A model entry as Megatron saves it: tensor (or extra state) by parameter name."""
    return isinstance(value, dict) and all(isinstance(k, str) for k in value)


def _layer_order(models: list[dict[str, Any]], mla: bool) -> tuple[str, ...]:
    """Layer-relative parameter names in stored order, TE spelling, over every layer the files
    hold (a model of dense and MoE layers, or of gated delta net and attention layers, has
    several kinds: every layer's own suffixes keep their order in the merged one); an MoE
    layer's experts collapse into the one ``EXPERTS`` marker where their block starts."""
    layers: dict[tuple[int, str], list[str]] = {}
    for n, model in enumerate(models):
        for key in model:
            if not key.startswith(LAYER_PREFIX) or key.endswith(_EXTRA_STATE):
                continue
            local, _, suffix = key[len(LAYER_PREFIX) :].partition(".")
            layers.setdefault((n, local), []).append(suffix)
    out: list[str] = []
    expert_prefix = f"{EXPERTS}."
    for suffixes in layers.values():
        moe = any(s.startswith("mlp.router.") for s in suffixes)
        at = 0  # a suffix not seen yet goes after the one before it in its own layer
        for suffix in suffixes:
            te = te_layer_suffix(suffix, moe, mla)
            te = EXPERTS if te.startswith(expert_prefix) else te
            if te in out:
                at = out.index(te) + 1
            else:
                out.insert(at, te)
                at += 1
    return tuple(out)


def _mtp_inner(names: list[str]) -> str:
    """The module the files keep MTP layers' transformer layers under (by release)."""
    if any(name.startswith(mtp_layer_prefix(0, MTP_INNER)) for name in names):
        return MTP_INNER
    return MTP_LEGACY_INNER


def _expert_naming(names: list[str], where: str) -> ExpertNaming:
    """Which expert module wrote the files, from the names of its parameters."""
    for name in names:
        rest = name.split(f".{EXPERTS}.", 1)
        if len(rest) < 2:
            continue
        if rest[1].startswith("local_experts."):
            return ExpertNaming.SEQUENTIAL
        if rest[1].startswith(("linear_fc1.", "linear_fc2.")):
            return ExpertNaming.TE_GROUPED
        if rest[1] in GROUPED_MLP_NAMES.values():
            return ExpertNaming.GROUPED
        raise CheckpointError(
            f"{where}: experts stored as {name.split('.', 3)[-1]}, which no megatron-core "
            "expert module (SequentialMLP, TEGroupedMLP, GroupedMLP) writes; cannot map them"
        )
    return ExpertNaming.SEQUENTIAL


def probe_megatron(
    storage: Storage,
    *,
    iteration: int | None = None,
    true_vocab_size: int | None = None,
    allow_missing: bool = False,
    trusted: frozenset[str] = frozenset(),
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
    spec = spec_from_args(args, true_vocab_size, trusted)
    layout = layout_from_args(args)
    check_saved_layout(args, spec, layout, storage.describe(first_rel))
    try:
        savers = {c.directory(layout): c for c in saving_ranks(layout)}
    except LayoutError as err:
        raise CheckpointError(f"{storage.describe(iter_rel)}: {err}") from None
    expected = set(savers)
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
        if not isinstance(readers[rel].tree, dict):
            kind = type(readers[rel].tree).__name__
            raise CheckpointError(f"{storage.describe(rel)}: holds a {kind}, not a rank file")
        other = readers[rel].tree.get("args")
        for key in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "num_layers",
            "hidden_size",
            "padded_vocab_size",
            "use_distributed_optimizer",
            "num_experts",
            "expert_model_parallel_size",
        ):
            if getattr(other, key, None) != getattr(args, key, None):
                problems.append(
                    f"{storage.describe(rel)}: args.{key}={getattr(other, key, None)} disagrees "
                    f"with {getattr(args, key, None)} in {storage.describe(first_rel)}"
                )
        if "iteration" in readers[rel].tree:
            checked_iteration(readers[rel].tree["iteration"], storage.describe(rel), number)
    if problems:
        raise CheckpointError("; ".join(problems))

    trees = {rel: r.tree for rel, r in readers.items()}
    for rel, tree in trees.items():
        for key, value in tree.items():
            if str(key).startswith("model") and not _state_dict(value):
                raise CheckpointError(
                    f"{storage.describe(rel)}: '{key}' holds a {type(value).__name__}, not a "
                    "state dict of named tensors"
                )
    models = [v for t in trees.values() for k, v in t.items() if k.startswith("model")]
    names = [k for m in models for k in m]
    mla = spec.mla is not None
    naming = Naming.LOCAL if uses_local_names(names, mla) else Naming.TE
    stored_order = _layer_order(models, mla)
    expert_naming = _expert_naming(names, storage.describe(first_rel))
    mtp_inner = _mtp_inner(names)
    # Unknown names are reported by the file check below, missing ones too: the order keeps the
    # catalog's parameters only, in the order the files store them.
    known = suffix_order(spec)
    in_files = [s for s in stored_order if s in known]
    absent = [s for s in known if s not in in_files]
    if stored_order and absent:
        # Before the optimizer is matched: its error would hide the plain cause.
        raise CheckpointError(
            f"{storage.describe(first_rel)}: layers lack {', '.join(absent)}, which the "
            "model args call for (e.g. qk_layernorm, add_qkv_bias, a LayerNorm's bias)"
        )
    layer_order = tuple(in_files + absent)
    if spec.mtp_num_layers and not any(name.startswith(MTP_PREFIX) for name in names):
        raise CheckpointError(
            f"{storage.describe(first_rel)}: args.mtp_num_layers={spec.mtp_num_layers} but the "
            "files hold no multi-token prediction layer (mtp.layers.*)"
        )
    extra = sorted({k for k in names if k.endswith(_EXTRA_STATE)})
    some_weight = next(v for m in models for v in m.values() if isinstance(v, TensorRef))
    optimizer = optimizer_layout(trees[first_rel], args)
    templates: dict[bool, dict[str, Any]] = {}
    if optimizer is not None:
        by_rank = {
            (c.tp, c.pp, c.ep): trees[join(name, RANK_FILE)]
            for name, c in savers.items()
            if name not in missing
        }
        optimizer, templates = match_groups(
            spec, layout, (naming, layer_order, expert_naming, mtp_inner), optimizer, by_rank
        )
    notes, warnings = [], []
    eod = eod_row_note(args, spec, layout.tp) if true_vocab_size is None else None
    if eod is not None:
        notes.append(eod)
    if layout.distributed_optimizer and optimizer is None:
        notes.append("no optimizer state in the rank files: weights only")
    if extra and any(m[k] is not None for m in models for k in m if k.endswith(_EXTRA_STATE)):
        warnings.append(
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
        expert_naming=expert_naming,
        mtp_inner=mtp_inner,
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
        optimizer_step(readers[first_rel], optimizer),
        warnings=tuple(warnings),
        replicas=tp_replicas(spec, files, lost),
    )
    return MegatronCheckpoint(
        storage,
        view,
        readers,
        args,
        naming,
        layer_order or (),
        optimizer,
        extra,
        templates,
        lost,
        expert_naming,
        mtp_inner,
    )


def _check_distopt(
    file: StoredFile, tree: Any, storage: Storage, problems: list[str]
) -> StoredFile:
    """The flat buffers must exist with the length the replayed layout gives."""
    where = storage.describe(file.path)
    # A chained optimizer's file lists its optimizers' states (dense, expert; None if absent).
    parts = [t for t in (tree if isinstance(tree, list) else [tree]) if t is not None]
    if not parts or not all(isinstance(t, dict) and t.get("buckets_coalesced") for t in parts):
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
        if ref.shape != t.stored_shape:
            problems.append(
                f"{where}: tensor {'.'.join(map(str, t.key))} has shape {list(ref.shape)}, "
                f"expected {list(t.stored_shape)} for this layout"
            )
            continue
        tensors.append(replace(t, dtype=dtype_name(ref.dtype)))
    return replace(file, tensors=tuple(tensors))


# --- writing ----------------------------------------------------------------------------------
