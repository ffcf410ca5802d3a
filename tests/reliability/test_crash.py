"""Crash consistency: a save SIGKILLed at any point never costs the previous checkpoint.

Exact kill points come from the ``DCP_EXT_CRASH_AT`` hook (``dcp_ext.storage.commit``):
the chosen rank of a real gloo job SIGKILLs itself when the save reaches a phase.
Timed kills of a process saving in a loop cover the moments between the hooks. After
every kill: the directory holds the old checkpoint (phases before the commit point) or
the complete new one (after it), never a mix, and loads with ``verify_checksums=True``
(every record's CRC32C found in an index); ``verify_checkpoint`` passes and names
which save it is; and a fresh save into the same directory succeeds and cleans up.
A save that fails while it is planned (a replica mismatch) leaves no ``step{N}``
directory behind once the next save through the writer, or its ``close()``, ran.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from dcp_ext import CheckpointError, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.formats.data_files import is_data_file
from dcp_ext.formats.index import INDEX_NAME, PREVIOUS_INDEX_NAME
from dcp_ext.formats.marker import MARKER_NAME
from dcp_ext.runtime.crash import CRASH_ENV
from dcp_ext.storage.verify import verify_checkpoint

from mp import WorkerError, run_job
from support import assert_state_dict_equal, load, save

pytestmark = pytest.mark.mp

DATA_PHASES = ["before-data", "mid-file", "after-file"]  # every rank passes these
COMMIT_PHASES = ["after-data", "before-commit", "after-index"]  # coordinator, before the commit point
COMMITTED_PHASES = ["before-marker", "mid-cleanup"]  # coordinator, after the commit point


def crash_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    state: dict = {f"layer{i}.w": torch.randn(64, 128, generator=g) for i in range(8)}
    state["layer0.b"] = torch.randn(128, generator=g).to(torch.bfloat16)
    state["meta"] = {"seed": seed}
    return state


def save_job(rank: int, world: int, path: str, seed: int, phase: str | None, crash_rank: int, use_async: bool) -> None:
    """Save ``crash_state(seed)`` (replicated on every rank, so dedup spreads it over ranks)."""
    if phase and rank == crash_rank:
        os.environ[CRASH_ENV] = phase
    writer, planner = ShardWriter(path, thread_count=2), ShardSavePlanner()
    if not use_async:
        dcp.save(crash_state(seed), storage_writer=writer, planner=planner)
        return
    response = dcp.async_save(crash_state(seed), storage_writer=writer, planner=planner)
    (response.upload_completion if isinstance(response, AsyncSaveResponse) else response).result(timeout=60)


def save_id(path) -> str:
    reader = ShardReader(path, cache_metadata=False)
    return reader.read_metadata().storage_meta.save_id


def committed_files(path) -> set[str]:
    reader = ShardReader(path, cache_metadata=False)
    reader.read_metadata()
    return {item.relative_path for item in reader.catalog.items.values()}


def check_after_crash(path, expect: str, old_id: str | None) -> None:
    """``expect`` is "old" (the previous checkpoint, or none), or "new" (seed 2, complete)."""
    report = verify_checkpoint(str(path))
    if expect == "old" and old_id is None:
        assert not report.ok and "no committed checkpoint here" in report.faults[0]
        with pytest.raises(CheckpointError, match="no committed checkpoint"):
            ShardReader(path, cache_metadata=False).read_metadata()
    else:
        assert report.ok and report.items_without_checksum == 0, report
        want = crash_state(1 if expect == "old" else 2)
        assert (report.save_id == old_id) == (expect == "old")
        assert_state_dict_equal(load(want, path, cache_metadata=False)[0], want)
        # checksums included: a save killed after replacing the index left the old .metadata without them
        assert_state_dict_equal(load(want, path, cache_metadata=False, verify_checksums=True)[0], want)
    fresh = crash_state(3)
    save(fresh, path, thread_count=2)
    assert_state_dict_equal(load(fresh, path, cache_metadata=False)[0], fresh)
    names = set(os.listdir(path))
    assert {n for n in names if is_data_file(n)} == committed_files(path)  # crashed save cleaned up
    assert names - committed_files(path) == {".metadata", INDEX_NAME, MARKER_NAME}


def crash_case(path, world: int, phase: str, existing: bool, use_async: bool = False) -> None:
    old_id = None
    if existing:
        run_job(save_job, world, str(path), 1, None, 0, False)
        old_id = save_id(path)
    crash_rank = 1 if world == 2 and phase in DATA_PHASES else 0
    with pytest.raises(WorkerError, match="SIGKILL"):
        run_job(save_job, world, str(path), 2, phase, crash_rank, use_async)
    check_after_crash(path, "new" if phase in COMMITTED_PHASES else "old", old_id)


# (phase, existing): a save into an empty directory has nothing to clean up, so no mid-cleanup there
KILL_POINTS = [
    pytest.param(phase, existing, id=f"{phase}-{'over-checkpoint' if existing else 'empty-dir'}")
    for phase in DATA_PHASES + COMMIT_PHASES + COMMITTED_PHASES
    for existing in (False, True)
    if existing or phase != "mid-cleanup"
]


@pytest.mark.parametrize("world", [1, 2], ids=["1proc", "2procs"])
@pytest.mark.parametrize("phase, existing", KILL_POINTS)
def test_sigkill_at_each_phase(tmp_path, world, phase, existing):
    crash_case(tmp_path / "ckpt", world, phase, existing)


@pytest.mark.parametrize("phase", ["mid-file", "after-data", "before-marker"])
def test_sigkill_during_async_save_background_write(tmp_path, phase):
    """The kill lands in async_save's background thread, after staging returned."""
    crash_case(tmp_path / "ckpt", 1, phase, existing=True, use_async=True)


