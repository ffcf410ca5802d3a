"""A pickle continued from an object pickled earlier (``formats.pickle_splice``) loads as
a fresh ``pickle.dumps`` does, under ``pickle.loads`` and our restricted metadata loader,
with shared objects shared; streams the splice cannot take raise ValueError."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_ext.formats import chunk_lists
from dcp_ext.formats.chunk_lists import ChunkListsOnDemand, MetadataOnDemand
from dcp_ext.formats.pickle_splice import dumps_after, pickled_prefix
from dcp_ext.formats.safe_pickle import load_metadata_pickle


def _keys(count: int, chunks: int = 2) -> ChunkListsOnDemand:
    state = {f"layers.{k}.w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([8 * chunks, 3]), [])
             for k in range(count)}
    state["step"] = BytesStorageMetadata()
    offsets = np.array([[8 * c, 0] for c in range(chunks)])
    sizes = np.array([[8, 3]] * chunks)
    return ChunkListsOnDemand(state, lambda k: (offsets + k % 2, sizes))


def _metadata(keys: ChunkListsOnDemand, save: int) -> MetadataOnDemand:
    md = MetadataOnDemand(state_dict_metadata=keys, planner_data={"w": ("model", "w")})
    md.storage_data = {
        MetadataIndex(fqn, chunk.offsets, place): f"__{save}_file_{place}.distcp"
        for fqn, value in keys.plain().items() if isinstance(value, TensorStorageMetadata)
        for place, chunk in enumerate(value.chunks)
    }
    md.version = "1.0.0"
    return md


@pytest.mark.parametrize("count", [1, 40, 3000])  # one short frame; several; past 64 KiB, many frames
def test_a_spliced_pickle_loads_as_a_fresh_one(count):
    keys = _keys(count)
    for save in range(2):  # the second continues the first's prefix
        md = _metadata(keys, save)
        spliced, fresh = md.dumps(), pickle.dumps(md)
        assert pickle.loads(spliced) == pickle.loads(fresh)
        assert load_metadata_pickle(spliced, "test") == pickle.loads(fresh)
    assert keys.pickled() is keys.pickled()  # once per mapping
    if count == 3000:
        assert len(spliced) > 1 << 17


def test_a_chunk_list_pickle_too_large_to_keep_is_not_kept(monkeypatch):
    monkeypatch.setattr(chunk_lists, "SPLICED_BYTES", 1 << 10)
    keys = _keys(40)
    for save in range(2):
        md = _metadata(keys, save)
        assert pickle.loads(md.dumps()) == pickle.loads(pickle.dumps(md))
    assert keys.pickled() is None  # the first save's served it alone; later saves pickle afresh


def test_objects_of_the_prefix_stay_shared():
    shared = torch.Size([4, 2])
    head = {"a": shared, "b": [shared, "text"]}
    loaded = pickle.loads(dumps_after(pickled_prefix(head), (head, shared, head["b"], torch.Size([4, 2]))))
    again, same, inner, equal = loaded
    assert again == head and again["a"] is same and again["b"] is inner and again["b"][0] is same
    assert equal == shared and equal is not same


def test_the_prefix_is_the_stream_as_it_was_pickled():
    head = {"a": [1, 2]}
    prefix = pickled_prefix(head)
    head["a"].append(3)  # changed afterwards: a later stream holds it as it was
    assert pickle.loads(dumps_after(prefix, head)) == {"a": [1, 2]}


@pytest.mark.parametrize("big", ["x" * (1 << 16), b"y" * (1 << 17)])
def test_an_object_written_outside_frames_is_refused(big):
    with pytest.raises(ValueError, match="outside a frame"):
        pickled_prefix({"big": big, "after": list(range(10))})
    keys = _keys(3)
    md = _metadata(keys, 0)
    keys._state["huge.key." + "k" * (1 << 16)] = BytesStorageMetadata()  # no prefix for these keys
    keys = ChunkListsOnDemand(keys._state, keys._boxes)
    md.state_dict_metadata = keys
    assert pickle.loads(md.dumps()) == pickle.loads(pickle.dumps(md))
    assert keys.pickled() is None and not keys._spliceable  # tried once
    keys = _keys(3)
    md = _metadata(keys, 0)
    md.planner_data = {"big": (big,)}  # in the part pickled per save: the metadata is pickled afresh
    assert pickle.loads(md.dumps()) == pickle.loads(pickle.dumps(md))


def test_a_mapping_pickles_as_a_plain_dict():
    keys = _keys(3)
    assert pickle.loads(pickle.dumps(keys)) == keys.plain()
    assert type(pickle.loads(pickle.dumps(keys))) is dict
