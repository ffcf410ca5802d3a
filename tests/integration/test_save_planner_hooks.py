"""DCP's save-planner hooks keep working on ShardSavePlanner subclasses.

``lookup_object`` and ``transform_object`` are DCP's documented extension points of
``DefaultSavePlanner`` (a subclass that casts what it saves, or takes it from elsewhere).
``ShardSavePlanner`` finds a DTensor shard's data itself (a refined piece of it too): a
subclass's overrides must still decide what is written, for DTensor shards as for plain
tensors. Before, they were skipped for DTensors and the untransformed shard was saved
without a word. The same hooks on DCP's own planner and writer are the reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter

from mp import run_job
from support import assert_state_dict_equal, garbage_like


class Hooks:
    """Saves every tensor doubled (``transform_object``) and ``swapped`` plus 100 (``lookup_object``)."""

    def lookup_object(self, index):  # noqa: ANN001, ANN201
        found = super().lookup_object(index)
        return found + 100 if index.fqn == "swapped" else found

    def transform_object(self, write_item, obj):  # noqa: ANN001, ANN201
        obj = super().transform_object(write_item, obj)
        return obj * 2 if isinstance(obj, torch.Tensor) else obj


class ShardHooks(Hooks, ShardSavePlanner):
    pass


class StockHooks(Hooks, DefaultSavePlanner):
    pass


def _state(mesh) -> dict:
    g = torch.Generator().manual_seed(5)
    return {
        "rows": distribute_tensor(torch.randn(7, 3, generator=g), mesh, [Shard(0)], src_data_rank=None),
        "swapped": distribute_tensor(torch.randn(4, 2, generator=g), mesh, [Shard(1)], src_data_rank=None),
        "replicated": distribute_tensor(torch.randn(5, generator=g), mesh, [Replicate()], src_data_rank=None),
        "plain": torch.randn(6, generator=g),
        "step": 12,
    }


def _save_with_hooks(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    state = _state(mesh)
    dcp.save(state, storage_writer=ShardWriter(f"{root}/ours"), planner=ShardHooks())
    dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{root}/stock"), planner=StockHooks())
    want = {key: value.full_tensor() * 2 if hasattr(value, "full_tensor") else value * 2 if isinstance(value, torch.Tensor) else value
            for key, value in state.items()}
    want["swapped"] = (state["swapped"].full_tensor() + 100) * 2
    for name in ("ours", "stock"):
        for reader, planner in ((ShardReader(f"{root}/{name}"), ShardLoadPlanner()), (dcp.FileSystemReader(f"{root}/{name}"), None)):
            got = {key: garbage_like(value) for key, value in want.items() if isinstance(value, torch.Tensor)} | {"step": -1}
            dcp.load(got, storage_reader=reader, planner=planner, no_dist=True)
            assert_state_dict_equal(got, want, f"{name} through {type(reader).__name__}: ")


@pytest.mark.mp
def test_a_subclass_lookup_and_transform_decide_what_every_item_saves(tmp_path):
    run_job(_save_with_hooks, 2, str(tmp_path))
