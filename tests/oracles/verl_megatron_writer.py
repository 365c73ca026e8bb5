"""Write a verl Megatron actor checkpoint of a megatron-core GPT model trained one step, file for
file as verl's ``MegatronCheckpointManager.save_checkpoint`` writes it
(``verl/utils/checkpoint/megatron_checkpoint_manager.py`` with ``use_dist_checkpointing``):
verl 0.9.1's split layout (``v2``, its ``MANIFEST_SCHEMA_VERSION = 2``) or the single
``dist_ckpt/`` of the releases before it (the default).

verl itself cannot run here (it imports Ray and needs CUDA for its Megatron workers), so this
oracle makes the calls that manager makes, on megatron-core 0.13.1 (the release verl's Megatron
images pin; ``tests/megatron_core_013.py`` installs it: 0.15 and later refuse to save the
optimizer form verl's call without metadata asks for) and gloo (TP = 2 CPU
processes): the model is megatron-core's own ``GPTModel`` built from the HF config the way
verl's ``hf_to_mcore_config`` builds a Llama (vocabulary as the config says, not padded),
wrapped in ``DistributedDataParallel`` and the ``DistributedOptimizer``, trained one step
(``mcore_cpu``), then each rank saves, through ``dist_checkpointing.save`` with the default
``torch_dist`` strategy wrapped in ``FullyParallelSaveStrategyWrapper`` (verl's
``save_dist_checkpointing``), the state dict verl's ``generate_state_dict`` builds::

    {"model": model.sharded_state_dict(),
     "optimizer": optimizer.sharded_state_dict(state_dict, is_loading=False),  # no metadata
     "lr_scheduler": scheduler.state_dict(),
     "rng_state": ShardedObject("rng_state", [rng], (PP, TP), (pp, tp), replica_id=dp)}

to ``OUT/global_step_1/actor/dist_ckpt``; rank 0 saves the HF config to ``actor/huggingface``
and ``asdict(TransformerConfig)`` (callables dropped, dtypes as strings) to
``actor/transformer_config.json``, and writes ``OUT/latest_checkpointed_iteration.txt``.

CPU shims (none touching what is saved): megatron-core's CUDA calls run on CPU
(``mcore_cpu.patch_megatron_for_cpu``, ``CpuAsCudaMode``); numpy 2's ``np.prod`` under the
name 0.13.1 calls (``np.product``); the local layer spec instead of
TransformerEngine's (its tensors are saved under TransformerEngine's names all the same); the
RNG state has no CUDA generator (a Philox-shaped stand-in, as ``megatron_core_torch_dist_writer``).

``hf`` (verl's checkpoint mode with a bridge, ``use_dist_checkpointing`` off): the state dict
is built the same way, then its ``"model"`` popped before the save
(``generate_state_dict(generate_model=False)``), so ``dist_ckpt`` holds the optimizer, scheduler
and RNG state only; the weights go to ``huggingface/`` as HF safetensors through mbridge 0.15.1
(verl's ``vanilla_bridge``: ``AutoBridge.from_config`` of the HF config, ``save_weights`` of
the model chunks on every rank), which also writes the config there. Its CPU shims: the local
layer spec's norms are given the HF names mbridge gives the TransformerEngine-fused norms they
stand for; the bridge's record of the run's starting weights (verl loads them through it, and
it shards the save alike) is a directory without an index, so one ``model.safetensors``.

``v2`` (verl 0.9.1, ``use_dist_checkpointing`` on, ``save_contents`` model, optimizer, extra):
three ``dist_checkpointing.save`` calls of the same strategy, each a ``torch_dist`` directory
of its own, as its ``save_checkpoint`` schedules them: ``actor/model/dist_ckpt`` the model's
sharded state dict (built with verl's content metadata, ``dp_cp_group`` added),
``actor/optimizer/dist_ckpt`` the optimizer's (no metadata: megatron-core < 0.14) and the
scheduler's, ``actor/extra/dist_ckpt`` the RNG state; then ``transformer_config.json`` and,
last, ``ckpt_contents.json`` (its ``_build_checkpoint_manifest``). Without Megatron-Bridge
verl 0.9.1 saves no HF config with this layout: the config the run started from is written
to ``OUT_DIR/hf_config.json``, outside the actor, for ``--hf-config``. ``v2-hf`` (its default,
Megatron-Bridge on, ``use_dist_checkpointing`` off): no ``model/dist_ckpt``; the HF config in
``model/huggingface``, with the weights mbridge writes there as in ``hf``.

Usage::

    python tests/oracles/verl_megatron_writer.py OUT_DIR [hf|v2|v2-hf]

Writes ``OUT_DIR/logits.pt``: ``{"input_ids", "logits"}`` of megatron-core's own TP forward of
the trained model, the whole vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mcore_cpu import (
    FFN_HIDDEN,
    HIDDEN,
    KV_CHANNELS,
    MAX_POSITIONS,
    MODEL_SEED,
    NORM_EPS,
    NUM_HEADS,
    NUM_QUERY_GROUPS,
    ROTARY_BASE,
    TRUE_VOCAB,
    mean_loss,
    model_parallel,
    patch_megatron_for_cpu,
    randomise_norms,
    reference_input_ids,
    spawn,
    train_step,
    transformer_config,
    wrap_for_training,
)
from megatron_core_torch_dist_writer import (
    BATCH,
    SEQ,
    patch_numpy_product,
    reference_logits,
    rng_state_object,
    training_batch,
)

TP = 2
NUM_LAYERS = 2
STEP = 1


def hf_config() -> dict[str, Any]:
    """The HF config the run started from (verl builds the Megatron model from it)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=TRUE_VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN_HIDDEN,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_QUERY_GROUPS,
        head_dim=KV_CHANNELS,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=NORM_EPS,
        rope_theta=ROTARY_BASE,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        torch_dtype="float32",
        architectures=["LlamaForCausalLM"],
    )
    return config.to_dict()


