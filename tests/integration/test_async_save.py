"""Async saves through ShardWriter/ShardSavePlanner (``writer.async_save``, which calls
``dcp.async_save`` with the writer as its stager and keeps the future DCP returns).

* the values saved are the ones staged when ``async_save`` returned: the
  source tensors (and a nested list object) are overwritten right after it
  returns, and the checkpoint must still hold the old values;
* two async saves back to back into the same directory: the second wins,
  and a reader opened after it sees the second checkpoint (not metadata
  cached from loading the first);
* with DCP's thread and process executors, 2 gloo ranks, one ShardWriter
  reused for every save (``dcp_ext.storage.staging``):
  - staging memory is reused: same buffers (data pointers) and one
    allocation over 6 saves, no RSS growth; a changed structure re-stages
    into new buffers and round-trips (DTensors, plain tensors, objects; and
    ShardedTensors, thread executor);
  - overlapping saves: a save started while the previous one still writes
    waits for it, and both checkpoints hold exactly their own values; so
    does a plain ``dcp.save`` through the writer after an ``async_save``;
  - a training loop that never waits on its futures: every step's
    checkpoint holds that step's values, through one set of buffers;
  - a background failure (a planner raising mid-write; ``overwrite=False``
    refusing) is raised at ``.result()`` and again, as CheckpointError, at
    the next save through the writer; the previous checkpoint still loads
    bit-exact and the next good save cleans up the failed save's files;
* direct ``dcp.async_save`` calls through one writer per rank, none awaited: every rank
  runs them in call order though one rank's first upload thread reaches the writer late,
  so each commit holds one step on both ranks, and a failed save lets the later ones run;
  where the writer cannot know the order (another stager), ranks pairing different
  saves are refused on every rank before anything is written;
* DCP's deprecated ``synchronize_staging`` hook is never called;
* ``dcp.async_save(storage_writer=writer)`` called directly is refused while
  ``reuse_staging=True`` (the writer would not know when its copy is free) and
  stages into new memory with ``reuse_staging=False``.
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import Future

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as STShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, init_from_local_shards
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from dcp_ext import CheckpointError, InvalidRequestError, ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.formats.data_files import is_data_file
from dcp_ext.storage.verify import verify_checkpoint

from mp import run_job
from support import (
    assert_state_dict_equal,
    distributed_state,
    garbage_like,
    load,
    load_tensors,
    make_globals,
    rss_bytes,
    sample_state,
    save,
)

SPECS = {
    "w": ((9, 8), torch.float32, Shard(0)),  # uneven over 2 ranks
    "b": ((4, 6), torch.bfloat16, Shard(1)),
    "r": ((5,), torch.float16, Replicate()),
    "i": ((7,), torch.int64, Shard(0)),
}


GLOBAL_SPECS = {**SPECS, "plain": ((3, 4), torch.float32), "only_b": ((6,), torch.float32)}


def build(mesh, seed: int, *, destination: bool, with_only_b: bool = False):
    names = [*SPECS, "plain"] + (["only_b"] if with_only_b else [])
    glob = {name: tensor for name, tensor in make_globals(GLOBAL_SPECS, seed).items() if name in names}
    placements = {name: placement for name, (_, _, placement) in SPECS.items()}
    sd, exp = distributed_state(glob, mesh, placements, destination=destination)
    sd["objects"] = {"seed": -1, "history": []} if destination else {"seed": seed, "history": [seed, "x"]}
    exp["objects"] = {"seed": seed, "history": [seed, "x"]}
    return sd, exp


# 4 x 2 MiB of float32 per rank: a staging copy leaked per save (8 MiB) stands out in RSS against
# the allocator's per-thread caches, which grow by at most a record (2 MiB) at a time
BIG = [f"big.{n}" for n in range(4)]
BIG_NUMEL = 1 << 19
BIG_BYTES = len(BIG) * BIG_NUMEL * 4
EXECUTORS = [AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS]


def big_state(mesh, seed: int, *, destination: bool, with_only_b: bool = False):
    """``build`` plus the plain tensors ``BIG``."""
    sd, exp = build(mesh, seed, destination=destination, with_only_b=with_only_b)
    g = torch.Generator().manual_seed(seed)
    for name in BIG:
        exp[name] = torch.randn(BIG_NUMEL, generator=g)
        sd[name] = garbage_like(exp[name]) if destination else exp[name].clone()
    return sd, exp


def _start(
    sd: dict,
    writer: ShardWriter,
    *,
    checkpoint_id: str | None = None,
    planner: ShardSavePlanner | None = None,
    executor: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
) -> Future:
    """Start an async save through ``writer``; staging is complete when this returns."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*synchronize_staging.*")  # the deprecated hook
        fut = writer.async_save(
            sd,
            checkpoint_id=checkpoint_id,
            planner=planner or ShardSavePlanner(),
            async_checkpointer_type=executor,
        )
    assert isinstance(fut, Future), type(fut)  # ShardWriter stages synchronously: a plain future
    return fut


def _async_save(sd: dict, path: str) -> Future:
    return _start(sd, ShardWriter(path))