def test_commits_killed_twice_before_the_commit_point_keep_the_checksums(tmp_path):
    """The second dead commit must not set the dead index of the first aside over the one
    the live ``.metadata`` needs: the next save puts that one back first."""
    path = tmp_path / "ckpt"
    run_job(save_job, 1, str(path), 1, None, 0, False)
    old_id = save_id(path)
    for phase in ("after-index", "after-index"):
        with pytest.raises(WorkerError, match="SIGKILL"):
            run_job(save_job, 1, str(path), 2, phase, 0, False)
        assert PREVIOUS_INDEX_NAME in os.listdir(path)
    check_after_crash(path, "old", old_id)


def test_verify_cli_tells_old_from_new_after_a_crash(tmp_path):
    path = tmp_path / "ckpt"
    run_job(save_job, 1, str(path), 1, None, 0, False)
    old_id = save_id(path)
    with pytest.raises(WorkerError, match="SIGKILL"):
        run_job(save_job, 1, str(path), 2, "after-data", 0, False)
    cli = [sys.executable, "-m", "dcp_ext.cli.main", "verify", str(path)]
    result = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and f"(save {old_id})" in result.stdout, result.stdout + result.stderr
    assert "left by an interrupted save" in result.stdout  # the dead save's data files
    with pytest.raises(WorkerError, match="SIGKILL"):
        run_job(save_job, 1, str(path), 2, "before-marker", 0, False)
    result = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and old_id not in result.stdout and "OK:" in result.stdout


# -- timed kills: a process saving in a loop, killed at arbitrary moments -------------------
def _big_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(512, 1024, generator=g) for i in range(24)}  # ~48 MiB


def _save_forever(path: str, ready) -> None:
    torch.set_num_threads(1)
    state = _big_state(99)
    ready.set()
    while True:
        save(state, path, thread_count=2)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2, 0.5, 1.0])
def test_timed_sigkill_mid_save_keeps_previous_checkpoint(tmp_path, delay):
    old_state = _big_state(1)
    save(old_state, tmp_path)
    old_files = set(os.listdir(tmp_path))
    ctx = mp.get_context("forkserver")
    ready = ctx.Event()
    proc = ctx.Process(target=_save_forever, args=(str(tmp_path), ready))
    proc.start()
    try:
        ready.wait(60)
        deadline = time.time() + 60
        while not {n for n in os.listdir(tmp_path) if n.endswith(".distcp")} - old_files and time.time() < deadline:
            time.sleep(0.002)
        time.sleep(delay)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
    assert verify_checkpoint(str(tmp_path)).ok
    is_old = committed_files(tmp_path) <= old_files
    want = old_state if is_old else _big_state(99)  # the loop may have committed: then whole
    assert_state_dict_equal(load(want, tmp_path, cache_metadata=False)[0], want)
    fresh = _big_state(7)
    save(fresh, tmp_path)
    assert_state_dict_equal(load(fresh, tmp_path, cache_metadata=False)[0], fresh)
    assert {n for n in os.listdir(tmp_path) if n.endswith((".distcp", ".tmp"))} == committed_files(tmp_path)


