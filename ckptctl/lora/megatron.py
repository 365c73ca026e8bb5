"""A LoRA adapter trained in Megatron by Megatron-Bridge, as verl's Megatron workers save it with
LoRA on: before verl 0.9, ``adapter_checkpoint/mp_rank_TT[_PPP][_EEE]_adapter.pt``, each
``{"adapter_state_dict": {name: tensor}}`` of one rank's stage, with Megatron-Bridge's names
(``decoder.layers.<local layer>.<module>.adapter.linear_in|linear_out.weight``) and TP shards;
from 0.9 under ``use_dist_checkpointing``, beside the base in its ``torch_dist`` checkpoint
(``formats.torch_dist.lora_shards``: each key's global tensor, its layers stacked, is what one
TP rank of an unsplit run would hold).

Megatron-Bridge's ``LoRALinear`` adds ``alpha / dim * linear_out(linear_in(x))`` to a Megatron
linear layer: ``linear_in`` is LoRA's A, ``linear_out`` its B, the scale PEFT's. How each is
cut over TP follows the base layer (``ParallelLinearAdapter``): for a column-parallel base
(``linear_qkv``, ``linear_fc1``) A is a column-parallel layer of the rank (its rows split) and B
follows the base's rows (``[gate_r; up_r]`` for a SwiGLU ``linear_fc1``); for a row-parallel
base (``linear_proj``, ``linear_fc2``) A is row-parallel (its columns split) and B a
column-parallel layer gathered after (its rows split). Gathered, B's rows are cut into the HF
weights the base weight becomes (q/k/v out of the group-interleaved fused QKV, gate/up), each
with A whole: the same update, as PEFT's adapter of the HF model. The alpha is in verl's run
config, not in the files: it is given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ckptctl import arrays, json_input
from ckptctl.errors import CheckpointError, CheckpointNotFoundError, LayoutError
from ckptctl.formats.torch_dist.verl_actor import TRANSFORMER_CONFIG, layout_of
from ckptctl.formats.torchsave.refs import open_torch_file
from ckptctl.formats.verl.layout import ADAPTER_DIR
from ckptctl.io.storage import Storage
from ckptctl.lora.adapter import HeldAdapter
from ckptctl.lora.embedded import gathered, held_parts
from ckptctl.model.catalog import LAYER_PREFIX, parameters_by_name
from ckptctl.model.geometry import Split, shard_shape_and_pieces
from ckptctl.model.hf_families import choose_family
from ckptctl.model.hf_layout import per_name_tensors
from ckptctl.model.layout import ModelSpec, ParallelLayout
from ckptctl.model.lora import PREFIX
from ckptctl.settings import StorageConfig

if TYPE_CHECKING:
    import torch

    from ckptctl.formats.base import Checkpoint

STATE_KEY = "adapter_state_dict"
_FILE = re.compile(r"mp_rank_(?P<tp>\d{2})(?:_(?P<a>\d{3}))?(?:_(?P<b>\d{3}))?_adapter\.pt")
_NAME = re.compile(
    r"decoder\.layers\.(?P<layer>\d+)\.(?P<module>.+)\.adapter\.linear_(?P<part>in|out)\.weight"
)
_STACKED = re.compile(r"decoder\.layers\.(?P<module>.+)\.adapter\.linear_(?P<part>in|out)\.weight")
"""A ``torch_dist`` key of Megatron-Bridge's A or B, its layers stacked on the first axis."""
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(?P<local>\d+)\.(?P<linear>linear_fc[12])")
"""A ``SequentialMLP`` expert's linear: each local expert has an adapter of its own."""
_SPLIT_OF_A = {Split.COLUMN: Split.COLUMN, Split.GATED: Split.COLUMN, Split.ROW: Split.ROW}
"""How ``linear_in`` (A, ``[rank, in]``) is cut, by the base weight's cut."""
_SPLIT_OF_B = {Split.COLUMN: Split.COLUMN, Split.GATED: Split.GATED, Split.ROW: Split.COLUMN}
"""How ``linear_out`` (B, ``[out, rank]``) is cut, by the base weight's cut."""


def holds_megatron_adapter(url: str, config: StorageConfig) -> bool:
    """Whether ``url`` is verl's actor directory with an ``adapter_checkpoint`` or that
    directory itself."""
    storage = Storage(url, config, read_only=True)
    if not storage.exists() or not storage.isdir():
        return False
    return any(_FILE.fullmatch(f.rpartition("/")[2]) for f in storage.find_files())


@dataclass(frozen=True)
class _RankFile:
    path: str
    tp: int
    pp: int
    ep: int