def _clobber(sd: dict) -> None:
    """Overwrite every source value in place, and check the overwrite took."""
    with torch.no_grad():
        for name, value in sd.items():
            if isinstance(value, DTensor):
                local = value.to_local()
                before = local.clone()
                local.copy_(garbage_like(local))
                after = sd[name].to_local()
                assert local.numel() == 0 or not torch.equal(after, before), f"{name}: mutation did not take"
            elif isinstance(value, torch.Tensor):
                value.copy_(garbage_like(value))
    sd["objects"]["history"].append("mutated-after-async_save")
    sd["objects"]["seed"] = -99


def _load(path: str, mesh, seed: int, where: str, with_only_b: bool = False, builder=build) -> None:
    dest, expected = builder(mesh, seed, destination=True, with_only_b=with_only_b)
    reader = ShardReader(path)
    dcp.load(dest, storage_reader=reader, planner=ShardLoadPlanner())
    assert_state_dict_equal(dest, expected, where)
    assert reader.stats.items_read > 0 and reader.stats.bytes_read > 0, reader.stats


def async_job(rank: int, world: int, base: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    where = f"world {world} rank {rank}"

    # 1. Values are the staged ones.
    path = os.path.join(base, "staged")
    sd, _ = build(mesh, 1, destination=False)
    fut = _async_save(sd, path)
    _clobber(sd)  # source changes while the upload may still be running
    md = fut.result(timeout=60)
    assert isinstance(md, Metadata), type(md)
    assert set(SPECS) | {"plain"} <= set(md.state_dict_metadata), sorted(md.state_dict_metadata)
    dist.barrier()
    _load(path, mesh, 1, f"{where} staged values")

    # 2. Two async saves back to back into one directory: the second wins.
    path = os.path.join(base, "twice")
    first, _ = build(mesh, 2, destination=False)
    _async_save(first, path).result(timeout=60)
    dist.barrier()
    _load(path, mesh, 2, f"{where} after first save")  # also warms any metadata cache
    second, _ = build(mesh, 3, destination=False, with_only_b=True)
    fut = _async_save(second, path)
    _clobber(second)
    fut.result(timeout=60)
    dist.barrier()
    _load(path, mesh, 3, f"{where} after second save", with_only_b=True)


@pytest.mark.mp
@pytest.mark.parametrize("world", [1, 2])
def test_async_saves_store_the_staged_values_and_the_last_save_wins(tmp_path, world):
    run_job(async_job, world, str(tmp_path))


# -- one ShardWriter reused for every save ----------------------------------------------------


class FailingPlanner(ShardSavePlanner):
    """Raises in the background while ``fail_rank`` writes key ``w``: an injected failure
    after the save is planned and its files are opened, before anything is committed."""

    def __init__(self, fail_rank: int):
        super().__init__()
        self.fail_rank = fail_rank

    def resolve_data(self, write_item: WriteItem):
        if dist.get_rank() == self.fail_rank and write_item.index.fqn == "w":
            raise RuntimeError(f"injected failure writing {write_item.index.fqn!r}")
        return super().resolve_data(write_item)


class SlowPlanner(ShardSavePlanner):
    """Holds the background write of ``BIG[0]`` for ``delay`` seconds, so a save started
    meanwhile overlaps it."""

    def __init__(self, delay: float):
        super().__init__()
        self.delay = delay

    def resolve_data(self, write_item: WriteItem):
        if write_item.index.fqn == BIG[0]:
            time.sleep(self.delay)
        return super().resolve_data(write_item)


def _refill(sd: dict, mesh, seed: int) -> None:
    """Give ``sd`` the values of ``big_state(mesh, seed)`` in place: the test itself allocates
    no new memory between saves, so RSS measures the staging."""
    fresh, _ = build(mesh, seed, destination=False)
    with torch.no_grad():
        for name, value in fresh.items():
            if isinstance(value, DTensor):
                sd[name].to_local().copy_(value.to_local())
            elif isinstance(value, torch.Tensor):
                sd[name].copy_(value)
            else:
                sd[name] = value
        g = torch.Generator().manual_seed(seed)
        for name in BIG:
            torch.randn(BIG_NUMEL, generator=g, out=sd[name])


def reuse_job(rank: int, world: int, base: str, executor: AsyncCheckpointerType) -> None:
    mesh = init_device_mesh("cpu", (world,))
    where = f"{executor.value} rank {rank}"
    writer = ShardWriter(os.path.join(base, "default"))
    ptrs, rss = [], []
    sd, _ = big_state(mesh, 1, destination=False)
    for seed in range(1, 7):
        _refill(sd, mesh, seed)
        fut = _start(sd, writer, checkpoint_id=os.path.join(base, f"s{seed}"), executor=executor)
        _clobber(sd)
        fut.result(timeout=60)
        ptrs.append(writer.staging.data_ptrs())
        rss.append(rss_bytes())
    assert writer.staging.allocations == 1, (where, writer.staging.allocations)
    assert BIG_BYTES < writer.staging.nbytes < BIG_BYTES + 4096, (where, writer.staging.nbytes)
    assert all(p == ptrs[0] for p in ptrs), (where, ptrs)  # (process: moved to shared memory in save 1)
    assert rss[-1] - rss[1] < BIG_BYTES, (where, rss)  # a staging copy per save would add 4 x BIG_BYTES
    dist.barrier()
    for seed in range(1, 7):
        _load(os.path.join(base, f"s{seed}"), mesh, seed, f"{where} save {seed}", builder=big_state)

    # a changed structure re-stages into new buffers; the old ones are dropped, not kept
    nbytes = writer.staging.nbytes
    changed, _ = big_state(mesh, 7, destination=False, with_only_b=True)
    _start(changed, writer, checkpoint_id=os.path.join(base, "s7"), executor=executor).result(timeout=60)
    assert writer.staging.allocations == 2, (where, writer.staging.allocations)
    assert writer.staging.nbytes == nbytes + changed["only_b"].nbytes, (where, writer.staging.nbytes)
    dist.barrier()
    _load(os.path.join(base, "s7"), mesh, 7, f"{where} changed structure", with_only_b=True, builder=big_state)


def overlap_job(rank: int, world: int, base: str, executor: AsyncCheckpointerType) -> None:
    mesh = init_device_mesh("cpu", (world,))
    where = f"{executor.value} rank {rank}"
    writer = ShardWriter(os.path.join(base, "default"))
    first, _ = big_state(mesh, 1, destination=False)
    second, _ = big_state(mesh, 2, destination=False)
    slow = SlowPlanner(delay=1.0)
    fut1 = _start(first, writer, checkpoint_id=os.path.join(base, "one"), planner=slow, executor=executor)
    _clobber(first)
    assert not fut1.done(), where  # the first save is still writing
    fut2 = _start(second, writer, checkpoint_id=os.path.join(base, "two"), executor=executor)
    assert fut1.done(), where  # the second waited for it before staging into the same buffers
    _clobber(second)
    fut1.result(timeout=60)
    fut2.result(timeout=60)
    assert writer.staging.allocations == 1, where
    # a plain dcp.save through the writer while an async save runs waits for it too
    third, _ = big_state(mesh, 3, destination=False)
    fourth, _ = big_state(mesh, 4, destination=False)
    fut3 = _start(third, writer, checkpoint_id=os.path.join(base, "three"), planner=SlowPlanner(delay=1.0), executor=executor)
    assert not fut3.done(), where
    dcp.save(fourth, storage_writer=writer, checkpoint_id=os.path.join(base, "four"), planner=ShardSavePlanner())
    assert fut3.done(), where
    fut3.result(timeout=60)
    dist.barrier()
    for n, name in enumerate(["one", "two", "three", "four"], start=1):
        _load(os.path.join(base, name), mesh, n, f"{where} {name} of overlapping saves", builder=big_state)


def training_loop_job(rank: int, world: int, base: str, executor: AsyncCheckpointerType) -> None:
    """Five steps, each saving without waiting for the previous save (the writer waits before it
    stages into the same buffers) and changing the tensors right after: no stale values."""
    mesh = init_device_mesh("cpu", (world,))
    where = f"{executor.value} rank {rank}"
    writer = ShardWriter(os.path.join(base, "default"))
    sd, _ = big_state(mesh, 1, destination=False)
    futures, ptrs = [], []
    for step in range(1, 6):
        _refill(sd, mesh, step)  # the step's update, in place
        fut = _start(sd, writer, checkpoint_id=os.path.join(base, f"step{step}"), planner=SlowPlanner(delay=0.3),
                     executor=executor)
        assert all(f.done() for f in futures), where  # the previous save finished before this one staged
        _clobber(sd)  # training goes on while the save writes
        futures.append(fut)
        ptrs.append(writer.staging.data_ptrs())
    for fut in futures:
        fut.result(timeout=60)
    # (process: torch moves the buffers into shared memory while it sends save 1, so from save 2 on)
    assert writer.staging.allocations == 1 and all(p == ptrs[1] for p in ptrs[1:]), (where, ptrs)
    writer.close()
    assert writer.staging.nbytes == 0, where
    dist.barrier()
    for step in range(1, 6):
        _load(os.path.join(base, f"step{step}"), mesh, step, f"{where} step {step}", builder=big_state)


def _raises_previous_failure(sd: dict, writer: ShardWriter, path: str, executor: AsyncCheckpointerType, cause: str):
    """The next save through ``writer`` raises the earlier background failure, naming ``path``."""
    with pytest.raises(CheckpointError, match="failed in the background") as info:
        _start(sd, writer, executor=executor)
    assert path in str(info.value), str(info.value)
    assert isinstance(info.value.__cause__, CheckpointException), repr(info.value.__cause__)
    assert cause in str(info.value.__cause__), str(info.value.__cause__)


def failure_job(rank: int, world: int, base: str, executor: AsyncCheckpointerType) -> None:
    mesh = init_device_mesh("cpu", (world,))
    where = f"{executor.value} rank {rank}"
    path = os.path.join(base, "ckpt")
    writer = ShardWriter(path)
    sd, _ = build(mesh, 1, destination=False)
    _start(sd, writer, executor=executor).result(timeout=60)

    # 1. a planner raising mid-write on the last rank: raised at .result() on every rank ...
    sd, _ = build(mesh, 2, destination=False)
    fut = _start(sd, writer, planner=FailingPlanner(fail_rank=world - 1), executor=executor)
    with pytest.raises(CheckpointException, match="injected failure"):
        fut.result(timeout=60)
    dist.barrier()
    _load(path, mesh, 1, f"{where} previous checkpoint after a failed async save")
    # ... and again at the next save through the writer, which then starts nothing
    _raises_previous_failure(sd, writer, path, executor, "injected failure")

    # 2. a failure nobody asked .result() for: overwrite=False refusing the directory
    refusing = ShardWriter(path, overwrite=False)
    _start(sd, refusing, executor=executor)
    _raises_previous_failure(sd, refusing, path, executor, "Checkpoint already exists")
    dist.barrier()
    _load(path, mesh, 1, f"{where} previous checkpoint after a refused async save")

    # 3. the writer saves again; the failed save's half-written files are gone
    sd, _ = build(mesh, 3, destination=False)
    _start(sd, writer, executor=executor).result(timeout=60)
    dist.barrier()
    _load(path, mesh, 3, f"{where} after recovering")
    reader = ShardReader(path, cache_metadata=False)
    reader.read_metadata()
    on_disk = {name for name in os.listdir(path) if is_data_file(name)}
    assert on_disk == {item.relative_path for item in reader.catalog.items.values()}, (where, on_disk)

    # 4. a failed save into a new step directory: the failure reported at the next save (a
    # plain dcp.save through the writer) removes the directory it made; it stayed until
    # writer.close()
    step = os.path.join(base, "step9")
    fut = _start(sd, writer, checkpoint_id=step, planner=FailingPlanner(fail_rank=world - 1), executor=executor)
    with pytest.raises(CheckpointException, match="injected failure"):
        fut.result(timeout=60)
    dist.barrier()
    with pytest.raises(CheckpointError, match="failed in the background"):
        dcp.save(sd, storage_writer=writer, planner=ShardSavePlanner(), checkpoint_id=os.path.join(base, "step10"))
    if executor == AsyncCheckpointerType.PROCESS:  # the failed save is tracked in DCP's checkpoint
        dist.barrier()  # process (README): its next save there removes what it left
        _start(sd, writer, checkpoint_id=path, executor=executor).result(timeout=60)
    dist.barrier()
    assert sorted(os.listdir(base)) == ["ckpt"], (where, os.listdir(base))


def _sharded_tensor(rank: int, world: int, value: float) -> ShardedTensor:
    """A (2 * world, 3) ShardedTensor: two rows per rank, all ``value``."""
    meta = ShardMetadata(shard_offsets=[2 * rank, 0], shard_sizes=[2, 3], placement=f"rank:{rank}/cpu")
    return init_from_local_shards([STShard(torch.full((2, 3), value), meta)], [2 * world, 3])


def sharded_tensor_job(rank: int, world: int, base: str) -> None:
    writer = ShardWriter(base)
    ptrs = []
    for value in (1.0, 2.0, 3.0):
        sd = {"st": _sharded_tensor(rank, world, value)}
        fut = _start(sd, writer)
        sd["st"].local_shards()[0].tensor.fill_(-1.0)
        fut.result(timeout=60)
        ptrs.append(writer.staging.data_ptrs())
    assert writer.staging.allocations == 1 and ptrs[0] == ptrs[1] == ptrs[2], ptrs
    dest = {"st": _sharded_tensor(rank, world, 0.0)}
    dist.barrier()
    dcp.load(dest, storage_reader=ShardReader(base), planner=ShardLoadPlanner())
    assert_state_dict_equal(dest["st"].local_shards()[0].tensor, torch.full((2, 3), 3.0), f"rank {rank} st")


@pytest.mark.mp
def test_sharded_tensor_staging_is_reused(tmp_path):
    run_job(sharded_tensor_job, 2, str(tmp_path))


@pytest.mark.mp
@pytest.mark.parametrize("executor", EXECUTORS, ids=lambda e: e.value)
@pytest.mark.parametrize(
    "job", [reuse_job, overlap_job, training_loop_job, failure_job], ids=["reuse", "overlap", "training-loop", "failure"]
)
def test_async_save_through_one_writer(tmp_path, job, executor):
    run_job(job, 2, str(tmp_path), executor)


def explicit_stager_job(rank: int, world: int, base: str, async_staging: bool) -> None:
    """Three overlapping async saves through one writer with DCP's own stager: each lands in
    its own directory with its own values (the writer, not its stager role, serializes)."""
    mesh = init_device_mesh("cpu", (world,))
    where = f"rank {rank} async_staging={async_staging}"
    writer = ShardWriter(os.path.join(base, "default"))
    stager = DefaultStager(StagingOptions(False, False, async_staging, False))
    uploads = []
    for seed in (1, 2, 3):
        sd, _ = big_state(mesh, seed, destination=False)
        planner = SlowPlanner(delay=1.0) if seed == 1 else ShardSavePlanner()  # the others start meanwhile
        response = dcp.async_save(sd, storage_writer=writer, planner=planner, async_stager=stager,
                                  checkpoint_id=os.path.join(base, f"s{seed}"))
        if isinstance(response, AsyncSaveResponse):
            response.staging_completion.result(timeout=60)
            response = response.upload_completion
        _clobber(sd)
        uploads.append(response)
    assert not uploads[0].done(), where  # they did overlap
    for upload in uploads:
        upload.result(timeout=60)
    stager.close()
    dist.barrier()
    for seed in (1, 2, 3):
        _load(os.path.join(base, f"s{seed}"), mesh, seed, f"{where} save {seed}", builder=big_state)


@pytest.mark.mp
@pytest.mark.parametrize("world, async_staging", [(1, False), (2, False), (2, True)], ids=["1-sync", "2-sync", "2-async"])
def test_explicit_stager_saves_one_at_a_time(tmp_path, world, async_staging):
    run_job(explicit_stager_job, world, str(tmp_path), async_staging, timeout=90)


class LateState(Stateful):
    """Holds the upload thread of the save it is in back for ``delay`` seconds before that
    thread reaches the storage writer: DCP turns a top-level ``Stateful`` into its state dict
    in ``dcp.async_save``'s caller (here: itself, so the staged copy is one too) and again at
    the start of ``dcp.save`` in the upload thread, before any writer call when no
    ``checkpoint_id`` is given."""

    def __init__(self, delay: float):
        self.delay = delay
        self.caller = threading.get_ident()

    def state_dict(self):
        if threading.get_ident() == self.caller:
            return self
        time.sleep(self.delay)
        return {"late": torch.zeros(4)}

    def load_state_dict(self, state_dict) -> None:
        raise AssertionError("never loaded")


DIRECT_STEPS = 8


def direct_saves_in_call_order_job(rank: int, world: int, base: str) -> tuple[list[str], list[int]]:
    """Direct ``dcp.async_save`` calls through one writer per rank, none awaited, into one
    directory; rank 1's first upload thread reaches the writer 1 s late, and step 3 fails
    on rank 0 mid-write. The coordinator copies the directory after each commit."""
    root = os.path.join(base, "ckpt")
    commits: list[str] = []

    def snapshot(report) -> None:  # on the coordinator's upload thread, right after its commit
        if report.is_coordinator:
            commits.append(shutil.copytree(root, os.path.join(base, f"commit{len(commits)}")))

    writer = ShardWriter(root, on_report=snapshot)
    group = dist.new_group(backend="gloo")
    futures = []
    for step in range(DIRECT_STEPS):
        sd = {f"r{rank}": torch.full((64,), float(step))}
        if rank == 0:
            sd["w"] = torch.full((8,), float(step))  # FailingPlanner's key
        if rank == 1 and step == 0:
            sd["held_back"] = LateState(delay=1.0)
        planner = FailingPlanner(fail_rank=0) if step == 3 else ShardSavePlanner()
        futures.append(dcp.async_save(sd, storage_writer=writer, planner=planner, process_group=group))
    failed = [step for step, future in enumerate(futures) if _failed_with(future, "injected failure")]
    return commits, failed


def _failed_with(future: Future, message: str) -> bool:
    """Whether the save failed with ``message`` (any other failure is raised)."""
    try:
        future.result(timeout=60)
    except CheckpointException as exc:
        if message not in str(exc):
            raise
        return True
    return False


@pytest.mark.mp
def test_direct_async_saves_run_in_call_order_on_every_rank(tmp_path):
    """Each rank used to take its waiting saves in the order their upload threads reached the
    writer: rank 1 ran its step 1 with rank 0's step 0 and committed the mix."""
    (commits, failed), (_, failed_on_1) = run_job(direct_saves_in_call_order_job, 2, str(tmp_path))
    assert failed == failed_on_1 == [3], (failed, failed_on_1)  # on every rank; the later saves went on
    steps = [step for step in range(DIRECT_STEPS) if step not in failed]
    assert len(commits) == len(steps), commits
    for step, path in zip(steps, commits):
        expected = {name: torch.full(size, float(step)) for name, size in [("r0", (64,)), ("w", (8,)), ("r1", (64,))]}
        loaded = {name: garbage_like(value) for name, value in expected.items()}
        dcp.load(loaded, storage_reader=ShardReader(path), planner=ShardLoadPlanner(), no_dist=True)
        assert_state_dict_equal(loaded, expected, f"commit of step {step}")


class ThreadPerSaveStager(AsyncStager):
    """Stages each save on a thread of its own; the staging of save number ``n`` (from 1)
    waits for ``hold[n]`` first: set once another save's upload thread has taken its turn at
    the storage writer (``ArrivalWriter.arrived``), so that each rank's arrival order is
    certain. A delay (0.5 s after the second staging) was not enough on a loaded machine,
    nor was leaving one rank's order to its threads (its second save reached the writer
    first now and then, and the ranks' orders agreed)."""

    _synchronize_after_execute = False

    def __init__(self, hold: dict[int, threading.Event]):
        self.calls = 0
        self.hold = hold

    def stage(self, state_dict):
        self.calls += 1
        wait_for, staged = self.hold.get(self.calls), concurrent.futures.Future()

        def copy() -> None:
            if wait_for is not None:
                assert wait_for.wait(timeout=60)
            staged.set_result(BlockingAsyncStager().stage(state_dict))

        threading.Thread(target=copy).start()
        return staged


class ArrivalWriter(ShardWriter):
    """Sets ``arrived[name]`` once a save into directory ``name`` holds its turn (``reset``
    waits for it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.arrived = {name: threading.Event() for name in ("step0", "step1")}

    def reset(self, checkpoint_id=None):
        super().reset(checkpoint_id)
        if checkpoint_id is not None and os.path.basename(os.fspath(checkpoint_id)) in self.arrived:
            self.arrived[os.path.basename(os.fspath(checkpoint_id))].set()


def mismatched_pairing_job(rank: int, world: int, base: str) -> list[str | None]:
    """Two direct saves with another stager, not awaited, a directory each: rank 0's second
    is staged after its first reached the writer, rank 1's first after its second did. Then
    a third, awaited."""
    writer = ArrivalWriter(base)
    group = dist.new_group(backend="gloo")
    hold = {2: writer.arrived["step0"]} if rank == 0 else {1: writer.arrived["step1"]}
    stager = ThreadPerSaveStager(hold)
    uploads = []
    for step in range(3):
        if step == 2:
            concurrent.futures.wait(uploads)
        # a replicated key too: the saves paired, its copies differ (reported as a replica mismatch before)
        sd = {f"r{rank}": torch.full((64,), float(step)), "shared": torch.full((8,), float(step))}
        response = dcp.async_save(sd, storage_writer=writer, planner=ShardSavePlanner(), process_group=group,
                                  async_stager=stager, checkpoint_id=os.path.join(base, f"step{step}"))
        uploads.append(response.upload_completion)
    return [None if upload.exception(timeout=60) is None else str(upload.exception()) for upload in uploads]


@pytest.mark.mp
def test_ranks_pairing_different_saves_are_refused(tmp_path):
    """Where the writer cannot know the call order, a pairing of different saves fails on
    every rank before anything is written (rank 1 used to write its step 1 into step0/)."""
    for rank, errors in enumerate(run_job(mismatched_pairing_job, 2, str(tmp_path))):
        for step in (0, 1):  # save k: rank 0's step k with rank 1's step 1 - k
            k = step if rank == 0 else 1 - step
            paired = f"(rank 0: its save #{k}, into {tmp_path / f'step{k}'}; rank 1: its save #{k}, into {tmp_path / f'step{1 - k}'})"
            assert errors[step] is not None and "the ranks paired different saves in one dcp.save " + paired in errors[step], errors[step]
            assert not (tmp_path / f"step{step}" / ".metadata").exists(), step
        assert errors[2] is None, (rank, errors)
    expected = {name: torch.full((64,), 2.0) for name in ("r0", "r1")} | {"shared": torch.full((8,), 2.0)}
    loaded = {name: garbage_like(value) for name, value in expected.items()}
    dcp.load(loaded, storage_reader=ShardReader(tmp_path / "step2"), planner=ShardLoadPlanner(), no_dist=True)
    assert_state_dict_equal(loaded, expected, "step 2")


def sub_group_then_job_saves(rank: int, world: int, base: str) -> None:
    """One writer per rank: rank 0 alone saves through it (a sub-group, then no_dist), then
    every rank saves (plain and async) into a directory each."""
    writer = ShardWriter(base)
    solo = dist.new_group([0])
    if rank == 0:
        dcp.save({"extra": torch.ones(4)}, storage_writer=writer, planner=ShardSavePlanner(), process_group=solo,
                 checkpoint_id=os.path.join(base, "extra"))
        dcp.save({"alone": torch.ones(4)}, storage_writer=writer, planner=ShardSavePlanner(), no_dist=True,
                 checkpoint_id=os.path.join(base, "alone"))
    for step in range(3):
        sd = {f"r{rank}": torch.full((64,), float(step))}
        path = os.path.join(base, f"step{step}")
        if step == 1:
            writer.async_save(sd, planner=ShardSavePlanner(), checkpoint_id=path).result(timeout=60)
        else:
            dcp.save(sd, storage_writer=writer, planner=ShardSavePlanner(), checkpoint_id=path)


@pytest.mark.mp
def test_saves_through_one_writer_on_a_sub_group_leave_later_job_saves_paired(tmp_path):
    """Saves are numbered per process group: rank 0's saves on its own had every later
    save of the whole job refused, for good ("the ranks paired different saves"). Stock
    saves them."""
    run_job(sub_group_then_job_saves, 2, str(tmp_path))
    for step in range(3):
        expected = {name: torch.full((64,), float(step)) for name in ("r0", "r1")}
        loaded = {name: garbage_like(value) for name, value in expected.items()}
        dcp.load(loaded, storage_reader=ShardReader(tmp_path / f"step{step}"), planner=ShardLoadPlanner(), no_dist=True)
        assert_state_dict_equal(loaded, expected, f"step {step}")


# -- without a process group ------------------------------------------------------------------


def test_writer_is_its_own_stager_and_pickles_without_buffers(tmp_path):
    writer = ShardWriter(tmp_path)
    assert isinstance(writer, AsyncStager) and not writer.should_synchronize_after_execute
    _start(sample_state(1), writer).result(timeout=60)
    copy = pickle.loads(pickle.dumps(writer))  # what the process executor sends
    assert writer.staging.nbytes > 0 and copy.staging.nbytes == 0 and copy.staging.reuse
    assert copy.location.url == writer.location.url
    assert not pickle.loads(pickle.dumps(ShardWriter(tmp_path, reuse_staging=False))).staging.reuse


def report_to_module_function(report) -> None:  # picklable: travels to the checkpoint process
    pass


def test_an_on_report_that_cannot_travel_to_the_checkpoint_process_is_dropped_with_a_warning(tmp_path):
    """The process executor pickles the writer: a lambda failed the whole save."""
    kept = pickle.loads(pickle.dumps(ShardWriter(tmp_path, on_report=report_to_module_function)))
    assert kept.on_report is report_to_module_function
    with pytest.warns(UserWarning, match=r"ShardWriter\(on_report=.*lambda.*\) cannot be pickled into DCP's checkpoint process"):
        dropped = pickle.loads(pickle.dumps(ShardWriter(tmp_path, on_report=lambda report: None)))
    assert dropped.on_report is None


def pickle_planner_with_group_job(rank: int, world: int) -> None:
    ShardSavePlanner(group=dist.group.WORLD)  # usable in this process
    with pytest.raises(InvalidRequestError, match=r"ShardSavePlanner\(group=\.\.\.\) cannot go to DCP's checkpoint process"):
        pickle.dumps(ShardSavePlanner(group=dist.group.WORLD))
    pickle.loads(pickle.dumps(ShardSavePlanner()))


@pytest.mark.mp
def test_a_planner_with_a_group_is_refused_by_name_for_the_checkpoint_process(tmp_path):
    """Was a bare "cannot pickle ProcessGroup" from DCP's pipe on every rank."""
    run_job(pickle_planner_with_group_job, 1)


def test_direct_dcp_async_save_is_refused_with_reuse_staging_true(tmp_path):
    """dcp.async_save keeps its future from the writer, which then cannot know when a reused
    copy is free: reuse_staging=True refuses it before anything is staged or written."""
    writer = ShardWriter(tmp_path, reuse_staging=True)
    with pytest.raises(InvalidRequestError, match=r"reuse_staging=True.*writer\.async_save"):
        dcp.async_save(sample_state(1), storage_writer=writer, planner=ShardSavePlanner())
    with pytest.raises(InvalidRequestError, match="reuse_staging=True"):
        writer.stage(sample_state(1))
    assert writer.staging.allocations == 0 and os.listdir(tmp_path) == []
    with pytest.raises(InvalidRequestError, match="reuse_staging must be None, True or False, got 1"):
        ShardWriter(tmp_path, reuse_staging=1)


def another_stager_job(rank: int, world: int, path: str, executor: AsyncCheckpointerType) -> None:
    writer = ShardWriter(path, reuse_staging=True)
    for stager in (BlockingAsyncStager(), DefaultStager(StagingOptions(False, False, False, False))):
        future = dcp.async_save(sample_state(1), storage_writer=writer, planner=ShardSavePlanner(),
                                async_stager=stager, async_checkpointer_type=executor)
        with pytest.raises((CheckpointException, InvalidRequestError)) as info:
            future.result(timeout=120)
        error = info.value.failures[rank][0] if isinstance(info.value, CheckpointException) else info.value
        assert isinstance(error, InvalidRequestError) and "staged by another stager" in str(error), error
        stager.close()
    assert not any(is_data_file(n) for n in os.listdir(path))  # refused before a byte is written
    for seed in (2, 3):  # the writer's own async saves go on reusing its memory
        _start(sample_state(seed), writer, executor=executor).result(timeout=120)
    assert writer.staging.allocations == 1
    writer.close()
    assert_state_dict_equal(load(sample_state(3), path)[0], sample_state(3))


@pytest.mark.mp
@pytest.mark.parametrize("executor", EXECUTORS, ids=lambda e: e.value)
def test_reuse_staging_true_refuses_a_save_another_stager_staged(tmp_path, executor):
    """``dcp.async_save(storage_writer=writer, async_stager=...)`` stages with that stager and
    never calls the writer's: ``reuse_staging=True`` took no effect, silently. The upload
    now fails naming it (where DCP first hands the save to the writer: its thread
    executor's save, or the pickling into its checkpoint process)."""
    run_job(another_stager_job, 1, str(tmp_path), executor)


@pytest.mark.parametrize(
    "reuse_staging, start",
    [(False, "writer.async_save"), (False, "dcp.async_save"), (None, "dcp.async_save")],
    ids=["off-writer", "off-direct", "default-direct"],
)
def test_saves_the_writer_cannot_track_keep_no_memory(tmp_path, reuse_staging, start):
    """Each save is staged into new memory the writer does not hold; values are the staged ones."""
    writer = ShardWriter(tmp_path, reuse_staging=reuse_staging)
    for seed in (1, 2):
        state = sample_state(seed)
        if start == "writer.async_save":
            fut = _start(state, writer)
        else:
            fut = dcp.async_save(state, storage_writer=writer, planner=ShardSavePlanner())
            assert isinstance(fut, Future), type(fut)
        state["w"].copy_(torch.full_like(state["w"], float("nan")))
        fut.result(timeout=60)
        assert_state_dict_equal(load(sample_state(seed), tmp_path)[0], sample_state(seed))
    assert writer.staging.allocations == 2 and writer.staging.nbytes == 0
    writer.close()


def test_plain_saves_in_a_row_on_one_thread_are_each_a_new_save(tmp_path):
    """The writer tells a save's later begin calls from the next save's first one on the same
    thread: each commit gets its own save id, and the thread never waits for itself."""
    writer = ShardWriter(tmp_path)
    save_ids = []
    for seed, checkpoint_id in ((1, None), (2, tmp_path), (3, None)):
        dcp.save(sample_state(seed), storage_writer=writer, planner=ShardSavePlanner(), checkpoint_id=checkpoint_id)
        reader = ShardReader(tmp_path, cache_metadata=False)
        save_ids.append(reader.read_metadata().storage_meta.save_id)
        assert_state_dict_equal(load(sample_state(seed), tmp_path)[0], sample_state(seed))
    assert len(set(save_ids)) == 3 and writer.save_id == save_ids[-1], save_ids


@pytest.mark.timeout(120)
def test_a_plain_save_after_an_unawaited_async_one_runs_after_it(tmp_path):
    """Plain save, direct async save not awaited (its upload thread held back), plain save,
    on one thread: each waited for the other forever (the first plain save's turn looked
    unfinished, its thread being inside dcp.save again). Found reviewing the turns."""
    writer = ShardWriter(tmp_path)
    dcp.save(sample_state(1), storage_writer=writer, planner=ShardSavePlanner())
    future = dcp.async_save({"late": LateState(0.3)}, storage_writer=writer, planner=ShardSavePlanner())
    dcp.save(sample_state(3), storage_writer=writer, planner=ShardSavePlanner())
    future.result(timeout=60)
    assert_state_dict_equal(load(sample_state(3), tmp_path)[0], sample_state(3))  # call order: the async one first
    writer.close()


@pytest.mark.timeout(120)
class LateUploadWriter(ShardWriter):
    """A writer whose async uploads reach their set-up late, as a busy machine schedules them."""

    def set_up_storage_writer(self, *args, **kwargs) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)
        super().set_up_storage_writer(*args, **kwargs)


