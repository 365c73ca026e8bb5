"""The merge, band by band: each band of rows ``[lo, hi)`` of an adapted weight, as the
assembler builds it from the base, becomes ``W + scaling * B[lo:hi] @ A``, computed in float32
(torch's matmul and PEFT's order of operations) and rounded once to the weight's dtype. Memory
stays a band's and a few adapters' matrices, whatever the model's size."""

from __future__ import annotations

import threading
from collections import OrderedDict
from math import prod
from typing import TYPE_CHECKING

from ckptctl import arrays
from ckptctl.errors import CheckpointError
from ckptctl.lora.adapter import LoraSource
from ckptctl.lora.plan import ExpertRoute
from ckptctl.model.lora import LoraPair
from ckptctl.model.lora_params import interleaved_rows
from ckptctl.model.plan import TensorWrite

if TYPE_CHECKING:
    import numpy as np
    import torch

KEPT_PAIRS = 8
"""Adapters' matrices kept between bands (a tensor's bands come one after another; a few
files may be written at once)."""


class LoraMerge:
    """The band adjustment the assembler applies to the tensors ``covers`` says it changes."""

    def __init__(self, adapter: LoraSource, routes: dict[str, ExpertRoute] | None = None) -> None:
        """``routes``: the output's per-expert tensors an adapter on packed experts changes
        (``lora.plan.expert_routes``)."""
        self.adapter = adapter
        self.routes = routes or {}
        self._kept: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self._kept_whole: dict[str, torch.Tensor] = {}

    def covers(self, write: TensorWrite) -> bool:
        name = str(write.key[0]) if len(write.key) == 1 else None
        adapter = self.adapter
        return (
            name in adapter.pairs
            or name in adapter.whole
            or name in adapter.tokens
            or name in self.routes
        )

    def apply(self, write: TensorWrite, lo: int, hi: int, dim: int, band: np.ndarray) -> np.ndarray:
        """The band of rows ``[lo, hi)`` as the merged model holds it: a tensor saved beside
        the adapter first (it replaces the base's), then the LoRA delta, then trained rows."""
        name = str(write.key[0])
        pair = self.adapter.pairs.get(name)
        experts = pair is not None and pair.experts > 0  # bands of one expert's [out, in]
        if not experts and (dim != 0 or write.transposed):
            raise CheckpointError(f"{name}: a LoRA merge needs bands of whole rows")
        base = arrays.to_torch(band)
        route = self.routes.get(name)
        if route is not None:
            if dim != 0 or write.transposed:
                raise CheckpointError(f"{name}: a LoRA merge needs bands of whole rows")
            pair = self.adapter.pairs[route.packed]
            rows = list(range(route.row + lo, route.row + hi))
            base = self._expert_rows_added(pair, route.expert, rows, slice(None), base)
            return arrays.from_torch(base)
        if name in self.adapter.whole:  # in the base's dtype, as PEFT loads it over the base's
            whole = self.adapter.whole[name]
            trained = self.adapter.rows(whole.tensor, lo, hi if whole.shape else lo)
            base = trained.to(base.dtype)
        if pair is not None and pair.experts:
            base = self._expert_delta_added(pair, write, (lo, hi, dim), base)
        elif pair is not None and pair.kernel:
            delta = self._conv_delta(pair)[lo:hi]
            base = (base.float() + delta.reshape(base.shape)).to(base.dtype)
        elif pair is not None:
            base = self._delta_added(pair, lo, hi, base)
        if name in self.adapter.tokens:  # trained rows: PEFT's index_copy
            base = self._rows(name, lo, hi, base)
        return arrays.from_torch(base)

    def _delta_added(self, pair: LoraPair, lo: int, hi: int, base: torch.Tensor) -> torch.Tensor:
        """``W + scaling * B @ A`` for rows ``[lo, hi)``, in float32, rounded once (an
        embedding's delta is ``(B @ A)`` transposed: its rows are A's columns)."""
        a, b = self._matrices(pair)
        product = (b @ a[:, lo:hi]).T if pair.embedding else b[lo:hi] @ a
        return (base.float() + product * pair.scaling).to(base.dtype)

    def _conv_delta(self, pair: LoraPair) -> torch.Tensor:
        """A convolution's whole delta ``[out, in, *kernel]`` (kept while its bands come), in
        float32, as PEFT's ``_ConvNd.get_delta_weight`` computes it: a 1x1 2-D kernel by
        matmul, any other by convolving ``A`` (as a batch of ``in``) with ``B``, then scaled."""
        import torch.nn.functional as F

        with self._lock:
            kept = self._kept_whole.get(pair.weight)
        if kept is not None:
            return kept
        a, b = (m.float() for m in self._matrices(pair))
        if pair.kernel == (1, 1):
            delta = (b.squeeze(3).squeeze(2) @ a.squeeze(3).squeeze(2))[:, :, None, None]
            delta = delta * pair.scaling
        else:
            conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(pair.kernel)]
            delta = conv(a.transpose(0, 1), b).transpose(0, 1) * pair.scaling
        with self._lock:
            self._kept_whole = {pair.weight: delta}  # one at a time: a convolution is small
        return delta

    def _expert_delta_added(
        self, pair: LoraPair, write: TensorWrite, band: tuple[int, int, int], base: torch.Tensor
    ) -> torch.Tensor:
        """A band of one expert's ``[out, in]`` block (the packed tensor's ``view_offset``
        says which expert; rows ``[lo, hi)``, or columns where the block is stored transposed,
        as GPT-OSS's are), plus PEFT's ``ParamWrapper`` delta for it: its own contraction
        (``einsum("o r e, e r i -> e i o")``) on that expert alone, in float32, rounded once.
        GPT-OSS's ``gate_up_proj`` interleaves gates and ups: a canonical row is the packed
        tensor's output ``interleaved_rows`` says."""
        lo, hi, dim = band
        out = pair.shape[0]
        expert = (write.view_offset or 0) // prod(write.shape)
        order = interleaved_rows(out) if write.interleaved else list(range(out))
        rows = order if dim else order[lo:hi]
        columns = slice(lo, hi) if dim else slice(None)
        return self._expert_rows_added(pair, expert, rows, columns, base, transposed=True)

    def _expert_rows_added(
        self,
        pair: LoraPair,
        expert: int,
        rows: list[int],
        columns: slice,
        base: torch.Tensor,
        transposed: bool = False,
    ) -> torch.Tensor:
        """``base`` plus ``scaling`` times rows ``rows`` (outputs) and ``columns`` (inputs) of
        expert ``expert``'s ``B_e @ A_e``, by PEFT's contraction for the packed layout
        (``transposed``: ``[E, in, out]``, GPT-OSS's; else ``[E, out, in]``)."""
        import torch

        a, b = self._matrices(pair)
        out, inner = pair.shape
        b_expert = b.reshape(out, pair.rank, pair.experts)[rows][:, :, expert : expert + 1]
        a_expert = a.reshape(pair.experts, pair.rank, inner)[expert : expert + 1, :, columns]
        if transposed:
            product = torch.einsum("o r e, e r i -> e i o", b_expert, a_expert)[0].T
        else:
            product = torch.einsum("o r e, e r i -> e o i", b_expert, a_expert)[0]
        return (base.float() + product * pair.scaling).to(base.dtype)

    def _rows(self, name: str, lo: int, hi: int, base: torch.Tensor) -> torch.Tensor:
        rows = self.adapter.tokens[name]
        base = base.clone()  # the band may be the source's own bytes
        trained = self._whole_tensor(rows.tensor)
        for position, index in enumerate(rows.indices):
            if lo <= index < hi:
                base[index - lo] = trained[position].to(base.dtype)
        return base

    def _whole_tensor(self, tensor: str) -> torch.Tensor:
        with self._lock:
            kept = self._kept_whole.get(tensor)
        if kept is None:
            kept = self.adapter.matrix(tensor)
            with self._lock:
                self._kept_whole = {tensor: kept}  # one at a time (trained token rows: small)
        return kept

    def _matrices(self, pair: LoraPair) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            kept = self._kept.get(pair.weight)
            if kept is not None:
                self._kept.move_to_end(pair.weight)
                return kept
        kept = self.adapter.matrix(pair.a), self.adapter.matrix(pair.b)
        with self._lock:
            self._kept[pair.weight] = kept
            while len(self._kept) > KEPT_PAIRS:
                self._kept.popitem(last=False)
        return kept