class MegatronAdapter(HeldAdapter):
    """Megatron-Bridge's adapter, as the PEFT adapter of the HF model ``spec`` describes:
    ``shards`` holds each adapted base weight's A (``"in"``) and B (``"out"``) by TP rank,
    cut over ``tp`` ranks as Megatron-Bridge cuts them."""

    def __init__(
        self,
        url: str,
        spec: ModelSpec,
        alpha: float,
        base: str | None,
        shards: dict[tuple[str, str], dict[int, np.ndarray]],
        tp: int,
    ) -> None:
        self._url = url
        self._held: dict[str, np.ndarray] = {}
        self._place(spec, shards, tp)
        shapes = {name: tuple(a.shape) for name, a in self._held.items()}
        self.dtypes = {name: arrays.dtype_of(a) for name, a in self._held.items()}
        architecture = choose_family(spec).architecture
        where = f"{url} (Megatron-Bridge's LoRA adapter)"
        self._describe(shapes, alpha, architecture, base, where)

    @classmethod
    def from_rank_files(
        cls, url: str, config: StorageConfig, spec: ModelSpec, alpha: float, base: str | None
    ) -> MegatronAdapter:
        """verl's ``adapter_checkpoint/`` of per-rank files."""
        storage = Storage(url, config, read_only=True)
        files = storage.find_files()
        inner = f"{ADAPTER_DIR}/" if any(f.startswith(f"{ADAPTER_DIR}/") for f in files) else ""
        layout, found = _layout(storage, url, inner, files)
        shards = _rank_shards(storage, spec, layout, found)
        if not shards:
            raise CheckpointError(f"{url}: the adapter checkpoint holds no adapter")
        return cls(url, spec, alpha, base, shards, layout.tp)

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, url: str, alpha: float) -> MegatronAdapter:
        """The adapter a ``torch_dist`` checkpoint holds beside its base (``ckpt.adapter``,
        ``lora_shards``): each stacked key's global tensor is the whole matrix of every layer,
        as one TP rank would hold it."""
        adapter, spec = ckpt.adapter, ckpt.view.spec
        assert adapter is not None and adapter.megatron and spec is not None
        shards: dict[tuple[str, str], dict[int, np.ndarray]] = {}
        for name, parts in held_parts(adapter).items():
            match = _STACKED.fullmatch(name)
            if match is None:
                raise CheckpointError(f"{url}: {name}: not a Megatron-Bridge LoRA A or B")
            stacked = gathered(ckpt, parts, name, url)
            for layer in range(stacked.shape[0]):
                base = f"{LAYER_PREFIX}{layer}.{match['module']}.weight"
                shards[(base, match["part"])] = {0: stacked[layer]}
        return cls(url, spec, alpha, None, shards, 1)

    @property
    def url(self) -> str:
        return self._url

    def names(self) -> list[str]:
        return sorted(self._held)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._held[name].shape)

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        return arrays.to_torch(self._held[name][lo:hi]).float()

    def stored(self, name: str) -> np.ndarray:
        return self._held[name]

    def _place(
        self, spec: ModelSpec, shards: dict[tuple[str, str], dict[int, np.ndarray]], tp: int
    ) -> None:
        """Every adapted base weight's A and B gathered over TP and cut into the HF weights of
        the base weight."""
        params = parameters_by_name(spec)
        by_canonical: dict[str, list[tuple[str, tuple[int, ...], tuple[Any, ...]]]] = {}
        for hf, canonical, shape, pieces in per_name_tensors(spec, "merge-lora"):
            by_canonical.setdefault(canonical, []).append((hf, shape, pieces))
        for base in sorted({b for b, _ in shards}):
            if base not in params or base not in by_canonical:
                raise LayoutError(f"{self._url}: an adapter on {base}, which the base has not")
            parts = {p: shards.get((base, p)) for p in ("in", "out")}
            if parts["in"] is None or parts["out"] is None:
                missing = "linear_in" if parts["in"] is None else "linear_out"
                raise LayoutError(f"{self._url}: the adapter on {base} has no {missing}")
            param = params[base]
            if param.split not in _SPLIT_OF_A:
                raise LayoutError(
                    f"{self._url}: an adapter on {base}, whose TP cut ({param.split}) "
                    "Megatron-Bridge's LoRA of a parallel linear layer does not have"
                )
            a = _gathered(parts["in"], _SPLIT_OF_A[param.split], tp, base, "linear_in")
            rank = a.shape[0]
            out_rows, in_cols = param.shape[0], param.shape[1]
            b_shape = (out_rows, rank)
            b = _gathered(parts["out"], _SPLIT_OF_B[param.split], tp, base, "linear_out", b_shape)
            if a.shape[1] != in_cols:
                raise LayoutError(
                    f"{self._url}: {base}'s adapter takes {a.shape[1]} inputs, the base {in_cols}"
                )
            for hf, shape, pieces in by_canonical[base]:
                self._add(hf, shape, pieces, a, b, in_cols)

    def _add(
        self, hf: str, shape: tuple[int, ...], pieces: Any, a: np.ndarray, b: np.ndarray, cols: int
    ) -> None:
        """HF weight ``hf``'s adapter: A whole, B's rows where the weight's rows come from."""
        if len(shape) != 2 or shape[1] != cols:
            raise LayoutError(f"{self._url}: {hf} is no row cut of its Megatron weight")
        rows = np.zeros((shape[0], b.shape[1]), b.dtype)
        filled = 0
        for piece in pieces:
            if piece.canonical[1] != 0 or piece.sizes[1] != cols:
                raise LayoutError(f"{self._url}: {hf} is no row cut of its Megatron weight")
            lo, n = piece.local[0], piece.sizes[0]
            rows[lo : lo + n] = b[piece.canonical[0] : piece.canonical[0] + n]
            filled += n
        if filled != shape[0]:
            raise LayoutError(f"{self._url}: {hf}'s rows are not all in its Megatron weight")
        module = f"{PREFIX}{hf.removesuffix('.weight')}"
        self._held[f"{module}.lora_A.weight"] = a
        self._held[f"{module}.lora_B.weight"] = rows


