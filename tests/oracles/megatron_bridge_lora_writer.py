"""Write verl's Megatron LoRA checkpoint (``actor/adapter_checkpoint``) of a megatron-core GPT
model with Megatron-Bridge's own LoRA, and the base it was trained on as a legacy Megatron
checkpoint.

verl's Megatron workers train LoRA through Megatron-Bridge (``megatron.bridge.peft.lora.LoRA``,
verl's ``get_peft_cls``) and, with LoRA on, save only the adapter: each rank
``torch.save({"adapter_state_dict": {name: param}})`` of every parameter whose name holds
``.adapter.`` in its (first) model chunk, to
``adapter_checkpoint/mp_rank_TT[_PPP][_EEE]_adapter.pt`` (``save_adapter_checkpoint`` of
``verl/utils/megatron_peft_utils.py`` in the releases before 0.9, whose split layout keeps the
adapter in ``model/dist_ckpt`` and Megatron-Bridge's PEFT export instead; the names are the
stage's own, layer numbers local to it). verl itself cannot run here (Ray, CUDA workers), so
this script makes that call's few lines itself; the adapter is Megatron-Bridge 0.3.1's, on
megatron-core 0.16.1's own ``GPTModel`` (``mcore_cpu``: local layer spec, gloo, ``--tp`` x
``--pp`` CPU processes).

Modes:

* ``train`` (PP = 1): LoRA (rank 8, alpha 16, Megatron-Bridge's default modules ``linear_qkv``,
  ``linear_proj``, ``linear_fc1``, ``linear_fc2``) trained 3 Adam steps on a fixed batch, so B is
  no longer zero; ``OUT/logits.pt`` holds megatron-core's forward of the LoRA model (logits
  gathered over TP, true vocabulary).
* ``seeded``: every adapter matrix set from a generator seeded by its *global* name (layer
  number as megatron-core numbers it), so runs at other pipeline splits hold the same adapter;
  with PP = 1 ``OUT/logits.pt`` as above.

The base is written to ``OUT/base`` as Megatron-LM's legacy ``save_checkpoint`` lays it out
(``args`` as ``megatron_core_legacy_writer``), unless ``--base DIR`` gives a legacy checkpoint
to load instead (a pipeline split's base resharded to PP = 1, to compute its logits).

CPU shims (none touching what is saved): megatron-core's CUDA calls on CPU
(``mcore_cpu.patch_megatron_for_cpu``); Megatron-Bridge's ``peft`` imported without its package
``__init__`` (which imports its HF bridges and transformers < 5) and with a stand-in module for
``transformer_engine.pytorch`` while it is imported (``lora.py`` imports it unconditionally; the
LoRA layers used here are megatron-core's own ``ColumnParallelLinear`` / ``RowParallelLinear``
adapters, which never touch it).

``--split`` (with ``train``): also verl 0.9's split layout of the LoRA run under
``use_dist_checkpointing`` (``OUT/actor``): verl's checkpoint manager builds the LoRA-wrapped
model's sharded state dict (Megatron-Bridge's ``AdapterWrapper.sharded_state_dict``: the base's
keys as they were, each adapter's under ``<module>.adapter.linear_in|linear_out``) and saves it
whole with ``dist_checkpointing.save`` to ``model/dist_ckpt``; ``transformer_config.json``
and ``ckpt_contents.json`` (``backend.peft`` true) beside it, as verl 0.9.1's
``_build_checkpoint_manifest`` composes it. Not written: the optimizer's directory (verl's
comes from Megatron's distributed optimizer over the adapter; this script trains with torch's
Adam) and the RNG state's, which the manifest then does not name.

Usage::

    CKPTCTL_MEGATRON_BRIDGE=SITE python tests/oracles/megatron_bridge_lora_writer.py OUT \
        --tp 2 --pp 1 --mode train [--base DIR] [--split]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import types
import zlib
from pathlib import Path
from typing import Any

import megatron_core_moe as moe
import torch
import torch.distributed as dist
from mcore_cpu import (
    CHECKPOINT_VERSION,
    DATA_SEED,
    ITERATION,
    MAX_POSITIONS,
    MODEL_SEED,
    TRUE_VOCAB,
    causal_mask,
    gpt_model,
    model_args,
    model_parallel,
    patch_megatron_for_cpu,
    position_ids,
    randomise_norms,
    reference_input_ids,
    spawn,
    transformer_config,
)
from verl_megatron_writer import transformer_config_json

NUM_LAYERS = 4
RANK, ALPHA = 8, 16
BATCH, SEQ = 2, 17
STEPS = 3
LR = 1e-2
ADAPTER_SEED = 2468
MOE_VARIANT = "qwen3_moe"


def import_bridge_lora(site: Path) -> Any:
    """Megatron-Bridge's ``LoRA`` class, imported from ``site`` (see the module's shims)."""
    bridge = types.ModuleType("megatron.bridge")
    bridge.__path__ = [str(site / "megatron" / "bridge")]
    sys.modules["megatron.bridge"] = bridge

    class StandIn(types.ModuleType):
        """Any attribute is a new empty module class: enough for ``lora.py``'s class
        definitions and isinstance checks, which then match nothing."""

        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            made = type(name, (torch.nn.Module,), {})
            setattr(self, name, made)
            return made

    te, te_torch = StandIn("transformer_engine"), StandIn("transformer_engine.pytorch")
    te_torch.ops = StandIn("transformer_engine.pytorch.ops")
    te.pytorch = te_torch
    before = set(sys.modules)
    sys.modules["transformer_engine"], sys.modules["transformer_engine.pytorch"] = te, te_torch
    # megatron-core's TransformerEngine layers stay unimportable, as without TransformerEngine:
    # Megatron-Bridge then knows the layers only as megatron-core's own parallel linears.
    extensions = "megatron.core.extensions.transformer_engine"
    held = sys.modules.get(extensions)
    sys.modules[extensions] = None  # type: ignore[assignment]
    try:
        lora = importlib.import_module("megatron.bridge.peft.lora")
    finally:  # megatron-core imported later must not see the stand-in
        for name in set(sys.modules) - before:
            if "transformer_engine" in name:
                del sys.modules[name]
        sys.modules.pop("transformer_engine", None)
        sys.modules.pop("transformer_engine.pytorch", None)
        if held is None:
            del sys.modules[extensions]
        else:
            sys.modules[extensions] = held
    return lora.LoRA


def megatron_args(tp: int, pp: int) -> argparse.Namespace:
    """The ``args`` Namespace Megatron-LM stores in a legacy checkpoint."""
    return argparse.Namespace(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        **model_args(tp, NUM_LAYERS),
        num_experts=None,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        use_distributed_optimizer=False,
        seq_length=MAX_POSITIONS,
    )


def rank_dir(tp_rank: int, pp_rank: int, pp: int) -> str:
    """Megatron's (and verl's) per-rank name: ``mp_rank_TT`` or ``mp_rank_TT_PPP``."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")


