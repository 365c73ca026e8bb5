"""Independent checks of the synthetic Megatron legacy checkpoint generator (``ckptctl.synth``).

The generator is a test oracle, so it is checked here without its own helpers: every rank file is
loaded with ``torch.load`` and merged back by hand-written rules (cat0 / cat1 / SwiGLU halves /
QKV de-interleave / vocab trim / VPP layer offsets) into an HF state dict compared bit-exactly with
the model, and the TP shards of a pp=1 layout drive a hand-written tensor-parallel forward pass
compared with HF's logits (reference S10.3 items 1 and 2). ``distrib_optim.pt`` (distributed
optimizer) is un-flattened by a hand-written replay of the S4.5 buffer layout, itself checked
against worked examples and against megatron-core's own ``_ParamAndGradBuffer``.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import pytest
import torch

from ckptctl import synth

# Variant A/B of the reference (S10.3): GQA, untied / tied; ng = 4 allows tp in {1, 2, 4}.
CONFIG_A = {"num_heads": 8, "num_kv_heads": 4, "intermediate_size": 96}
ODD = {"hidden_size": 40, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 50}


@pytest.fixture(scope="module")
def trained() -> dict:
    """``(kind) -> (model, states)`` built once per module; weights are after one Adam step."""
    cache: dict = {}

    def get(kind: str):
        if kind not in cache:
            overrides = {
                "untied": dict(CONFIG_A),
                "tied": {**CONFIG_A, "tie_word_embeddings": True},
                # brief defaults: nq=4, ng=2 (ng < tp at tp=4), and head_dim != h/nq
                "default": {},
                "headdim": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 24},
                # sizes that are not multiples of 64 (norms 40, fc2 shard 40x25), so the
                # distributed optimizer's 64-element start alignment leaves visible gaps
                "odd": ODD,
                "odd_tied": {**ODD, "tie_word_embeddings": True},
            }[kind]
            config = synth.tiny_llama_config(**overrides)
            model = synth.make_model(config, seed=0)
            states = synth.adam_step(model, seed=0)
            cache[kind] = (model, states)
        return cache[kind]

    return get


# --------------------------------------------------------------------------------------------
# Hand-written reader and merger (does not use ckptctl.synth)
# --------------------------------------------------------------------------------------------


def load_files(out: Path) -> tuple[dict[tuple[int, int], dict], object]:
    iteration = int((out / "latest_checkpointed_iteration.txt").read_text())
    iter_dir = out / f"iter_{iteration:07d}"
    names = sorted(os.listdir(iter_dir))
    first = torch.load(iter_dir / names[0] / "model_optim_rng.pt", weights_only=False)
    args = first["args"]
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    expected = sorted(
        f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
        for t in range(tp)
        for p in range(pp)
    )
    assert names == expected
    files = {}
    for t in range(tp):
        for p in range(pp):
            name = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
            files[(t, p)] = torch.load(iter_dir / name / "model_optim_rng.pt", weights_only=False)
            assert files[(t, p)]["iteration"] == iteration
    return files, args


def chunk_dicts(payload: dict, vpp: int) -> list[dict[str, torch.Tensor]]:
    if vpp == 1:
        assert "model0" not in payload
        return [payload["model"]]
    assert "model" not in payload
    return [payload[f"model{c}"] for c in range(vpp)]


def layer_offsets(args) -> dict[tuple[int, int], tuple[int, int]]:
    """(stage, chunk) -> (first global layer, count), written from S3.7."""
    L, pp = args.num_layers, args.pipeline_model_parallel_size
    vpp = args.virtual_pipeline_model_parallel_size or 1
    counts = [None] * pp
    first = getattr(args, "num_layers_in_first_pipeline_stage", None)
    last = getattr(args, "num_layers_in_last_pipeline_stage", None)
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    free = [s for s in range(pp) if counts[s] is None]
    left = L - sum(c for c in counts if c is not None)
    for s in free:
        counts[s] = left // len(free)
    assert sum(counts) == L
    out = {}
    for s in range(pp):
        for c in range(vpp):
            out[(s, c)] = (c * (L // vpp) + sum(counts[:s]) // vpp, counts[s] // vpp)
    return out


def optimizer_by_name(
    payload: dict, vpp: int, group_order: str = "appearance"
) -> dict[str, dict[str, torch.Tensor]]:
    """Per (chunk-prefixed) parameter name: exp_avg, exp_avg_sq, step, fp32_param (if any).

    Groups are identified by their ``wd_mult`` (0.0 = no weight decay: bias or 1-D), whatever
    their order; ``group_order`` is the order this test expects the writer to have used.
    """
    opt = payload["optimizer"]
    mixed = "fp32_from_fp16_params" in opt
    torch_sd = opt["optimizer"] if mixed else opt
    members: dict[bool, list[tuple[int, str]]] = {}
    for c, chunk in enumerate(chunk_dicts(payload, vpp)):
        for name, w in chunk.items():
            members.setdefault(name.endswith(".bias") or w.dim() == 1, []).append((c, name))
    groups = torch_sd["param_groups"]
    no_wd_flags = [g["wd_mult"] == 0.0 for g in groups]
    if group_order == "appearance":
        assert no_wd_flags == list(members)
    else:
        assert no_wd_flags == sorted(members)  # the weight-decay group (False) first
    result = {}
    index = 0
    for g, group in enumerate(groups):
        no_wd = no_wd_flags[g]
        assert group["weight_decay"] == (0.0 if no_wd else 0.1)
        assert group["params"] == list(range(index, index + len(members[no_wd])))
        for j, (c, name) in enumerate(members[no_wd]):
            st = torch_sd["state"][index]
            assert list(st) == ["step", "exp_avg", "exp_avg_sq"]
            entry = {k: st[k] for k in ("exp_avg", "exp_avg_sq", "step")}
            if mixed:
                assert len(opt["fp32_from_fp16_params"][g]) == len(members[no_wd])
                entry["fp32_param"] = opt["fp32_from_fp16_params"][g][j]
            result[f"{c}/{name}"] = entry
            index += 1
    assert sorted(torch_sd["state"]) == list(range(index))
    return result


def merge(shards: list[torch.Tensor], key: str, tp: int) -> torch.Tensor:
    """Full tensor from TP shards (still vocab-padded)."""
    if key.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight")):
        return torch.cat(shards, dim=0)
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return torch.cat(shards, dim=1)
    if key.endswith("linear_fc1.weight"):
        gates = [s[: s.shape[0] // 2] for s in shards]
        ups = [s[s.shape[0] // 2 :] for s in shards]
        return torch.cat(gates + ups, dim=0)
    assert shards[0].dim() == 1, key
    for s in shards[1:]:
        assert torch.equal(s, shards[0]), f"replicated {key} differs across TP ranks"
    return shards[0]


def to_hf(
    files: dict, args, tensor_of, vocab: int, zero_padding: bool = True
) -> dict[str, torch.Tensor]:
    """Rebuild an HF Llama state dict; ``tensor_of(tp, pp, chunk, key)`` picks a local tensor.

    A tied last-stage copy of the embedding comes back under the name ``"tied copy"``.
    """
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    vpp = args.virtual_pipeline_model_parallel_size or 1
    nq, ng, d = args.num_attention_heads, args.num_query_groups, args.kv_channels
    r = nq // ng
    local_names = {
        "input_layernorm.weight": "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    }
    hf: dict[str, torch.Tensor] = {}
    offsets = layer_offsets(args)
    for p in range(pp):
        for c in range(vpp):
            start, count = offsets[(p, c)]
            keys = list(chunk_dicts(files[(0, p)], vpp)[c])
            for key in keys:
                if key.endswith("._extra_state"):  # written by real Megatron, not by synth
                    continue
                full = merge([tensor_of(t, p, c, key) for t in range(tp)], key, tp)
                if key == "embedding.word_embeddings.weight":
                    assert (p, c) == (0, 0)
                    assert full.shape[0] == args.padded_vocab_size
                    assert not (zero_padding and full[vocab:].any()), "padding rows must be zero"
                    hf["model.embed_tokens.weight"] = full[:vocab]
                    continue
                if key == "output_layer.weight":
                    assert (p, c) == (pp - 1, vpp - 1)
                    assert not (zero_padding and full[vocab:].any())
                    untied = args.untie_embeddings_and_output_weights
                    hf["lm_head.weight" if untied else "tied copy"] = full[:vocab]
                    continue
                if key == "decoder.final_layernorm.weight":
                    assert (p, c) == (pp - 1, vpp - 1)
                    hf["model.norm.weight"] = full
                    continue
                _, _, local_i, rest = key.split(".", 3)
                assert 0 <= int(local_i) < count
                prefix = f"model.layers.{start + int(local_i)}."
                if rest == "self_attention.linear_qkv.weight":
                    blocks = full.view(ng, r + 2, d, -1)
                    hf[prefix + "self_attn.q_proj.weight"] = blocks[:, :r].reshape(nq * d, -1)
                    hf[prefix + "self_attn.k_proj.weight"] = blocks[:, r].reshape(ng * d, -1)
                    hf[prefix + "self_attn.v_proj.weight"] = blocks[:, r + 1].reshape(ng * d, -1)
                elif rest == "mlp.linear_fc1.weight":
                    f = full.shape[0] // 2
                    hf[prefix + "mlp.gate_proj.weight"] = full[:f]
                    hf[prefix + "mlp.up_proj.weight"] = full[f:]
                else:
                    hf[prefix + local_names[rest]] = full
    return hf


def expected_state_dict(model) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------

LAYOUTS = [(1, 1, 1), (2, 2, 1), (4, 1, 1), (1, 4, 2), (2, 2, 2)]


def check_checkpoint(
    out: Path, model, states, *, naming: str = "te", group_order: str = "appearance"
) -> dict | None:
    files, args = load_files(out)
    config = model.config
    vocab = config.vocab_size
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    vpp = args.virtual_pipeline_model_parallel_size or 1
    tied = config.tie_word_embeddings
    m = args.make_vocab_size_divisible_by
    assert args.padded_vocab_size == math.ceil(vocab / (m * tp)) * m * tp
    assert args.untie_embeddings_and_output_weights == (not tied)
    assert args.num_query_groups == config.num_key_value_heads
    assert args.kv_channels == config.head_dim
    assert args.world_size == tp * pp * args.data_parallel_size

    # Key order: embedding first on stage 0 chunk 0, final norm (and output) last on the last.
    layer_keys = (
        [
            "self_attention.linear_proj.weight",
            "self_attention.linear_qkv.layer_norm_weight",
            "self_attention.linear_qkv.weight",
            "mlp.linear_fc1.layer_norm_weight",
            "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight",
        ]
        if naming == "te"
        else [
            "input_layernorm.weight",
            "self_attention.linear_proj.weight",
            "self_attention.linear_qkv.weight",
            "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight",
        ]
    )
    offsets = layer_offsets(args)
    for (t, p), payload in files.items():
        assert list(payload)[:3] == ["args", "checkpoint_version", "iteration"]
        assert payload["checkpoint_version"] == 3.0
        for c, chunk in enumerate(chunk_dicts(payload, vpp)):
            want = ["embedding.word_embeddings.weight"] if (p, c) == (0, 0) else []
            want += [
                f"decoder.layers.{i}.{k}" for i in range(offsets[(p, c)][1]) for k in layer_keys
            ]
            if (p, c) == (pp - 1, vpp - 1):
                want.append("decoder.final_layernorm.weight")
                if not tied or pp > 1:
                    want.append("output_layer.weight")
            assert list(chunk) == want, (t, p, c)
            for v in chunk.values():
                # Each tensor owns exactly its bytes (no views into a larger storage).
                assert v.untyped_storage().nbytes() == v.numel() * v.element_size()

    weights = to_hf(
        files, args, lambda t, p, c, k: chunk_dicts(files[(t, p)], vpp)[c][k].float(), vocab
    )
    tied_copy = weights.pop("tied copy", None)
    expected = expected_state_dict(model)
    if tied:
        assert "lm_head.weight" not in weights
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        assert (tied_copy is not None) == (pp > 1)
        if tied_copy is not None:
            assert torch.equal(tied_copy, weights["model.embed_tokens.weight"])
    assert sorted(weights) == sorted(expected)
    dtype = args.params_dtype
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor.to(dtype).float()), name

    if "optimizer" not in files[(0, 0)]:
        return
    if args.use_distributed_optimizer:
        return check_distrib_optim(out, files, args, model, states, group_order=group_order)
    by_name = {key: optimizer_by_name(pl, vpp, group_order) for key, pl in files.items()}
    for kind in ("exp_avg", "exp_avg_sq", "step", "fp32_param"):
        if kind == "fp32_param" and dtype == torch.float32:
            continue
        if kind == "step":
            for per_file in by_name.values():
                for entry in per_file.values():
                    assert torch.equal(entry["step"], torch.tensor(1.0))
            continue
        merged = to_hf(
            files, args, lambda t, p, c, k, kind=kind: by_name[(t, p)][f"{c}/{k}"][kind], vocab
        )
        copy = merged.pop("tied copy", None)
        if copy is not None:
            assert torch.equal(copy, merged["model.embed_tokens.weight"])
        for name, tensor in merged.items():
            assert tensor.dtype == torch.float32
            want = expected[name] if kind == "fp32_param" else states[name][kind]
            assert torch.equal(tensor, want), (kind, name)
        assert sorted(merged) == sorted(states)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "tp{}_pp{}_vpp{}".format(*x))
def test_round_trip(tmp_path: Path, trained, layout, tied) -> None:
    model, states = trained("tied" if tied else "untied")
    tp, pp, vpp = layout
    synth.write_megatron(model, states, str(tmp_path), tp=tp, pp=pp, vpp=vpp)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
    check_checkpoint(tmp_path, model, states)


@pytest.mark.parametrize(
    ("kind", "tp", "pp", "vpp", "kwargs"),
    [
        ("default", 4, 1, 1, {}),  # ng=2 < tp=4: even dim-0 split cutting inside groups
        ("headdim", 2, 2, 1, {}),
        ("untied", 2, 2, 1, {"naming": "local"}),
        ("untied", 2, 2, 1, {"naming": "local", "param_group_order": "wd_first"}),
        ("tied", 1, 2, 2, {"naming": "local"}),
        ("untied", 2, 2, 1, {"params_dtype": torch.bfloat16}),
        ("tied", 2, 2, 2, {"params_dtype": torch.bfloat16}),
        ("untied", 1, 3, 1, {"first_stage_layers": 2}),
        ("tied", 2, 3, 2, {"first_stage_layers": 2, "last_stage_layers": 2}),
        ("untied", 1, 2, 1, {"last_stage_layers": 6, "iteration": 1234}),
        ("untied", 2, 1, 1, {"with_optimizer": False, "make_vocab_size_divisible_by": 64}),
    ],
)
def test_variants(tmp_path: Path, trained, kind, tp, pp, vpp, kwargs) -> None:
    model, states = trained(kind)
    synth.write_megatron(model, states, str(tmp_path), tp=tp, pp=pp, vpp=vpp, **kwargs)
    check_checkpoint(
        tmp_path,
        model,
        states,
        naming=kwargs.get("naming", "te"),
        group_order=kwargs.get("param_group_order", "appearance"),
    )
    files, args = load_files(tmp_path)
    payload = files[(0, 0)]
    assert ("optimizer" in payload) == kwargs.get("with_optimizer", True)
    if kwargs.get("params_dtype") == torch.bfloat16:
        assert set(payload["optimizer"]) == {"optimizer", "fp32_from_fp16_params"}
        assert args.bf16 and args.params_dtype == torch.bfloat16
        assert all(v.dtype == torch.bfloat16 for v in chunk_dicts(payload, vpp)[0].values())
    assert list(payload)[-3:] == [
        "opt_param_scheduler",
        "rng_state",
        "num_floating_point_operations_so_far",
    ]


def test_placement_matches_reference_example(tmp_path: Path, trained) -> None:
    """S3.7 example, L=8 p=2 v=2: pp0/model0 0-1, pp1/model0 2-3, pp0/model1 4-5, pp1/model1 6-7."""
    model, states = trained("untied")
    synth.write_megatron(model, states, str(tmp_path), tp=1, pp=2, vpp=2, with_optimizer=False)
    files, _ = load_files(tmp_path)
    for (p, c), first in {(0, 0): 0, (1, 0): 2, (0, 1): 4, (1, 1): 6}.items():
        chunk = files[(0, p)][f"model{c}"]
        for i in range(2):
            w = chunk[f"decoder.layers.{i}.mlp.linear_fc2.weight"]
            assert torch.equal(w, model.model.layers[first + i].mlp.down_proj.weight)


def test_byte_reproducible(tmp_path: Path, trained) -> None:
    model, states = trained("tied")
    digests = []
    for run in ("a", "b"):
        synth.write_megatron(model, states, str(tmp_path / run), tp=2, pp=2, vpp=2)
        files = sorted((tmp_path / run).rglob("*.pt"))
        digests.append([hashlib.sha256(f.read_bytes()).hexdigest() for f in files])
    assert digests[0] == digests[1]


def test_bad_layouts_are_refused(tmp_path: Path, trained) -> None:
    model, states = trained("untied")
    for kwargs in (
        {"tp": 3},
        {"pp": 3},
        {"pp": 1, "vpp": 2},
        {"pp": 2, "vpp": 3},
        {"pp": 1, "first_stage_layers": 2},
        {"dp": 0},
        {"bucket_size": 1000},  # needs distributed_optimizer
        {"distributed_optimizer": True, "bucket_size": 0},
    ):
        with pytest.raises(ValueError):
            synth.write_megatron(model, states, str(tmp_path), **kwargs)


# --------------------------------------------------------------------------------------------
# Distributed optimizer: distrib_optim.pt (S4.1, S4.2, S4.5-S4.7), replayed by hand
# --------------------------------------------------------------------------------------------

Layout = tuple[list[tuple[int, int, int]], list[tuple[int, int]], list[int]]


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def replay_buffer(
    numels: list[int], shared: list[bool], dp: int, bucket_size: int | None
) -> Layout:
    """S4.5 for one grad buffer whose parameters are given in ``named_parameters()`` order.

    Returns ``(where, ranges, unpadded)``: ``where[i] = (start, end, bucket)`` of parameter ``i``
    in buffer coordinates, ``ranges[b] = (start, padded end)`` and ``unpadded[b]``.
    """
    end_multiple = dp * 128 // math.gcd(dp, 128)
    where: dict[int, tuple[int, int, int]] = {}
    ranges: list[tuple[int, int]] = []
    unpadded: list[int] = []
    members: list[int] = []  # parameters of the bucket being filled
    bucket_begin = 0
    cursor = 0

    def seal(end: int) -> int:
        nonlocal bucket_begin
        unpadded.append(end - bucket_begin)
        ranges.append((bucket_begin, round_up(end, end_multiple)))
        bucket_begin = ranges[-1][1]
        members.clear()
        return bucket_begin

    end = 0
    for i in range(len(numels) - 1, -1, -1):  # backprop order: last parameter first
        cursor = round_up(cursor, 64)
        if shared[i] and members:
            cursor = seal(cursor)  # the gap up to the aligned start counts as unpadded
        begin, end = cursor, cursor + numels[i]
        where[i] = (begin, end, len(ranges))
        members.append(i)
        full = bucket_size is not None and end - bucket_begin >= bucket_size
        cursor = seal(end) if shared[i] or full else end
    if members:
        seal(end)
    return [where[i] for i in range(len(numels))], ranges, unpadded


def unflatten_by_dp_rank(
    world: torch.Tensor, layout: Layout, dp: int
) -> tuple[list[torch.Tensor], int]:
    """S4.6: rebuild each parameter from its pieces in the DP ranks' windows, in rank order.

    Returns the flat tensors (in parameter order) and how many parameters straddle windows.
    """
    where, ranges, unpadded = layout
    pieces: list[list[torch.Tensor]] = [[] for _ in where]
    offset = 0  # start of the bucket in the (bucket-end-padding stripped) world tensor
    for b, (bstart, bend) in enumerate(ranges):
        assert (bend - bstart) % dp == 0 and bstart % dp == 0
        bucket = torch.zeros(bend - bstart)
        bucket[: unpadded[b]] = world[offset : offset + unpadded[b]]
        offset += unpadded[b]
        window = (bend - bstart) // dp
        for q in range(dp):
            w0 = bstart + q * window
            shard = bucket[q * window : (q + 1) * window]  # DP rank q's contiguous shard
            for i, (s, e, pb) in enumerate(where):
                lo, hi = max(s, w0), min(e, w0 + window)
                if pb == b and lo < hi:
                    pieces[i].append(shard[lo - w0 : hi - w0])
    assert offset == len(world)
    return [torch.cat(p) for p in pieces], sum(len(p) > 1 for p in pieces)


def check_distrib_optim(
    out: Path, files: dict, args, model, states, *, group_order: str = "appearance"
) -> dict:
    """Every parameter's fp32 master / exp_avg / exp_avg_sq from ``distrib_optim.pt``.

    Un-flattens with :func:`replay_buffer`, two ways (S4.7 slicing and S4.6 DP windows), merges the
    local shards like the weights and compares bit-exactly with the model and its Adam state.
    Returns ``{"buckets": {(t, p, c): n}, "straddling": n, "lengths": {(t, p, c): n}}``.
    """
    pp = args.pipeline_model_parallel_size
    vpp = args.virtual_pipeline_model_parallel_size or 1
    dp = args.data_parallel_size
    bucket_size = args.ddp_bucket_size
    assert args.overlap_grad_reduce == (bucket_size is not None)
    assert not args.ddp_pad_buckets_for_high_nccl_busbw
    tied = not args.untie_embeddings_and_output_weights
    dtype = args.params_dtype
    iteration = int((out / "latest_checkpointed_iteration.txt").read_text())
    stats: dict = {"buckets": {}, "straddling": 0, "lengths": {}}
    local: dict[str, dict] = {key: {} for key in DISTRIB_KEYS}
    for (t, p), payload in files.items():
        # model_optim_rng.pt['optimizer'] = DistributedOptimizer.state_dict(): groups only.
        opt = payload["optimizer"]
        assert list(opt) == ["optimizer"]  # no grad scaler for bf16 / fp32
        assert list(opt["optimizer"]) == ["param_groups"]
        members: dict[bool, None] = {}
        for chunk in chunk_dicts(payload, vpp):
            for w in chunk.values():
                members.setdefault(w.dim() == 1, None)
        flags = [g["wd_mult"] == 0.0 for g in opt["optimizer"]["param_groups"]]
        assert flags == (list(members) if group_order == "appearance" else sorted(members))
        for g in opt["optimizer"]["param_groups"]:
            assert "params" not in g and g["step"] == 1.0 and isinstance(g["step"], float)
            assert g["weight_decay"] == (0.0 if g["wd_mult"] == 0.0 else 0.1)

        rank = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
        path = out / f"iter_{iteration:07d}" / rank / "distrib_optim.pt"
        distrib = torch.load(path, weights_only=True)
        assert list(distrib) == ["buckets_coalesced", *range(vpp)]
        assert distrib["buckets_coalesced"] is True
        for c, chunk in enumerate(chunk_dicts(payload, vpp)):
            assert list(distrib[c]) == [(dtype, torch.float32)]
            world = distrib[c][(dtype, torch.float32)]
            assert list(world) == ["param", "exp_avg", "exp_avg_sq", "numel_unpadded"]
            names = list(chunk)
            shared = [tied and pp > 1 and n in (EMB, OUT) for n in names]
            # DDP buckets only the first model chunk of pipeline stage 0.
            layout = replay_buffer(
                [chunk[n].numel() for n in names],
                shared,
                dp,
                bucket_size if (p, c) == (0, 0) else None,
            )
            where, ranges, unpadded = layout
            assert world["numel_unpadded"] == sum(unpadded)
            assert where[-1][0] == 0, "world position 0 belongs to the last parameter"
            for i in range(len(names)):
                if shared[i]:  # alone in its bucket
                    assert [w[2] for w in where].count(where[i][2]) == 1
            stats["buckets"][(t, p, c)] = len(ranges)
            stats["lengths"][(t, p, c)] = sum(unpadded)
            covered = torch.zeros(sum(unpadded), dtype=torch.bool)
            base = [sum(unpadded[:b]) for b in range(len(ranges))]
            for key in local:
                tensor = world[key]
                assert tensor.dtype == torch.float32 and tensor.shape == (sum(unpadded),)
                flats, straddling = unflatten_by_dp_rank(tensor, layout, dp)
                for name, (s, e, b), flat in zip(names, where, flats, strict=True):
                    lo = base[b] + s - ranges[b][0]
                    assert torch.equal(tensor[lo : lo + e - s], flat)  # S4.7 == S4.6
                    covered[lo : lo + e - s] = True
                    local[key][(t, p, c, name)] = flat.view(chunk[name].shape)
                assert not tensor[~covered].any(), "alignment gaps must be zero"
            stats["straddling"] += straddling

    expected = expected_state_dict(model)
    vocab = model.config.vocab_size
    for key, truth in (
        ("param", lambda n: expected[n]),
        ("exp_avg", lambda n: states[n]["exp_avg"]),
        ("exp_avg_sq", lambda n: states[n]["exp_avg_sq"]),
    ):
        merged = to_hf(files, args, lambda t, p, c, k, key=key: local[key][(t, p, c, k)], vocab)
        copy = merged.pop("tied copy", None)
        assert (copy is not None) == (tied and pp > 1)
        if copy is not None:
            assert torch.equal(copy, merged["model.embed_tokens.weight"])
        assert sorted(merged) == sorted(states)
        for name, tensor in merged.items():
            assert torch.equal(tensor, truth(name)), (key, name)
    return stats


EMB = "embedding.word_embeddings.weight"
OUT = "output_layer.weight"
DISTRIB_KEYS = ("param", "exp_avg", "exp_avg_sq")


def test_replay_buffer_worked_examples() -> None:
    """S4.5 by hand, to pin the test's own replay."""
    # dp 3 -> buckets end at multiples of lcm(3, 128) = 384; bucket_size 200; the first
    # parameter is a shared embedding. Backprop order: 5 @0, 300 @64 (bucket 0 reaches 364 >= 200:
    # closed, padded to 384), 63 @384, then the shared one: aligned 447 -> 448 closes bucket 1
    # (unpadded 64, gap included, padded to 768) and it gets bucket 2 alone.
    assert replay_buffer([100, 63, 300, 5], [True, False, False, False], 3, 200) == (
        [(768, 868, 2), (384, 447, 1), (64, 364, 0), (0, 5, 0)],
        [(0, 384), (384, 768), (768, 1152)],
        [364, 64, 100],
    )
    # dp 2, no bucket size: one bucket, padded to a multiple of 128.
    assert replay_buffer([10, 130, 1], [False] * 3, 2, None) == (
        [(256, 266, 0), (64, 194, 0), (0, 1, 0)],
        [(0, 384)],
        [266],
    )
    # A bucket exactly reaching bucket_size closes; the next parameter starts a new one.
    assert replay_buffer([64, 64], [False, False], 1, 64) == (
        [(128, 192, 1), (0, 64, 0)],
        [(0, 128), (128, 256)],
        [64, 64],
    )


