"""A load's stored items looked up all at once in a fresh index (``IndexedItems.items_of``)
answer exactly what one-by-one lookups answer, whatever the plan's hints say."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dcp_ext import ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.errors import CheckpointError

from mp import run_job


def _save(rank: int, world_size: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    state = {
        "rows": DTensor.from_local(torch.full((2, 3), float(rank)), mesh, [Shard(0)]),
        "cols": DTensor.from_local(torch.full((2, 3), float(rank + 5)), mesh, [Shard(1)]),
        "scalar": torch.tensor(2.5),
        "whole": torch.arange(4.0),
        "step": 3,
    }
    dcp.save(state, storage_writer=ShardWriter(path), planner=ShardSavePlanner())


def _fresh_items(path):
    reader = ShardReader(path, cache_metadata=False)
    reader.read_metadata()
    return reader._require_catalog()


def _queries(path) -> list[MetadataIndex]:
    state = _fresh_items(path).metadata.state_dict_metadata
    queries = [MetadataIndex("step"), MetadataIndex("nope", (0,), 0), MetadataIndex("whole"), MetadataIndex("scalar", ())]
    for fqn in ("rows", "cols", "whole", "scalar"):
        md = state[fqn]
        assert isinstance(md, TensorStorageMetadata)
        n = len(md.chunks)
        for i, chunk in enumerate(md.chunks):
            for hint in (i, (i + 1) % n, None, -1, 99, True):  # right, another row's, none, out of range, not an int
                queries.append(MetadataIndex(fqn, chunk.offsets, hint))
            if len(chunk.offsets):  # no chunk starts one element further in
                queries.append(MetadataIndex(fqn, [o + 1 for o in chunk.offsets], i))
                queries.append(MetadataIndex(fqn, list(chunk.offsets) + [0], i))  # another ndim
    return queries


@pytest.mark.mp
def test_items_found_at_once_are_those_found_one_by_one(tmp_path):
    path = str(tmp_path / "ckpt")
    run_job(_save, 2, path)
    queries = _queries(path)
    at_once = _fresh_items(path).items.items_of(queries)
    one_by_one = [_fresh_items(path).items.get(index) for index in queries]  # each in a fresh index: no memo
    assert at_once == one_by_one
    assert sum(item is not None for item in at_once) >= 4 * 6 + 2  # the lookups that exist were found
    catalog = _fresh_items(path)
    assert catalog.items.items_of(queries) == at_once  # asked again: from what the first lookups remembered
    with pytest.raises(CheckpointError, match="no stored item for key 'nope'"):
        _fresh_items(path).stored_items(queries, rank=0)
