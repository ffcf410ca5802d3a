"""The process-wide metadata cache: one read per checkpoint version, never stale."""

from __future__ import annotations

import threading

import torch
from conftest import assert_state_equal, load, sample_state, save

from dcp_ext import ShardReader, clear_metadata_cache
from dcp_ext.storage.catalog import METADATA_CACHE


def test_many_readers_read_the_metadata_once(tmp_path):
    state = sample_state()
    save(state, tmp_path)
    readers = [load(state, tmp_path)[1] for _ in range(5)]
    assert [r.stats.metadata_reads for r in readers] == [1, 0, 0, 0, 0]
    assert all(r.catalog is readers[0].catalog for r in readers)


def test_concurrent_readers_share_one_read(tmp_path):
    save(sample_state(), tmp_path)
    readers = [ShardReader(tmp_path) for _ in range(8)]
    threads = [threading.Thread(target=r.read_metadata) for r in readers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.stats.metadata_reads for r in readers) == 1


def test_checkpoint_rewritten_in_place_is_reread(tmp_path):
    first, second = sample_state(1), sample_state(2)
    second["extra"] = torch.arange(5)
    save(first, tmp_path)
    got, reader = load(first, tmp_path)
    assert_state_equal(got, first)
    save(second, tmp_path)
    got, reader = load(second, tmp_path)
    assert reader.stats.metadata_reads == 1
    assert_state_equal(got, second)


def test_cache_disabled_bypasses_the_cache_entirely(tmp_path):
    state = sample_state()
    save(state, tmp_path)
    readers = [load(state, tmp_path, cache_metadata=False)[1] for _ in range(3)]
    assert [r.stats.metadata_reads for r in readers] == [1, 1, 1]
    assert not METADATA_CACHE._entries


def test_clear_metadata_cache_forces_a_new_read(tmp_path):
    state = sample_state()
    save(state, tmp_path)
    load(state, tmp_path)
    clear_metadata_cache()
    assert load(state, tmp_path)[1].stats.metadata_reads == 1


def test_cache_is_bounded(tmp_path):
    for n in range(METADATA_CACHE.max_entries + 3):
        save({"t": torch.tensor([n])}, tmp_path / str(n))
        ShardReader(tmp_path / str(n)).read_metadata()
    assert len(METADATA_CACHE._entries) == METADATA_CACHE.max_entries


def test_stock_checkpoint_metadata_is_cached_too(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = sample_state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path))
    reads = [load(state, tmp_path)[1].stats.metadata_reads for _ in range(3)]
    assert reads == [1, 0, 0]


def test_overwrite_false_refuses_an_existing_checkpoint(tmp_path):
    import pytest
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_ext import CheckpointExistsError

    state = sample_state()
    save(state, tmp_path, overwrite=False)  # empty directory: fine
    with pytest.raises(CheckpointException) as info:
        save(sample_state(5), tmp_path, overwrite=False)
    error = next(iter(info.value.failures.values()))[0]
    assert isinstance(error, CheckpointExistsError) and str(tmp_path) in str(error)
    assert "Checkpoint already exists" in str(error)  # stock's phrase: code matching it keeps working
    assert_state_equal(load(state, tmp_path)[0], state)  # the existing checkpoint is untouched


def test_index_loaded_metadata_equals_the_pickle(tmp_path):
    """The index builds storage_data on first use; read, iterated or pickled it is the
    plain dict stock DCP unpickles, and the tensor entries match chunk for chunk."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from dcp_ext.formats.index import StorageDataView

    save(sample_state(), tmp_path)
    ours = ShardReader(tmp_path, cache_metadata=False).read_metadata()
    stock = dcp.FileSystemReader(tmp_path).read_metadata()
    assert isinstance(ours.storage_data, StorageDataView)  # loaded from the index, not the pickle
    assert len(ours.storage_data) == len(stock.storage_data)
    assert all(index in ours.storage_data for index in stock.storage_data)
    assert dict(ours.storage_data.items()) == stock.storage_data
    copied = pickle.loads(pickle.dumps(ours))
    assert type(copied.storage_data) is dict and copied.storage_data == stock.storage_data
    assert ours.state_dict_metadata == stock.state_dict_metadata


def test_gc_pause_nests_and_restores_the_collector():
    import gc

    from dcp_ext.formats.gc_pause import gc_paused

    assert gc.isenabled()
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a collector the caller turned off stays off
    finally:
        gc.enable()


def test_load_id_matches_the_metadata_storage_meta(tmp_path):
    """As stock readers: ``read_metadata().storage_meta.load_id == reader.load_id``, new per reset."""
    save(sample_state(), tmp_path)
    reader = ShardReader(tmp_path)
    assert reader.read_metadata().storage_meta.load_id == reader.load_id
    first = reader.load_id
    reader.reset(tmp_path)
    assert reader.load_id != first and reader.read_metadata().storage_meta.load_id == reader.load_id