# "odd" sizes make alignment gaps and bucket boundaries visible in the world tensor (with sizes
# that are all multiples of 64, closing a bucket moves nothing: S4.5 then only adds end padding,
# which the coalesced format strips).
ODD_VOCAB = {"make_vocab_size_divisible_by": 7}  # 1100 -> 1106 at tp 2: 6 zero rows, unaligned
DISTOPT_CASES = [
    # kind, tp, pp, vpp, dp, bucket_size, extra write_megatron kwargs
    ("untied", 2, 2, 1, 2, None, {}),
    ("untied", 2, 2, 1, 2, 3000, {}),
    ("odd", 2, 2, 1, 2, None, {}),
    ("odd", 2, 2, 1, 2, 3000, ODD_VOCAB),
    ("odd", 2, 2, 1, 1, 1, {}),  # every parameter of stage 0 in its own bucket
    ("odd", 1, 1, 1, 3, 1000, ODD_VOCAB),
    ("odd", 2, 1, 1, 4, 777, {}),
    ("odd", 2, 1, 1, 2, 553 * 40, ODD_VOCAB),  # output_layer alone fills a bucket exactly
    ("odd", 2, 2, 1, 2, 3000, {"naming": "local", "param_group_order": "wd_first"}),
    ("odd_tied", 2, 2, 1, 2, 2000, ODD_VOCAB),  # shared embedding on the first and last stage
    ("odd_tied", 1, 1, 1, 3, 500, {}),  # tied, pp 1: no shared_embedding
    ("odd_tied", 1, 2, 2, 3, 1500, {}),
    ("tied", 1, 2, 2, 2, 1500, {}),
    ("odd", 2, 2, 2, 2, 4096, {"params_dtype": torch.bfloat16}),
    ("odd_tied", 2, 2, 2, 4, None, {"params_dtype": torch.bfloat16, **ODD_VOCAB}),
]