@pytest.mark.parametrize("named_by", ["writer", "checkpoint_id"])
def test_saves_into_one_directory_through_two_writers_run_one_at_a_time(tmp_path, named_by):
    """An async save through one writer, then a plain save through a new writer for the same
    directory (a ``ShardWriter(path)`` per save): the second waits until the first has left
    ``dcp.save``. They ran at once, each removing the other's files as a dead save's: both
    reported success while the directory lost every checkpoint (found by the crash sweep,
    3 times in 40 tries). Then, when the async save's thread came late, the plain save ran
    first and the directory ended with the older state (CI, once in six runs on a busy machine)."""
    ended: dict[str, float] = {}

    def slow_report(report) -> None:  # runs inside the first save's dcp.save, after its commit
        time.sleep(0.5)
        ended["first"] = time.monotonic()

    if named_by == "writer":
        first = dcp.async_save(sample_state(1), storage_writer=LateUploadWriter(tmp_path, on_report=slow_report),
                               planner=ShardSavePlanner())
    else:  # the directory is the async save's checkpoint_id, not its writer's
        first = dcp.async_save(sample_state(1), checkpoint_id=tmp_path, planner=ShardSavePlanner(),
                               storage_writer=LateUploadWriter(tmp_path / "elsewhere", on_report=slow_report))
    second = ShardWriter(tmp_path, on_report=lambda report: ended.setdefault("second", time.monotonic()))
    dcp.save(sample_state(2), storage_writer=second, planner=ShardSavePlanner())
    first.result(timeout=60)
    assert ended["second"] > ended["first"]
    assert_state_dict_equal(load(sample_state(2), tmp_path)[0], sample_state(2))  # call order: the plain one last
    assert verify_checkpoint(str(tmp_path)).ok


