"""Small Megatron checkpoints in the three on-disk formats, built from known global tensors.

Layouts follow REFERENCE.md section 2: legacy ``iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/
model_optim_rng.pt`` files with local layer/expert numbers and TP splits; torch_dist DCP
directories (records written by stock ``FileSystemWriter``) with ``metadata.json``,
``mcore_data`` flattened-range tensors, ``common.pt`` or a ``common_state`` object; zarr
v2 arrays (uncompressed chunk files, one per rank shard) with ``metadata.json``.
Sizes are odd on purpose so that DTensor shards cut across the saved TP splits.

Imitations, kept only where the real library cannot produce the case here (real
megatron-core checkpoints are in ``tests/fixtures/megatron``): legacy ``mp_rank`` files come
from Megatron-LM's training code, not megatron-core; the torch_dist writer covers
flattened-range ranges split into three boxes (the real 0.14.0 / 0.15.3 fixtures split at
most into two), incomplete saves and TP-replica keys (its ``common_state`` object is now also covered by the real
megatron-core 0.19.2 fixture); the zarr writer covers incomplete saves and bad shapes.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import random
import re
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

H, F, V, N_EXPERTS = 10, 14, 18, 4  # hidden, ffn (per SwiGLU half), vocab, experts

# global name pattern -> (shape, dtype, TP split dim or None)
DENSE_LAYER = {
    "self_attention.linear_qkv.weight": ((3 * H, H), torch.float32, 0),
    "self_attention.linear_qkv.bias": ((3 * H,), torch.float32, 0),
    "self_attention.linear_qkv.layer_norm_weight": ((H,), torch.bfloat16, None),
    "self_attention.linear_proj.weight": ((H, H), torch.float32, 1),
    "self_attention.linear_proj.bias": ((H,), torch.float32, None),
    "pre_mlp_layernorm.weight": ((H,), torch.bfloat16, None),
}
MLP = {
    "mlp.linear_fc1.weight": ((2 * F, H), torch.float32, 0),  # SwiGLU: [W; V]
    "mlp.linear_fc2.weight": ((H, F), torch.float32, 1),
}
EXPERT = {
    "linear_fc1.weight": ((2 * F, H), torch.float32, 0),
    "linear_fc2.weight": ((H, F), torch.float32, 1),
}
FIRST = {"embedding.word_embeddings.weight": ((V, H), torch.float32, 0)}
LAST = {
    "decoder.final_layernorm.weight": ((H,), torch.bfloat16, None),
    "output_layer.weight": ((V, H), torch.float32, 0),
}


def _value(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def global_model(num_layers: int, moe: bool = False) -> dict[str, tuple[torch.Tensor, int | None]]:
    """Global name -> (full tensor, TP split dim)."""
    specs: dict[str, tuple[tuple[int, ...], torch.dtype, int | None]] = dict(FIRST)
    for layer in range(num_layers):
        prefix = f"decoder.layers.{layer}."
        specs.update({prefix + k: v for k, v in DENSE_LAYER.items()})
        if moe:
            specs[prefix + "mlp.router.weight"] = ((N_EXPERTS, H), torch.float32, None)
            for e in range(N_EXPERTS):
                specs.update({f"{prefix}mlp.experts.local_experts.{e}.{k}": v for k, v in EXPERT.items()})
        else:
            specs.update({prefix + k: v for k, v in MLP.items()})
    specs.update(LAST)
    return {name: (_value(shape, dtype, n), dim) for n, (name, (shape, dtype, dim)) in enumerate(specs.items())}


def tp_shard(name: str, full: torch.Tensor, dim: int | None, tp: int, rank: int, swiglu: bool) -> torch.Tensor:
    if dim is None:
        return full.clone()
    if swiglu and name.endswith("linear_fc1.weight"):
        w, v = full.chunk(2, dim=0)
        return torch.cat([w.chunk(tp, dim=0)[rank], v.chunk(tp, dim=0)[rank]]).clone()
    return full.chunk(tp, dim=dim)[rank].clone()


def _local_name(name: str, layer_base: int, expert_base: int) -> str:
    name = re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m[1]) - layer_base}.", name, count=1)
    return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m[1]) - expert_base}.", name)


def make_args(tp: int, pp: int, ep: int, num_layers: int, moe: bool) -> argparse.Namespace:
    return argparse.Namespace(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        num_layers=num_layers, hidden_size=H, ffn_hidden_size=F, swiglu=True,
        num_experts=N_EXPERTS if moe else None, params_dtype=torch.float32, iteration=None,
    )


# mcore name -> pre-mcore name (megatron/legacy/model: ParallelTransformer, ParallelMLP)
PRE_MCORE_NAMES = (
    (r"^embedding\.", "language_model.embedding."),
    (r"^decoder\.final_layernorm\.", "language_model.encoder.final_norm."),
    (r"^output_layer\.", "language_model.output_layer."),
    (r"^decoder\.layers\.", "language_model.encoder.layers."),
    (r"self_attention\.linear_qkv\.layer_norm_weight$", "input_norm.weight"),
    (r"self_attention\.linear_qkv\.", "self_attention.query_key_value."),
    (r"self_attention\.linear_proj\.", "self_attention.dense."),
    (r"pre_mlp_layernorm\.", "post_attention_norm."),
    (r"mlp\.linear_fc1\.", "mlp.dense_h_to_4h."),
    (r"mlp\.linear_fc2\.", "mlp.dense_4h_to_h."),
)


def pre_mcore_name(name: str) -> str:
    for pattern, replacement in PRE_MCORE_NAMES:
        name = re.sub(pattern, replacement, name)
    return name


def pre_mcore_model(params: dict[str, object]) -> dict[str, object]:
    """Pre-mcore nesting: model["language_model"][section][...] with the encoder's layers flat.

    Megatron-LM's legacy model code is not part of megatron-core (the library whose real
    outputs the other fixtures are), so this layout is written here from its
    ``state_dict_for_save_checkpoint`` structure.
    """
    nested: dict[str, dict] = {}
    for name, value in params.items():
        _, section, rest = pre_mcore_name(name).split(".", 2)
        if section == "encoder":
            nested.setdefault(section, {})[rest] = value
        else:  # embedding.word_embeddings.weight -> {"word_embeddings": {"weight": ...}}
            node = nested.setdefault(section, {})
            *parents, leaf = rest.split(".")
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = value
    return {"language_model": nested}


def write_legacy(
    root: str, tp: int, pp: int, ep: int = 1, num_layers: int = 4, moe: bool = False, iteration: int | str = 20,
    pre_mcore: bool = False, extra_state: object = None,
) -> dict[str, torch.Tensor]:
    """Write a legacy checkpoint; return the global tensors it holds (global names).

    ``pre_mcore``: the nested pre-mcore layout and names; ``extra_state``: the value stored
    as each attention's ``_extra_state`` (Transformer Engine writes io.BytesIO; empty ones too).
    """
    model = global_model(num_layers, moe)
    args = make_args(tp, pp, ep, num_layers, moe)
    per_stage, per_ep = num_layers // pp, N_EXPERTS // ep
    iter_dir = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    for t in range(tp):
        for p in range(pp):
            for e in range(ep):
                params: OrderedDict[str, object] = OrderedDict()
                for name, (full, dim) in model.items():
                    layer = re.search(r"layers\.(\d+)\.", name)
                    expert = re.search(r"local_experts\.(\d+)\.", name)
                    if layer and int(layer[1]) // per_stage != p:
                        continue
                    if not layer and p != (0 if name in FIRST else pp - 1):
                        continue
                    if expert and int(expert[1]) // per_ep != e:
                        continue
                    local = _local_name(name, p * per_stage, e * per_ep)
                    params[local] = tp_shard(name, full, dim, tp, t, swiglu=True)
                    if name.endswith("linear_proj.weight"):  # TE extra state rides along in real files
                        extra = io.BytesIO(b"te") if extra_state is None else extra_state
                        params[local.replace("linear_proj.weight", "core_attention._extra_state")] = extra
                directory = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
                path = os.path.join(root, iter_dir, directory)
                os.makedirs(path, exist_ok=True)
                torch.save(
                    {
                        "args": args,
                        "checkpoint_version": 3.0,
                        "iteration": 0 if iteration == "release" else int(iteration),
                        "model": pre_mcore_model(params) if pre_mcore else params,
                        "optimizer": {"param_groups": [{"lr": 1e-4}], "state": {}},
                        "opt_param_scheduler": {"num_steps": 64},
                        "rng_state": [{
                            "random_rng_state": random.Random(t).getstate(),
                            "np_rng_state": np.random.RandomState(t).get_state(),
                            "torch_rng_state": torch.get_rng_state(),
                            "rng_tracker_states": {},
                        }],
                    },
                    os.path.join(path, "model_optim_rng.pt"),
                )
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return {pre_mcore_name(name) if pre_mcore else name: full for name, (full, _) in model.items()}


# -- torch_dist ---------------------------------------------------------------------------

COMMON = {"args": argparse.Namespace(tensor_model_parallel_size=2, swiglu=True), "iteration": 7, "checkpoint_version": 3.0}
STACKED = "decoder.layers.self_attention.linear_qkv.weight"  # layer-stacked (L, 3H, H), TP split on dim 1
FLAT = "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight"
NORM = "decoder.final_layernorm.weight"
OBJECTS = {"decoder.layers.self_attention.core_attention._extra_state/shard_0_2": {"fp8": 0},
           "decoder.layers.self_attention.core_attention._extra_state/shard_1_2": {"fp8": 1}}
FLAT_RANGES = ((0, 41), (41, 77), (77, 150))  # three DP ranks' ranges of each 150-element block


def torch_dist_globals() -> dict[str, torch.Tensor]:
    return {
        STACKED: _value((2, 3 * H, H), torch.float32, 101),
        FLAT: _value((2, 3 * H, H), torch.float32, 102),
        NORM: _value((H,), torch.bfloat16, 103),
    }


def write_torch_dist(root: str, common: str = "common.pt", complete: bool = True) -> dict[str, torch.Tensor]:
    """A TP2 torch_dist checkpoint with a flattened-range optimizer state; ``common``:
    "common.pt" (megatron-core 0.16) or "object" (a ``common_state`` ShardedObject)."""
    full = torch_dist_globals()
    chunks: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {NORM: [((0,), full[NORM])]}
    half = 3 * H // 2
    chunks[STACKED] = [((layer, r * half, 0), full[STACKED][layer : layer + 1, r * half : (r + 1) * half])
                       for layer in range(2) for r in range(2)]
    chunks[FLAT] = []
    for layer in range(2):
        for r in range(2):
            block = full[FLAT][layer : layer + 1, r * half : (r + 1) * half].reshape(-1)
            for start, stop in FLAT_RANGES:
                chunks[FLAT].append(((layer, r, 0, start), block[start:stop].reshape(1, 1, 1, -1)))
    shapes = {NORM: (H,), STACKED: (2, 3 * H, H), FLAT: (2, 2, 1, half * H)}
    objects = {k: _saved([v]) for k, v in OBJECTS.items()}
    if common == "object":
        objects["common_state/shard_0_1"] = _saved([COMMON])
    else:
        torch.save(COMMON, os.path.join(root, "common.pt"))
    write_dcp(root, chunks, shapes, objects, {FLAT: {"nd_reformulated_orig_global_shape": (2, 3 * H, H)}})
    if complete:
        with open(os.path.join(root, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                       "common_backend": "torch", "common_backend_version": 1}, f)
    return full


def _saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class _MCoreLikeSavePlanner(DefaultSavePlanner):
    """Like Megatron's planner: ShardedObject bytes are written as they are (already serialized)."""

    def transform_object(self, write_item, object):  # noqa: A002 - DCP's signature
        return object


