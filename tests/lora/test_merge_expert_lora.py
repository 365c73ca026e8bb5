"""``merge-lora`` of LoRA on packed expert weights (PEFT's ``target_parameters``, issue 55), as
OpenAI's GPT-OSS fine-tuning recipe trains them: judged by PEFT. PEFT wraps a tiny seeded
transformers GPT-OSS (attention LoRA beside the experts'), its matrices seeded random, saves the
adapter; ``merge_and_unload`` says what the merged model holds. A float32 base comes out
bit-equal, a bfloat16 one equal to PEFT's merge done in float32 and rounded once; transformers
loads the output with the merged model's logits. Qwen3-MoE likewise: transformers 5 packs its
experts in memory (``[E, 2F, H]``, where PEFT trains them) but saves them one by one as the hub
holds them, which the output keeps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.formats.hf.models import tensors

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
IDS = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(2))


def _base(dtype: torch.dtype) -> Any:
    config = transformers.GptOssConfig(
        hidden_size=64,
        intermediate_size=48,  # gate_up_proj [E, 64, 96]: in and out differ
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
    )
    return _drawn(transformers.GptOssForCausalLM, config, 5, dtype)


def _qwen3_moe(dtype: torch.dtype) -> Any:
    config = transformers.Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return _drawn(transformers.Qwen3MoeForCausalLM, config, 6, dtype)


def _deepseek_v3(dtype: torch.dtype) -> Any:
    config = transformers.DeepseekV3Config(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,  # gate_up_proj [E, 64, 64]: out and in alike
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        vocab_size=300,
    )
    return _drawn(transformers.DeepseekV3ForCausalLM, config, 7, dtype)


def _mixtral(dtype: torch.dtype) -> Any:
    config = transformers.MixtralConfig(
        hidden_size=64,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return _drawn(transformers.MixtralForCausalLM, config, 8, dtype)


def _drawn(model_class: Any, config: Any, seed: int, dtype: torch.dtype) -> Any:
    """``config``'s model, every parameter ~ N(0, 0.2) (seeded), in ``dtype``."""
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model.to(dtype).eval()


def _made(
    tmp: Path, dtype: torch.dtype, targets: list[str], build: Any = _base
) -> tuple[Path, Path, dict]:
    """(base, adapter, PEFT's merged model saved by transformers, in float32 rounded once to
    ``dtype``, as tensors by name)."""
    base, adapter = tmp / "base", tmp / "adapter"
    build(dtype).save_pretrained(base)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], target_parameters=targets
    )
    wrapped = peft.get_peft_model(build(dtype), config)
    seeded = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=seeded) * 0.1)
    wrapped.save_pretrained(adapter)
    reference = peft.PeftModel.from_pretrained(build(dtype).float(), adapter).float()
    merged = reference.merge_and_unload().to(dtype)
    merged.save_pretrained(tmp / "peft-merged")  # the hub's names, as transformers saves them
    return base, adapter, tensors(tmp / "peft-merged")


@pytest.mark.parametrize(
    ("dtype", "targets"),
    [
        (torch.float32, EXPERTS),
        (torch.bfloat16, EXPERTS),
        (torch.float32, EXPERTS[1:]),  # one parameter: no nesting
        (torch.float32, EXPERTS[::-1]),  # PEFT nests by the module's order, not the list's
    ],
)
def test_expert_lora_merges_as_peft_merges_it(
    tmp_path: Path, cli, dtype: torch.dtype, targets: list[str]
) -> None:
    base, adapter, merged = _made(tmp_path, dtype, targets)
    out = tmp_path / "out"
    result = cli("merge-lora", base, adapter, out)
    adapted = 2 * (2 + len(targets))  # per layer: q_proj, o_proj and each expert parameter
    assert f"{adapted} weights" in result.stdout + result.stderr
    ours, before = tensors(out), tensors(base)
    assert sorted(ours) == sorted(merged)
    moved = set()
    for name, want in merged.items():
        assert ours[name].dtype == dtype, name
        assert torch.equal(ours[name], want), name
        if not torch.equal(ours[name], before[name]):
            moved.add(name)
    assert len(moved) == adapted
    assert {n.rpartition(".")[2] for n in moved if "experts" in n} == {
        t.rpartition(".")[2] for t in targets
    }
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
    with torch.no_grad():  # out of the mapped file: CPU kernels round by operand alignment
        for param in loaded.parameters():
            param.data = param.data.clone()
    # loaded alike (a model cast with .to() keeps its RoPE frequencies in its dtype)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "peft-merged", dtype=dtype
    )
    with torch.no_grad():
        for param in reference.parameters():
            param.data = param.data.clone()
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, reference.eval()(IDS).logits)


@pytest.mark.parametrize(
    ("dtype", "build", "adapted"),
    [
        # per MoE layer every expert's gate, up and down, and per layer q_proj and o_proj
        (torch.float32, _qwen3_moe, 2 * (4 * 3 + 2)),
        (torch.bfloat16, _qwen3_moe, 2 * (4 * 3 + 2)),
        # a dense first layer, MLA (o_proj only), a shared expert beside the routed ones
        (torch.float32, _deepseek_v3, 2 * 4 * 3 + 3),
        # the hub's block_sparse_moe.experts.N.w1 / w3 / w2, mlp.experts.* in memory
        (torch.bfloat16, _mixtral, 2 * (4 * 3 + 2)),
    ],
)
def test_expert_lora_merges_into_the_hubs_per_expert_tensors(
    tmp_path: Path, cli, dtype: torch.dtype, build: Any, adapted: int
) -> None:
    base, adapter, merged = _made(tmp_path, dtype, EXPERTS, build)
    out = tmp_path / "out"
    cli("merge-lora", base, adapter, out)
    ours, before = tensors(out), tensors(base)
    assert sorted(ours) == sorted(merged)
    moved = {name for name in merged if not torch.equal(merged[name], before[name])}
    for name, want in merged.items():
        assert torch.equal(ours[name], want), name
    assert len(moved) == adapted, sorted(moved)


def test_an_expert_adapter_of_another_model_is_refused(tmp_path: Path, cli) -> None:
    """An adapter whose experts do not fit the base (another expert count): refused by name,
    nothing written."""
    base, adapter, _ = _made(tmp_path, torch.float32, EXPERTS)
    config = json.loads((base / "config.json").read_text())
    other = tmp_path / "other"
    small = {**config, "num_local_experts": 2}
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{
        k: v for k, v in small.items() if k not in ("architectures", "model_type")
    }))  # fmt: skip
    model.save_pretrained(other)
    out = tmp_path / "out"
    result = cli("merge-lora", other, adapter, out, code=2)
    assert "spans 4 experts, the base has 2" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()


def test_lora_on_another_parameter_is_refused_by_name(tmp_path: Path, cli) -> None:
    """PEFT also wraps other parameters (the router's weight): not merged, refused naming it."""
    base, adapter, _ = _made(tmp_path, torch.float32, ["mlp.router.weight"])
    out = tmp_path / "out"
    result = cli("merge-lora", base, adapter, out, code=2)
    assert "target_parameters weight of" in result.stderr and "mlp.router" in result.stderr
    assert "Traceback" not in result.stderr and not out.exists()