def _rank_shards(
    storage: Storage, spec: ModelSpec, layout: ParallelLayout, found: list[_RankFile]
) -> dict[tuple[str, str], dict[int, np.ndarray]]:
    """Each rank file's A and B of each adapted base weight, their layer numbers made global."""
    stages = layout.chunk_layers(spec.num_layers)
    shards: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    per_rank = (spec.num_experts or 0) // layout.ep
    for rank_file in found:
        reader = open_torch_file(storage, rank_file.path)
        where = storage.describe(rank_file.path)
        tree = reader.tree
        if not isinstance(tree, dict) or not isinstance(tree.get(STATE_KEY), dict):
            raise CheckpointError(f"{where}: no {STATE_KEY}; not verl's adapter checkpoint")
        held = stages[(rank_file.pp, 0)]
        for name, ref in tree[STATE_KEY].items():
            match = _NAME.fullmatch(str(name))
            module = match["module"] if match else ""
            expert = _EXPERT.fullmatch(module)
            if match is None or (".experts." in f".{module}." and expert is None):
                what = "LoRA on grouped experts" if match else "not a LoRA A or B"
                raise CheckpointError(
                    f"{where}: {name}: {what} (Megatron-Bridge's LoRA on a decoder "
                    "layer's linear_qkv, linear_proj, linear_fc1, linear_fc2, each "
                    "SequentialMLP expert's too, is read)"
                )
            if expert is None and rank_file.ep:  # dense: the same on every EP rank
                continue
            if expert is not None:  # local expert j of EP rank e: global e * n + j
                if layout.expert_tp != layout.tp:
                    raise CheckpointError(
                        f"{where}: LoRA on experts with expert TP {layout.expert_tp} other "
                        f"than TP {layout.tp}: the files do not say the expert TP rank"
                    )
                number = rank_file.ep * per_rank + int(expert["local"])
                module = f"mlp.experts.local_experts.{number}.{expert['linear']}"
            local = int(match["layer"])
            if local >= len(held):
                raise CheckpointError(
                    f"{where}: {name}: pipeline stage {rank_file.pp} holds {len(held)} "
                    "layers; is transformer_config.json this run's?"
                )
            base = f"{LAYER_PREFIX}{held[local]}.{module}.weight"
            data = reader.read(ref, (0,) * len(ref.shape), tuple(ref.shape))
            shards.setdefault((base, match["part"]), {})[rank_file.tp] = data
    return shards


