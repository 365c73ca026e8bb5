"""LoRA on parameters (PEFT's ``target_parameters``): adapters on a mixture of experts' packed
weights, as OpenAI's GPT-OSS fine-tuning recipe trains them. Pure.

PEFT wraps each targeted parameter (``mlp.experts.gate_up_proj [E, in, out]``) in a
``ParamWrapper`` whose ``lora_A [r * E, in]`` holds each expert's ``A`` one after another and
whose ``lora_B [out, r * E]`` holds the experts' ``B`` columns interleaved (column ``k * E + e``
is expert ``e``'s ``k``-th); expert ``e``'s delta is ``scaling * B_e @ A_e``, ``[out, in]``,
added to its ``[in, out]`` block transposed (``einsum("o r e, e r i -> e i o")``). Several
parameters of one module nest: the module's first targeted parameter is wrapped first, so its
adapter is saved under the most ``base_layer.`` links, the last one's under none.

Only the packed layout transformers keeps in memory and GPT-OSS also releases (``[E, in, out]``,
``is_transposed``) is read; others are refused by name (``parameter_target``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ckptctl.errors import LayoutError

NESTED = ".base_layer"
PARAMETER_ORDER = ("gate_up_proj", "down_proj")
"""The packed expert parameters ckptctl merges into, in the order transformers' expert modules
define them (GPT-OSS's ``GptOssExperts``): the order PEFT nests their wrappers in."""


def parameter_target(module: str, targets: Sequence[str], where: str) -> tuple[str, str] | None:
    """``(weight, module)`` of a saved LoRA module (its name in the adapter, ``base_layer``
    links included) that adapts a parameter (``target_parameters``), or ``None`` for a layer's
    LoRA. The weight is the packed parameter's name in the model."""
    depth, stripped = 0, module
    while stripped.endswith(NESTED):
        stripped, depth = stripped.removesuffix(NESTED), depth + 1
    named = []
    for target in targets:
        owner, _, parameter = str(target).rpartition(".")
        if owner and (stripped == owner or stripped.endswith("." + owner)):
            named.append(parameter)
    if not named:
        if depth:
            raise LayoutError(
                f"{where}: {module} is a nested LoRA wrapper, but no target_parameters entry "
                "names a parameter of its module"
            )
        return None
    unknown = sorted(set(named) - set(PARAMETER_ORDER))
    if unknown:
        raise LayoutError(
            f"{where}: target_parameters {', '.join(unknown)} of {stripped}: merge-lora merges "
            f"LoRA on the packed expert weights {', '.join(PARAMETER_ORDER)} only"
        )
    ordered = [p for p in PARAMETER_ORDER if p in named]
    if depth >= len(ordered):
        raise LayoutError(
            f"{where}: {module} nests {depth} wrappers, but target_parameters names "
            f"{len(ordered)} parameter(s) of {stripped}"
        )
    return f"{stripped}.{ordered[len(ordered) - 1 - depth]}", stripped


def expert_count(rows: int, rank: int, module: str, where: str) -> int:
    """How many experts a parameter adapter of ``rows`` A rows and rank ``rank`` spans."""
    if rank <= 0 or rows % rank:
        raise LayoutError(
            f"{where}: {module}'s lora_A has {rows} rows, no multiple of its rank {rank}"
        )
    return rows // rank


def interleaved_rows(out: int) -> list[int]:
    """Rows of a packed ``gate_up_proj``'s transposed block (``[2i, in]``: gate and up
    interleaved, GPT-OSS's layout) for each canonical row (gates, then ups)."""
    half = out // 2
    return [2 * r for r in range(half)] + [2 * r + 1 for r in range(half)]