def build_model() -> tuple[Any, torch.nn.Module]:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(tp=TP, num_layers=NUM_LAYERS, pipeline_dtype=torch.float32)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=TRUE_VOCAB,  # verl: hf_config.vocab_size, unpadded
        max_sequence_length=MAX_POSITIONS,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=ROTARY_BASE,
    )
    return config, model


def transformer_config_json(config: Any) -> dict[str, Any]:
    """``asdict(TransformerConfig)`` as verl writes it: callables dropped, dtypes as strings."""
    out = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if callable(value) or field.name.endswith("_func"):
            continue
        if isinstance(value, torch.dtype):
            value = str(value)
        try:
            json.dumps(value)
        except TypeError:
            value = str(value)
        out[field.name] = value
    return out


def worker(rank: int, port: int, out_dir: Path, mode: str) -> None:
    patch_megatron_for_cpu(noop_cuda_synchronize=True)
    patch_numpy_product()
    with model_parallel(rank, port, TP, tp=TP, cpu_as_cuda=True):
        run_rank(out_dir, mode)


def save_dist(state_dict: dict[str, Any], path: Path) -> None:
    """verl's ``save_dist_checkpointing``: the ``torch_dist`` strategy, saved fully parallel
    over the data-parallel group."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy("torch_dist"),
        parallel_state.get_data_parallel_group(with_context_parallel=True),
    )
    dist_checkpointing.save(
        state_dict, str(path), sharded_strategy=strategy, validate_access_integrity=True
    )
    dist.barrier()


def manifest(hf_weights: bool) -> dict[str, Any]:
    """``ckpt_contents.json`` as verl 0.9.1's ``_build_checkpoint_manifest`` composes it (rank
    0, after every save)."""
    contents: dict[str, Any] = {}
    if hf_weights:
        contents["model"] = {
            "path": "model/huggingface",
            "format": "huggingface",
            "backend": "mbridge",
        }
    else:
        contents["model"] = {
            "path": "model/dist_ckpt",
            "format": "megatron_dist_checkpoint",
            "backend": "dist_checkpointing",
        }
    contents["optimizer"] = {"path": "optimizer/dist_ckpt", "format": "megatron_dist_checkpoint"}
    contents["lr_scheduler"] = {
        "path": "optimizer/dist_ckpt",
        "format": "megatron_dist_checkpoint",
        "key": "lr_scheduler",
    }
    contents["rng_state"] = {
        "path": "extra/dist_ckpt",
        "format": "megatron_dist_checkpoint",
        "key": "rng_state",
    }
    contents["transformer_config"] = {"path": "transformer_config.json", "format": "json"}
    if hf_weights:
        contents["hf_config"] = {"path": "model/huggingface", "format": "huggingface"}
    return {
        "schema_version": 2,
        "framework": "megatron",
        "role": "actor",
        "arch": "LlamaForCausalLM",
        "global_step": STEP,
        "world_size": TP,
        "backend": {
            "has_bridge": hf_weights,
            "use_dist_checkpointing": not hf_weights,
            "peft": False,
        },
        "save_contents": ["model", "optimizer", "extra"],
        "contents": contents,
        "directories": {},
        "saved_any_dist_ckpt": True,
    }


def run_rank(out_dir: Path, mode: str) -> None:

    torch.manual_seed(MODEL_SEED)
    config, gpt = build_model()
    randomise_norms(gpt, seed_per_name=True)
    ddp, optimizer, scheduler = wrap_for_training(config, gpt, global_batch=BATCH)
    losses, _ = train_step(ddp, optimizer, scheduler, [training_batch()], global_batch=BATCH)
    if dist.get_rank() == 0:
        print(f"loss {mean_loss(losses):.4f}", flush=True)
    logits = reference_logits(gpt)

    actor = out_dir / f"global_step_{STEP}" / "actor"
    if mode in ("hf", "v2-hf"):
        save_hf_weights(ddp, actor / ("model/huggingface" if mode == "v2-hf" else "huggingface"))
    if mode.startswith("v2"):
        save_split(actor, gpt, optimizer, scheduler, mode == "v2-hf")
    else:
        state_dict: dict[str, Any] = {"model": gpt.sharded_state_dict()}
        state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, is_loading=False)
        state_dict["lr_scheduler"] = scheduler.state_dict()
        state_dict["rng_state"] = rng_state_object()
        if mode == "hf":
            state_dict.pop("model")
        save_dist(state_dict, actor / "dist_ckpt")
    if dist.get_rank() == 0:
        if mode == "v2":
            (out_dir / "hf_config.json").write_text(json.dumps(hf_config(), indent=2))
        elif mode == "v1":
            hf_dir = actor / "huggingface"
            hf_dir.mkdir(parents=True, exist_ok=True)
            (hf_dir / "config.json").write_text(json.dumps(hf_config(), indent=2))
        (actor / "transformer_config.json").write_text(
            json.dumps(transformer_config_json(config), indent=2)
        )
        if mode.startswith("v2"):
            (actor / "ckpt_contents.json").write_text(
                json.dumps(manifest(mode == "v2-hf"), indent=2, sort_keys=True)
            )
        (out_dir / "latest_checkpointed_iteration.txt").write_text(str(STEP))
        torch.save(
            {"input_ids": reference_input_ids(BATCH, SEQ), "logits": logits}, out_dir / "logits.pt"
        )
    dist.barrier()


def save_hf_weights(ddp: Any, hf_dir: Path) -> None:
    """verl's ``_save_model_as_hf_via_bridge`` with its vanilla bridge: mbridge's
    ``AutoBridge`` built from the run's HF config (verl's ``AutoBridge.from_config``), then
    ``save_weights`` of the DDP-wrapped model chunks (every rank takes part in the TP gathers;
    rank 0 writes the safetensors and the config)."""
    import transformers
    from mbridge import AutoBridge
    from mbridge.core.safetensor_io import SafeTensorIO

    bridge = AutoBridge.from_config(transformers.LlamaConfig(**hf_config()))
    # verl's run loads its starting weights through the bridge, which records that directory's
    # index to shard the save alike; this run starts from random weights, as from a model
    # saved unsharded (no index: one model.safetensors).
    # CPU shim: the local layer spec's norms (no TransformerEngine) are mapped to the HF names
    # mbridge gives the TransformerEngine-fused norms they stand for.
    layer = "model.layers.{layer_number}"
    bridge._OTHER_MAPPING = {"input_layernorm.weight": [f"{layer}.input_layernorm.weight"]}
    bridge._MLP_MAPPING = {
        **bridge._MLP_MAPPING,
        "pre_mlp_layernorm.weight": [f"{layer}.post_attention_layernorm.weight"],
    }
    hf_dir.mkdir(parents=True, exist_ok=True)
    bridge.safetensor_io = SafeTensorIO(str(hf_dir))
    bridge.save_weights([ddp], str(hf_dir))


def save_split(actor: Path, gpt: Any, optimizer: Any, scheduler: Any, hf_weights: bool) -> None:
    """verl 0.9.1's ``save_checkpoint``: the model's sharded state dict built once (with
    verl's content metadata; on megatron-core < 0.14 the distributed optimizer's sharding type,
    which it passes to neither save), saved to ``model/dist_ckpt`` unless the weights go to HF,
    and read by the optimizer's ``sharded_state_dict``; then the optimizer and the RNG state,
    each to its own directory."""
    from megatron.core import parallel_state

    metadata = {
        "distrib_optim_sharding_type": "fully_sharded_model_space",
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }
    model = {"model": gpt.sharded_state_dict(metadata=metadata)}
    optimizer_state = {
        "optimizer": optimizer.sharded_state_dict(model, is_loading=False),
        "lr_scheduler": scheduler.state_dict(),
    }
    if not hf_weights:
        save_dist(model, actor / "model" / "dist_ckpt")
    save_dist(optimizer_state, actor / "optimizer" / "dist_ckpt")
    save_dist({"rng_state": rng_state_object()}, actor / "extra" / "dist_ckpt")


def main() -> int:
    out_dir = Path(sys.argv[1]).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    mode = sys.argv[2] if len(sys.argv) > 2 else "v1"
    if mode not in ("v1", "hf", "v2", "v2-hf"):
        raise SystemExit(f"unknown mode {mode!r}")
    spawn(worker, TP, out_dir, mode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
