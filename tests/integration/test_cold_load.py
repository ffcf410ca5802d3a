"""A load of files whose pages are not cached lands every value: ours (records read
straight from the index's offsets, in steps while the page cache lacks them) and stock
(each record's ends read, with the kernel asked for them all at once, and parsed first)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.storage.location import LocalRangeReader
from support import evict, garbage_state


def _cold_file(path: str) -> bool:
    """Evict ``path``'s pages; False where this file system keeps them or cannot tell."""
    reader = LocalRangeReader(path)
    try:
        for _ in range(3):  # writeback of a busy machine can keep pages a moment
            evict(path)
            if not reader.holds([0]):
                evict(path)  # the probe may have started reading ahead
                return True
        return False
    finally:
        reader.close()


@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_a_cold_load_lands_every_value_and_leaves_no_thread(tmp_path, writer) -> None:
    g = torch.Generator().manual_seed(5)
    state = {f"layer{i}": torch.randn(512, 1024, generator=g) for i in range(8)}  # 2 MiB each
    state["step"] = torch.tensor(7)
    if writer == "ours":
        dcp.save(state, storage_writer=ShardWriter(tmp_path, thread_count=2, sync_files=True),
                 planner=ShardSavePlanner(), no_dist=True)
    else:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=2, sync_files=True), no_dist=True)
    files = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".distcp"))
    if not all(_cold_file(str(tmp_path / name)) for name in files):
        pytest.skip("this file system keeps the file's pages (tmpfs) or has no RWF_NOWAIT")
    before = set(threading.enumerate())
    dest = garbage_state(state)
    dcp.load(dest, storage_reader=ShardReader(tmp_path, thread_count=2, cache_metadata=False),
             planner=ShardLoadPlanner(), no_dist=True)
    for key, value in state.items():
        assert torch.equal(dest[key], value), key
    assert not [t for t in threading.enumerate() if t not in before and t.name.startswith("dcp_ext")]
