"""A PEFT LoRA adapter as the merge sees it: which base weights it changes and by how much.
Pure: the adapter's ``adapter_config.json`` (parsed) and its tensors' names and shapes in,
the merge's terms out.

PEFT's LoRA adds ``scaling * B @ A`` to a linear layer's weight ``W [out, in]`` (``A [r, in]``,
``B [out, r]``), with ``scaling = lora_alpha / r`` (``/ sqrt(r)`` under ``use_rslora``), the rank
and alpha of a module taken from ``rank_pattern`` / ``alpha_pattern`` when a key matches its
name. Any field that changes the merged weights in another way (DoRA, LoRA biases, modules
saved whole, initialisations that change the base, ...) is refused by name unless at its
default: a merge that ignored it would write wrong weights.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ckptctl.errors import LayoutError
from ckptctl.model.geometry import Shape
from ckptctl.model.lora_params import expert_count, parameter_target

ADAPTER_CONFIG = "adapter_config.json"
"""What marks a PEFT adapter directory (``save_pretrained`` of a PEFT model)."""
PREFIX = "base_model.model."
"""Where PEFT's saved adapter names start (the wrapped model's own names follow)."""
_TOKENS = re.compile(r"(?P<module>.+)\.token_adapter\.trainable_tokens_delta")
_LORA = re.compile(r"(?P<module>.+)\.lora_(?P<part>A|B)(?:\.(?P<adapter>[^.]+))?\.weight")
_EMBEDDING_LORA = re.compile(
    r"(?P<module>.+)\.lora_embedding_(?P<part>A|B)(?:\.(?P<adapter>[^.]+))?"
)
_BASE_LAYER = re.compile(r"(?P<module>.+)\.base_layer\.(?P<param>weight|bias)")

HARMLESS = frozenset(
    {
        "task_type",
        "peft_type",
        "auto_mapping",
        "peft_version",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "r",
        "lora_alpha",
        "use_rslora",
        "rank_pattern",
        "alpha_pattern",
        "target_modules",
        "exclude_modules",
        "layers_to_transform",
        "layers_pattern",
        "lora_dropout",
        "init_lora_weights",
        "runtime_config",
        "megatron_core",
        "qalora_group_size",
        "ensure_weight_tying",
        "eva_config",  # EVA initialises A and B only: the saved adapter is what it is
        "modules_to_save",  # their trained tensors replace the base's (``Replacement``)
        "trainable_token_indices",  # those rows replaced (``TokenRows``)
        "target_parameters",  # LoRA on packed expert weights (``lora_params``)
    }
)
"""Fields that do not change what merging the saved tensors means."""
CHANGES_THE_MERGE = {
    "fan_in_fan_out": "a Conv1D model's transposed weights",
    "bias": "LoRA biases",
    "lora_bias": "LoRA biases",
    "use_dora": "DoRA's magnitude vectors",
    "layer_replication": "replicated layers",
    "megatron_config": "Megatron-parallel LoRA layers",
    "loftq_config": "LoftQ, which changes the base weights",
    "corda_config": "CorDA, which changes the base weights",
    "lora_ga_config": "LoRA-GA, which changes the base weights",
    "use_qalora": "QA-LoRA's pooled inputs",
    "alora_invocation_tokens": "activated LoRA (applies after its invocation tokens only)",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing among adapters",
    "kasa_config": "KaSA's singular-value adapters",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA's sampled adapters",
}
"""Fields that change the merge when not at their default, and what they are."""
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")
"""``init_lora_weights`` values that move part of the base into the adapter at training
start: the saved adapter then belongs to a changed base (PEFT converts it only when asked)."""


@dataclass(frozen=True, slots=True)
class LoraPair:
    """One adapted linear layer: ``weight += scaling * B @ A``."""

    weight: str
    """The base weight's name (HF), e.g. ``model.layers.0.self_attn.q_proj.weight``."""
    a: str
    b: str
    """The adapter's tensor names."""
    rank: int
    scaling: float
    shape: Shape
    """The base weight's shape the adapter implies: ``(B's rows, A's columns)``."""
    embedding: bool = False
    """An embedding's LoRA (``lora_embedding_A [r, vocab]``, ``_B [dim, r]``): the delta is
    ``(B @ A)`` transposed."""
    experts: int = 0
    """LoRA on a packed expert parameter (``lora_params``): how many experts ``A`` and ``B``
    hold, ``rank`` each; ``shape`` is one expert's ``[out, in]``."""
    kernel: Shape = ()
    """A convolution's LoRA (``A`` a convolution ``[r, in, *kernel]``, ``B`` a 1x..1 one ``[out,
    r, 1, ...]``): its kernel; ``shape`` is then the whole ``[out, in, *kernel]``."""


