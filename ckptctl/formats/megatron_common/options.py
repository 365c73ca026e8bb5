"""The options of Megatron checkpoints (legacy, ``torch_dist``, and DCP saves inside Megatron
iteration directories)."""

from __future__ import annotations

from ckptctl.formats.options import FormatOption

ITERATION: FormatOption[int | None] = FormatOption(
    "iteration",
    "--iteration",
    "names a Megatron iteration directory",
    None,
    instead={"deepspeed": "--tag", "deepspeed-universal": "--tag"},
)
TRUE_VOCAB_SIZE: FormatOption[int | None] = FormatOption(
    "true_vocab_size",
    "--true-vocab-size",
    "unpads the vocabulary rows Megatron padded",
    None,
)