@pytest.mark.parametrize(
    ("kind", "tp", "pp", "vpp", "dp", "bucket_size", "kwargs"),
    DISTOPT_CASES,
    ids=lambda x: str(x) if not isinstance(x, dict) else "-".join(map(str, x.values())) or "-",
)
def test_distributed_optimizer(
    tmp_path: Path, trained, kind, tp, pp, vpp, dp, bucket_size, kwargs
) -> None:
    model, states = trained(kind)
    synth.write_megatron(
        model,
        states,
        str(tmp_path),
        tp=tp,
        pp=pp,
        vpp=vpp,
        distributed_optimizer=True,
        dp=dp,
        bucket_size=bucket_size,
        **kwargs,
    )
    _, args = load_files(tmp_path)
    assert args.use_distributed_optimizer and args.data_parallel_size == dp
    assert args.world_size == tp * pp * dp
    assert args.ddp_bucket_size == bucket_size
    stats = check_checkpoint(
        tmp_path,
        model,
        states,
        naming=kwargs.get("naming", "te"),
        group_order=kwargs.get("param_group_order", "appearance"),
    )
    assert stats is not None
    shared_ends = model.config.tie_word_embeddings and pp > 1
    for (_, p, c), n in stats["buckets"].items():
        if (p, c) == (0, 0) and bucket_size is not None:
            assert n > 2  # small buckets: several per buffer
        else:  # no bucketing here; the shared embedding still gets a bucket of its own
            first, last = (p, c) == (0, 0), (p, c) == (pp - 1, vpp - 1)
            assert n == 1 + (shared_ends and (first or last))
    if dp > 1:
        assert stats["straddling"] > 0  # some parameters are split over DP ranks
    # TP ranks hold equally sized shards, so their buffers have the same length.
    for (_, p, c), n in stats["lengths"].items():
        assert n == stats["lengths"][(0, p, c)]


