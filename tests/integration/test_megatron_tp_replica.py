"""Megatron TP-replica keys (``{key}.__tp_replica_{r}``) load as the plain key, from the own file."""

from __future__ import annotations

import json
import os
import pickle

import crc32c
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_ext import ShardLoadPlanner, ShardReader

from mp import run_job
from support import assert_tensor_equal, garbage_like

pytestmark = pytest.mark.mp

NORM = torch.linspace(-1, 1, 16)
WEIGHT = torch.arange(64.0).reshape(8, 8)


def _megatron_style_save(rank: int, world: int, path: str, rank1_norm: torch.Tensor | None = None) -> None:
    """What a Megatron locality save looks like on disk: stock DCP files, one replica per TP
    rank (``rank1_norm``: rank 1's replica is another tensor)."""
    mesh = init_device_mesh("cpu", (world,))
    norm = rank1_norm if rank == 1 and rank1_norm is not None else NORM.clone()
    state = {f"norm.weight.__tp_replica_{rank}": norm, "w": distribute_tensor(WEIGHT, mesh, [Shard(0)])}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    dist.barrier()
    if rank == 0:
        torch.save({"iteration": 7}, os.path.join(path, "common.pt"))
        with open(os.path.join(path, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)


def _load_plain_key(rank: int, world: int, path: str) -> int:
    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(WEIGHT, mesh, [Shard(0)])
    w.to_local().copy_(garbage_like(w.to_local()))
    state = {"norm.weight": garbage_like(NORM), "w": w}
    reader = ShardReader(path)
    dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner())
    assert_tensor_equal(state["norm.weight"], NORM, "norm.weight")
    assert_tensor_equal(state["w"].full_tensor(), WEIGHT, "w")
    return reader.stats.files_opened


FLAT_KEY, FLAT_FULL, FLAT_RANGES = "optimizer.state.exp_avg.w", torch.arange(24.0).reshape(4, 6) * 0.5 + 3, [(0, 10), (10, 24)]


def _with_flattened_key(rank: int, world: int, path: str) -> None:
    """Replicas beside a distributed-optimizer key saved as flattened ranges (one per rank)."""
    start, stop = FLAT_RANGES[rank]
    state = {f"norm.weight.__tp_replica_{rank}": NORM.clone(), f"flat#{rank}": FLAT_FULL.reshape(-1)[start:stop].reshape(1, 1, -1).clone()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    dist.barrier()
    if rank == 0:  # the .metadata megatron-core <= 0.15 writes for such ranges
        with open(os.path.join(path, ".metadata"), "rb") as f:
            metadata = pickle.load(f)
        entries, storage = metadata.state_dict_metadata, metadata.storage_data
        chunks = []
        for r, (start, stop) in enumerate(FLAT_RANGES):
            chunks.append(ChunkStorageMetadata(torch.Size((0, 0, start)), torch.Size((1, 1, stop - start))))
            storage[MetadataIndex(FLAT_KEY, torch.Size((0, 0, start)))] = storage.pop(MetadataIndex(f"flat#{r}", torch.Size((0, 0, 0))))
            properties = entries.pop(f"flat#{r}").properties
        entries[FLAT_KEY] = TensorStorageMetadata(properties, torch.Size((1, 1, 24)), chunks)
        metadata.planner_data = {key: (key,) for key in entries}
        metadata.mcore_data = {FLAT_KEY: {"nd_reformulated_orig_global_shape": (4, 6)}}
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(metadata, f)
        torch.save({"iteration": 7}, os.path.join(path, "common.pt"))
        with open(os.path.join(path, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)


def _load_norm_and_flat(rank: int, world: int, path: str) -> int:
    state = {"norm.weight": garbage_like(NORM), FLAT_KEY: garbage_like(FLAT_FULL)}
    reader = ShardReader(path)
    dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner())
    assert_tensor_equal(state["norm.weight"], NORM, "norm.weight")
    assert_tensor_equal(state[FLAT_KEY], FLAT_FULL, FLAT_KEY)
    return reader.catalog.item_for_rank(MetadataIndex("norm.weight", torch.Size([0])), rank).relative_path


def test_replicas_stay_each_ranks_own_beside_flattened_ranges(tmp_path):
    """Restoring the flattened ranges rebuilt the catalog and dropped the replica copies:
    every rank was served rank 0's copy."""
    run_job(_with_flattened_key, 2, str(tmp_path))
    own = run_job(_load_norm_and_flat, 2, str(tmp_path))
    assert own[0] != own[1] and all(name.startswith(f"__{rank}_") for rank, name in enumerate(own)), own


def test_postfixed_replicas_load_from_each_ranks_own_file(tmp_path):
    run_job(_megatron_style_save, 2, str(tmp_path))
    reader = ShardReader(tmp_path, cache_metadata=False)
    reader.read_metadata()
    assert "norm.weight" in reader.catalog.metadata.state_dict_metadata
    # the merged view is the same checkpoint: two-stage groups tell checkpoints apart by it (it was 0)
    assert reader.catalog.fingerprint == crc32c.crc32c((tmp_path / ".metadata").read_bytes())
    assert run_job(_load_plain_key, 2, str(tmp_path)) == [1, 1]  # own file only
    assert run_job(_load_plain_key, 1, str(tmp_path)) == [2]  # TP degree changed: any replica


@pytest.mark.parametrize("rank1_norm", [NORM.to(torch.bfloat16), torch.arange(32.0)], ids=["dtype", "shape"])
def test_replicas_that_are_not_copies_of_one_tensor_are_not_merged(tmp_path, caplog, rank1_norm):
    """A bf16 replica beside an fp32 one was read with the fp32 layout (its bytes, and 16
    bytes past its end, taken as values) and a longer one was cut: silently, verify said OK.
    Now the plain key is not served (a warning names the replicas); the postfixed keys and
    every other key still load, as with stock."""
    run_job(_megatron_style_save, 2, str(tmp_path), rank1_norm)
    with caplog.at_level("WARNING", logger="dcp_ext"):
        entries = ShardReader(tmp_path, cache_metadata=False).read_metadata().state_dict_metadata
    assert "norm.weight" not in entries and "norm.weight.__tp_replica_1" in entries
    assert "TP-replica keys of 'norm.weight' disagree" in caplog.text
    state = {"norm.weight.__tp_replica_1": garbage_like(rank1_norm), "w": garbage_like(WEIGHT)}
    dcp.load(state, storage_reader=ShardReader(tmp_path), planner=ShardLoadPlanner(), no_dist=True)
    assert_tensor_equal(state["norm.weight.__tp_replica_1"], rank1_norm, "replica 1")
    assert_tensor_equal(state["w"], WEIGHT, "w")
