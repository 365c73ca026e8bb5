"""Byte movement: the ``Storage`` of any fsspec URL (local files, S3 with multipart uploads, the
staging tier), URL resolution, storage errors, and how source bytes are read ahead and copied.
Knows nothing of checkpoint formats."""