def test_distributed_optimizer_states_equal_non_distributed(tmp_path: Path, trained) -> None:
    """Per parameter, distrib_optim.pt holds exactly the non-distributed optimizer's state."""
    model, states = trained("tied")
    common = {"tp": 2, "pp": 2, "vpp": 2, "params_dtype": torch.bfloat16}
    synth.write_megatron(model, states, str(tmp_path / "plain"), **common)
    synth.write_megatron(
        model,
        states,
        str(tmp_path / "dist"),
        distributed_optimizer=True,
        dp=2,
        bucket_size=2500,
        **common,
    )
    plain, _ = load_files(tmp_path / "plain")
    dist, _ = load_files(tmp_path / "dist")
    for (t, p), payload in dist.items():
        want = optimizer_by_name(plain[(t, p)], 2)
        rank = f"mp_rank_{t:02d}_{p:03d}"
        distrib = torch.load(tmp_path / "dist/iter_0000001" / rank / "distrib_optim.pt")
        for c, chunk in enumerate(chunk_dicts(payload, 2)):
            assert list(chunk) == list(chunk_dicts(plain[(t, p)], 2)[c])
            names = list(chunk)
            layout = replay_buffer(
                [chunk[n].numel() for n in names],
                [n in (EMB, OUT) for n in names],
                2,
                2500 if (p, c) == (0, 0) else None,
            )
            world = distrib[c][(torch.bfloat16, torch.float32)]
            flats = {k: unflatten_by_dp_rank(world[k], layout, 2)[0] for k in DISTRIB_KEYS}
            for i, name in enumerate(names):
                entry = want[f"{c}/{name}"]
                assert torch.equal(flats["param"][i], entry["fp32_param"].reshape(-1))
                assert torch.equal(flats["exp_avg"][i], entry["exp_avg"].reshape(-1))
                assert torch.equal(flats["exp_avg_sq"][i], entry["exp_avg_sq"].reshape(-1))
    assert (tmp_path / "plain/iter_0000001/mp_rank_00_000/model_optim_rng.pt").exists()
    assert not list((tmp_path / "plain").rglob("distrib_optim.pt"))
    assert len(list((tmp_path / "dist").rglob("distrib_optim.pt"))) == 4


