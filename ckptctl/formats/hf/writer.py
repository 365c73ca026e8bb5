"""Writing HF safetensors: the header first (every tensor's dtype, shape and byte range), then
each tensor's bytes streamed in order."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from functools import partial
from math import prod
from typing import Any

from ckptctl.formats.base import WriteJob
from ckptctl.io.byte_streams import ByteStream
from ckptctl.io.prefetch import ReadAhead
from ckptctl.io.runs import Run, write_in_slices
from ckptctl.model.dtypes import DTYPES, ITEMSIZE
from ckptctl.model.plan import FileWrite


def write_safetensors(
    f: ByteStream,
    tensors: list[tuple[str, str, tuple[int, ...]]],
    produce: Callable[[int], Iterable[bytes | memoryview | Run]],
) -> None:
    """Write ``(name, dtype, shape)`` tensors in order; ``produce(i)`` yields tensor i's bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    sizes = []
    for name, dtype, shape in tensors:
        nbytes = prod(shape) * ITEMSIZE[dtype]
        header[name] = {
            "dtype": DTYPES[dtype].safetensors,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        sizes.append(nbytes)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for i, expected in enumerate(sizes):
        written = 0
        for chunk in produce(i):
            if isinstance(chunk, Run):  # unchanged source bytes: a kernel copy where possible
                chunk.write_to(f)
                written += chunk.nbytes
            else:
                write_in_slices(f, chunk)
                written += len(chunk)
        if written != expected:
            raise AssertionError(f"tensor {tensors[i][0]}: wrote {written} of {expected} bytes")


def write_safetensors_file(job: WriteJob, file: FileWrite, out: ByteStream) -> None:
    """One ``model*.safetensors`` of the plan, tensors assembled and streamed in order."""
    entries = [(str(t.key[0]), t.dtype, t.shape) for t in file.tensors]
    produce = partial(job.assemble.chunks, file=file.path)
    job.assemble.expect(file.tensors)
    with ReadAhead(list(file.tensors), produce) as ahead:
        write_safetensors(out, entries, lambda i: ahead(file.tensors[i]))
