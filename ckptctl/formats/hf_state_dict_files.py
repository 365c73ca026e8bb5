"""HF models trained under other frameworks, saved as ``torch.save`` state dicts by HF
parameter name (verl's per-rank FSDP files, accelerate's full state dicts): their tensors as a
generic view (each name its own tensor, a DTensor shard placed in its global tensor, optimizer
state as ``optim.state.<name>.<state>``), then placed in a mapped family's canonical tensors,
or, for any other architecture transformers builds, kept by hub name. Reading side only."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ckptctl import json_input
from ckptctl.errors import CheckpointError, LayoutError
from ckptctl.formats.base import SavedTraining, templates_of
from ckptctl.formats.shifted_reads import ShiftedReads
from ckptctl.formats.torchsave.archive import TensorRef
from ckptctl.formats.torchsave.dtensor import LOCAL, DTensorRef
from ckptctl.formats.torchsave.refs import TorchFiles
from ckptctl.io.runs import Span
from ckptctl.io.storage import Storage
from ckptctl.model.catalog import state_name
from ckptctl.model.dtypes import dtype_name
from ckptctl.model.geometry import Piece
from ckptctl.model.hf_config import spec_from_config
from ckptctl.model.hf_layout import hf_tensors
from ckptctl.model.hf_named import HfNamedModel, HfNamedSource
from ckptctl.model.megatron_style import TORCH_ADAM, MegatronStyle
from ckptctl.model.peft_wrapped import EmbeddedLora, PeftNames
from ckptctl.model.stored import (
    CheckpointView,
    FlatView,
    KeyPath,
    Shape,
    StoredTensor,
    canonical_shapes,
)

if TYPE_CHECKING:
    import numpy as np

TRAINER_STATE = "trainer_state.json"
"""The HF Trainer's record of a ``checkpoint-N/`` directory (``global_step``, ...)."""


def trainer_step(storage: Storage) -> int | None:
    """The HF Trainer's ``global_step``, when the directory is one of its checkpoints."""
    if not storage.exists(TRAINER_STATE):
        return None
    where = storage.describe(TRAINER_STATE)
    step = json_input.parse_object(storage.read_text(TRAINER_STATE), where).get("global_step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{where}: global_step is {step!r}, not a step count")
    return step


OPTIM_PREFIX = "optim.state."
"""How the generic view names optimizer state (``optim.state.<name>.<state>``, as torch's
``get_optimizer_state_dict`` would), so the HF naming places it."""


@dataclass
class HfStateDictFiles(TorchFiles):
    """``torch.save`` files of an HF model's state dicts, read box by box; the model under
    torch's Adam (per-parameter step and moments, the fp32 weights their own masters)."""

    adapter: EmbeddedLora | None = None
    by_name: CheckpointView | None = None
    """Every stored tensor by its stored name (a verl target is cut from it), when the format
    keeps one."""
    rounding: bool = False
    """Round a shifted weight whose shift is not taken off exactly (``--allow-rounding``)."""
    gated: frozenset[tuple[str, KeyPath]] = field(init=False, default=frozenset())
    """GPT-OSS's packed ``gate_up`` tensors: each expert's block read with gate and up apart."""
    shifted: ShiftedReads = field(init=False, default_factory=ShiftedReads)
    """Weights stored shifted from the canonical values (Qwen3.5's gated norms)."""

    def __post_init__(self) -> None:
        files = self.view.files
        self.gated = frozenset((f.path, t.key) for f in files for t in f.tensors if t.interleaved)
        self.shifted = ShiftedReads.of(self.view, self.rounding)

    def read(
        self,
        path: str,
        key: KeyPath,
        offsets: Shape,
        sizes: Shape,
        view: FlatView = None,
        transposed: bool = False,
        into: np.ndarray | None = None,
    ) -> np.ndarray:
        if view is not None and (path, key) in self.gated:  # an expert's block, in order
            from ckptctl.arrays import packed_block_box

            start, shape = view
            block = (start, shape[::-1] if transposed else shape)
            stored = super().read
            return packed_block_box(
                lambda first, count: stored(path, key, first, count, block),
                offsets,
                sizes,
                shape[0],
                transposed,
                True,
            )
        if (path, key) in self.shifted:
            data = super().read(path, key, offsets, sizes, view, transposed)
            return self.shifted.unshifted((path, key), data, f"{path}: {'.'.join(map(str, key))}")
        return super().read(path, key, offsets, sizes, view, transposed, into)

    def where(
        self, path: str, key: KeyPath, offsets: Shape, sizes: Shape, view: FlatView = None
    ) -> Span | None:
        if (path, key) in self.gated or (path, key) in self.shifted:
            return None  # read reordered or shifted: not the bytes as stored
        return super().where(path, key, offsets, sizes, view)

    def extent(
        self, path: str, key: KeyPath, offsets: Shape, sizes: Shape, view: FlatView = None
    ) -> Span | None:
        if (path, key) in self.gated or (path, key) in self.shifted:
            return None
        return super().extent(path, key, offsets, sizes, view)

    def rounding_errors(self) -> dict[str, float]:
        """The largest error each shifted weight was rounded with (``--allow-rounding``)."""
        return self.shifted.errors

    @property
    def style(self) -> MegatronStyle:
        if not self.view.has_optimizer or self.view.spec is None:
            return MegatronStyle()
        return MegatronStyle(optimizer=TORCH_ADAM)

    def saved_training(self, path: str) -> SavedTraining:
        """The optimizer's parameter-group settings (rank 0's file: every rank saves them)."""
        first = next((p for p in self.readers if p.startswith("optim")), None)
        tree = self.readers[first].tree if first is not None else {}
        groups = tree.get("param_groups") if isinstance(tree, dict) else None
        if not isinstance(groups, list) or not groups:
            return SavedTraining()
        if len(groups) == 1:  # one group for every parameter: both kinds share it
            return SavedTraining(templates={k: dict(groups[0]) for k in (False, True)})
        return SavedTraining(templates=templates_of(groups))


