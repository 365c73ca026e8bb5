"""What the tests of the routed HF families (DeepSeek-V3, GLM-4.5) share: a model built by
transformers with random weights saved as the hub keeps it, and its safetensors read back."""

from __future__ import annotations

from pathlib import Path

import torch


def randomised_and_saved(model: torch.nn.Module, root: Path) -> torch.nn.Module:
    """``model`` with every parameter and the routers' score-correction bias random (norms
    start at one and the bias at zero: random values catch any misplaced one), saved to
    ``root``; returned in eval mode."""
    with torch.no_grad():
        biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
        for tensor in (*model.parameters(), *biases):
            tensor.normal_(0.0, 0.2)
    model.save_pretrained(root)
    return model.eval()


def safetensors_of(root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(root.glob("*.safetensors")):
        out.update(load_file(path))
    return out
