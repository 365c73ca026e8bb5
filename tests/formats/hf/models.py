"""What the HF family tests share: a model transformers builds from a config, its parameters
drawn at random (biases, sinks and norms start at zero and one, which would hide a misplaced
one) and saved; the tensors of a saved directory; a model's logits on fixed inputs."""

from __future__ import annotations

from pathlib import Path

import torch


def saved_model(config: object, root: Path, seed: int) -> torch.nn.Module:
    """``config``'s model (float32, parameters ~ N(0, 0.2)) saved to ``root``, in eval mode."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(root)
    return model.eval()


def tensors(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``root``."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(root.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits
