"""One thread-count rule for reads and writes, and no silently ignored thread_count."""

from __future__ import annotations

import os

import pytest

from dcp_ext import ShardReader, ShardWriter
from dcp_ext.errors import InvalidRequestError
from dcp_ext.runtime.threads import MAX_THREADS, MIN_THREADS, io_thread_count


def test_rule_shares_the_cores_among_the_ranks_of_a_node(monkeypatch) -> None:
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = io_thread_count()
    assert alone == max(MIN_THREADS, min(MAX_THREADS, 2 * cores))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cores))  # more ranks than cores
    assert io_thread_count() == MIN_THREADS
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not-a-number")  # a launcher's oddity: counted as one rank
    assert io_thread_count() == alone


def test_reader_and_writer_use_the_rule_and_refuse_bad_counts(tmp_path) -> None:
    assert ShardReader(tmp_path).thread_count == ShardWriter(tmp_path).thread_count == io_thread_count()
    assert ShardReader(tmp_path, thread_count=3).thread_count == 3
    for bad in (0, -2, 1.5, True):
        with pytest.raises(InvalidRequestError, match=r"ShardReader\(thread_count=...\) must be a positive integer"):
            ShardReader(tmp_path, thread_count=bad)
        with pytest.raises(InvalidRequestError, match=r"ShardWriter\(thread_count=...\) must be a positive integer"):
            ShardWriter(tmp_path, thread_count=bad)
