"""The ``Metadata`` a save returns: on every rank the checkpoint's ``.metadata``, though
DCP's broadcast of it reuses the bytes the writer wrote (``MetadataOnDemand.broadcast_as``)
rather than pickling it again; any other pickle of it is made afresh."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dcp_ext import ShardSavePlanner, ShardWriter
from dcp_ext.formats.chunk_lists import MetadataOnDemand, PickledMetadata

from mp import run_job


def _fields(md: Metadata) -> tuple:
    return md.state_dict_metadata, md.storage_data, md.storage_meta, md.planner_data, md.version


def _file_metadata(path: Path) -> Metadata:
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)


def _save_on_ranks(rank: int, world_size: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    state = {
        "model": {f"w{i}": DTensor.from_local(torch.full((2, 3), float(rank * 10 + i)), mesh, [Shard(0)]) for i in range(5)},
        "step": 3,
    }
    md = dcp.save(state, storage_writer=ShardWriter(path), planner=ShardSavePlanner())
    if rank == 0:
        assert type(md) is MetadataOnDemand and "_pickled" not in vars(md)  # the broadcast took the bytes
    else:  # what DCP's broadcast delivered: the file's bytes, not unpickled until a field is read
        assert type(md) is PickledMetadata and set(vars(md)) == {"_pickled"}
        assert md.__dict__["_pickled"] == (Path(path) / ".metadata").read_bytes()
    written = _file_metadata(Path(path))
    assert dict(md.state_dict_metadata) == written.state_dict_metadata
    assert _fields(md)[1:] == _fields(written)[1:]


@pytest.mark.mp
def test_every_rank_gets_the_checkpoints_metadata(tmp_path):
    run_job(_save_on_ranks, 2, str(tmp_path / "ckpt"))


def test_a_pickle_other_than_the_broadcast_is_made_afresh(tmp_path):
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 3}
    md = dcp.save(state, storage_writer=ShardWriter(tmp_path / "ckpt"), planner=ShardSavePlanner(), no_dist=True)
    assert type(md) is MetadataOnDemand and "_pickled" in vars(md)  # no broadcast in one process
    md.planner_data = {"changed": ("after", "the save")}  # the caller changes what it got back
    again = pickle.loads(pickle.dumps(md))
    assert type(again) is Metadata and again.planner_data == {"changed": ("after", "the save")}
    assert "_pickled" not in vars(md)  # once only: any pickle clears it
    assert _fields(again)[:3] == _fields(_file_metadata(tmp_path / "ckpt"))[:3]


def test_torchs_object_collective_sends_the_bytes_given(tmp_path):
    from torch.distributed.distributed_c10d import _object_to_tensor, _tensor_to_object

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}}
    md = dcp.save(state, storage_writer=ShardWriter(tmp_path / "ckpt"), planner=ShardSavePlanner(), no_dist=True)
    stand_in = pickle.dumps(Metadata(state_dict_metadata={}, planner_data={"stands": ("in",)}))
    md.broadcast_as(stand_in)  # what the collective sends is these bytes, not a new pickle
    sent, size = _object_to_tensor(md, torch.device("cpu"), None)
    got = _tensor_to_object(sent, size, None)
    assert type(got) is PickledMetadata and got.__dict__["_pickled"] == stand_in and got.planner_data == {"stands": ("in",)}
    sent, size = _object_to_tensor(md, torch.device("cpu"), None)  # once only: then a pickle of the object
    assert _fields(_tensor_to_object(sent, size, None))[:3] == _fields(_file_metadata(tmp_path / "ckpt"))[:3]


def test_the_broadcast_metadata_is_unpickled_on_first_use(tmp_path):
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 3}
    dcp.save(state, storage_writer=ShardWriter(tmp_path / "ckpt"), planner=ShardSavePlanner(), no_dist=True)
    data = (tmp_path / "ckpt" / ".metadata").read_bytes()
    written = _file_metadata(tmp_path / "ckpt")
    md = PickledMetadata(data)
    assert _fields(md) == _fields(written) and "_pickled" not in vars(md)  # read: the fields are the file's
    md = PickledMetadata(data)
    md.planner_data = {"set": ("first",)}  # set before any read: the others come from the bytes, this one stays
    assert md.planner_data == {"set": ("first",)} and _fields(md)[:3] == _fields(written)[:3]
    again = pickle.loads(pickle.dumps(PickledMetadata(data)))  # any pickle of it is a stock Metadata
    assert type(again) is Metadata and again == written
    assert dataclasses.replace(PickledMetadata(data), version="x").storage_data == written.storage_data
