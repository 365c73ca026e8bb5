"""Writing HF safetensors with block-scaled FP8 linear weights (``--dtype fp8-block``): each
quantized weight is assembled in its own dtype, quantized a block of rows at a time as it
streams (``fp8.quantize_rows``) and followed by its ``weight_scale_inv``; the FP8 bytes and the
scales are what the manifest's checksums cover, and each weight's largest error goes to the
report (``Report.quantized``), which ``verify --against`` holds the file to."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from math import prod

import numpy as np
import xxhash

from ckptctl.arrays import buffer, numpy_dtype, words
from ckptctl.formats.base import WriteJob
from ckptctl.formats.hf.fp8 import FP8, SCALE_SUFFIX, WRITE_BLOCK, quantizable
from ckptctl.formats.hf.fp8_math import quantize_rows
from ckptctl.formats.hf.writer import write_safetensors
from ckptctl.io.byte_streams import ByteStream
from ckptctl.io.prefetch import ReadAhead
from ckptctl.io.runs import Run
from ckptctl.model.dtypes import ITEMSIZE
from ckptctl.model.plan import FileWrite, TensorWrite


class Collect:
    """Where a ``Run``'s bytes land when they must be looked at (not a file: no kernel copy)."""

    def __init__(self, into: bytearray) -> None:
        self.into = into

    def write(self, data: memoryview | bytes) -> int:
        self.into += data
        return len(data)


def write_fp8_safetensors_file(job: WriteJob, file: FileWrite, out: ByteStream) -> None:
    entries: list[tuple[str, str, tuple[int, ...]]] = []
    parts: list[tuple[str, TensorWrite]] = []
    for t in file.tensors:
        name = str(t.key[0])
        if quantizable(name, t.shape):
            grid = WRITE_BLOCK.scale_shape((t.shape[0], t.shape[1]))
            entries += [(name, FP8, t.shape), (name + SCALE_SUFFIX, "float32", grid)]
            parts += [("weight", t), ("scales", t)]
        else:
            entries.append((name, t.dtype, t.shape))
            parts.append(("plain", t))
    scales: dict[str, bytes] = {}
    checksums = job.report.tensor_checksums.setdefault(file.path, {})

    def chunks(t: TensorWrite) -> Iterable[memoryview | Run]:
        return job.assemble.chunks(t, file.path)

    job.assemble.expect(file.tensors)
    with ReadAhead(list(file.tensors), chunks) as ahead:

        def produce(i: int) -> Iterable[bytes | memoryview | Run]:
            kind, t = parts[i]
            name = str(t.key[0])
            if kind == "plain":
                return ahead(t)
            if kind == "scales":
                data = scales.pop(name)
                checksums[name + SCALE_SUFFIX] = xxhash.xxh3_64_hexdigest(data)
                return [data]
            return _quantized(job, file.path, t, ahead(t), scales, checksums)

        write_safetensors(out, entries, produce)


def _quantized(
    job: WriteJob,
    path: str,
    t: TensorWrite,
    source: Iterable[memoryview | Run],
    scales: dict[str, bytes],
    checksums: dict[str, str],
) -> Iterator[memoryview]:
    """Weight ``t``'s FP8 bytes, a block of rows at a time, from its bytes in its own dtype;
    its scales are left in ``scales`` for the entry that follows it."""
    name = str(t.key[0])
    columns = t.shape[1]
    step = WRITE_BLOCK.block[0] * columns * ITEMSIZE[t.dtype]
    pending = bytearray()
    digest = xxhash.xxh3_64()
    grid: list[np.ndarray] = []
    largest = 0.0
    written = 0

    def emit(data: bytes | bytearray | memoryview) -> memoryview:
        nonlocal largest, written
        rows = np.frombuffer(data, numpy_dtype(t.dtype)).reshape(-1, columns)
        codes, inverse, error = quantize_rows(rows, WRITE_BLOCK.block)
        grid.append(inverse)
        largest = max(largest, error)
        view = buffer(words(codes).reshape(-1))
        digest.update(view)
        written += len(view)
        return view

    for chunk in source:
        if isinstance(chunk, Run):
            chunk.write_to(Collect(pending))
        else:
            pending += chunk
        at = 0
        while len(pending) - at >= step:
            yield emit(memoryview(pending)[at : at + step].tobytes())
            at += step
        del pending[:at]
    if pending:
        yield emit(bytes(pending))
    scales[name] = np.concatenate(grid).astype("<f4").tobytes()
    with job.assemble.counting:  # it counted the weight's bytes in its own dtype as written
        job.report.bytes_written -= prod(t.shape) * ITEMSIZE[t.dtype] - written
        job.report.bytes_written += len(scales[name])
    # The assembler recorded the checksum of the bytes it gave; the file holds these.
    checksums[name] = digest.hexdigest()
    errors = job.report.quantized.setdefault(path, {})
    errors[t.canonical] = max(errors.get(t.canonical, 0.0), largest)
