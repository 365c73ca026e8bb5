"""The Qwen hybrids' multi-token prediction layer as their hub releases keep it (``mtp.*``, which
transformers does not load), for the tests of issue 56: added to a model transformers saved, and
run with transformers' own modules.

The releases name it as vLLM's ``Qwen3NextMultiTokenPredictor`` and Megatron-Bridge's Qwen3-Next
bridge read it: ``mtp.fc`` (the projection of the normed embedding and the normed hidden state,
concatenated in that order), ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, one
full-attention decoder layer ``mtp.layers.0.*`` named as the model's own layers, and
``mtp.norm`` before the model's ``lm_head``; the embedding and head are the model's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.formats.hf.models import tensors


def add_hub_mtp(root: Path, seed: int, decoder: str = "model.") -> dict[str, torch.Tensor]:
    """Give the model saved in ``root`` (one ``model.safetensors``) an MTP layer as the
    releases hold it: its decoder layer named as the model's first full-attention layer's
    tensors are in the file (the hub's per-expert names), every value drawn anew (norms
    about zero: they scale by one plus their weight). ``decoder``: where the text decoder's
    tensors are (``model.language_model.`` in a vision-language release, whose ``mtp.*``
    stays at the top and whose ``text_config`` announces it). Returns the MTP tensors."""
    whole = json.loads((root / "config.json").read_text())
    config = whole.get("text_config", whole)
    attention = config["layer_types"].index("full_attention")
    weights = tensors(root)
    generator = torch.Generator().manual_seed(seed)
    h = config["hidden_size"]
    dtype = weights[f"{decoder}embed_tokens.weight"].dtype

    def drawn(shape: tuple[int, ...] | torch.Size, scale: float) -> torch.Tensor:
        return (scale * torch.randn(tuple(shape), generator=generator)).to(dtype)

    mtp = {
        "mtp.fc.weight": drawn((h, 2 * h), 0.1),
        "mtp.pre_fc_norm_embedding.weight": drawn((h,), 0.1),
        "mtp.pre_fc_norm_hidden.weight": drawn((h,), 0.1),
        "mtp.norm.weight": drawn((h,), 0.1),
    }
    prefix = f"{decoder}layers.{attention}."
    for name, tensor in weights.items():
        if name.startswith(prefix):
            norm = name.endswith("norm.weight")
            mtp[f"mtp.layers.0.{name[len(prefix) :]}"] = drawn(tensor.shape, 0.1 if norm else 0.2)
    save_file({**weights, **mtp}, root / "model.safetensors", metadata={"format": "pt"})
    config["mtp_num_hidden_layers"] = 1
    config["mtp_use_dedicated_embeddings"] = False
    (root / "config.json").write_text(json.dumps(whole, indent=2))
    return mtp


def mtp_logits(root: Path, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The logits of the MTP layer in ``root`` (an HF directory with ``mtp.*``) for tokens
    ``ids`` and the model's final (normed) hidden states ``hidden`` ``[batch, seq, h]``, as
    megatron-core's MTP layer computes them: the embedding of each position's next token
    (the last position's that of token 0, as Megatron rolls them), with transformers' modules
    doing every step: its RMSNorm for the three norms, its decoder layer (a one-layer model of
    the same config holding ``mtp.layers.0``, which also applies ``mtp.norm`` and the head)."""
    import transformers

    weights = tensors(root)
    config = json.loads((root / "config.json").read_text())
    one = root.parent / f"{root.name}-mtp-as-one-layer"
    shutil.rmtree(one, ignore_errors=True)
    one.mkdir()
    config |= {"num_hidden_layers": 1, "layer_types": ["full_attention"]}
    config.pop("mtp_num_hidden_layers", None)
    (one / "config.json").write_text(json.dumps(config))
    own = {
        "model.embed_tokens.weight": weights["model.embed_tokens.weight"],
        "model.norm.weight": weights["mtp.norm.weight"],
        "lm_head.weight": weights.get("lm_head.weight", weights["model.embed_tokens.weight"]),
    }
    own |= {
        f"model.layers.0.{name[len('mtp.layers.0.') :]}": tensor
        for name, tensor in weights.items()
        if name.startswith("mtp.layers.0.")
    }
    save_file({k: v.contiguous() for k, v in own.items()}, one / "model.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(one, dtype=torch.float32).eval()
    norm_class = type(model.model.norm)
    h = config["hidden_size"]

    def norm(name: str) -> torch.nn.Module:
        module = norm_class(h, eps=config["rms_norm_eps"])
        module.weight.data = weights[name].float()
        return module

    rolled = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    with torch.no_grad():
        embedded = norm("mtp.pre_fc_norm_embedding.weight")(model.model.embed_tokens(rolled))
        normed = norm("mtp.pre_fc_norm_hidden.weight")(hidden.float())
        joined = torch.cat([embedded, normed], dim=-1) @ weights["mtp.fc.weight"].float().T
        out: torch.Tensor = model(inputs_embeds=joined).logits
    shutil.rmtree(one)
    return out


def hf_outputs(root: Path, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, MTP logits, final hidden states) of the HF model in ``root`` for ``ids``: the
    model as transformers loads it (fp32), its MTP layer by ``mtp_logits`` on its own hidden
    states."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
        logits = model.lm_head(hidden)
    return logits, mtp_logits(root, ids, hidden), hidden
