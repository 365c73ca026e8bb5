"""Reading HF weights stored shifted from Megatron's (Qwen3.5's gated norm: ``1 + w``), the
shift taken off exactly, or, when the user allows it (``--allow-rounding``), rounded to the
weight's dtype with each tensor's largest error kept for the output's manifest."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from ckptctl.arrays import shifted, shifted_rounded

UNSHIFTED = (
    "the model's zero-centred norm (Megatron's) cannot hold this weight minus one exactly in its "
    "dtype (a weight below 0.5); pass --allow-rounding to round it (its error recorded), or keep "
    "this model in a format that stores the weight as it is (HF, DCP)"
)
"""Why a shifted HF weight cannot be read as the canonical one exactly."""


@dataclass
class ShiftedReads:
    """The shifted tensors of one HF checkpoint: ``(file, name) -> (shift, canonical name)``."""

    shifts: dict[tuple[str, str], tuple[float, str]] = field(default_factory=dict)
    rounding: bool = False
    """Round where taking the shift off is not exact (``--allow-rounding``)."""
    errors: dict[str, float] = field(default_factory=dict)
    """Largest rounding error so far by canonical name (only where one was made)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self.shifts

    def unshifted(self, path: str, name: str, data: np.ndarray) -> np.ndarray:
        """``data`` (a box of ``name`` in ``path``) as the canonical tensor holds it."""
        by, canonical = self.shifts[(path, name)]
        if not self.rounding:
            return shifted(data, -by, f"{path}: {name}", UNSHIFTED)
        out, error = shifted_rounded(data, -by)
        if error:
            with self._lock:
                self.errors[canonical] = max(self.errors.get(canonical, 0.0), error)
        return out