def _piece(ref: Any) -> tuple[tuple[int, ...], tuple[int, ...], str, tuple[Piece, ...]]:
    """A stored tensor's local shape, global offsets, dtype and its piece of the global one."""
    local = ref.local if isinstance(ref, DTensorRef) else ref
    offsets = ref.offsets if isinstance(ref, DTensorRef) else (0,) * len(local.shape)
    shape = tuple(local.shape)
    pieces = (Piece((0,) * len(shape), offsets, shape),) if all(shape) else ()
    return shape, offsets, dtype_name(local.dtype), pieces


def stored_tensor(key: KeyPath, name: str, ref: Any, rank: int) -> StoredTensor | None:
    """A DTensor's local shard, or a plain tensor (every rank holds it whole: rank 0's)."""
    if isinstance(ref, DTensorRef):
        key = (*key, LOCAL)
    elif not isinstance(ref, TensorRef) or rank != 0:
        return None
    shape, _, dtype, pieces = _piece(ref)
    return StoredTensor(key, name, shape, dtype, pieces)


def optimizer_tensors(
    tree: Any, parameters: tuple[str, ...], where: str, rank: int
) -> list[StoredTensor]:
    state = tree.get("state") if isinstance(tree, dict) else None
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: not an optimizer state dict (no 'state')")
    _check_numbering(tree.get("param_groups"), parameters, where)
    out = []
    for index, per_param in state.items():
        # torch numbers parameters; FSDP's full optimizer state dicts name them
        if isinstance(index, str) and index in parameters:
            param = index
        elif isinstance(index, int) and 0 <= index < len(parameters):
            param = parameters[index]
        else:
            raise CheckpointError(
                f"{where}: state of parameter {index!r}, but the model has "
                f"{len(parameters)} parameters and no such name; is the config.json this run's?"
            )
        unknown = sorted(set(per_param or {}) - ADAM_STATES, key=str)
        if unknown:
            raise CheckpointError(
                f"{where}: {param}'s optimizer state holds {unknown}: not torch's Adam, whose "
                "state ckptctl carries; convert the weights from the model files alone"
            )
        for kind, ref in (per_param or {}).items():
            name = f"{OPTIM_PREFIX}{param}.{kind}"
            tensor = stored_tensor(("state", index, kind), name, ref, rank)
            if tensor is not None:
                out.append(tensor)
    return out


ADAM_STATES = frozenset(TORCH_ADAM.states)
"""The state torch's Adam keeps per parameter (what ckptctl carries)."""


def _check_numbering(groups: Any, parameters: tuple[str, ...], where: str) -> None:
    """Parameters numbered by index name the model's in ``named_parameters`` order only when
    one group holds them all in that order (as verl's and accelerate's single optimizer
    over ``model.parameters()`` does); other numberings are refused, not guessed."""
    if not isinstance(groups, list):
        return
    numbered = [p for g in groups if isinstance(g, dict) for p in g.get("params", [])]
    if not any(isinstance(p, int) for p in numbered):
        return  # by name (FSDP's full optimizer state dicts)
    if len(groups) != 1 or numbered != list(range(len(parameters))):
        raise CheckpointError(
            f"{where}: the optimizer numbers {len(numbered)} parameters in {len(groups)} "
            f"group(s), not the model's {len(parameters)} in one group in order; which "
            "index is which parameter cannot be told"
        )


def model_tensors(
    tree: Any,
    model: HfNamedModel,
    where: str,
    rank: int,
    renamed: Mapping[str, str] | None = None,
) -> list[StoredTensor]:
    """The tensors of one rank's (or the only) model state dict, each tied group once;
    ``renamed`` (a PEFT model's stored names -> the base model's) reads the base model out of
    a wrapped state dict."""
    if not isinstance(tree, dict):
        raise CheckpointError(f"{where}: not a model state dict")
    stored = {fqn: fqn for fqn in tree} if renamed is None else {v: k for k, v in renamed.items()}
    named = {name: tree[fqn] for name, fqn in stored.items()}
    aliases = tied_aliases(named, model, where)
    return [
        t
        for name, ref in named.items()
        if name not in aliases and (t := stored_tensor((stored[name],), name, ref, rank))
    ]