@dataclass(frozen=True, slots=True)
class Replacement:
    """A tensor of a module trained whole beside the adapter (``modules_to_save``): the
    merged model holds it instead of the base's."""

    weight: str
    tensor: str
    """The adapter's tensor name."""
    shape: Shape


@dataclass(frozen=True, slots=True)
class TokenRows:
    """Rows of an embedding trained beside the adapter (``trainable_token_indices``): the
    merged model holds the trained rows at ``indices`` (PEFT's ``index_copy``)."""

    weight: str
    tensor: str
    indices: tuple[int, ...]


def token_rows(
    config: dict[str, Any], shapes: dict[str, Shape], where: str
) -> dict[str, TokenRows]:
    """Each embedding whose rows the adapter trained, by its weight's name."""
    asked = config.get("trainable_token_indices")
    out: dict[str, TokenRows] = {}
    for name, shape in shapes.items():
        match = _TOKENS.fullmatch(_local(name))
        if match is None:
            continue
        module = match["module"]
        if isinstance(asked, dict):
            key = next((k for k in asked if _is_module(module, k)), None)
            indices = asked.get(key) if key is not None else None
        else:
            indices = asked
        if not isinstance(indices, list) or not all(isinstance(i, int) for i in indices):
            raise LayoutError(f"{where}: {name}: trainable_token_indices names no rows for it")
        if len(set(indices)) != len(indices) or len(shape) != 2 or shape[0] != len(indices):
            raise LayoutError(
                f"{where}: {name} holds {list(shape)} rows for the indices {indices[:8]}: "
                "one row per distinct index is needed"
            )
        out[f"{module}.weight"] = TokenRows(f"{module}.weight", name, tuple(indices))
    return out


def _local(name: str) -> str:
    """An adapter tensor's name in the wrapped model (``""`` for one PEFT did not save)."""
    return name[len(PREFIX) :] if name.startswith(PREFIX) else ""


def _is_module(module: str, key: str) -> bool:
    """PEFT's rule for a config's module list: the name, or its dotted tail."""
    return module == key or module.endswith("." + key)


def _is_default(value: Any) -> bool:
    return value in (None, False, "none", {}, [], 0)


def check_config(config: dict[str, Any], where: str, trusted: frozenset[str]) -> None:
    """Refuse, by name, a config whose merge ckptctl would not do exactly as PEFT does."""
    kind = config.get("peft_type")
    if kind != "LORA":
        raise LayoutError(f"{where}: peft_type is {kind!r}; only LoRA adapters are merged")
    for field, value in config.items():
        if field in HARMLESS or field in trusted or _is_default(value):
            continue
        what = CHANGES_THE_MERGE.get(field)
        if what is not None:
            raise LayoutError(
                f"{where}: {field} = {value!r} ({what}) is not supported by merge-lora; "
                "merge with PEFT's merge_and_unload instead"
            )
        raise LayoutError(
            f"{where}: unknown field {field} = {value!r}; if it does not change the merged "
            f"weights, pass --trust-field {field}"
        )
    init = str(config.get("init_lora_weights", True)).lower()
    if init.startswith(_BASE_CHANGING_INITS):
        raise LayoutError(
            f"{where}: init_lora_weights = {config['init_lora_weights']!r} changed the base "
            "weights when training began; convert the adapter with PEFT "
            "(path_initial_model_for_weight_conversion) before merging it"
        )


_REPEATED_GROUP = re.compile(r"\)[*+{?]")
"""A repeated group in a pattern: what catastrophic backtracking needs (``(a+)+``)."""


def _pattern_value(patterns: dict[str, Any], module: str, default: Any, where: str) -> Any:
    """PEFT's rule: the first pattern key that matches the module name's tail. The keys come
    from an untrusted file: a key that repeats a group is refused, not run, since such a
    regular expression can take exponential time on a module's name."""
    for key, value in patterns.items():
        if not isinstance(key, str) or len(key) > 500 or _REPEATED_GROUP.search(key):
            raise LayoutError(
                f"{where}: rank_pattern / alpha_pattern key {str(key)[:60]!r} repeats a group "
                "(or is over 500 characters): ckptctl does not evaluate such patterns"
            )
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error as err:
            raise LayoutError(f"{where}: rank_pattern / alpha_pattern key {key!r}: {err}") from None
    return default