def _gathered(
    shards: dict[int, np.ndarray],
    split: Split,
    tp: int,
    base: str,
    part: str,
    shape: tuple[int, ...] | None = None,
) -> np.ndarray:
    """The whole matrix from its TP shards (``shape``: known, else from the shards' cut)."""
    if sorted(shards) != list(range(tp)):
        raise LayoutError(f"{base}'s adapter {part}: TP ranks {sorted(shards)} of {tp}")
    local = shards[0].shape
    if shape is None:
        dim = 0 if split is Split.COLUMN else 1
        shape = (*local[:dim], local[dim] * tp, *local[dim + 1 :])
    out = np.zeros(shape, shards[0].dtype)
    for rank, data in shards.items():
        expected, placed = shard_shape_and_pieces(split, shape, tp, rank)
        if tuple(data.shape) != expected:
            raise LayoutError(
                f"{base}'s adapter {part} is {list(data.shape)} on TP rank {rank}, not "
                f"{list(expected)} as Megatron-Bridge cuts it; the base is not this adapter's"
            )
        for piece in placed:
            src = tuple(slice(o, o + n) for o, n in zip(piece.local, piece.sizes, strict=True))
            dst = tuple(slice(o, o + n) for o, n in zip(piece.canonical, piece.sizes, strict=True))
            out[dst] = data[src]
    return out


def _layout(
    storage: Storage, url: str, inner: str, files: list[str]
) -> tuple[ParallelLayout, list[_RankFile]]:
    """The saved parallel layout (``transformer_config.json`` beside the adapter, or the file
    names where they say it alone) and each rank's file."""
    named: list[tuple[str, re.Match[str]]] = []
    for path in files:
        rest = path[len(inner) :] if path.startswith(inner) else "/"
        match = _FILE.fullmatch(rest)
        if match is not None:
            named.append((path, match))
    if not named:
        raise CheckpointNotFoundError(f"{url}: no mp_rank_*_adapter.pt; not verl's adapter")
    saved = _saved_config(storage, url, inner)
    if saved is not None:
        # The files number each stage's layers from 0: what else splits the layers over the
        # stages would put the adapters on other layers.
        for field in _STAGE_SPLITS:
            if saved.get(field) not in (None, False):
                raise CheckpointError(
                    f"{url}: {TRANSFORMER_CONFIG}: {field}={saved[field]!r} splits the layers "
                    "over the pipeline stages in a way ckptctl does not place adapters by yet"
                )
        layout = layout_of(saved, f"{url}: {TRANSFORMER_CONFIG}")
    elif any(m["a"] for _, m in named):
        raise CheckpointNotFoundError(
            f"{url}: {TRANSFORMER_CONFIG} not found beside {ADAPTER_DIR}; its file names do "
            "not say pipeline from expert ranks: give verl's actor directory"
        )
    else:
        layout = ParallelLayout(tp=len(named))
    if layout.vpp > 1:
        raise CheckpointError(
            f"{url}: saved with virtual pipeline stages (vpp {layout.vpp}): verl saves the "
            "adapter of each rank's first model chunk only, so the others' are not in it"
        )
    found: list[_RankFile] = []
    for path, m in named:
        extra = [int(g) for g in (m["a"], m["b"]) if g is not None]
        pp = extra.pop(0) if layout.pp > 1 and extra else 0
        ep = extra.pop(0) if layout.ep > 1 and extra else 0
        if extra:
            raise CheckpointError(f"{storage.describe(path)}: not a rank of {layout.describe()}")
        found.append(_RankFile(path, int(m["tp"]), pp, ep))
    ranks = {(f.tp, f.pp, f.ep) for f in found}
    sizes = (range(layout.tp), range(layout.pp), range(layout.ep))
    wanted = {(t, p, e) for t in sizes[0] for p in sizes[1] for e in sizes[2]}
    if ranks != wanted:
        absent = sorted(wanted - ranks)[:3]
        raise CheckpointError(
            f"{url}: the adapter of ranks (tp, pp, ep) {absent} is missing, or files of other "
            f"ranks are there (saved at {layout.describe()})"
        )
    return layout, found


_STAGE_SPLITS = (
    "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)
"""``TransformerConfig`` fields that move layers between pipeline stages beyond the uneven
first / last stage counts ``layout_of`` reads."""


def _saved_config(storage: Storage, url: str, inner: str) -> dict[str, Any] | None:
    """verl's ``transformer_config.json``: in the actor directory, beside ``adapter_checkpoint``."""
    if inner and storage.exists(TRANSFORMER_CONFIG):
        text, where = storage.read_text(TRANSFORMER_CONFIG), storage.describe(TRANSFORMER_CONFIG)
    else:
        parent = Storage(url.rstrip("/").rpartition("/")[0] or ".", storage.config, read_only=True)
        if not parent.exists(TRANSFORMER_CONFIG):
            return None
        text, where = parent.read_text(TRANSFORMER_CONFIG), parent.describe(TRANSFORMER_CONFIG)
    return json_input.parse_object(text, where)