def adapter_tensors(tree: Any, peft: PeftNames, where: str, rank: int) -> list[StoredTensor]:
    """The LoRA matrices a PEFT model's state dict holds, by PEFT's saved names."""
    if not isinstance(tree, dict) or set(tree) != set(peft.base) | set(peft.adapter):
        raise CheckpointError(f"{where}: not the state dict of the same PEFT model as rank 0's")
    return [
        t
        for fqn, name in peft.adapter.items()
        if (t := stored_tensor((fqn,), name, tree[fqn], rank)) is not None
    ]


def check_names(held: set[str], model: HfNamedModel, url: str) -> None:
    """The model files hold the model's tensors (in-memory names), no fewer and no more."""
    wanted = set(model.shapes()) - set(dict(model.tied))
    missing, extra = sorted(wanted - held), sorted(held - wanted)
    if missing or extra:
        said = [f"{', '.join(missing[:3])} missing"] if missing else []
        said += [f"{', '.join(extra[:3])}: not in {model.architecture}"] if extra else []
        raise CheckpointError(f"{url}: " + "; ".join(said) + " (is the config.json this run's?)")


def tied_aliases(tree: dict[str, Any], model: HfNamedModel, where: str) -> set[str]:
    """The tied names a state dict holds besides the tensor they share (the same stored
    bytes: not read twice); a tied name holding other bytes is refused."""
    out = set()
    for alias, kept in model.tied:
        if alias not in tree or kept not in tree:
            continue
        a, k = tree[alias], tree[kept]
        a, k = (x.local if isinstance(x, DTensorRef) else x for x in (a, k))
        if not (isinstance(a, TensorRef) and isinstance(k, TensorRef) and a == k):
            raise CheckpointError(
                f"{where}: {alias} should be {kept} (the model ties them) but holds other bytes"
            )
        out.add(alias)
    return out


def _optimizer_state(name: str) -> tuple[str, str]:
    """``optim.state.<param>.<state>`` -> (param, state)."""
    param, _, state = name[len(OPTIM_PREFIX) :].rpartition(".")
    return param, state


def with_state_names(view: CheckpointView) -> CheckpointView:
    """``view`` with its optimizer state named as everywhere else (``exp_avg/<param>``)."""

    def renamed(t: StoredTensor) -> StoredTensor:
        if not t.canonical.startswith(OPTIM_PREFIX):
            return t
        param, state = _optimizer_state(t.canonical)
        return replace(t, canonical=state_name(state, param))

    files = tuple(replace(f, tensors=tuple(map(renamed, f.tensors))) for f in view.files)
    return replace(view, files=files)


def _generic_names(view: CheckpointView) -> set[str]:
    return {t.canonical for f in view.files for t in f.tensors}


def _by_hub_name(view: CheckpointView, model: HfNamedModel, url: str) -> CheckpointView:
    """Each tensor under its hub name (optimizer state under its state name), each of the
    model's shape (``check_names`` has held the names to the model already)."""
    shapes = model.shapes()
    tied = dict(model.tied)
    held = {
        name: shape
        for name, (shape, _) in canonical_shapes(view).items()
        if not name.startswith(OPTIM_PREFIX)
    }
    problems = [
        f"{n} is {list(held[n])}, the model's {list(s)}"
        for n, s in shapes.items()
        if n in held and held[n] != s
    ]
    if problems:
        raise CheckpointError(f"{url}: " + "; ".join(problems[:5]))

    def renamed(t: StoredTensor) -> StoredTensor | None:
        name = t.canonical
        if name.startswith(OPTIM_PREFIX):
            param, state = _optimizer_state(name)
            return replace(t, canonical=state_name(state, model.hub_name(param)))
        if name in tied:
            return None
        return replace(t, canonical=model.hub_name(name))

    files = tuple(
        replace(f, tensors=tuple(r for t in f.tensors if (r := renamed(t)) is not None))
        for f in view.files
    )
    return replace(view, files=files)


def hf_model_view(
    generic: CheckpointView,
    model: HfNamedModel,
    config: dict[str, Any],
    generation: str | None,
    trusted: frozenset[str],
    url: str,
) -> CheckpointView:
    """A mapped family's canonical view of ``generic``, or (no family table takes the config)
    the view by hub name that HF targets write, the config carried."""
    try:
        spec = spec_from_config(config, trusted=trusted)
        hf_tensors(spec)  # refuses what no HF name can hold
    except LayoutError as err:
        view = _by_hub_name(generic, model, url)
        carried = HfNamedSource(model, json.dumps(config, indent=2), generation)
        why = f"not convertible to Megatron layouts: {err}"
        return replace(view, notes=(*view.notes, why), hf_named=carried)
    from ckptctl.formats.named import under_spec

    view, _ = under_spec(generic, spec, packed=True)
    unplaced = sorted(
        {t.canonical for f in view.files for t in f.tensors} & _generic_names(generic)
    )
    if unplaced:
        raise CheckpointError(
            f"{url}: {', '.join(unplaced[:3])} "
            + (f"and {len(unplaced) - 3} more " if len(unplaced) > 3 else "")
            + f"have no place in the {model.architecture} its config.json describes"
        )
    return view
