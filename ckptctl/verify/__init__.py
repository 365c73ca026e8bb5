"""``ckptctl verify``: whether a checkpoint is whole (``checks``) and whether two checkpoints
hold the same tensors (``compare``, ``padding_rows``)."""