def replacements(config: dict[str, Any], shapes: dict[str, Shape]) -> dict[str, Replacement]:
    """The tensors of ``modules_to_save`` the adapter holds whole (PEFT saves them under the
    module's own name), by the base tensor they replace."""
    saved = config.get("modules_to_save") or []
    out: dict[str, Replacement] = {}
    for name, shape in shapes.items():
        local = _local(name)
        module = local.rpartition(".")[0]
        if any(_is_module(module, m) for m in saved):
            out[local] = Replacement(local, name, shape)
        elif (layer := _BASE_LAYER.fullmatch(local)) is not None:
            # PEFT saves an adapted embedding's base layer beside the adapter (a resized
            # vocabulary's rows) and loads it over the base's: the merge starts from it.
            weight = f"{layer['module']}.{layer['param']}"
            out[weight] = Replacement(weight, name, shape)
    return out


def _conv_kernel(a: Shape, b: Shape, embedding: bool) -> Shape | None:
    """``()`` for a linear layer's (or an embedding's) matrices of one rank; a convolution's
    kernel for PEFT's convolution LoRA (``A [r, in, *kernel]``, ``B [out, r, 1, ...]``); else
    ``None``."""
    if len(a) == 2 and len(b) == 2:
        return () if a[0] == b[1] else None
    one_by_one = len(b) == len(a) and all(k == 1 for k in b[2:])
    if embedding or len(a) not in (3, 4, 5) or not one_by_one or a[0] != b[1]:
        return None
    return tuple(a[2:])


def pairs(config: dict[str, Any], shapes: dict[str, Shape], where: str) -> dict[str, LoraPair]:
    """Each adapted base weight (by name) and its merge terms, from the adapter's tensor
    names and shapes; anything else in the adapter (but ``modules_to_save``'s tensors) is
    refused by name."""
    found: dict[str, dict[str, tuple[str, Shape]]] = {}
    whole = {r.tensor for r in replacements(config, shapes).values()}
    whole |= {name for name in shapes if _TOKENS.fullmatch(_local(name))}
    embeddings: set[str] = set()
    for name, shape in shapes.items():
        if name in whole:
            continue
        local = _local(name)
        match = _LORA.fullmatch(local) or _EMBEDDING_LORA.fullmatch(local)
        if match is None:
            raise LayoutError(
                f"{where}: tensor {name} is not a LoRA A or B matrix of a linear, embedding "
                "or convolution layer"
            )
        if match.re is _EMBEDDING_LORA:
            embeddings.add(match["module"])
            shape = shape[::-1]  # A [r, vocab], B [dim, r]: as a linear layer's, transposed
        found.setdefault(match["module"], {})[match["part"]] = (name, shape)
    out: dict[str, LoraPair] = {}
    use_rslora = bool(config.get("use_rslora"))
    targets = config.get("target_parameters") or []
    for module, parts in sorted(found.items()):
        if set(parts) != {"A", "B"}:
            missing = ({"A", "B"} - set(parts)).pop()
            raise LayoutError(f"{where}: {module} has no lora_{missing} matrix")
        (a, a_shape), (b, b_shape) = parts["A"], parts["B"]
        embedding = module in embeddings
        if embedding:  # back to A [r, vocab], B [dim, r]
            a_shape, b_shape = a_shape[::-1], b_shape[::-1]
        kernel = _conv_kernel(a_shape, b_shape, embedding)
        if kernel is not None and len(kernel) == 3 and kernel[:2] == (1, 1):
            raise LayoutError(
                f"{where}: {module} is a 3-D convolution of kernel {list(kernel)}, which PEFT "
                "merges through its 1x1 path (meant for 2-D kernels): not merged"
            )
        if kernel is None:
            raise LayoutError(
                f"{where}: {module}'s lora_A {list(a_shape)} and lora_B {list(b_shape)} are "
                "not the matrices (or convolutions) of one rank"
            )
        rank = a_shape[0]
        ranks = config.get("rank_pattern") or {}
        parameter = parameter_target(module, targets, where) if targets else None
        stated = _pattern_value(ranks, module, config.get("r", 8), where)
        experts = 0
        if parameter is not None:  # A holds every expert's rows: rank * experts
            experts = expert_count(rank, stated, module, where)
            rank = stated
        if stated != rank:
            raise LayoutError(
                f"{where}: {module}'s matrices have rank {rank}, the config says {stated}"
            )
        alphas = config.get("alpha_pattern") or {}
        alpha = _pattern_value(alphas, module, config.get("lora_alpha", 8), where)
        scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        weight = f"{module}.weight" if parameter is None else parameter[0]
        shape = (a_shape[1], b_shape[0]) if embedding else (b_shape[0], a_shape[1], *kernel)
        if weight in out:
            raise LayoutError(f"{where}: two adapters of {weight}")
        out[weight] = LoraPair(weight, a, b, rank, scaling, shape, embedding, experts, kernel)
    return out
