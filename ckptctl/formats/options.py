"""Options a user gives about the checkpoint being read (CLI flags such as ``--hf-config``), as
the formats that read them declare them.

An option lives with the format that reads it (``deepspeed.options.TAG``,
``megatron_common.options.ITERATION``); the ones several formats read are here. A format lists
what it reads in ``CheckpointFormat.options`` and asks ``ProbeRequest.get`` for each value; the
probe refuses, by its flag, an option that no source of the job reads (it would change
nothing), rather than ignore it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class FormatOption(Generic[T]):
    """One option: ``name`` is its key in ``ProbeRequest.options`` (and the ``Settings`` field
    or job argument it comes from), ``flag`` the CLI flag that gives it."""

    name: str
    flag: str
    about: str
    """What it does, completing "``--flag`` ...": said when it is refused."""
    default: T
    refused_unread: bool = True
    """Refused when no source of the job reads it (``False``: a target or an adapter of the
    job may read it too, so the probe alone cannot tell it changes nothing)."""
    instead: Mapping[str, str] = field(default_factory=dict)
    """Per format that does not read it, the flag meant instead (``--tag`` on Megatron:
    ``--iteration``)."""
    hint: str = ""
    """What to do next when it is refused, for every format."""


HF_CONFIG: FormatOption[Mapping[str, Any] | None] = FormatOption(
    "hf_config",
    "--hf-config",
    "gives the HF config.json of a checkpoint that holds an HF model",
    None,
)
TRUSTED_FIELDS: FormatOption[frozenset[str]] = FormatOption(
    "trusted_fields",
    "--trust-field",
    "vouches for fields of a model description",
    frozenset(),
    refused_unread=False,  # an adapter's config (merge-lora) is read with it too
)
TEXT_ONLY: FormatOption[bool] = FormatOption(
    "text_only",
    "--text-only",
    "reads the text decoder of a vision-language model saved by transformers (HF "
    "safetensors) or FSDP (DCP)",
    False,
)
ALLOW_ROUNDING: FormatOption[bool] = FormatOption(
    "allow_rounding",
    "--allow-rounding",
    "rounds weights HF stores shifted from Megatron's",
    False,
    refused_unread=False,  # writing HF rounds with it too (the job refuses it when needless)
)


def given(values: Mapping[str, Any]) -> dict[str, Any]:
    """The options the user gave, by name: those not at the value meaning "not given"."""
    return {k: v for k, v in values.items() if v is not None and v is not False and v != set()}
