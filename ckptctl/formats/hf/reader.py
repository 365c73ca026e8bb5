"""HuggingFace safetensors checkpoints: header parsing, ranged reads, streaming writes, probing.

The safetensors library saves from tensors in memory; we write the header from the plan (shapes
and dtypes are known up front) and then stream each tensor's bytes, so a shard never has to be
assembled whole. Reads use the header's offsets to fetch only the needed bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from math import prod
from typing import Any, BinaryIO, ClassVar

import numpy as np
import xxhash

from ckptctl import json_input
from ckptctl.arrays import buffer, packed_block_box, words
from ckptctl.checksums import record_checks
from ckptctl.checksums.manifest import recorded
from ckptctl.errors import CheckpointError, CheckpointNotFoundError, LayoutError, UsageError
from ckptctl.formats.base import Checkpoint
from ckptctl.formats.hf.box_reads import RangeFile, read_box
from ckptctl.formats.hf.fp8 import (
    DEQUANTIZED,
    FP8,
    QUANTIZATION,
    SCALE_SUFFIX,
    BlockFp8,
    block_fp8,
)
from ckptctl.formats.hf.fp8_math import dequantize, scale_rows_and_columns
from ckptctl.formats.hf.mxfp4 import check_config as check_mxfp4
from ckptctl.formats.hf.mxfp4 import is_mxfp4
from ckptctl.formats.hf.packed_experts import Parts, packed_block
from ckptctl.formats.hf.probe_checks import refuse_unmapped, scale_problem
from ckptctl.formats.hf.text_only import read_backbone, renamed
from ckptctl.formats.safetensors_header import SafetensorsEntry, read_header
from ckptctl.formats.shifted_reads import ShiftedReads
from ckptctl.io.runs import Span
from ckptctl.io.storage import Storage
from ckptctl.model.dtypes import ITEMSIZE
from ckptctl.model.hf_config import has_family_table, spec_from_config
from ckptctl.model.hf_layout import (
    CONFIG,
    INDEX,
    SINGLE,
    hf_tensors,
    mtp_marker,
    packed_expert,
    shared_original,
)
from ckptctl.model.hf_qwen35 import MTP_HEAD, mtp_warning, value_shift
from ckptctl.model.hf_text_backbone import TEXT_CONFIG, text_only_hint
from ckptctl.model.layout import ParallelLayout
from ckptctl.model.stored import (
    CheckpointView,
    FlatView,
    Format,
    KeyPath,
    Replica,
    Shape,
    StoredFile,
    StoredTensor,
)


@dataclass
class HFCheckpoint(Checkpoint):
    reads_into: ClassVar[bool] = True
    locates: ClassVar[bool] = True

    storage: Storage
    view: CheckpointView
    headers: dict[str, dict[str, SafetensorsEntry]]
    config: dict[str, Any]
    digests: dict[str, dict[str, str]] = field(default_factory=dict)
    """Each tensor's xxh3-64 by file and name, where a ckptctl manifest records them: the
    format stores no checksum, so these are what every read is held to."""
    fp8: BlockFp8 | None = None
    quantized: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    """FP8 weights by (file, name): where their scales are (read dequantized)."""
    written_errors: dict[str, float] = field(default_factory=dict)
    """The largest error each canonical tensor was quantized with, where ckptctl wrote the FP8
    (its manifest says): ``verify --against`` holds the tensor to it."""
    mxfp4: dict[tuple[str, str], tuple[tuple[str, str], tuple[str, str]]] = field(
        default_factory=dict
    )
    """MXFP4 weights by (file, in-memory name): where their blocks and scales are (read
    dequantized, ``mxfp4``)."""
    packed_gated: frozenset[tuple[str, str]] = frozenset()
    """(file, name) of packed tensors whose gated halves are interleaved (GPT-OSS's
    ``gate_up_proj``): each expert's block is read with its rows put in Megatron's order."""
    shifted: ShiftedReads = field(default_factory=ShiftedReads)
    """Tensors stored shifted from the canonical values (``StoredTensor.shift``): read with
    the shift taken off, exactly or (``--allow-rounding``) rounded."""
    _open: dict[str, BinaryIO] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def read(
        self,
        path: str,
        key: KeyPath,
        offsets: Shape,
        sizes: Shape,
        view: FlatView = None,
        *,
        transposed: bool = False,
        into: np.ndarray | None = None,
    ) -> np.ndarray:
        name = str(key[0])
        if view is not None and (transposed or (path, name) in self.packed_gated):
            return self._read_block(path, name, offsets, sizes, view, transposed)
        if (path, name) in self.mxfp4:
            return self._read_mxfp4(path, name, offsets, sizes)
        if (path, name) in self.shifted:
            data = self._read_box(path, name, offsets, sizes, None, view)
            return self.shifted.unshifted((path, name), data, f"{path}: {name}")
        scales = self.quantized.get((path, name))
        data = self._read_box(path, name, offsets, sizes, None if scales else into, view)
        if scales is None or self.fp8 is None:
            return data
        block = self.fp8.block
        first, count = scale_rows_and_columns(block, offsets, sizes)
        grid = self._read_box(*scales, first, count, None)
        return dequantize(data, grid, block, (offsets[0], offsets[1]))

    def _read_block(
        self,
        path: str,
        name: str,
        offsets: Shape,
        sizes: Shape,
        view: tuple[int, Shape],
        transposed: bool,
    ) -> np.ndarray:
        """Box ``(offsets, sizes)``, in Megatron's orientation and row order, of one expert's
        block of a packed tensor (``view``: its offset and shape in that orientation), stored
        transposed and/or with its gated halves interleaved: the stored rows that span the box
        are read, then turned and put in order."""
        at, shape = view
        stored = (at, shape[::-1] if transposed else shape)
        interleaved = (path, name) in self.packed_gated
        return packed_block_box(
            lambda first, count: self._stored_box(path, name, stored, first, count),
            offsets,
            sizes,
            shape[0],
            transposed,
            interleaved,
        )

    def _stored_box(
        self, path: str, name: str, view: tuple[int, Shape], offsets: Shape, sizes: Shape
    ) -> np.ndarray:
        """A box of a block of a packed tensor as stored (MXFP4: as transformers holds it)."""
        if (path, name) in self.mxfp4:
            at, shape = view
            expert = at // prod(shape)
            data = self._read_mxfp4(path, name, (expert, *offsets), (1, *sizes))
            return data.reshape(sizes)
        return self._read_box(path, name, offsets, sizes, None, view)

    def _read_mxfp4(self, path: str, name: str, offsets: Shape, sizes: Shape) -> np.ndarray:
        from ckptctl.formats.hf.mxfp4_math import read_in_memory_box

        blocks, scales = self.mxfp4[(path, name)]
        return read_in_memory_box(
            lambda where, at, size: self._read_box(*where, at, size, None),
            blocks,
            scales,
            offsets,
            sizes,
        )

    def quantization_errors(self) -> dict[str, float]:
        return self.written_errors

    def rounding_errors(self) -> dict[str, float]:
        return self.shifted.errors

    def _read_box(
        self,
        path: str,
        name: str,
        offsets: Shape,
        sizes: Shape,
        into: np.ndarray | None,
        view: FlatView = None,
    ) -> np.ndarray:
        stored = entry = self.headers[path][name]
        if view is not None:  # one expert's part of a packed tensor: read as a tensor of its own
            at, shape = view
            begin = entry.begin + at * ITEMSIZE[entry.dtype]
            entry = SafetensorsEntry(
                entry.dtype, shape, begin, begin + prod(shape) * ITEMSIZE[entry.dtype]
            )
        where = self.storage.describe(path)
        if not self.storage.is_local:  # exact ranged GETs, several in flight
            data = read_box(RangeFile(self.storage, path), entry, offsets, sizes, into, where)
        else:
            with self._lock:  # one handle per file: seek + read must not interleave
                if path not in self._open:
                    self._open[path] = self.storage.open_read(path)
                data = read_box(self._open[path], entry, offsets, sizes, into, where)
        # a packed expert's part is never the whole stored tensor its checksum covers
        whole = view is None and not any(offsets) and tuple(sizes) == stored.shape
        self._check(path, name, stored, whole, data)
        return data

    def _check(
        self,
        path: str,
        name: str,
        entry: SafetensorsEntry,
        whole: bool,
        data: np.ndarray,
    ) -> None:
        """Hold what was read to the manifest's checksum of its tensor: a whole tensor here
        and now, a part by the check of the whole tensor (``record_checks``)."""
        record = self._record(path, name, entry)
        if record is None:
            return
        if not whole:
            record_checks.ask(record)
        elif xxhash.xxh3_64_hexdigest(buffer(words(data).reshape(-1))) != record.digest:
            raise CheckpointError(record_checks.failure_text(record))

    def _record(self, path: str, name: str, entry: SafetensorsEntry) -> record_checks.Record | None:
        digest = self.digests.get(path, {}).get(name)
        if digest is None:
            return None
        what = f"{self.storage.describe(path)}: tensor {name}"
        size = entry.end - entry.begin
        if self.storage.is_local:
            return self.storage.checks.record(
                self.storage.path(path), entry.begin, size, 0, what, digest=digest
            )
        storage, begin = self.storage, entry.begin
        return storage.checks.record(
            storage.describe(path),
            begin,
            size,
            0,
            what,
            fetch=lambda at, n: storage.read_range(path, begin + at, n),
            version=storage.identity(path),
            digest=digest,
        )

    def where(
        self, path: str, key: KeyPath, offsets: Shape, sizes: Shape, view: FlatView = None
    ) -> Span | None:
        """Where the box lies in the file, when it is whole rows of the tensor (and its bytes
        are the values: not FP8 read dequantized)."""
        if (path, str(key[0])) in self.mxfp4 or (path, str(key[0])) in self.shifted:
            return None  # read dequantized or shifted: not the bytes as stored
        entry = self.headers[path][str(key[0])]
        if view is not None or prod(sizes) == 0 or (path, str(key[0])) in self.quantized:
            return None
        if entry.shape and tuple(sizes[1:]) != tuple(entry.shape[1:]):
            return None
        row = prod(entry.shape[1:]) * ITEMSIZE[entry.dtype]
        start = entry.begin + (offsets[0] * row if entry.shape else 0)
        record = self._record(path, str(key[0]), entry)
        return Span(path, start, prod(sizes) * ITEMSIZE[entry.dtype], entry.dtype, record=record)


def probe_hf(
    storage: Storage,
    make_vocab_size_divisible_by: int = 128,
    trusted: frozenset[str] = frozenset(),
    config: dict[str, Any] | None = None,
    text_only: bool = False,
    round_shifted: bool = False,
) -> HFCheckpoint:
    """Read config (``config``: given, for weights saved without one) and safetensors
    headers; map every HF tensor onto canonical tensors (``text_only``: a vision-language
    model's text decoder's, ``formats.hf.text_only``)."""
    if config is None:
        if not storage.exists(CONFIG):
            raise CheckpointNotFoundError(
                f"{storage.describe(CONFIG)}: missing; not an HF checkpoint"
            )
        config = json_input.parse_object(storage.read_text(CONFIG), storage.describe(CONFIG))
    try:
        # how the weights are stored, not what the model is (MXFP4: GPT-OSS's experts, below)
        fp8 = None if is_mxfp4(config) else block_fp8(config)
        if is_mxfp4(config):
            check_mxfp4(config, storage.describe(CONFIG))
    except LayoutError as err:
        raise LayoutError(f"{storage.describe(CONFIG)}: {err}") from None
    backbone = read_backbone(storage, config, storage.describe(CONFIG)) if text_only else None
    try:
        model = dict(backbone.config if backbone else config)
        model.pop(QUANTIZATION, None)
        spec = spec_from_config(model, make_vocab_size_divisible_by, trusted)
    except LayoutError as err:
        if backbone is not None:
            raise LayoutError(f"{storage.describe(CONFIG)} ({TEXT_CONFIG}): {err}") from None
        # No family table takes it: transformers judges the names, which are kept.
        from ckptctl.formats.hf.named_reader import probe_named

        try:
            hint = text_only_hint(config)
            view, held, experts = probe_named(
                storage, config, f"not convertible to Megatron: {err}{f'; {hint}' if hint else ''}"
            )
        except (CheckpointError, UsageError):
            if has_family_table(config):  # its table's refusal names the field
                raise LayoutError(f"{storage.describe(CONFIG)}: {err}") from None
            raise
        known = recorded(storage)
        digests = known.tensors if known else {}
        return HFCheckpoint(storage, view, held, config, digests, mxfp4=experts)
    if storage.exists(INDEX):
        where = storage.describe(INDEX)
        index = json_input.parse_object(storage.read_text(INDEX), where)
        weight_map = json_input.field(index, "weight_map", dict, f"{where}: malformed index")
        weight_map = renamed(weight_map, backbone)
        for name, rel in weight_map.items():
            if not isinstance(rel, str) or "\x00" in rel:
                raise CheckpointError(f"{where}: the file of tensor {name} is {rel!r}, not a path")
    elif storage.exists(SINGLE):
        weight_map = None
    else:
        raise CheckpointNotFoundError(f"{storage.url}: neither {INDEX} nor {SINGLE} found")
    headers: dict[str, dict[str, SafetensorsEntry]] = {}

    def entry_of(name: str) -> tuple[str, SafetensorsEntry | None]:
        path = weight_map.get(name) if weight_map is not None else SINGLE
        if path is None:
            return "", None
        if path not in headers:
            storage.path(path)  # refuses paths escaping the root before anything is opened
            with storage.open_read(path) as f:
                tensors = read_header(f, storage.describe(path), storage.size(path)).tensors
                headers[path] = renamed(tensors, backbone)
        return path, headers[path].get(name)

    def held_names() -> set[str]:
        """Every tensor the checkpoint holds, by the index or the one file's header."""
        if weight_map is not None:
            return set(weight_map)
        entry_of(SINGLE)  # (reads the file's header)
        return set(headers[SINGLE])

    warnings: tuple[str, ...] = ()
    if spec.mtp_num_layers:
        first = mtp_marker(spec)
        if not any(name.startswith(first) for name in held_names()):
            # transformers saves DeepSeek-V3, GLM-4.5 and the Qwen hybrids without their MTP
            # layers (it never loads them) and keeps the count: the model is whole without them.
            where = storage.describe(CONFIG)
            warnings = (
                mtp_warning(spec.mtp_num_layers, where)
                if first == MTP_HEAD
                else f"{where} announces {spec.mtp_num_layers} multi-token "
                "prediction layer(s) (num_nextn_predict_layers) but the checkpoint holds none "
                "(transformers drops them when it saves): read, and written, without them",
            )
            spec = spec.model_copy(update={"mtp_num_layers": 0})
    quantized: dict[tuple[str, str], tuple[str, str]] = {}
    used: set[str] = set()
    copies: list[tuple[str, str, str]] = []
    files: dict[str, list[StoredTensor]] = {}
    problems = []
    packed_gated: set[tuple[str, str]] = set()
    shifted_names: dict[Hashable, tuple[float, str]] = {}
    dequantized: dict[tuple[str, str], Parts] = {}
    for name, canonical, shape, pieces in hf_tensors(spec):
        found = packed_block(spec, name, canonical, shape, pieces, entry_of, is_mxfp4(config))
        if isinstance(found, str):
            problems.append(found)
            continue
        if found is not None:  # an expert's block of a packed tensor (GPT-OSS)
            where, tensor, parts = found
            files.setdefault(where, []).append(tensor)
            if tensor.interleaved:
                packed_gated.add((where, name))
            if parts is not None:
                dequantized[(where, name)] = parts
                used.update(part for _, part in parts)
            continue
        path, entry = entry_of(name)
        packed = packed_expert(spec, name) if entry is None else None
        if packed is not None and entry_of(packed[0])[1] is not None:
            # transformers 5's in-memory spelling: every expert in one tensor
            where, whole = entry_of(packed[0])
            assert whole is not None
            if whole.dtype == FP8:
                problems.append(
                    f"{storage.describe(where)}: {packed[0]} holds every expert in {FP8}; "
                    "ckptctl reads FP8 experts stored one by one (as released) only"
                )
                continue
            if whole.shape != packed[1]:
                problems.append(
                    f"{storage.describe(where)}: tensor {packed[0]} has shape "
                    f"{list(whole.shape)}, expected {list(packed[1])}"
                )
                continue
            used.add(packed[0])
            tensor = StoredTensor((packed[0],), canonical, shape, whole.dtype, pieces, packed[2])
            files.setdefault(where, []).append(tensor)
            continue
        if not path:
            problems.append(f"{storage.describe(INDEX)}: no file for tensor {name}")
            continue
        if entry is None:
            problems.append(f"{storage.describe(path)}: tensor {name} missing")
            continue
        if entry.shape != shape:
            problems.append(
                f"{storage.describe(path)}: tensor {name} has shape {list(entry.shape)}, "
                f"expected {list(shape)}"
            )
            continue
        original = shared_original(spec, name)
        if original is not None:  # an MTP layer's copy: checked against the original, not read
            copies.append((name, path, original))
            continue
        dtype = entry.dtype
        if dtype == FP8:
            problem = scale_problem(fp8, name, shape, entry_of(name + SCALE_SUFFIX), storage)
            if problem:
                problems.append(problem)
                continue
            quantized[(path, name)] = (entry_of(name + SCALE_SUFFIX)[0], name + SCALE_SUFFIX)
            dtype = DEQUANTIZED
        shift = value_shift(spec, name)
        if shift:
            shifted_names[(path, name)] = (shift, canonical)
        tensor = StoredTensor((name,), canonical, shape, dtype, pieces, shift=shift)
        files.setdefault(path, []).append(tensor)
    if problems:
        raise CheckpointError("; ".join(problems[:5]))
    held = held_names()
    mapped = {name for name, *_ in hf_tensors(spec)} | {name for _, name in quantized.values()}
    mapped |= used
    refuse_unmapped(held - mapped, spec, storage)
    replicas = tuple(
        Replica(entry_of(original)[0], (original,), headers[path][name].shape, path, (name,))
        for name, path, original in copies
    )
    view = CheckpointView(
        Format.HF,
        spec,
        ParallelLayout(),
        tuple(StoredFile(path, tuple(ts)) for path, ts in files.items()),
        None,
        False,
        (
            "HF checkpoints hold weights only: no optimizer state",
            *([backbone.note()] if backbone else []),
            *(
                [f"{len(quantized)} weights stored as {fp8.describe()}"]
                if fp8 and quantized
                else []
            ),
            *(
                [f"{len(set(dequantized))} expert weights stored in MXFP4, read as bfloat16"]
                if dequantized
                else []
            ),
        ),
        replicas=replicas,
        warnings=warnings,
    )
    known = recorded(storage)
    digests = renamed(known.tensors, backbone) if known is not None else {}
    lossy = quantized or dequantized or shifted_names  # shifted: rounded if --allow-rounding
    errors = known.quantized if known is not None and lossy else {}
    return HFCheckpoint(
        storage,
        view,
        headers,
        backbone.config if backbone else config,
        digests,
        fp8,
        quantized,
        errors,
        mxfp4=dequantized,
        packed_gated=frozenset(packed_gated),
        shifted=ShiftedReads(shifted_names, round_shifted),
    )
