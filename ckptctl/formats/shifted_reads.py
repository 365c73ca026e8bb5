"""Reading HF weights stored shifted from Megatron's (Qwen3.5's gated norm: ``1 + w``), the
shift taken off exactly, or, when the user allows it (``--allow-rounding``), rounded to the
weight's dtype with each tensor's largest error kept for the output's manifest. Shared by the
formats that hold HF weights as transformers does (HF safetensors, FSDP's DCP)."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy only where bytes are handled: jobs that copy bytes never import it
    import numpy as np

    from ckptctl.model.stored import CheckpointView

UNSHIFTED = (
    "the model's zero-centred norm (Megatron's) cannot hold this weight minus one exactly in its "
    "dtype (a weight below 0.5); pass --allow-rounding to round it (its error recorded), or keep "
    "this model in a format that stores the weight as it is (HF, DCP)"
)
"""Why a shifted HF weight cannot be read as the canonical one exactly."""


@dataclass
class ShiftedReads:
    """The shifted tensors of one checkpoint: its reader's key of a stored tensor (HF: file and
    name; DCP: the chunk's key) -> ``(shift, canonical name)``."""

    shifts: dict[Hashable, tuple[float, str]] = field(default_factory=dict)
    rounding: bool = False
    """Round where taking the shift off is not exact (``--allow-rounding``)."""
    errors: dict[str, float] = field(default_factory=dict)
    """Largest rounding error so far by canonical name (only where one was made)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def of(cls, view: CheckpointView, rounding: bool) -> ShiftedReads:
        """The tensors ``view`` declares shifted (``StoredTensor.shift``), by file and key."""
        shifts: dict[Hashable, tuple[float, str]] = {
            (file.path, t.key): (t.shift, t.canonical)
            for file in view.files
            for t in file.tensors
            if t.shift
        }
        return cls(shifts, rounding)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.shifts

    def unshifted(self, key: Hashable, data: np.ndarray, where: str) -> np.ndarray:
        """``data`` (a box of the tensor at ``key``, named ``where`` in messages) as the
        canonical tensor holds it."""
        from ckptctl.arrays import shifted, shifted_rounded

        by, canonical = self.shifts[key]
        if not self.rounding:
            return shifted(data, -by, where, UNSHIFTED)
        out, error = shifted_rounded(data, -by)
        if error:
            with self._lock:
                self.errors[canonical] = max(self.errors.get(canonical, 0.0), error)
        return out
