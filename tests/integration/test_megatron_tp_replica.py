"""Megatron TP-replica keys (``{key}.__tp_replica_{r}``) load as the plain key, from the own file."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_ext import ShardLoadPlanner, ShardReader

from mp import run_job
from support import assert_tensor_equal, garbage_like

pytestmark = pytest.mark.mp

NORM = torch.linspace(-1, 1, 16)
WEIGHT = torch.arange(64.0).reshape(8, 8)


def _megatron_style_save(rank: int, world: int, path: str) -> None:
    """What a Megatron locality save looks like on disk: stock DCP files, one replica per TP rank."""
    mesh = init_device_mesh("cpu", (world,))
    state = {f"norm.weight.__tp_replica_{rank}": NORM.clone(), "w": distribute_tensor(WEIGHT, mesh, [Shard(0)])}
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


def test_postfixed_replicas_load_from_each_ranks_own_file(tmp_path):
    run_job(_megatron_style_save, 2, str(tmp_path))
    assert run_job(_load_plain_key, 2, str(tmp_path)) == [1, 1]  # own file only
    assert run_job(_load_plain_key, 1, str(tmp_path)) == [2]  # TP degree changed: any replica
