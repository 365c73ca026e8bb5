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
    """One ``model*.safetensors`` of the plan, tensors assembled and streamed in order; the
    blocks of a packed tensor (GPT-OSS's experts: writes of one key with a ``base_shape``)
    one after the other as that tensor."""
    groups: list[list[int]] = []
    for i, t in enumerate(file.tensors):
        if groups and t.base_shape and file.tensors[groups[-1][0]].key == t.key:
            groups[-1].append(i)
        else:
            groups.append([i])
    entries = []
    for members in groups:
        first = file.tensors[members[0]]
        shape = first.base_shape or first.shape
        if sum(prod(file.tensors[i].shape) for i in members) != prod(shape):
            raise AssertionError(f"tensor {first.key[0]}: its blocks do not fill it")
        entries.append((str(first.key[0]), first.dtype, shape))
    produce = partial(job.assemble.chunks, file=file.path)
    job.assemble.expect(file.tensors)
    with ReadAhead(list(file.tensors), produce) as ahead:

        def chunks(i: int) -> Iterable[bytes | memoryview | Run]:
            for member in groups[i]:
                yield from ahead(file.tensors[member])

        write_safetensors(out, entries, chunks)
