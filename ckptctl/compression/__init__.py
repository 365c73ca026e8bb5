"""Compressed checkpoints: lossless chunked storage, optionally delta-encoded against a base
checkpoint (``codec``), read transparently by every command (``view``), written and restored by
``ckptctl compress`` / ``decompress`` (``jobs``)."""
