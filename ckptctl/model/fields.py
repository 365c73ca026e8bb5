"""One refusal for every model description (Megatron ``args``, HF ``config.json``): fields that
change the model away from what ckptctl can carry, and fields it does not know. Pure."""

from __future__ import annotations

from ckptctl.errors import LayoutError

TRUST_HINT = (
    "if you know a field leaves the tensors' layout and meaning unchanged, pass --trust-field NAME"
)


def refuse_fields(changed: list[str], unknown: list[str], context: str = "") -> None:
    """Raise ``LayoutError`` naming ``changed`` (``name=value`` the model spec cannot carry) and
    ``unknown`` fields (``context`` says where ckptctl looked them up); nothing if both are
    empty."""
    problems = []
    if changed:
        problems.append(
            f"{_listed(changed)}: not supported yet (these change the model's math or tensor "
            "layout); ckptctl refuses rather than convert it wrong"
        )
    if unknown:
        problems.append(
            f"{_listed(unknown)}: unknown to ckptctl{context}, so it cannot tell whether "
            f"{'they change' if len(unknown) > 1 else 'it changes'} the model; {TRUST_HINT}"
        )
    if problems:
        raise LayoutError("; ".join(problems))


SHOWN = 4
"""Fields an error line names before it counts the rest: the line stays one line."""


def _listed(items: list[str]) -> str:
    if len(items) <= SHOWN + 1:
        return ", ".join(items)
    return f"{', '.join(items[:SHOWN])} and {len(items) - SHOWN} more"
