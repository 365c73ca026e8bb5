"""The training loop's side of ckptctl: ``save``, ``async_save`` and ``load`` as
``torch.distributed.checkpoint`` spells them, on one process-wide ``Checkpointer``."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from ckptctl.training.checkpointer import Checkpointer, SaveReport
from ckptctl.training.loading import LoadReport
from ckptctl.training.tiers import Tiers
from planners.retention import Retention

_default: Checkpointer | None = None


def default_checkpointer() -> Checkpointer:
    global _default
    if _default is None:
        _default = Checkpointer()
    return _default


def save(
    state_dict: Mapping[str, Any], *, checkpoint_id: str, step: int | None = None
) -> SaveReport:
    return default_checkpointer().save(state_dict, checkpoint_id=checkpoint_id, step=step)


def async_save(
    state_dict: Mapping[str, Any], *, checkpoint_id: str, step: int | None = None
) -> Future[SaveReport]:
    return default_checkpointer().async_save(state_dict, checkpoint_id=checkpoint_id, step=step)


def load(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str,
    full: str | None = None,
    no_dist: bool = False,
) -> LoadReport:
    return default_checkpointer().load(
        state_dict, checkpoint_id=checkpoint_id, full=full, no_dist=no_dist
    )


__all__ = [
    "Checkpointer",
    "LoadReport",
    "Retention",
    "SaveReport",
    "Tiers",
    "async_save",
    "default_checkpointer",
    "load",
    "save",
]
