"""The option of DeepSpeed checkpoints: which tag directory to read."""

from __future__ import annotations

from ckptctl.formats.options import FormatOption

TAG: FormatOption[str | None] = FormatOption(
    "tag",
    "--tag",
    "names a DeepSpeed tag directory",
    None,
    instead={"megatron": "--iteration", "torch_dist": "--iteration"},
    hint="beside other checkpoints, give the DeepSpeed tag's directory (CKPT/TAG)",
)