@pytest.mark.parametrize("numel", [16, 1000, 1500, 2000, 3000])  # records from < 4 KiB to > 8 KiB
def test_index_and_metadata_from_different_commits_fall_back_to_metadata(tmp_path, numel):
    """A crash between the index rename and the .metadata rename: .metadata wins.

    Without the index, records are located by parsing their zip headers (the stock path).
    """
    first, second = {**crash_state(1), "v": torch.arange(numel, dtype=torch.float32)}, {"other": torch.arange(3)}
    save(first, tmp_path / "a")
    save(second, tmp_path / "b")
    os.replace(tmp_path / "b" / INDEX_NAME, tmp_path / "a" / INDEX_NAME)
    got, reader = load(first, tmp_path / "a")
    assert_state_dict_equal(got, first)
    assert not reader.catalog.indexed


def replica_mismatch_job(rank: int, world: int, root: str) -> list[str]:
    """Both ranks save ``w`` at the same offsets with different values: the save planner's
    global step refuses it, after the coordinator created the save's new directory."""
    writer = ShardWriter(root)
    with pytest.raises(CheckpointException):
        dcp.save({"w": torch.full((4,), float(rank))}, storage_writer=writer, planner=ShardSavePlanner(),
                 checkpoint_id=os.path.join(root, "step1"))
    good = {"w": torch.arange(4.0)}
    dcp.save(good, storage_writer=writer, planner=ShardSavePlanner(), checkpoint_id=os.path.join(root, "step2"))
    assert_state_dict_equal(load(good, os.path.join(root, "step2"))[0], good)
    with pytest.raises(CheckpointException):
        dcp.save({"w": torch.full((4,), float(rank))}, storage_writer=writer, planner=ShardSavePlanner(),
                 checkpoint_id=os.path.join(root, "step3"))
    writer.close()
    dist.barrier()
    return sorted(os.listdir(root))


def test_a_save_refused_while_planned_leaves_no_step_directory(tmp_path):
    assert run_job(replica_mismatch_job, 2, str(tmp_path)) == [["step2"]] * 2


class _CtrlCAfterPublishing:
    """``os`` for ``dcp_ext.storage.location``, whose ``replace`` of ``.metadata`` is followed
    by a real SIGINT to this process: a Ctrl-C landing in the rename syscall is raised as
    the rename returns, before anything after it runs."""

    def __getattr__(self, name: str):
        return getattr(os, name)

    @staticmethod
    def replace(src: str, dst: str) -> None:
        os.replace(src, dst)
        if os.path.basename(dst) == ".metadata":
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_as_metadata_is_published_keeps_the_new_checkpoint(tmp_path, monkeypatch):
    """Before, the failure handler took the save for uncommitted and deleted the data files
    the new ``.metadata`` references: neither checkpoint loaded. Stock DCP keeps the new one."""
    import dcp_ext.storage.location as location_module

    old, new = crash_state(1), crash_state(2)
    save(old, tmp_path)
    monkeypatch.setattr(location_module, "os", _CtrlCAfterPublishing())
    with pytest.raises(BaseException):  # DCP wraps the KeyboardInterrupt (or lets it through)
        save(new, tmp_path)
    monkeypatch.undo()
    assert_state_dict_equal(load(new, tmp_path, cache_metadata=False)[0], new)
    assert verify_checkpoint(str(tmp_path)).ok
    save(old, tmp_path)  # the next save works and removes what the interrupted one retired
    assert_state_dict_equal(load(old, tmp_path, cache_metadata=False)[0], old)
    assert {n for n in os.listdir(tmp_path) if n.endswith((".distcp", ".tmp"))} == committed_files(tmp_path)
