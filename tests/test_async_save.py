"""dcp.async_save through ShardWriter/ShardSavePlanner.

* the values saved are the ones staged when ``async_save`` returned: the
  source tensors (and a nested list object) are overwritten right after it
  returns, and the checkpoint must still hold the old values;
* two async saves back to back into the same directory: the second wins,
  and a reader opened after it sees the second checkpoint (not metadata
  cached from loading the first).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from mp import assert_state_dict_equal, garbage_like, run_job

SPECS = {
    "w": ((9, 8), torch.float32, Shard(0)),  # uneven over 2 ranks
    "b": ((4, 6), torch.bfloat16, Shard(1)),
    "r": ((5,), torch.float16, Replicate()),
    "i": ((7,), torch.int64, Shard(0)),
}


def _globals(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype, _) in SPECS.items():
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=g).to(dtype)
        else:
            out[name] = torch.randint(-(10**9), 10**9, shape, generator=g, dtype=dtype)
    out["plain"] = torch.randn(3, 4, generator=g)
    out["only_b"] = torch.randn(6, generator=g)
    return out


def build(mesh, seed: int, *, destination: bool, with_only_b: bool = False):
    glob = _globals(seed)
    sd, exp = {}, {}
    for name, (_, _, placement) in SPECS.items():
        src = garbage_like(glob[name]) if destination else glob[name].clone()
        sd[name] = distribute_tensor(src, mesh, [placement], src_data_rank=None)
        exp[name] = distribute_tensor(glob[name], mesh, [placement], src_data_rank=None).to_local().clone()
    names = ["plain"] + (["only_b"] if with_only_b else [])
    for name in names:
        sd[name] = garbage_like(glob[name]) if destination else glob[name].clone()
        exp[name] = glob[name]
    sd["objects"] = {"seed": -1, "history": []} if destination else {"seed": seed, "history": [seed, "x"]}
    exp["objects"] = {"seed": seed, "history": [seed, "x"]}
    return sd, exp


def _async_save(sd: dict, path: str):
    """Start an async save; return the upload future once staging is done."""
    resp = dcp.async_save(sd, storage_writer=ShardWriter(path), planner=ShardSavePlanner())
    if isinstance(resp, AsyncSaveResponse):
        resp.staging_completion.result()
        return resp.upload_completion
    return resp


def _clobber(sd: dict) -> None:
    """Overwrite every source value in place, and check the overwrite took."""
    with torch.no_grad():
        for name, value in sd.items():
            if isinstance(value, DTensor):
                local = value.to_local()
                before = local.clone()
                local.copy_(garbage_like(local))
                after = sd[name].to_local()
                assert local.numel() == 0 or not torch.equal(after, before), f"{name}: mutation did not take"
            elif isinstance(value, torch.Tensor):
                value.copy_(garbage_like(value))
    sd["objects"]["history"].append("mutated-after-async_save")
    sd["objects"]["seed"] = -99


def _load(path: str, mesh, seed: int, where: str, with_only_b: bool = False) -> None:
    dest, expected = build(mesh, seed, destination=True, with_only_b=with_only_b)
    reader = ShardReader(path)
    dcp.load(dest, storage_reader=reader, planner=ShardLoadPlanner())
    assert_state_dict_equal(dest, expected, where)
    assert reader.stats.items_read > 0 and reader.stats.bytes_read > 0, reader.stats


def async_job(rank: int, world: int, base: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    where = f"world {world} rank {rank}"

    # 1. Values are the staged ones.
    path = os.path.join(base, "staged")
    sd, _ = build(mesh, 1, destination=False)
    fut = _async_save(sd, path)
    _clobber(sd)  # source changes while the upload may still be running
    md = fut.result(timeout=60)
    assert isinstance(md, Metadata), type(md)
    assert set(SPECS) | {"plain"} <= set(md.state_dict_metadata), sorted(md.state_dict_metadata)
    dist.barrier()
    _load(path, mesh, 1, f"{where} staged values")

    # 2. Two async saves back to back into one directory: the second wins.
    path = os.path.join(base, "twice")
    first, _ = build(mesh, 2, destination=False)
    _async_save(first, path).result(timeout=60)
    dist.barrier()
    _load(path, mesh, 2, f"{where} after first save")  # also warms any metadata cache
    second, _ = build(mesh, 3, destination=False, with_only_b=True)
    fut = _async_save(second, path)
    _clobber(second)
    fut.result(timeout=60)
    dist.barrier()
    _load(path, mesh, 3, f"{where} after second save", with_only_b=True)


@pytest.mark.parametrize("world", [1, 2])
def test_async_save(tmp_path, world):
    run_job(async_job, world, str(tmp_path))