def test_distrib_optim_does_not_depend_on_dp(tmp_path: Path, trained) -> None:
    """DP only pads bucket ends (to lcm(dp, 128), a multiple of 64), which the coalesced format
    strips: distrib_optim.pt is byte-identical for any dp; only ``args`` differ."""
    model, states = trained("odd_tied")
    digests = set()
    for dp in (1, 2, 3, 4, 256):
        out = tmp_path / f"dp{dp}"
        synth.write_megatron(
            model, states, str(out), tp=2, pp=2, distributed_optimizer=True, dp=dp, bucket_size=900
        )
        files = sorted(out.rglob("distrib_optim.pt"))
        assert len(files) == 4
        digests.add(tuple(hashlib.sha256(f.read_bytes()).hexdigest() for f in files))
    assert len(digests) == 1


def test_example_cli_writes_distributed_optimizer(tmp_path: Path) -> None:
    import importlib.util

    script = Path(__file__).resolve().parents[2] / "examples" / "make_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_checkpoint", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "ckpt"
    argv = ["--out", str(out), "--layers", "2", "--tp", "2", "--pp", "2", "--dp", "3"]
    assert module.main([*argv, "--distributed-optimizer", "--bucket-size", "3000"]) == 0
    _, args = load_files(out)
    assert args.use_distributed_optimizer and args.ddp_bucket_size == 3000
    assert args.world_size == 12
    assert len(list(out.rglob("distrib_optim.pt"))) == 4
    assert module.main([*argv, "--bucket-size", "3000"]) == 2  # needs --distributed-optimizer


