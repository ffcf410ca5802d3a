"""Concurrency and load: parallel jobs, a reader racing a writer, many and huge tensors, soak.

Memory figures are the process's resident set (``VmRSS``/``VmHWM`` from /proc), with the
high-water mark reset through ``/proc/self/clear_refs`` before the measured step.
"""

from __future__ import annotations

import concurrent.futures
import gc
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_ext import CheckpointError, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.formats.index import INDEX_NAME
from dcp_ext.storage.catalog import METADATA_NAME, read_catalog
from dcp_ext.storage.commit import commit, remove_dead_files
from dcp_ext.storage.location import LocalLocation
from dcp_ext.storage.verify import verify_checkpoint

from mp import run_job
from support import assert_state_dict_equal, load, rss_bytes, save

MiB = 1 << 20


def seeded_state(seed: int) -> dict:
    """A state whose ``seed`` entry says which save it came from."""
    g = torch.Generator().manual_seed(seed)
    state: dict = {f"w{i}": torch.randn(96, 64, generator=g) for i in range(6)}
    state["seed"] = torch.tensor([seed])
    return state


# -- concurrency ---------------------------------------------------------------------------
def _save_seeded_job(rank: int, world: int, path: str, seed: int) -> None:
    save(seeded_state(seed), path, thread_count=2)


@pytest.mark.mp
def test_two_jobs_save_to_different_directories_at_once(tmp_path):
    errors: list[BaseException] = []

    def job(name: str, seed: int) -> None:
        try:
            run_job(_save_seeded_job, 2, str(tmp_path / name), seed)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=job, args=(name, seed)) for name, seed in (("a", 1), ("b", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name, seed in (("a", 1), ("b", 2)):
        assert_state_dict_equal(load(seeded_state(seed), tmp_path / name)[0], seeded_state(seed))


def _save_in_a_loop(path: str, first_seed: int, count: int) -> None:
    torch.set_num_threads(1)
    for seed in range(first_seed, first_seed + count):
        save(seeded_state(seed), path, thread_count=2)


@pytest.mark.mp
def test_reader_loading_while_a_writer_commits_gets_old_or_new_whole(tmp_path):
    """Every load is one whole checkpoint or a clear 'load again' error, never a mix."""
    save(seeded_state(0), tmp_path)
    writer = mp.get_context("forkserver").Process(target=_save_in_a_loop, args=(str(tmp_path), 1, 30))
    writer.start()
    outcomes: dict[str, int] = {"whole": 0, "replaced": 0}
    seeds_seen = set()
    try:
        while writer.is_alive() or not outcomes["whole"]:
            try:
                got, _ = load(seeded_state(0), tmp_path, verify_checksums=True)
            except BaseException as exc:
                error = next(iter(exc.failures.values()))[0] if hasattr(exc, "failures") else exc
                assert isinstance(error, CheckpointError) and "load again" in str(error), error
                outcomes["replaced"] += 1
                continue
            seed = int(got["seed"])
            assert_state_dict_equal(got, seeded_state(seed))
            seeds_seen.add(seed)
            outcomes["whole"] += 1
    finally:
        writer.join(120)
    assert writer.exitcode == 0
    assert outcomes["whole"] >= 1 and len(seeds_seen) >= 2, (outcomes, seeds_seen)
    print(f"reader vs writer: {outcomes}, {len(seeds_seen)} distinct checkpoints loaded")


class _PausingPlanner(ShardSavePlanner):
    """Pauses a save after its first record (announcing it with file ``paused``) until
    file ``resume`` exists: a job that keeps saving while another saves into its directory."""

    def __init__(self, paused: str, resume: str) -> None:
        super().__init__()
        self.paused, self.resume, self.records = paused, resume, 0

    def resolve_data(self, write_item):  # noqa: ANN001, ANN201
        self.records += 1
        if self.records == 2:
            open(self.paused, "w").close()
            while not os.path.exists(self.resume):
                time.sleep(0.01)
        return super().resolve_data(write_item)


def _save_paused(path: str, seed: int, paused: str, resume: str) -> str:
    """Save ``seeded_state(seed)`` pausing mid-write; the error it ended with ("" for success)."""
    writer = ShardWriter(path, thread_count=1)  # one file: the pause falls between two of its records
    try:
        dcp.save(seeded_state(seed), storage_writer=writer, planner=_PausingPlanner(paused, resume))
    except BaseException as exc:
        error = next(iter(exc.failures.values()))[0] if hasattr(exc, "failures") else exc
        return f"{type(error).__name__}: {error}"
    return ""


@pytest.mark.mp
def test_a_save_whose_files_another_job_removed_fails_and_the_other_stays(tmp_path):
    """Two jobs saving into one directory (a zombie outliving its restart): the other job's
    save removed the paused save's files as a dead save's. Before, the paused save then
    committed a ``.metadata`` over missing files and both reported success: every
    checkpoint of the directory was lost."""
    path, paused, resume = tmp_path / "ckpt", str(tmp_path / "paused"), str(tmp_path / "resume")
    save(seeded_state(1), path)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("forkserver")) as pool:
        zombie = pool.submit(_save_paused, str(path), 2, paused, resume)
        while not os.path.exists(paused):
            assert not zombie.done(), zombie.result()
            time.sleep(0.01)
        save(seeded_state(3), path)  # the restarted job, in this process
        open(resume, "w").close()
        error = zombie.result(timeout=120)
    assert error.startswith("CheckpointError: ") and "removed while it ran" in error, error
    assert "another save into this directory removed them, so two jobs are saving here" in error
    got, reader = load(seeded_state(0), path, cache_metadata=False, verify_checksums=True)
    assert_state_dict_equal(got, seeded_state(3))
    data_files = {name for name in os.listdir(path) if name.endswith((".distcp", ".tmp", ".parquet"))}
    assert data_files == {item.relative_path for item in reader.catalog.items.values()} | {INDEX_NAME}
    assert verify_checkpoint(str(path)).ok


class _OtherJobStartsMidCommit(LocalLocation):
    """A directory where another job's save begins (its real clean-up of dead saves' files,
    ``remove_dead_files``) just after this commit synced its temporary files."""

    def sync_directory(self) -> None:
        super().sync_directory()
        remove_dead_files(LocalLocation(self.root))


def test_a_commit_whose_temporary_files_another_job_removed_fails_naming_the_two_jobs(tmp_path):
    """The other job's clean-up takes any temporary commit file for a dead save's. Before, the
    rename of the removed file raised a bare FileNotFoundError naming no cause."""
    path = tmp_path / "ckpt"
    save(seeded_state(1), path)
    location = LocalLocation(str(path))
    files = read_catalog(location).files()
    with pytest.raises(CheckpointError) as info:
        commit(_OtherJobStartsMidCommit(str(path)), "5" * 32, (path / METADATA_NAME).read_bytes(),
               (path / INDEX_NAME).read_bytes(), files, sync=True)
    message = str(info.value)
    assert "is gone while it commits: another save into this directory removed it, so two jobs are saving here" in message
    got, _ = load(seeded_state(0), path, cache_metadata=False, verify_checksums=True)
    assert_state_dict_equal(got, seeded_state(1))
    assert verify_checkpoint(str(path)).ok


def test_verify_during_a_save_that_commits_says_so_instead_of_reporting_faults(tmp_path):
    """A save committed while ``verify`` reads (a monitoring check beside a training job)
    retires the files verify is about to check. Before, verify reported them missing and the
    new ``.metadata`` as corrupt: false alarms about a healthy directory."""
    path = tmp_path / "ckpt"
    save(seeded_state(1), path, thread_count=4)  # several files: the save lands between two of them
    saved = []

    def save_once(done: int, total: int) -> None:
        if not saved:
            save(seeded_state(2), path, thread_count=4)
            saved.append(True)

    report = verify_checkpoint(str(path), progress=save_once)
    assert saved and report.changed and len(report.faults) == 1, report.faults
    assert "a newer save was committed into this directory while verify ran" in report.faults[0]
    assert "run verify again" in report.faults[0]
    again = verify_checkpoint(str(path))
    assert again.ok and not again.changed


# -- load ----------------------------------------------------------------------------------
def test_thousand_small_tensors(tmp_path):
    g = torch.Generator().manual_seed(3)
    state = {f"layers.{i}.weight": torch.randn(4, 8, generator=g).to(torch.bfloat16 if i % 3 else torch.float32)
             for i in range(1000)}
    save(state, tmp_path, thread_count=4)
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".distcp")]) == 4
    got, reader = load(state, tmp_path, verify_checksums=True)
    assert_state_dict_equal(got, state)
    assert reader.stats.items_read == 1000 and reader.stats.files_opened == 4


