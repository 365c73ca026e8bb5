"""Where a Megatron checkpoint's iteration lies: the tracker file, ``iter_NNNNNNN`` /
``release`` directories, and the files megatron-core saves beside a ``torch_dist`` iteration's
DCP files (a plain DCP save may sit in such a directory too)."""

from __future__ import annotations

import re

from ckptctl import json_input
from ckptctl.errors import CheckpointError, CheckpointNotFoundError
from ckptctl.formats.megatron_common.layout import TRACKER, iteration_dir
from ckptctl.io.storage import Storage

MCORE_METADATA = "metadata.json"
"""megatron-core's description of its sharded backend, beside the DCP files."""
COMMON = "common.pt"
"""megatron-core's common (not sharded) state: ``args``, counters, the optimizer's groups."""
_ITER_DIR = re.compile(r"^(iter_\d{7}|release)$")


def recognised(names: frozenset[str]) -> bool:
    return TRACKER in names or any(n.startswith(("mp_rank_", "iter_", "release")) for n in names)


def find_iteration(storage: Storage, iteration: int | None) -> tuple[str, int | None]:
    """The iteration directory (relative) and number the user means."""
    if iteration is not None:
        rel = iteration_dir(iteration)
        if not storage.isdir(rel):
            raise CheckpointNotFoundError(f"{storage.describe(rel)}: no such iteration directory")
        return rel, iteration
    if storage.exists(TRACKER):
        text = storage.read_text(TRACKER, limit=1 << 10).strip()
        if text == "release":
            number = None
        elif text.isdigit() and len(text) <= 18:
            number = int(text)
        else:
            raise CheckpointError(
                f"{storage.describe(TRACKER)}: expected an iteration number or 'release', "
                f"found {text[:40]!r}"
            )
        rel = iteration_dir(number)
        if not storage.isdir(rel):
            raise CheckpointNotFoundError(
                f"{storage.describe(TRACKER)} names iteration {text} but {rel}/ is missing; "
                "pass --iteration to pick another"
            )
        return rel, number
    if any(name.startswith("mp_rank_") for name in storage.listdir("")):
        name = storage.url.rstrip("/").rsplit("/", 1)[-1]
        number = int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None
        return "", number
    iters = [n for n in storage.listdir("") if _ITER_DIR.match(n)]
    raise CheckpointNotFoundError(
        f"{storage.url}: no {TRACKER}"
        + (
            f"; found {', '.join(iters)}: pass --iteration"
            if iters
            else "; not a Megatron checkpoint"
        )
    )


def mcore_backend(storage: Storage, base: str) -> str | None:
    """The sharded backend megatron-core's ``metadata.json`` in ``base`` names, if any."""
    rel = f"{base}/{MCORE_METADATA}" if base else MCORE_METADATA
    if not storage.exists(rel):
        return None
    doc = json_input.parse_object(storage.read_text(rel), storage.describe(rel))
    return str(doc.get("sharded_backend"))