def test_distributed_optimizer_byte_reproducible(tmp_path: Path, trained) -> None:
    model, states = trained("tied")
    digests = []
    for run in ("a", "b"):
        synth.write_megatron(
            model,
            states,
            str(tmp_path / run),
            tp=2,
            pp=2,
            vpp=2,
            distributed_optimizer=True,
            dp=3,
            bucket_size=2000,
        )
        files = sorted((tmp_path / run).rglob("*.pt"))
        assert sum(f.name == "distrib_optim.pt" for f in files) == 4
        digests.append(
            [
                (f.relative_to(tmp_path / run), hashlib.sha256(f.read_bytes()).hexdigest())
                for f in files
            ]
        )
    assert digests[0] == digests[1]


# --------------------------------------------------------------------------------------------
# Simulated tensor-parallel forward from the shards (S10.3 item 2)
# --------------------------------------------------------------------------------------------


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def tp_forward(files: dict, args, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    tp = args.tensor_model_parallel_size
    assert args.pipeline_model_parallel_size == 1
    shards = [files[(t, 0)]["model"] for t in range(tp)]
    nq, ng, d = args.num_attention_heads, args.num_query_groups, args.kv_channels
    r, ng_local = nq // ng, ng // tp
    eps = args.norm_epsilon
    batch, seq = ids.shape
    vp_local = args.padded_vocab_size // tp
    local_spec = {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    }

    def norm(prefix: str, te_name: str) -> torch.Tensor:
        sd = shards[0]
        return sd.get(prefix + te_name, sd.get(prefix + local_spec[te_name]))

    # Vocab-parallel embedding: each rank looks up its own rows, zeros elsewhere, then all-reduce.
    x = torch.zeros(batch, seq, args.hidden_size)
    for t, sd in enumerate(shards):
        table = sd["embedding.word_embeddings.weight"]
        lo = t * vp_local
        mine = (ids >= lo) & (ids < lo + vp_local)
        local_ids = torch.where(mine, ids - lo, torch.zeros_like(ids))
        x = x + table[local_ids] * mine.unsqueeze(-1)

    pos = torch.arange(seq, dtype=torch.float32)
    inv_freq = 1.0 / (args.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.cat([pos[:, None] * inv_freq[None], pos[:, None] * inv_freq[None]], dim=-1)
    cos, sin = angles.cos(), angles.sin()  # [seq, d]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()

    for i in range(args.num_layers):
        pre = f"decoder.layers.{i}."
        y = rmsnorm(x, norm(pre, "self_attention.linear_qkv.layer_norm_weight"), eps)
        attn_sum = torch.zeros_like(x)
        for sd in shards:
            z = y @ sd[pre + "self_attention.linear_qkv.weight"].T
            z = z.view(batch, seq, ng_local, r + 2, d)
            q = z[:, :, :, :r].reshape(batch, seq, ng_local * r, d).transpose(1, 2)
            k = z[:, :, :, r].transpose(1, 2)  # [b, groups, seq, d]
            v = z[:, :, :, r + 1].transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            heads = []
            for j in range(ng_local * r):
                g = j // r  # each query head reads its own group's k, v
                scores = q[:, j] @ k[:, g].transpose(-1, -2) / math.sqrt(d)
                scores = scores.masked_fill(~causal, float("-inf"))
                heads.append(scores.softmax(-1) @ v[:, g])
            o = torch.stack(heads, dim=2).reshape(batch, seq, ng_local * r * d)
            attn_sum = attn_sum + o @ sd[pre + "self_attention.linear_proj.weight"].T
        x = x + attn_sum

        y = rmsnorm(x, norm(pre, "mlp.linear_fc1.layer_norm_weight"), eps)
        mlp_sum = torch.zeros_like(x)
        for sd in shards:
            u = y @ sd[pre + "mlp.linear_fc1.weight"].T
            gate, up = u.chunk(2, dim=-1)
            mlp_sum = (
                mlp_sum
                + (torch.nn.functional.silu(gate) * up) @ sd[pre + "mlp.linear_fc2.weight"].T
            )
        x = x + mlp_sum

    h = rmsnorm(x, shards[0]["decoder.final_layernorm.weight"], eps)
    out_key = (
        "output_layer.weight"
        if args.untie_embeddings_and_output_weights
        else "embedding.word_embeddings.weight"
    )
    logits = torch.cat([h @ sd[out_key].T for sd in shards], dim=-1)
    return logits[..., :vocab]


@pytest.mark.parametrize("kind", ["untied", "tied", "headdim"])
def test_simulated_tp_forward(tmp_path: Path, trained, kind) -> None:
    model, states = trained(kind)
    synth.write_megatron(model, states, str(tmp_path), tp=2, with_optimizer=False)
    files, args = load_files(tmp_path)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(7)
    )
    # Make sure both vocab shards are exercised.
    assert (ids < args.padded_vocab_size // 2).any() and (ids >= args.padded_vocab_size // 2).any()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = tp_forward(files, args, ids, model.config.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_hf_save_round_trip(tmp_path: Path, trained) -> None:
    from transformers import LlamaForCausalLM

    model, _ = trained("tied")
    synth.save_hf(model, str(tmp_path))
    loaded = LlamaForCausalLM.from_pretrained(str(tmp_path))
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_model_is_deterministic(trained) -> None:
    model, states = trained("untied")
    again = synth.make_model(model.config, seed=0)
    again_states = synth.adam_step(again, seed=0)
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    for name, st in states.items():
        assert all(torch.equal(st[k], again_states[name][k]) for k in st)
    norm = model.model.layers[0].input_layernorm.weight
    assert not torch.allclose(norm, torch.ones_like(norm))


def test_param_group_order_matters_only_when_a_rank_starts_with_a_norm(
    tmp_path: Path, trained
) -> None:
    """Local names on stage 1 start with input_layernorm (1-D): the two orders differ there."""
    model, states = trained("untied")
    wd_mults = {}
    for order in ("appearance", "wd_first"):
        for naming in ("te", "local"):
            out = tmp_path / f"{order}-{naming}"
            synth.write_megatron(
                model, states, str(out), pp=2, naming=naming, param_group_order=order
            )
            files, _ = load_files(out)
            for p in range(2):
                groups = files[(0, p)]["optimizer"]["param_groups"]
                wd_mults[(order, naming, p)] = [g["wd_mult"] for g in groups]
    assert wd_mults[("appearance", "local", 1)] == [0.0, 1.0]
    for key, value in wd_mults.items():
        if key != ("appearance", "local", 1):
            assert value == [1.0, 0.0], key


# --------------------------------------------------------------------------------------------
# megatron-core as the judge (optional: skipped when megatron-core is not installed)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def megatron_cpu(monkeypatch):
    """A one-process gloo group with megatron-core's model-parallel state, patched for CPU."""
    pytest.importorskip("megatron.core")
    import contextlib
    import warnings

    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    # RoPE moves inv_freq to torch.cuda.current_device(); the dropout RNG fork needs CUDA.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(
        CudaRNGStatesTracker, "fork", lambda self, name="": contextlib.nullcontext()
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.oracle
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", ["untied", "tied", "headdim"])
def test_megatron_core_gptmodel_loads_local_spec_checkpoint(
    tmp_path: Path, trained, megatron_cpu, kind
) -> None:
    """megatron-core's own GPTModel (local spec) has exactly our key order and HF's logits."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

    model, states = trained(kind)
    synth.write_megatron(model, states, str(tmp_path), naming="local", with_optimizer=False)
    files, args = load_files(tmp_path)
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        tensor_model_parallel_size=1,
        normalization="RMSNorm",
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        parallel_output=False,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(args.rotary_base),
    )
    ours = files[(0, 0)]["model"]
    theirs = [k for k in gpt.state_dict_for_save_checkpoint() if not k.endswith("._extra_state")]
    assert list(ours) == theirs
    assert [name for name, _ in gpt.named_parameters()] == list(ours)
    gpt.load_state_dict(ours, strict=False)
    for name, tensor in gpt.state_dict().items():
        if not name.endswith("._extra_state"):
            assert torch.equal(tensor, ours[name]), name
    gpt.eval()

    ids = torch.randint(
        0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3)
    )
    positions = torch.arange(17).unsqueeze(0).expand(2, 17)
    mask = torch.ones(17, 17, dtype=torch.bool).triu(1)[None, None]  # True = masked
    with torch.no_grad():
        got = gpt(ids, positions, mask)[..., : model.config.vocab_size]
        want = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.fixture
def megatron_grad_buffer(monkeypatch):
    """Build megatron-core's own ``_ParamAndGradBuffer`` on CPU, no process group needed.

    Returns ``make(tensors, shared, dp, bucket_size) -> buffer``: the buffer is laid out for the
    distributed optimizer with a stub DP group of size ``dp``; the parameters' values are copied
    into ``buffer.param_data`` at megatron's own positions.
    """
    pytest.importorskip("megatron.core")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.distributed.param_and_grad_buffer as pgb
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.process_groups_config import ProcessGroupCollection

    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(pgb, "log_on_each_pipeline_stage", lambda *a, **k: None)

    class Group:  # what the buffer asks of its DP / TP groups while laying out
        def __init__(self, size: int) -> None:
            self._size = size

        def size(self) -> int:
            return self._size

        def rank(self) -> int:
            return 0

    def make(tensors, shared, dp, bucket_size):
        params = [torch.nn.Parameter(t.detach().clone()) for t in tensors]
        for param, flag in zip(params, shared, strict=True):
            if flag:
                param.shared_embedding = True
        groups = ProcessGroupCollection()
        groups.tp, groups.dp_cp = Group(1), Group(dp)
        return pgb._ParamAndGradBuffer(
            ddp_config=DistributedDataParallelConfig(
                use_distributed_optimizer=True, grad_reduce_in_fp32=True
            ),
            param_dtype=params[0].dtype,
            grad_dtype=torch.float32,
            params=params,
            data_parallel_group=Group(dp),
            bucket_size=bucket_size,
            param_to_name={param: str(i) for i, param in enumerate(params)},
            gradient_scaling_factor=1.0,
            param_indices=list(range(len(params))),
            nccl_ub=False,
            pg_collection=groups,
        ), params

    return make


@pytest.mark.oracle
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_replay_buffer_matches_megatron_core(megatron_grad_buffer) -> None:
    """The test's S4.5 replay against megatron-core's _ParamAndGradBuffer, random layouts."""
    gen = torch.Generator().manual_seed(0)
    for case in range(60):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        numels = [int(x) for x in torch.randint(1, 400, (n,), generator=gen)]
        shared = [False] * n
        if case % 3 == 1:
            shared[0] = True  # first stage: the embedding comes first
        elif case % 3 == 2:
            shared[-1] = True  # last stage: the output-layer copy comes last
        dp = [1, 2, 3, 4, 6, 256][case % 6]
        bucket_size = [None, 1, 64, 200, 500, 10_000][(case // 6) % 6]
        buffer, params = megatron_grad_buffer(
            [torch.zeros(k) for k in numels], shared, dp, bucket_size
        )
        where, ranges, unpadded = replay_buffer(numels, shared, dp, bucket_size)
        assert [buffer.param_index_map[param] for param in params] == where, case
        assert buffer.bucket_indices == ranges, case
        assert [bucket.numel_unpadded for bucket in buffer.buckets] == unpadded, case
        assert buffer.numel_unpadded == sum(unpadded)


@pytest.mark.oracle
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    ("kind", "tp", "pp", "vpp", "dp", "bucket_size", "dtype"),
    [
        ("odd_tied", 2, 2, 1, 2, 2000, torch.float32),
        ("odd", 1, 1, 1, 3, 700, torch.float32),
        ("odd_tied", 1, 2, 2, 4, 1500, torch.bfloat16),
    ],
)
def test_distrib_optim_master_weights_sit_where_megatron_core_puts_params(
    tmp_path: Path, trained, megatron_grad_buffer, kind, tp, pp, vpp, dp, bucket_size, dtype
) -> None:
    """megatron-core lays the stored weights out in its own buffer; its buckets minus end padding,
    concatenated, are the (cast) ``param`` world tensor of our distrib_optim.pt."""
    model, states = trained(kind)
    synth.write_megatron(
        model,
        states,
        str(tmp_path),
        tp=tp,
        pp=pp,
        vpp=vpp,
        params_dtype=dtype,
        distributed_optimizer=True,
        dp=dp,
        bucket_size=bucket_size,
        make_vocab_size_divisible_by=7,
    )
    files, args = load_files(tmp_path)
    tied = not args.untie_embeddings_and_output_weights
    for (t, p), payload in files.items():
        rank = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
        distrib = torch.load(tmp_path / "iter_0000001" / rank / "distrib_optim.pt")
        for c, chunk in enumerate(chunk_dicts(payload, vpp)):
            buffer, _ = megatron_grad_buffer(
                list(chunk.values()),
                [tied and pp > 1 and n in (EMB, OUT) for n in chunk],
                dp,
                bucket_size if (p, c) == (0, 0) else None,  # DDP: buckets on stage 0 chunk 0
            )
            theirs = torch.cat([b.param_data[: b.numel_unpadded] for b in buffer.buckets])
            ours = distrib[c][(dtype, torch.float32)]
            assert ours["numel_unpadded"] == buffer.numel_unpadded
            assert torch.equal(ours["param"].to(dtype), theirs), (t, p, c)


@pytest.mark.oracle
@pytest.mark.slow
def test_merge_rules_and_tp_forward_agree_with_real_megatron_tp2(tmp_path: Path) -> None:
    """The hand-written readers above, applied to shards megatron-core itself wrote at tp=2.

    Tests the tests: if these merge rules and this simulated TP forward reproduce megatron-core's
    own tp=2 logits, the bit-exact round trips above pin the generator to Megatron's layout.
    ``slow`` (a 2-process spawn, 6-12 s): run with ``pytest -m slow tests/synth/test_synth.py``.
    """
    pytest.importorskip("megatron.core")
    pytest.importorskip("einops")
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.oracle_runner import run_oracle

    run_oracle("megatron_core_legacy_writer.py", tmp_path, "--tp", 2, timeout=300)
    files, args = load_files(tmp_path)
    vocab = args.vocab_size
    reference = torch.load(tmp_path / "reference.pt")
    ids = reference["input_ids"]
    with torch.no_grad():
        got = tp_forward(files, args, ids, vocab)
    torch.testing.assert_close(got, reference["logits"], atol=1e-4, rtol=1e-4)

    # Megatron's random init fills the vocab padding rows, so they are not checked here.
    hf_sd = to_hf(
        files, args, lambda t, p, c, k: files[(t, p)]["model"][k], vocab, zero_padding=False
    )
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden_size,
        intermediate_size=args.ffn_hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_query_groups,
        head_dim=args.kv_channels,
        rms_norm_eps=args.norm_epsilon,
        rope_theta=float(args.rotary_base),
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=False,
    )
    hf = LlamaForCausalLM(config)
    hf.set_attn_implementation("eager")
    hf.load_state_dict(hf_sd, strict=True)
    with torch.no_grad():
        logits = hf(input_ids=ids).logits
    torch.testing.assert_close(logits, reference["logits"], atol=1e-4, rtol=1e-4)


@pytest.mark.oracle
@pytest.mark.slow
def test_distrib_optim_matches_real_megatron_core_distributed_optimizer(tmp_path: Path) -> None:
    """megatron-core's own DistributedOptimizer (8 CPU processes, TP2 PP2 DP2, tied, buckets of
    3000 on stage 0, unaligned sizes) against the test's replay and the generator.

    The replay un-flattens the real ``distrib_optim.pt`` into the exact master weights and Adam
    moments megatron reports (``truth_*.pt``); the generator, given the same shapes, writes the
    same structure and buffer lengths. ``slow`` (~45 s):
    ``pytest -m slow tests/synth/test_synth.py``.
    """
    pytest.importorskip("megatron.core")
    pytest.importorskip("einops")
    from tests.oracle_runner import run_oracle

    real = tmp_path / "real"
    flags = ["--tp", "2", "--pp", "2", "--dp", "2", "--bucket-size", "3000", "--tie-embeddings"]
    run_oracle("megatron_core_distopt_writer.py", real, *flags, "--hidden", 48, "--ffn-hidden", 100)
    files, args = load_files(real)
    assert args.use_distributed_optimizer and args.ddp_bucket_size == 3000

    config = synth.tiny_llama_config(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_attention_heads,
        num_kv_heads=args.num_query_groups,
        intermediate_size=args.ffn_hidden_size,
        head_dim=args.kv_channels,
        tie_word_embeddings=True,
    )
    model = synth.make_model(config)
    states = synth.adam_step(model)
    ours_dir = tmp_path / "ours"
    synth.write_megatron(
        model,
        states,
        str(ours_dir),
        tp=2,
        pp=2,
        naming="local",
        param_group_order="wd_first",  # megatron-core 0.16
        distributed_optimizer=True,
        dp=2,
        bucket_size=3000,
    )
    ours, _ = load_files(ours_dir)

    for (t, p), payload in files.items():
        rank = f"iter_0000001/mp_rank_{t:02d}_{p:03d}/distrib_optim.pt"
        real_distrib = torch.load(real / rank, weights_only=True)
        our_distrib = torch.load(ours_dir / rank, weights_only=True)
        assert list(payload["optimizer"]) == list(ours[(t, p)]["optimizer"]) == ["optimizer"]
        real_groups = payload["optimizer"]["optimizer"]["param_groups"]
        our_groups = ours[(t, p)]["optimizer"]["optimizer"]["param_groups"]
        assert [g["wd_mult"] for g in real_groups] == [g["wd_mult"] for g in our_groups]
        assert [g["step"] for g in real_groups] == [g["step"] for g in our_groups]
        assert list(real_distrib) == list(our_distrib) == ["buckets_coalesced", 0]
        assert list(real_distrib[0]) == list(our_distrib[0]) == [(torch.float32, torch.float32)]
        real_world = real_distrib[0][(torch.float32, torch.float32)]
        our_world = our_distrib[0][(torch.float32, torch.float32)]
        assert list(real_world) == list(our_world)
        assert real_world["numel_unpadded"] == our_world["numel_unpadded"]

        chunk = {k: v for k, v in payload["model"].items() if not k.endswith("._extra_state")}
        assert [(k, v.shape) for k, v in chunk.items()] == [
            (k, v.shape) for k, v in ours[(t, p)]["model"].items()
        ]
        layout = replay_buffer(
            [v.numel() for v in chunk.values()],
            [k in (EMB, OUT) for k in chunk],
            2,
            3000 if p == 0 else None,
        )
        assert real_world["numel_unpadded"] == sum(layout[2])
        truth = torch.load(real / f"truth_tp{t}_pp{p}.pt", weights_only=True)
        for key in DISTRIB_KEYS:
            flats, _ = unflatten_by_dp_rank(real_world[key], layout, 2)
            for name, flat in zip(chunk, flats, strict=True):
                assert torch.equal(flat.view(chunk[name].shape), truth[name][key]), (key, name)
