"""A cold load asks the kernel for its first bytes while it builds its requests
(``storage.read_ahead``): which ranges, that they reach the page cache, and that a load
through it lands every value."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.formats.index import StoredItem
from dcp_ext.storage import reader as reader_module
from dcp_ext.storage.location import PROBE_BYTES, Location, LocalRangeReader
from dcp_ext.storage.read_ahead import first_ranges, start_read_ahead
from support import evict, garbage_state

MiB = 1 << 20


def test_first_ranges_are_the_heads_of_the_first_files_in_read_order() -> None:
    records = [
        StoredItem("b.distcp", 10 * MiB, 4 * MiB, 10 * MiB),  # starts past b's head: not asked for
        StoredItem("c.distcp", 0, MiB, 64),  # third file in name order: past ``threads``
        StoredItem("b.distcp", 0, 3 * MiB, 64),
        StoredItem("a.distcp", 2 * MiB, 0, 2 * MiB),  # empty: nothing to read
        StoredItem("a.distcp", MiB, MiB),  # a stock record (payload unknown): its ends are parsed first
        StoredItem("a.distcp", 5 * MiB, 9 * MiB, 5 * MiB + 64),  # clipped to a's head
        StoredItem("a.distcp", 4 * MiB, MiB, 4 * MiB),
        StoredItem("b.distcp", 3 * MiB, 4 * MiB, 3 * MiB + 64),
    ]
    big = StoredItem("z.distcp", 0, 1 << 30, 64)  # a long load: each thread's share is 16x a head and more
    assert first_ranges([*records, big], threads=2, budget=16 * MiB) == [
        ("a.distcp", [(4 * MiB, MiB), (5 * MiB, 7 * MiB)]),  # 8 MiB from a's first record read straight
        ("b.distcp", [(0, 3 * MiB), (3 * MiB, 4 * MiB)]),
    ]
    # a short load: 23 MiB over 2 threads, a head of 1/16 of a thread's share (736 KiB)
    assert first_ranges(records, threads=2, budget=16 * MiB) == [
        ("a.distcp", [(4 * MiB, 23 * MiB // 2 // 16)]), ("b.distcp", [(0, 23 * MiB // 2 // 16)])]
    assert [name for name, _ in first_ranges([*records, big], threads=8, budget=3 * MiB)] == [
        "a.distcp", "b.distcp", "c.distcp", "z.distcp"]
    assert first_ranges([StoredItem("a.distcp", 0, 0, 0), StoredItem("b.distcp", 0, MiB)], threads=4) == []
    assert first_ranges([StoredItem("a.distcp", 0, 63, 0)], threads=4) == []  # too short to read ahead
    assert first_ranges([], threads=4) == []


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


def _wait_until(done, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, "the asked-for pages never reached the page cache"
        time.sleep(0.01)


def test_read_ahead_fills_the_page_cache_with_the_asked_ranges_only(tmp_path) -> None:
    data = os.urandom(8 * MiB)
    (tmp_path / "f.bin").write_bytes(data)
    path = str(tmp_path / "f.bin")
    if not _cold_file(path):
        pytest.skip("this file system keeps the file's pages (tmpfs) or has no RWF_NOWAIT")
    location = Location(str(tmp_path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no device read-ahead past what is asked
    finally:
        os.close(fd)
    thread = start_read_ahead(location, [("f.bin", [(MiB, MiB), (4 * MiB, PROBE_BYTES)])])
    assert thread is not None and thread.name == "dcp_ext-willneed"
    thread.join(timeout=30)
    reader = LocalRangeReader(path)
    try:
        asked = [MiB, 2 * MiB - PROBE_BYTES, 4 * MiB]
        _wait_until(lambda: reader.holds(asked))  # the advice queues the reads; they land a moment later
        assert not reader.holds([6 * MiB])
        got = bytearray(MiB)
        assert reader.read_into(MiB, [memoryview(got)]) == MiB and bytes(got) == data[MiB : 2 * MiB]
    finally:
        reader.close()
    assert start_read_ahead(location, [("f.bin", [(MiB, MiB)])]) is None  # cached now: nothing to ask
    assert start_read_ahead(location, [("missing.bin", [(0, MiB)])]) is None  # the load's read reports it


def test_a_remote_store_is_not_read_ahead(tmp_path) -> None:
    (tmp_path / "f.bin").write_bytes(b"x" * MiB)
    assert start_read_ahead(Location(f"file://{tmp_path}"), [("f.bin", [(0, MiB)])]) is None  # fsspec: no page cache here


@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_a_cold_load_reads_ahead_the_start_of_its_files_and_lands_every_value(tmp_path, monkeypatch, writer) -> None:
    """Through dcp.load on real files: the ranges asked for are the heads of the records
    the load reads (none of a stock checkpoint), and the load's values are bit-exact."""
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
    asked: list = []

    def noted(location, heads):
        thread = start_read_ahead(location, heads)
        asked.append((heads, thread))
        return thread

    monkeypatch.setattr(reader_module, "start_read_ahead", noted)
    dest = garbage_state(state)
    dcp.load(dest, storage_reader=ShardReader(tmp_path, thread_count=2), planner=ShardLoadPlanner(), no_dist=True)
    for key, value in state.items():
        assert torch.equal(dest[key], value), key
    [(heads, thread)] = asked
    if writer == "stock":  # its records' ends are parsed first: nothing read ahead beside those reads
        assert heads == [] and thread is None
        return
    assert thread is not None and not thread.is_alive()  # joined before the load returned
    assert [name for name, _ in heads] == files  # two files, two reader threads: both heads
    load_bytes = sum(os.path.getsize(tmp_path / name) for name in files)
    for name, ranges in heads:
        assert 0 < sum(length for _, length in ranges) <= load_bytes // 2 // 16  # 1/16 of a thread's share
        size = os.path.getsize(tmp_path / name)
        assert all(0 <= offset and offset + length <= size for offset, length in ranges)
