"""Global save plans reused across saves of an unchanged state dict, never when it changed.

Two gloo processes save DTensors (Shard(0), uneven) and a replicated tensor three times
into one directory: the second save (same layout, new values) reuses the coordinator's
plan, the third (one tensor with another shape, one key added) plans afresh; after each
save a load returns exactly the values just saved.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.planning.plan_cache import clear_plan_cache
from dcp_ext.planning.plan_table import items_from_table, table_from_items

from mp import run_job
from support import assert_state_dict_equal, garbage_like, shard_item


def _state(mesh, seed: int, rows: int, extra: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {
        "w": distribute_tensor(torch.randn(rows, 4, generator=g), mesh, [Shard(0)], src_data_rank=None),
        "norm": torch.randn(6, generator=g),
    }
    if extra:
        state["bias"] = distribute_tensor(torch.randn(5, generator=g), mesh, [Shard(0)], src_data_rank=None)
    return state


def _destination(state: dict) -> dict:
    return {
        k: distribute_tensor(garbage_like(v.full_tensor()), v.device_mesh, v.placements, src_data_rank=None)
        if hasattr(v, "device_mesh")
        else garbage_like(v)
        for k, v in state.items()
    }


def cache_job(rank: int, world_size: int, path: str) -> list[bool]:
    clear_plan_cache()
    mesh = init_device_mesh("cpu", (world_size,))
    reused = []
    for seed, rows, extra in ((1, 7, False), (2, 7, False), (3, 9, True)):
        state = _state(mesh, seed, rows, extra)
        planner = ShardSavePlanner()
        dcp.save(state, storage_writer=ShardWriter(path), planner=planner)
        reused.append(planner.plan_reused)
        # our index, and the .metadata stock DCP reads (a reused plan's continues the first's pickle)
        for reader in (ShardReader(path), dcp.FileSystemReader(path)):
            got = _destination(state)
            dcp.load(got, storage_reader=reader, planner=ShardLoadPlanner())
            assert_state_dict_equal(
                {k: v.to_local() if hasattr(v, "to_local") else v for k, v in got.items()},
                {k: v.to_local() if hasattr(v, "to_local") else v for k, v in state.items()},
            )
    return reused


@pytest.mark.mp
def test_unchanged_layout_reuses_the_plan_and_a_changed_one_does_not(tmp_path):
    results = run_job(cache_job, 2, str(tmp_path / "ckpt"))
    assert results[0] == [False, True, False]  # the coordinator's view
    assert results[1] == [False, False, False]  # other ranks never hold a global plan


def test_table_digest_covers_layout_not_values():
    a = [shard_item("w", (0, 0), (4, 3), (8, 3)), shard_item("b", (0,), (2,), (2,))]
    same = [shard_item("w", (0, 0), (4, 3), (8, 3)), shard_item("b", (0,), (2,), (2,))]
    assert table_from_items(a).digest == table_from_items(same).digest
    variants = [
        [shard_item("w", (4, 0), (4, 3), (8, 3)), a[1]],  # other offsets
        [shard_item("w", (0, 0), (4, 3), (9, 3)), a[1]],  # other global shape
        [shard_item("w", (0, 0), (4, 3), (8, 3), torch.bfloat16), a[1]],  # other dtype
        [a[0], shard_item("c", (0,), (2,), (2,))],  # other key
        a[:1],  # a key fewer
    ]
    digests = {table_from_items(v).digest for v in variants} | {table_from_items(a).digest}
    assert len(digests) == len(variants) + 1
    assert table_from_items(SavePlan(a).items, {"w": ("model", "w")}).digest != table_from_items(a).digest



def test_a_table_travels_with_its_facts_as_plain_values():
    """DCP gathers every rank's table each save: its tensor facts pickle as values, and
    become DCP's objects on the coordinator only when read (a reused plan reads none)."""
    items = [shard_item("w", (0, 0), (4, 3), (8, 3)), shard_item("b", (0,), (2,), (2,), torch.bfloat16)]
    table = table_from_items(items)
    data = pickle.dumps(table)
    assert b"TensorProperties" not in data
    back = pickle.loads(data)
    assert back.facts._facts is None
    assert back.digest == table.digest and list(back.facts) == list(table.facts)
    assert items_from_table(back) == items_from_table(table)


class _DcpCachingPlanner(DefaultSavePlanner):
    """DCP's own plan caching, under a class name of its own (DCP keys its class-level cache by it)."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)


def test_dcp_plan_caching_is_refused_before_it_can_overwrite_the_live_checkpoint(tmp_path):
    """DCP hands a cached save the first save's finished plans, with that save's data-file
    names: the second save overwrote, in place, the files the committed checkpoint points
    to (a crash then lost both). Refused at the first save, nothing written or removed."""
    live = {"w": torch.arange(6.0)}
    dcp.save(live, storage_writer=ShardWriter(tmp_path), planner=ShardSavePlanner(), no_dist=True)
    files = sorted(p.name for p in tmp_path.iterdir())
    try:
        with pytest.raises(CheckpointException) as info:
            dcp.save({"w": torch.zeros(6)}, storage_writer=ShardWriter(tmp_path), planner=_DcpCachingPlanner(), no_dist=True)
    finally:
        for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_all_plans, SavePlanner._cached_global_plan,
                      SavePlanner._cached_metadata, SavePlanner._cached_final_save_plan):
            cache.pop(_DcpCachingPlanner.__name__, None)
    error = next(iter(info.value.failures.values()))[0]
    assert "DefaultSavePlanner(enable_plan_caching=True)" in str(error) and str(tmp_path) in str(error), error
    assert sorted(p.name for p in tmp_path.iterdir()) == files
    out = {"w": garbage_like(live["w"])}
    dcp.load(out, storage_reader=ShardReader(tmp_path), planner=ShardLoadPlanner(), no_dist=True)
    assert_state_dict_equal(out, live)


def test_a_refused_caching_save_leaves_dcp_plan_cache_and_no_directory_behind(tmp_path):
    """DCP's plan cache is per process and keyed by planner class: the refused save had
    cached plans naming our data files, and every later caching save of that class, stock
    ``FileSystemWriter``'s too, failed ('FilePrefix' object has no attribute 'prefix'). The
    refused save into a new directory also left that directory behind, empty."""
    ours, stock = tmp_path / "ours", tmp_path / "stock"
    with pytest.raises(CheckpointException):
        dcp.save({"w": torch.zeros(6)}, storage_writer=ShardWriter(ours), planner=_DcpCachingPlanner(), no_dist=True)
    assert not ours.exists()
    planner = _DcpCachingPlanner()
    try:
        for step in range(3):
            want = {"w": torch.full((6,), float(step))}
            dcp.save(want, storage_writer=dcp.FileSystemWriter(stock), planner=planner, no_dist=True)
            out = {"w": garbage_like(want["w"])}
            dcp.load(out, storage_reader=dcp.FileSystemReader(stock), no_dist=True)
            assert_state_dict_equal(out, want)
    finally:
        for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_all_plans, SavePlanner._cached_global_plan,
                      SavePlanner._cached_metadata, SavePlanner._cached_final_save_plan):
            cache.pop(_DcpCachingPlanner.__name__, None)
