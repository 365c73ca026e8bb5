"""What the tests of the routed HF families (DeepSeek-V3, GLM-4.5) share: a model built by
transformers with random weights saved as the hub keeps it (with an MTP layer, as DeepSeek's and
GLM's releases keep one), and its safetensors read back."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

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


def with_mtp_layer(
    cls: type[torch.nn.Module], config: Any, root: Path, layers: int
) -> dict[str, torch.Tensor]:
    """Add an MTP layer to the model saved in ``root`` as the hub keeps one: decoder layer
    ``model.layers.<layers>`` (made by transformers as one more layer of the same model) with
    random MTP norms and projection, and copies of the embedding and output layer; written
    back as one ``model.safetensors``. Returns every tensor written."""
    from safetensors.torch import save_file

    tensors = safetensors_of(root)
    bigger = copy.deepcopy(config)
    bigger.num_hidden_layers = layers + 1
    with tempfile.TemporaryDirectory() as scratch:
        randomised_and_saved(cls(bigger), Path(scratch))
        prefix = f"model.layers.{layers}."
        tensors |= {k: v for k, v in safetensors_of(Path(scratch)).items() if k.startswith(prefix)}
    h = config.hidden_size
    gen = torch.Generator().manual_seed(31)
    for name, shape in (("enorm", (h,)), ("hnorm", (h,)), ("eh_proj", (h, 2 * h))):
        tensors[f"{prefix}{name}.weight"] = torch.randn(shape, generator=gen)
    tensors[f"{prefix}shared_head.norm.weight"] = torch.randn((h,), generator=gen)
    tensors[f"{prefix}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"{prefix}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    for path in [*root.glob("*.safetensors"), root / "model.safetensors.index.json"]:
        path.unlink(missing_ok=True)
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    return tensors