EXIT_WITHOUT_WAITING = """
import sys, warnings
import torch, torch.distributed.checkpoint as dcp
from dcp_ext import ShardSavePlanner, ShardWriter
warnings.filterwarnings("ignore")
state = {"w": torch.arange(100_000, dtype=torch.float32), "b": torch.ones(3, 5)}
if sys.argv[2] == "direct":
    dcp.async_save(state, storage_writer=ShardWriter(sys.argv[1], thread_count=2), planner=ShardSavePlanner())
else:
    ShardWriter(sys.argv[1], thread_count=2).async_save(state, planner=ShardSavePlanner())
"""  # the end of a training script: no .result()


@pytest.mark.mp
@pytest.mark.parametrize("how", ["direct", "writer.async_save"])
def test_an_async_save_nobody_waits_for_is_finished_at_exit(tmp_path, how):
    """Python joins DCP's save thread at exit, as it does for stock's FileSystemWriter; our
    writer threads came from concurrent.futures, which refuses new work by then: the save
    was dropped silently (rc 0, no checkpoint)."""
    result = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_WAITING, str(tmp_path / "ckpt"), how],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    load_tensors(tmp_path / "ckpt", {"w": torch.arange(100_000, dtype=torch.float32), "b": torch.ones(3, 5)})


def test_close_waits_and_raises_an_unreported_failure(tmp_path):
    save(sample_state(1), tmp_path)
    writer = ShardWriter(tmp_path, overwrite=False)
    _start(sample_state(2), writer)
    with pytest.raises(CheckpointError, match="failed in the background"):
        writer.close()
    assert writer.staging.nbytes == 0
    writer.close()  # reported once
    assert_state_dict_equal(load(sample_state(1), tmp_path)[0], sample_state(1))