def write_dcp(root, chunks, shapes, objects, mcore_data) -> None:
    """Stock-written records, then the ``.metadata`` Megatron's planner would have produced."""
    staged: dict[str, object] = {}
    for key, pieces in chunks.items():
        for n, (_, tensor) in enumerate(pieces):
            staged[f"{key}#{n}"] = tensor.contiguous()
    staged.update({f"{key}#b": io.BytesIO(data) for key, data in objects.items()})
    dcp.save(staged, storage_writer=dcp.FileSystemWriter(root), planner=_MCoreLikeSavePlanner())
    with open(os.path.join(root, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    stored = {index.fqn: info for index, info in metadata.storage_data.items()}
    entries, storage = {}, {}
    for key, pieces in chunks.items():
        props = metadata.state_dict_metadata[f"{key}#0"].properties
        chunk_md = []
        for n, (offsets, tensor) in enumerate(pieces):
            chunk_md.append(ChunkStorageMetadata(torch.Size(offsets), tensor.shape))
            storage[MetadataIndex(key, torch.Size(offsets))] = stored[f"{key}#{n}"]
        entries[key] = TensorStorageMetadata(props, torch.Size(shapes[key]), chunk_md)
    for key in objects:
        entries[key] = metadata.state_dict_metadata[f"{key}#b"]
        storage[MetadataIndex(key)] = stored[f"{key}#b"]
    metadata.state_dict_metadata, metadata.storage_data = entries, storage
    metadata.planner_data = {key: (key,) for key in entries}
    metadata.mcore_data = mcore_data
    with open(os.path.join(root, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)


# -- zarr ---------------------------------------------------------------------------------

ZARR_SPECS = {  # key -> (global tensor seed, shape, dtype, chunks)
    "decoder.layers.self_attention.linear_qkv.weight": (201, (2, 3 * H, H), torch.float32, (1, 3 * H // 2, H)),
    "decoder.layers.mlp.linear_fc2.weight": (202, (2, H, 2 * F), torch.float32, (1, H, F)),
    "decoder.final_layernorm.weight": (203, (H,), torch.bfloat16, (H,)),
    "embedding.word_embeddings.weight": (204, (V, H), torch.float16, (V // 2, H)),
}
_ZARR_DTYPES = {torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "bfloat16"}


def write_zarr(root: str, complete: bool = True) -> dict[str, torch.Tensor]:
    full = {}
    for key, (seed, shape, dtype, chunk) in ZARR_SPECS.items():
        tensor = full[key] = _value(shape, dtype, seed)
        array_dir = os.path.join(root, key)
        os.makedirs(array_dir)
        with open(os.path.join(array_dir, ".zarray"), "w") as f:
            json.dump({"zarr_format": 2, "shape": list(shape), "chunks": list(chunk), "dtype": _ZARR_DTYPES[dtype],
                       "compressor": None, "fill_value": None, "filters": None, "order": "C"}, f)
        grid = [range(n // c) for n, c in zip(shape, chunk)]
        for cell in np.ndindex(*[len(g) for g in grid]):
            box = tensor[tuple(slice(i * c, (i + 1) * c) for i, c in zip(cell, chunk))].contiguous()
            raw = box.view(torch.int16) if dtype == torch.bfloat16 else box
            with open(os.path.join(array_dir, ".".join(map(str, cell))), "wb") as f:
                f.write(raw.numpy().tobytes())
    os.makedirs(os.path.join(root, "rng_state"))
    torch.save({"seed": 5}, os.path.join(root, "rng_state", "shard_0_1.pt"))
    torch.save(COMMON, os.path.join(root, "common.pt"))
    if complete:
        with open(os.path.join(root, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "zarr", "sharded_backend_version": 1,
                       "common_backend": "torch", "common_backend_version": 1}, f)
    return full
