"""Load helpers shared by the Megatron tests (single process and DTensor workers)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dcp_ext import ShardLoadPlanner, ShardReader
from mp import assert_tensor_equal, garbage_like


def load_full(path, want: dict[str, torch.Tensor], extra: tuple[str, ...] = (), **reader_kwargs) -> tuple[dict, ShardReader]:
    """Load every key of ``want`` (plus bytes items ``extra``) as plain tensors; check bit-exact."""
    state: dict = {k: garbage_like(v) for k, v in want.items()}
    state.update({k: None for k in extra})
    reader = ShardReader(path, **reader_kwargs)
    dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner())
    for key, value in want.items():
        assert_tensor_equal(state[key], value, key)
    return state, reader


def placement(n: int, tensor: torch.Tensor):
    """Alternate Shard(0) / Shard(last) / Replicate over keys so cuts fall across TP splits."""
    choice = n % 3
    if choice == 2 or tensor.dim() == 0:
        return Replicate()
    return Shard(0 if choice == 0 else tensor.dim() - 1)


def dtensor_load_job(rank: int, world: int, path: str, want: dict[str, torch.Tensor]) -> int:
    """Load ``want`` into DTensors on a 1-D mesh; returns the files this rank read."""
    mesh = init_device_mesh("cpu", (world,))
    specs = {k: placement(n, v) for n, (k, v) in enumerate(sorted(want.items()))}
    state = {k: distribute_tensor(garbage_like(want[k]), mesh, [p], src_data_rank=None) for k, p in specs.items()}
    reader = ShardReader(path)
    dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner())
    for key, p in specs.items():
        expected = distribute_tensor(want[key], mesh, [p], src_data_rank=None).to_local()
        assert_tensor_equal(state[key].to_local(), expected, f"rank {rank}/{world} {key} {p}")
    return reader.stats.files_opened