def global_name(name: str, offset: int) -> str:
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def worker(
    rank: int,
    port: int,
    tp: int,
    pp: int,
    ep: int,
    out: Path,
    mode: str,
    base: Path | None,
    split: bool,
) -> None:
    if ep > 1:  # megatron_core_moe's model, processes and CPU shims
        moe.cpu_patches()
        parallel = moe.expert_parallel(rank, port, tp, ep, tp)
    else:
        patch_megatron_for_cpu(noop_cuda_synchronize=split)  # dist_checkpointing syncs
        parallel = model_parallel(rank, port, tp * pp, tp=tp, pp=pp, cpu_as_cuda=False)
    with parallel:
        from megatron.core import parallel_state as ps

        tp_rank, pp_rank = (
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
        )
        ep_rank = ps.get_expert_model_parallel_rank()
        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        torch.manual_seed(MODEL_SEED)
        if ep > 1:  # Qwen3-MoE-like: q/k norms, SequentialMLP experts (each its own adapter)
            model = moe.build(MOE_VARIANT, tp, ep)
            config, args = model.config, moe.megatron_args(MOE_VARIANT, tp, ep, tp)
        else:
            config = transformer_config(
                tp=tp, num_layers=NUM_LAYERS, pp=pp, pipeline_dtype=torch.float32
            )
            model = gpt_model(config, parallel_output=False, pre_process=first, post_process=last)
            args = megatron_args(tp, pp)
        offset = model.decoder.layers[0].layer_number - 1  # megatron-core numbers layers globally
        randomise_norms(model, seed_per_name=True, layer_offset=offset)
        where = rank_dir(tp_rank, pp_rank, pp) + (f"_{ep_rank:03d}" if ep > 1 else "")
        if base is not None:
            saved = torch.load(
                base / f"iter_{ITERATION:07d}" / where / "model_optim_rng.pt", weights_only=False
            )
            missing, unexpected = model.load_state_dict(saved["model"], strict=False)
            left = [n for n in (*missing, *unexpected) if not n.endswith("_extra_state")]
            assert not left, f"the base does not fit the model: {left}"
        else:
            shard = out / "base" / f"iter_{ITERATION:07d}" / where
            shard.mkdir(parents=True, exist_ok=True)
            torch.save(
                {
                    "args": args,
                    "checkpoint_version": CHECKPOINT_VERSION,
                    "iteration": ITERATION,
                    "model": model.state_dict_for_save_checkpoint(),
                },
                shard / "model_optim_rng.pt",
            )
            if rank == 0:
                (out / "base" / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        if rank == 0:  # verl's actor directory holds the run's TransformerConfig
            text = json.dumps(transformer_config_json(config), indent=2)
            (out / "transformer_config.json").write_text(text)

        lora = import_bridge_lora(Path(os.environ["CKPTCTL_MEGATRON_BRIDGE"]))
        model = lora(dim=RANK, alpha=ALPHA)(model, training=True)
        adapters = [(n, p) for n, p in model.named_parameters() if ".adapter." in n.lower()]
        assert adapters, "Megatron-Bridge added no adapter"
        if mode == "seeded":
            with torch.no_grad():
                for name, param in adapters:
                    seed = ADAPTER_SEED + zlib.crc32(global_name(name, offset).encode())
                    generator = torch.Generator().manual_seed(seed)
                    param.copy_(0.05 * torch.randn(param.shape, generator=generator))
        else:
            train(model, [p for _, p in adapters])

        # verl's save_adapter_checkpoint: the stage's adapter parameters by their own names
        state = {n: p.data.clone() for n, p in adapters}
        target = out / "adapter_checkpoint"
        target.mkdir(parents=True, exist_ok=True)
        torch.save({"adapter_state_dict": state}, target / f"{where}_adapter.pt")
        if split:
            save_split(model, config, out / "actor")

        if pp == 1:
            model.eval()
            ids = reference_input_ids(BATCH, SEQ)
            with torch.no_grad():
                logits = gathered(model(ids, position_ids(BATCH, SEQ), causal_mask(SEQ)))
            if rank == 0:
                torch.save(
                    {"input_ids": ids, "logits": logits[..., :TRUE_VOCAB].float().contiguous()},
                    out / "logits.pt",
                )
        dist.barrier()


def save_split(model: torch.nn.Module, config: Any, actor: Path) -> None:
    """verl 0.9.1's ``save_checkpoint`` of a LoRA run with ``use_dist_checkpointing`` on and
    Megatron-Bridge's HF save off: the wrapped model's sharded state dict (base and adapter)
    saved whole to ``model/dist_ckpt`` (megatron-core's default ``torch_dist`` strategy; its
    CUDA paths on the CPU), then rank 0's ``transformer_config.json`` and manifest."""
    from mcore_cpu import CpuAsCudaMode
    from megatron.core import dist_checkpointing

    path = actor / "model" / "dist_ckpt"
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    with CpuAsCudaMode():
        dist_checkpointing.save({"model": model.sharded_state_dict()}, str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        text = json.dumps(transformer_config_json(config), indent=2)
        (actor / "transformer_config.json").write_text(text)
        (actor / "ckpt_contents.json").write_text(json.dumps(split_manifest(), indent=2))


def split_manifest() -> dict[str, Any]:
    """``ckpt_contents.json`` of the LoRA run's split save: the model as Megatron shards, PEFT
    on, no Megatron-Bridge (so no HF export and no ``peft_adapters`` entry)."""
    return {
        "schema_version": 2,
        "framework": "megatron",
        "role": "actor",
        "arch": "LlamaForCausalLM",
        "global_step": ITERATION,
        "world_size": dist.get_world_size(),
        "backend": {"has_bridge": False, "use_dist_checkpointing": True, "peft": True},
        "save_contents": ["model"],
        "contents": {
            "model": {
                "path": "model/dist_ckpt",
                "format": "megatron_dist_checkpoint",
                "backend": "dist_checkpointing",
            },
            "transformer_config": {"path": "transformer_config.json", "format": "json"},
        },
        "directories": {},
        "saved_any_dist_ckpt": True,
    }


def gathered(logits: torch.Tensor) -> torch.Tensor:
    """The whole vocabulary's logits (the MoE model's are vocab-parallel)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return logits
    return gather_from_tensor_model_parallel_region(logits)


def train(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> None:
    """A few Adam steps of next-token loss on a fixed batch: the adapters only (the base is
    frozen by Megatron-Bridge), each rank on its own TP shards of them."""
    optimizer = torch.optim.Adam(params, lr=LR)
    generator = torch.Generator().manual_seed(DATA_SEED)
    tokens = torch.randint(0, TRUE_VOCAB, (BATCH, SEQ + 1), generator=generator)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    for _ in range(STEPS):
        logits = gathered(model(inputs, position_ids(BATCH, SEQ), causal_mask(SEQ)))
        loss = torch.nn.functional.cross_entropy(
            logits[..., :TRUE_VOCAB].reshape(-1, TRUE_VOCAB).float(), labels.reshape(-1)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="> 1: the MoE model, at PP 1")
    parser.add_argument("--mode", choices=("train", "seeded"), default="train")
    parser.add_argument("--base", type=Path, default=None)
    parser.add_argument("--split", action="store_true", help="also verl 0.9's split layout")
    args = parser.parse_args(argv)
    if args.split and (args.mode != "train" or args.ep > 1):
        parser.error("--split: the dense model's trained adapter (--mode train)")
    if args.mode == "train" and args.pp != 1:
        parser.error("--mode train computes its loss on one stage: --pp 1")
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.base.resolve() if args.base else None
    if args.ep > 1 and args.pp != 1:
        parser.error("--ep: the MoE model at --pp 1")
    world = moe.world_size(args.tp, args.ep, args.tp) if args.ep > 1 else args.tp * args.pp
    out = args.out.resolve()
    spawn(worker, world, args.tp, args.pp, args.ep, out, args.mode, base, args.split)
    return 0


if __name__ == "__main__":
    sys.exit(main())
