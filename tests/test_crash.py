"""A save killed with SIGKILL at any moment leaves the previous checkpoint intact."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
from conftest import assert_state_equal, load, save

from dcp_ext.formats.index import INDEX_NAME


def _big_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(512, 1024, generator=g) for i in range(24)}  # ~48 MiB


def _save_forever(path: str, ready) -> None:
    torch.set_num_threads(1)
    state = _big_state(99)
    ready.set()
    while True:
        save(state, path, thread_count=2)


def _new_files(path, old: set[str]) -> set[str]:
    return {n for n in os.listdir(path) if n.endswith(".distcp")} - old


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2, 0.5, 1.0])
def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path, delay):
    old_state = _big_state(1)
    save(old_state, tmp_path)
    old_files = set(os.listdir(tmp_path))
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_save_forever, args=(str(tmp_path), ready))
    proc.start()
    try:
        ready.wait(60)
        deadline = time.time() + 60
        while not _new_files(tmp_path, old_files) and time.time() < deadline:
            time.sleep(0.002)
        time.sleep(delay)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
    got, _ = load(old_state, tmp_path, cache_metadata=False) if _is_old(tmp_path, old_files) else (None, None)
    if got is not None:
        assert_state_equal(got, old_state)
    else:  # the new save committed before the kill: it must be whole
        assert_state_equal(load(_big_state(99), tmp_path, cache_metadata=False)[0], _big_state(99))
    fresh = _big_state(7)
    save(fresh, tmp_path)
    assert_state_equal(load(fresh, tmp_path, cache_metadata=False)[0], fresh)
    leftovers = {n for n in os.listdir(tmp_path) if n.endswith((".distcp", ".tmp"))}
    referenced = {n for n in os.listdir(tmp_path) if n.endswith(".distcp")}
    assert leftovers == referenced and len(referenced) <= 2  # crashed save's files were cleaned up


def _is_old(path, old_files: set[str]) -> bool:
    """True while the committed .metadata still references the old save's files."""
    from dcp_ext import ShardReader

    reader = ShardReader(path, cache_metadata=False)
    reader.read_metadata()
    return {i.relative_path for i in reader.catalog.items.values()} <= old_files


def test_index_and_metadata_from_different_commits_fall_back_to_metadata(tmp_path):
    """A crash between the index rename and the .metadata rename: .metadata wins."""
    first, second = _big_state(1), {"other": torch.arange(3)}
    save(first, tmp_path / "a")
    save(second, tmp_path / "b")
    os.replace(tmp_path / "b" / INDEX_NAME, tmp_path / "a" / INDEX_NAME)
    got, reader = load(first, tmp_path / "a")
    assert_state_equal(got, first)
    assert not reader.catalog.indexed
