"""Writing GPT-OSS's HF safetensors with its expert weights in MXFP4 (``--dtype mxfp4``), as
OpenAI releases it: each packed expert weight ``X`` as ``X_blocks`` then ``X_scales``
(``mxfp4``). Each expert's block of ``X`` is assembled in its own dtype in Megatron's
orientation (rows are outputs: the release's), quantized a band of rows at a time as it
streams (``mxfp4_math.quantize_rows``); the scales of every expert follow the blocks. The
codes and scales are what the manifest's checksums cover, and each expert weight's largest
error goes to the report (``Report.quantized``), which ``verify --against`` holds it to."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from math import prod

import numpy as np
import xxhash

from ckptctl.arrays import buffer, numpy_dtype, words
from ckptctl.formats.base import WriteJob
from ckptctl.formats.hf import mxfp4
from ckptctl.formats.hf.fp8_writer import Collect
from ckptctl.formats.hf.mxfp4_math import quantize_rows
from ckptctl.formats.hf.mxfp4_target import quantized_name
from ckptctl.formats.hf.writer import write_safetensors
from ckptctl.io.byte_streams import ByteStream
from ckptctl.io.prefetch import ReadAhead
from ckptctl.io.runs import Run
from ckptctl.model.dtypes import ITEMSIZE
from ckptctl.model.plan import FileWrite, TensorWrite


def write_mxfp4_safetensors_file(job: WriteJob, file: FileWrite, out: ByteStream) -> None:
    groups: list[list[TensorWrite]] = []
    for t in file.tensors:
        if groups and t.base_shape and groups[-1][0].key == t.key:
            groups[-1].append(t)
        else:
            groups.append([t])
    entries: list[tuple[str, str, tuple[int, ...]]] = []
    parts: list[tuple[str, list[TensorWrite]]] = []
    for members in groups:
        first = members[0]
        name = str(first.key[0])
        shape = first.base_shape or first.shape
        if quantized_name(name):
            experts, outputs, inputs = shape
            grid = (experts, outputs, inputs // mxfp4.BLOCK)
            entries += [
                (name + mxfp4.BLOCKS, "uint8", (*grid, 16)),
                (name + mxfp4.SCALES, "uint8", grid),
            ]
            parts += [("blocks", members), ("scales", members)]
        else:
            entries.append((name, first.dtype, shape))
            parts.append(("plain", members))
    scales: dict[str, bytes] = {}
    checksums = job.report.tensor_checksums.setdefault(file.path, {})

    def chunks(t: TensorWrite) -> Iterable[memoryview | Run]:
        return job.assemble.chunks(t, file.path)

    job.assemble.expect(file.tensors)
    with ReadAhead(list(file.tensors), chunks) as ahead:

        def produce(i: int) -> Iterable[bytes | memoryview | Run]:
            kind, members = parts[i]
            name = str(members[0].key[0])
            if kind == "plain":
                return (chunk for t in members for chunk in ahead(t))
            if kind == "scales":
                data = scales.pop(name)
                checksums[name + mxfp4.SCALES] = xxhash.xxh3_64_hexdigest(data)
                return [data]
            return _quantized(job, file.path, members, ahead, scales, checksums)

        write_safetensors(out, entries, produce)


def _quantized(
    job: WriteJob,
    path: str,
    members: list[TensorWrite],
    ahead: ReadAhead,
    scales: dict[str, bytes],
    checksums: dict[str, str],
) -> Iterator[memoryview]:
    """Packed weight ``members`` (one write per expert)'s codes, expert by expert and a band
    of rows at a time; its scales are left in ``scales`` for the entry that follows it."""
    name = str(members[0].key[0])
    digest = xxhash.xxh3_64()
    grid: list[np.ndarray] = []
    written = 0
    for t in members:
        columns = t.shape[1]
        largest = 0.0
        for chunk in _rows(ahead(t), columns * ITEMSIZE[t.dtype]):
            rows = np.frombuffer(chunk, numpy_dtype(t.dtype)).reshape(-1, columns)
            codes, powers, error = quantize_rows(rows)
            grid.append(powers)
            largest = max(largest, error)
            view = buffer(words(codes).reshape(-1))
            digest.update(view)
            written += len(view)
            yield view
        errors = job.report.quantized.setdefault(path, {})
        errors[t.canonical] = max(errors.get(t.canonical, 0.0), largest)
        # the assembler recorded the checksum of the bytes it gave; the file holds others
        checksums.pop(f"{name}@{t.view_offset}", None)
    scales[name] = np.concatenate([g.reshape(-1) for g in grid]).tobytes()
    source = sum(prod(t.shape) * ITEMSIZE[t.dtype] for t in members)
    with job.assemble.counting:  # it counted the weights' bytes in their own dtype
        job.report.bytes_written += written + len(scales[name]) - source
    checksums[name + mxfp4.BLOCKS] = digest.hexdigest()


def _rows(source: Iterable[memoryview | Run], row_bytes: int) -> Iterator[bytes]:
    """``source``'s bytes in whole rows (as many as each chunk completes)."""
    pending = bytearray()
    for chunk in source:
        if isinstance(chunk, Run):
            chunk.write_to(Collect(pending))
        else:
            pending += chunk
        whole = len(pending) // row_bytes * row_bytes
        if whole:
            yield bytes(pending[:whole])
            del pending[:whole]
    if pending:
        raise AssertionError("a weight's bytes ended inside a row")