LARGE_TENSOR_SCRIPT = r"""
import json, sys, torch
from support import save
path, n = sys.argv[1], int(sys.argv[2])

def status(field):
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith(field + ":")).split()[1]) * 1024

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

big = torch.arange(n, dtype=torch.int32)
reset_peak(); base = status("VmRSS")
save({"big": big}, path, thread_count=2)
save_extra = status("VmHWM") - base
del big
dest = {"big": torch.empty(n, dtype=torch.int32)}
dest["big"].fill_(-1)
reset_peak(); base = status("VmRSS")
import torch.distributed.checkpoint as dcp
from dcp_ext import ShardReader, ShardLoadPlanner
dcp.load(dest, storage_reader=ShardReader(path), planner=ShardLoadPlanner())
load_extra = status("VmHWM") - base
ok = all(torch.equal(dest["big"][i:i + (1 << 26)], torch.arange(i, min(n, i + (1 << 26)), dtype=torch.int32))
         for i in range(0, n, 1 << 26))
print(json.dumps({"save_extra": save_extra, "load_extra": load_extra, "ok": ok}))
"""


@pytest.mark.mp
@pytest.mark.slow
def test_one_gib_tensor_memory_stays_bounded(tmp_path):
    """Saving and loading a 1 GiB tensor needs no second copy of it in memory."""
    n = (1 << 30) // 4
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    result = subprocess.run(
        [sys.executable, "-c", LARGE_TENSOR_SCRIPT, str(tmp_path / "ckpt"), str(n)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["ok"]
    print(f"1 GiB tensor: extra peak RSS save {figures['save_extra'] / MiB:.1f} MiB, load {figures['load_extra'] / MiB:.1f} MiB")
    assert figures["save_extra"] < 96 * MiB and figures["load_extra"] < 96 * MiB, figures


def test_hundred_back_to_back_saves_with_the_cache_on(tmp_path):
    """Every load sees the save just committed (never cached metadata), and RSS stays flat."""
    rss = {}
    for seed in range(100):
        state = seeded_state(seed)
        save(state, tmp_path, thread_count=2)
        got, reader = load(state, tmp_path)
        assert_state_dict_equal(got, state)
        assert reader.stats.metadata_reads == 1, seed  # a new version is read, once
        if seed in (19, 99):
            gc.collect()
            rss[seed] = rss_bytes()
    assert rss[99] - rss[19] < 16 * MiB, rss
    print(f"100 saves: RSS after 20 {rss[19] / MiB:.1f} MiB, after 100 {rss[99] / MiB:.1f} MiB")
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".distcp")]) == 2
    assert set(ShardReader(tmp_path).read_metadata().state_dict_metadata) == set(seeded_state(99))  # the last save
