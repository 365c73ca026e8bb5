"""The single ``torch.save`` state-dict format's registry entry."""

from __future__ import annotations

from typing import Any

from ckptctl.formats.base import CheckpointFormat, ProbeRequest, lazy
from ckptctl.formats.support import FormatSupport
from ckptctl.formats.torch_file.names import STATE_DICT_FILE
from ckptctl.formats.torch_file.target import TORCH_SAVE, TorchTarget
from ckptctl.io.storage import Storage


def _probe(storage: Storage, names: frozenset[str], request: ProbeRequest) -> Any:
    from ckptctl.formats.torch_file.reader import probe_torch_file

    if request.file is not None:
        return (
            probe_torch_file(storage, request.file)
            if request.file.endswith((".pt", ".pth"))
            else None
        )
    return probe_torch_file(storage) if STATE_DICT_FILE in names else None


FORMAT = CheckpointFormat(
    "torch",
    _probe,
    support=FormatSupport(
        "torch",
        "one torch.save state dict",
        "state_dict.pt, or a *.pt file named directly",
        True,
        "consolidate --format torch (from DCP / torch_dist)",
        "nested state dicts as dcp_to_torch_save writes them",
        "CRC-32 of every zip entry",
    ),
    target=TorchTarget(),
    writers={TORCH_SAVE: lazy("ckptctl.formats.torch_file.writer", "write_state_dict_file")},
)
