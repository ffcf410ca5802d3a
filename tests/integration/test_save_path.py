"""The synchronous save path: each data file goes to disk while it is still being written
(early writeback), records are flushed once per file, and what lands reads back bit-exact
through our reader, through stock DCP's and through ``verify_checkpoint``."""

from __future__ import annotations

import io
import os
import pickle
import re
import subprocess
import sys
import threading

import crc32c
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.errors import ChecksumMismatchError, InvalidRequestError
from dcp_ext.formats.index import INDEX_NAME
from dcp_ext.formats.torch_record import WRITE_PIECE, RecordSink, parse_tensor_record, write_device_tensor, write_tensor
from dcp_ext.storage.device_staging import HostCopies
from dcp_ext.storage.verify import verify_checkpoint
from dcp_ext.storage.commit import TEMP_FILE
from dcp_ext.storage import page_cache
from dcp_ext.storage.cleanup import file_system_type
from dcp_ext.storage.location import Location
from dcp_ext.storage.writeback import WRITEBACK_BYTES, EarlyWriteback, PendingSyncs, early_writeback

from mp import run_job
from support import assert_state_dict_equal, garbage_like, load, load_error, save

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BIG_ROWS = 2048  # global rows of each large tensor: 2048 x 4096 fp32 = 32 MiB, 16 MiB per rank


def _globals() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    state = {f"big.{i}": torch.randn(BIG_ROWS, 4096, generator=g) for i in range(3)}
    state |= {f"small.{i}": torch.randn(17 + i, generator=g).to(torch.bfloat16) for i in range(40)}
    return state


def _state(full: dict[str, torch.Tensor], fill_garbage: bool) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (2,))
    out: dict[str, torch.Tensor] = {}
    for name, value in full.items():
        if name.startswith("big."):
            out[name] = distribute_tensor(value, mesh, [Shard(0)])
            if fill_garbage:
                out[name].to_local().copy_(garbage_like(out[name].to_local()))
        else:  # replicated plain tensors: one rank writes each
            out[name] = garbage_like(value) if fill_garbage else value.clone()
    return out


def _locals(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}


def _save_then_load(rank: int, world: int, path: str) -> list[int]:
    full = _globals()
    # one file per rank holding more than one writeback stretch
    dcp.save(_state(full, False), storage_writer=ShardWriter(path, thread_count=1, sync_files=True))
    want = _locals(_state(full, False))
    ours = _state(full, True)
    dcp.load(ours, storage_reader=ShardReader(path, cache_metadata=False), planner=ShardLoadPlanner())
    assert_state_dict_equal(_locals(ours), want)
    stock = _state(full, True)
    dcp.load(stock, storage_reader=dcp.FileSystemReader(path))
    assert_state_dict_equal(_locals(stock), want)
    return sorted(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))


@pytest.mark.mp
def test_files_written_back_early_read_bit_exact(tmp_path):
    path = str(tmp_path / "ckpt")
    sizes = run_job(_save_then_load, 2, path)[0]
    assert len(sizes) == 2 and min(sizes) > WRITEBACK_BYTES, sizes  # each file crossed a stretch
    report = verify_checkpoint(path)
    assert report.ok and report.faults == [] and report.items_without_checksum == 0, report


def _sync_events(path: str) -> list[tuple[str, str, str]]:
    """(event, file name, thread) of this process's re-opens for an fsync (``os.open``
    read-only) and renames under ``path``, from Python's audit hooks: no call is replaced."""
    events: list[tuple[str, str, str]] = []

    def hook(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], str) and args[0].startswith(path) and (
            args[0].endswith(".distcp") or TEMP_FILE.match(os.path.basename(args[0]))
        ) and args[1] is None and args[2] & os.O_ACCMODE == os.O_RDONLY:  # os.open, read-only
            events.append(("fsync-open", os.path.basename(args[0]), threading.current_thread().name))
        elif event == "os.rename" and str(args[0]).startswith(path):
            events.append(("rename", os.path.basename(str(args[1])), threading.current_thread().name))

    sys.addaudithook(hook)  # a worker process of its own: the hook goes with it
    return events


def _sync_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dcp_ext-sync")]


def _save_watching_syncs(rank: int, world: int, path: str) -> tuple[list[tuple[str, str, str]], list[str], list[str]]:
    events = _sync_events(path)
    full = _globals()
    dcp.save(_state(full, False), storage_writer=ShardWriter(path, thread_count=2))
    during_save, alive = list(events), _sync_threads()  # the load below opens the files too
    mine = sorted(f for f in os.listdir(path) if f.startswith(f"__{rank}_") and f.endswith(".distcp"))
    ours = _state(full, True)
    dcp.load(ours, storage_reader=ShardReader(path, cache_metadata=False), planner=ShardLoadPlanner())
    assert_state_dict_equal(_locals(ours), _locals(_state(full, False)))
    return during_save, mine, alive


@pytest.mark.mp
def test_the_coordinator_syncs_its_files_while_it_encodes_and_before_it_commits(tmp_path):
    """The coordinator's data files get their fsync on threads of their own once written
    (``PendingSyncs``), which run while DCP gathers the results and the metadata is encoded,
    and are awaited before ``.metadata`` names the files; the commit's temporary files are
    synced at once, beside them (one journal commit on ext4); every other rank's files are
    synced by the thread that wrote them before its ``write_data`` returns (nothing later
    would tell the coordinator they are durable). No sync thread outlives ``dcp.save``."""
    path = str(tmp_path / "ckpt")
    (events0, files0, alive0), (events1, files1, alive1) = run_job(_save_watching_syncs, 2, path)
    assert len(files0) == 2 and len(files1) == 2, (files0, files1)
    synced = [(name, thread) for kind, name, thread in events0 if kind == "fsync-open"]
    assert sorted(name for name, _ in synced if name.endswith(".distcp")) == files0, events0
    # the index, .metadata and marker written to temporary names are synced at once too
    assert sorted(TEMP_FILE.match(name).group(1) for name, _ in synced if not name.endswith(".distcp")) == [
        "dcp_ext_commit", "dcp_ext_index.parquet", "metadata"], events0
    assert all(thread.startswith("dcp_ext-sync") for _, thread in synced), synced
    renames = [name for kind, name, _ in events0 if kind == "rename"]
    assert ".metadata" in renames, events0
    last_sync = max(i for i, e in enumerate(events0) if e[0] == "fsync-open")
    assert last_sync < next(i for i, e in enumerate(events0) if e[:2] == ("rename", ".metadata")), events0
    assert [e for e in events1 if e[0] == "fsync-open"] == [], events1  # synced as written, not re-opened
    assert alive0 == [] and alive1 == [], (alive0, alive1)


class _FailsOnRankOne(ShardSavePlanner):
    """Rank 1's writes fail at their first item: rank 0 has written its files by then, and
    DCP skips the coordinator's ``finish``."""

    def resolve_data(self, write_item):
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1 cannot produce its data")
        return super().resolve_data(write_item)


def _failed_save_then_next(rank: int, world: int, path: str, close_first: bool) -> list[str]:
    full = _globals()
    writer = ShardWriter(path, thread_count=2)
    with pytest.raises(CheckpointException, match="rank 1 cannot produce its data"):
        dcp.save(_state(full, False), storage_writer=writer, planner=_FailsOnRankOne())
    if close_first:
        writer.close()  # waits for the failed save's syncs and removes its files
        assert _sync_threads() == []
        dist.barrier()
        assert not os.path.exists(path)  # the failed save's files and the directory it made
    dcp.save(_state(full, False), storage_writer=writer, planner=ShardSavePlanner())
    ours = _state(full, True)
    dcp.load(ours, storage_reader=ShardReader(path, cache_metadata=False), planner=ShardLoadPlanner())
    assert_state_dict_equal(_locals(ours), _locals(_state(full, False)))
    return _sync_threads()


@pytest.mark.mp
@pytest.mark.parametrize("close_first", [True, False])
def test_a_save_whose_finish_dcp_skipped_leaves_no_sync_running(tmp_path, close_first):
    """Another rank's failed write: DCP never calls the coordinator's ``finish``, which
    would have awaited its files' syncs. ``close()`` or the writer's next save does (their
    failures, on files of a failed save, are not raised); the next save commits and loads
    bit-exact from garbage."""
    assert run_job(_failed_save_then_next, 2, str(tmp_path / "ckpt"), close_first) == [[], []]


def test_sync_file_leaves_a_missing_file_to_the_commit(tmp_path):
    """A data file removed before its deferred fsync (another save into the directory took
    it for a dead save's) is reported by the commit's listing, which says what happened
    (``test_load.py::test_a_save_whose_files_another_job_removed_fails_and_the_other_stays``),
    not as a failed fsync."""
    location = Location(str(tmp_path))
    location.sync_file("__0_gone_0.distcp")
    (tmp_path / "here.distcp").write_bytes(b"x" * 100)
    location.sync_file("here.distcp")
    assert (tmp_path / "here.distcp").read_bytes() == b"x" * 100


def test_pending_syncs_stay_in_the_process_that_started_them(tmp_path):
    """A writer pickled into DCP's checkpoint process (``AsyncCheckpointerType.PROCESS``)
    while syncs of its last save still run carries none of them."""
    (tmp_path / "a.distcp").write_bytes(b"a" * 4096)
    pending = PendingSyncs(Location(str(tmp_path)), ["a.distcp"])
    try:
        assert pickle.loads(pickle.dumps(pending)) is None
    finally:
        pending.wait()
    assert _sync_threads() == []


def test_early_writeback_queues_each_stretch_once(tmp_path):
    target = tmp_path / "file"
    pieces = [bytes([n]) * size for n, size in enumerate((1000, 5000, 100, 3000, 9000), start=1)]
    with open(target, "wb", buffering=1 << 20) as out:
        writeback = EarlyWriteback(out, stretch=4096)
        queued = []
        for piece in pieces:
            assert writeback.write(piece) == len(piece)
            queued.append(writeback.started)
    assert queued == [0, 6000, 6000, 6000, 18100]  # queued once 4096 bytes are pending
    assert target.read_bytes() == b"".join(pieces)


def test_a_save_leaves_its_data_files_in_the_page_cache(tmp_path):
    # early writeback must not evict: a load right after the save reads memory, not the disk
    # again (with posix_fadvise(DONTNEED) about half of each file's pages were dropped here)
    g = torch.Generator().manual_seed(3)
    state = {f"t.{i}": torch.randn(1 << 20, generator=g) for i in range(24)}  # 96 MiB in two files
    save(state, tmp_path, thread_count=2)
    files = sorted(tmp_path.glob("*.distcp"))
    assert len(files) == 2 and min(f.stat().st_size for f in files) > 4 * WRITEBACK_BYTES
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            held = page_cache.cached(fd, 0, file.stat().st_size)
        finally:
            os.close(fd)
        if held is None:
            pytest.skip("needs cachestat(2) (Linux 6.5+) to ask the page cache")
        assert held, f"{file.name}: pages left the page cache"
    out, _ = load(state, tmp_path)
    assert_state_dict_equal(out, state)


def test_early_writeback_starts_the_disk_writes_of_each_stretch(tmp_path):
    if file_system_type(str(tmp_path)) in ("tmpfs", "ramfs"):
        pytest.skip("memory file systems write nothing back")
    data = os.urandom(1 << 20) * 12
    with open(tmp_path / "file", "wb", buffering=1 << 20) as out:
        writeback = early_writeback(out)
        if writeback is None:
            pytest.skip("no sync_file_range here (not Linux)")
        for end in range(1 << 20, len(data) + 1, 1 << 20):
            writeback.write(data[end - (1 << 20):end])
        out.flush()
        queued = page_cache.counts(out.fileno(), 0, writeback.started)
        rest = page_cache.counts(out.fileno(), writeback.started, len(data))
    if queued is None:
        pytest.skip("needs cachestat(2) (Linux 6.5+) to count dirty pages")
    assert writeback.started == WRITEBACK_BYTES
    assert queued.nr_dirty == 0 and queued.nr_cache == WRITEBACK_BYTES // os.sysconf("SC_PAGE_SIZE"), (queued.nr_dirty, queued.nr_cache)
    assert rest.nr_dirty == rest.nr_cache > 0  # the last stretch waits for the fsync


class _NotedWriteback(EarlyWriteback):
    """Notes each write's size and how far writeback was queued after it."""

    def __init__(self, out: io.BufferedWriter, stretch: int):
        super().__init__(out, stretch)
        self.noted: list[tuple[int, int]] = []

    def write(self, data: bytes | bytearray | memoryview, /) -> int:
        written = super().write(data)
        self.noted.append((written, self.started))
        return written


def test_a_large_record_goes_to_disk_piece_by_piece(tmp_path):
    """A storage larger than ``WRITE_PIECE`` reaches the file in checksummed pieces, so its
    first pieces are queued for writeback while the rest is still being checksummed (passed
    whole, a 64 MiB storage kept the disk idle until all of it was checksummed and copied)."""
    tensor = torch.randn(5 * WRITE_PIECE // 8, generator=torch.Generator().manual_seed(5))  # 2.5 pieces
    with open(tmp_path / "file", "wb", buffering=1 << 20) as out:
        writeback = _NotedWriteback(out, stretch=WRITE_PIECE)
        sink = RecordSink(writeback, checksums=True)
        stored = write_tensor(sink, "file", tensor, "t")
        sink.drain()
    sizes, queued = zip(*writeback.noted)
    assert max(sizes) <= WRITE_PIECE
    within = sorted({end for end in queued if 0 < end < stored.length})
    assert len(within) >= 2, writeback.noted  # writeback queued twice before the record's end
    record = (tmp_path / "file").read_bytes()
    assert stored.offset == 0 and stored.length == len(record)
    assert stored.checksum == crc32c.crc32c(record)
    assert torch.equal(torch.load(io.BytesIO(record), weights_only=True), tensor)


def test_early_writeback_needs_a_real_file():
    assert early_writeback(io.BytesIO()) is None  # no file descriptor: nothing to hand the kernel


def _record_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "w": torch.randn(64, 48, generator=g),
        "w.again": torch.randn(64, 48, generator=g),  # a kind seen before: its frames are reused
        "w.param": torch.nn.Parameter(torch.randn(64, 48, generator=g)),
        "w.big": torch.randn(256, 1024, generator=g),  # storage passed on as a write of its own
        "w.big.again": torch.randn(256, 1024, generator=g),
        "b": torch.randn(48, generator=g).to(torch.bfloat16),
        "b.again": torch.randn(48, generator=g).to(torch.bfloat16),
        "u16": torch.randint(0, 2**16, (7, 3), generator=g).to(torch.uint16),  # a _rebuild_tensor_v3 record
        "ids": torch.randint(-(2**40), 2**40, (33,), generator=g),
        "z": torch.randn(5, 3, dtype=torch.complex64, generator=g).conj(),  # stored resolved
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def _torch_save(tensor: torch.Tensor, zip_crc: bool) -> bytes:
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(zip_crc)
    try:
        out = io.BytesIO()
        torch.save(tensor.detach().resolve_conj().contiguous(), out)
        return out.getvalue()
    finally:
        torch.serialization.set_crc32_options(before)


@pytest.mark.parametrize("checksums", [True, False])
def test_records_are_torch_saves_with_one_checksum(tmp_path, checksums):
    """A record is byte for byte what torch.save writes: without its zip CRC-32s where the
    index holds the record's CRC32C (the default), with them where it does not; also where
    a record reuses the frames of an earlier one of its kind. Stock DCP reads both, and the
    process-wide torch.save option is left alone."""
    state = _record_state()
    save(state, tmp_path, checksums=checksums, thread_count=1)  # one file: later records reuse frames
    assert torch.serialization.get_crc32_options() is True
    storage = dcp.FileSystemReader(str(tmp_path)).read_metadata().storage_data
    for index, info in storage.items():
        with open(tmp_path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            record = f.read(info.length)
        assert record == _torch_save(state[index.fqn], zip_crc=not checksums), index.fqn
    stock = {k: garbage_like(v) for k, v in state.items()}
    dcp.load(stock, storage_reader=dcp.FileSystemReader(str(tmp_path)))
    assert_state_dict_equal(stock, {k: v.detach().resolve_conj() for k, v in state.items()})


def test_records_read_without_their_index(tmp_path):
    """Without the index (deleted, or copied without hidden files) a checkpoint reads from
    .metadata: a load is bit-exact, a verified load of records whose only checksum was in
    the index is refused by name and ``dcp-ext verify`` fails on each such record (it
    said OK, having checked no checksum), and ``checksums=False`` records verify by zip CRC-32."""
    state = _record_state()
    want = {k: v.detach().resolve_conj() for k, v in state.items()}
    save(state, tmp_path / "crc32c")
    (tmp_path / "crc32c" / INDEX_NAME).unlink()
    loaded, _ = load(state, tmp_path / "crc32c", cache_metadata=False)
    assert_state_dict_equal(loaded, want)
    error = load_error(state, tmp_path / "crc32c", cache_metadata=False, verify_checksums=True)
    assert isinstance(error, InvalidRequestError) and "verify_checksums=True" in str(error) and "no checksum" in str(error)
    report = verify_checkpoint(str(tmp_path / "crc32c"))
    assert not report.indexed and report.items_without_checksum == len(state), report
    assert sorted(fault.split("'")[1] for fault in report.faults) == sorted(state)
    assert all("record carries no checksum" in fault and "index, missing or stale" in fault for fault in report.faults)

    save(state, tmp_path / "zip", checksums=False)
    (tmp_path / "zip" / INDEX_NAME).unlink()
    loaded, _ = load(state, tmp_path / "zip", cache_metadata=False, verify_checksums=True)
    assert_state_dict_equal(loaded, want)
    info = next(v for k, v in dcp.FileSystemReader(str(tmp_path / "zip")).read_metadata().storage_data.items() if k.fqn == "w")
    with open(tmp_path / "zip" / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        record = f.read(info.length)
        payload = parse_tensor_record(len(record), lambda o, n: record[o : o + n], "w").payload_offset
        f.seek(info.offset + payload + 100)
        f.write(bytes([record[payload + 100] ^ 0x40]))
    error = load_error(state, tmp_path / "zip", cache_metadata=False, verify_checksums=True)
    assert isinstance(error, ChecksumMismatchError) and "crc32 mismatch" in str(error), error
    assert any("'w'" in fault and "crc32 mismatch" in fault for fault in verify_checkpoint(str(tmp_path / "zip")).faults)


def test_records_through_host_buffers_are_the_same_torch_saves():
    """The path device tensors take (``write_device_tensor``: frames of a CPU stand-in,
    the bytes through ``HostCopies``' bounded buffers), driven with CPU tensors and
    buffers smaller than most tensors: every record and stored item as the direct path
    writes it, byte for byte torch.save's, and never more buffers than the pool's count."""
    copies = HostCopies(count=2, buffer_bytes=4000)
    direct, staged = io.BytesIO(), io.BytesIO()
    direct_sink, staged_sink = RecordSink(direct, checksums=True), RecordSink(staged, checksums=True)
    for key, tensor in _record_state().items():
        want = write_tensor(direct_sink, "f", tensor, key)
        got = write_device_tensor(staged_sink, "f", tensor, key, copies.copy_out)
        assert got == want, key
    direct_sink.drain()
    staged_sink.drain()
    assert staged.getvalue() == direct.getvalue()
    for key, tensor in _record_state().items():  # each record is torch.save's (no zip CRC-32s)
        assert _torch_save(tensor, zip_crc=False) in staged.getvalue(), key
    assert copies.pool.allocated == 1  # one thread: one buffer at a time, reused


@CUDA
@pytest.mark.parametrize("checksums", [True, False])
def test_cuda_tensors_save_through_host_buffers_bit_exact(tmp_path, checksums):
    """A save of CUDA tensors (the 64 MiB one through several staging buffers) that stock
    DCP loads back to the CPU bit-exact; with ``checksums=False`` the records need their
    data for the zip CRC-32s and go through a host copy."""
    state = {k: v.detach().cuda() for k, v in _record_state().items()}
    state["huge"] = torch.randn(16 << 20, device="cuda")
    save(state, tmp_path, checksums=checksums)
    stock = {k: garbage_like(v.cpu()) for k, v in state.items()}
    dcp.load(stock, storage_reader=dcp.FileSystemReader(str(tmp_path)))
    assert_state_dict_equal(stock, {k: v.resolve_conj().cpu() for k, v in state.items()})


def _scalar_dtensor_async_job(rank: int, world: int, path: str) -> None:
    """torch's staging hands a 0-d DTensor back itself, not a copy: an in-place update
    right after ``async_save`` returned reached the checkpoint (stock DCP's too)."""
    mesh = init_device_mesh("cpu", (world,))
    state = {"scale": distribute_tensor(torch.tensor(1.0), mesh, [Replicate()]),
             "vec": distribute_tensor(torch.ones(4), mesh, [Replicate()])}
    for direct in (False, True):  # reused buffers (writer.async_save), new memory per save (dcp.async_save)
        writer = ShardWriter(path)
        for step in range(2):  # the second save copies into the first one's buffers
            with torch.no_grad():
                state["scale"].fill_(1.0 + step)
                state["vec"].fill_(1.0 + step)
            future = dcp.async_save(state, storage_writer=writer) if direct else writer.async_save(state)
            with torch.no_grad():  # train on while the upload runs
                state["scale"].add_(100.0)
                state["vec"].add_(100.0)
            future.result()
            out = {k: distribute_tensor(garbage_like(v.full_tensor()), mesh, [Replicate()]) for k, v in state.items()}
            dcp.load(out, storage_reader=ShardReader(path), planner=ShardLoadPlanner())
            assert out["scale"].to_local().item() == 1.0 + step and out["vec"].to_local().eq(1.0 + step).all()
        writer.close()


@pytest.mark.mp
def test_async_save_stages_a_0d_dtensor(tmp_path):
    run_job(_scalar_dtensor_async_job, 2, str(tmp_path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64, torch.bool, torch.float8_e4m3fn])
def test_views_of_one_element_with_any_stride_save_and_load(tmp_path, dtype):
    """A 1-element view keeps its parent's stride (``w[:1, 1]``: stride 2), which torch
    counts as contiguous: the save plan's replica digest viewed it as bytes and failed
    ("self.stride(-1) must be 1"). Stock saves it."""
    base = torch.randn(5, 6).to(dtype) if dtype != torch.complex64 else torch.randn(5, 6, dtype=dtype)
    state = {"column_row": base[:1, 1], "corner": base[:1, :1].t()[:, :1], "empty": base[:0, 1], "scalar_view": base[2, 3]}
    assert state["column_row"].stride() == (6,) and state["column_row"].is_contiguous()
    save(state, tmp_path)
    got, _ = load({k: garbage_like(v.clone()) for k, v in state.items()}, tmp_path)
    assert_state_dict_equal(got, {k: v.clone() for k, v in state.items()})


@pytest.mark.parametrize("planner", [ShardSavePlanner, DefaultSavePlanner])
def test_a_quantized_tensor_is_refused_before_anything_is_written(tmp_path, planner):
    """ShardWriter committed a quantized tensor into a checkpoint that every load of ours (and
    ``dcp-ext inspect`` / ``verify``) then called corrupt: its index holds no such dtype."""
    before = {"w": torch.randn(4, 4)}
    save(before, tmp_path)
    files = sorted(os.listdir(tmp_path))
    state = {"w": torch.randn(4, 4), "q": torch.quantize_per_tensor(torch.randn(4, 4), 0.1, 3, torch.qint8)}
    with pytest.raises(CheckpointException) as err:
        dcp.save(state, storage_writer=ShardWriter(tmp_path), planner=planner())
    failure = next(iter(err.value.failures.values()))[0]
    assert isinstance(failure, InvalidRequestError)
    assert str(failure).startswith(f"{tmp_path}: key 'q' is a quantized tensor (torch.qint8), which ShardWriter does not store")
    assert sorted(os.listdir(tmp_path)) == files  # nothing of the failed save left
    got, _ = load(before, tmp_path)
    assert_state_dict_equal(got, before)


def test_a_meta_tensor_is_refused_naming_its_key(tmp_path):
    """torch's "Cannot copy out of meta tensor" named no key (a model built on the meta
    device and saved before ``to_empty``); the previous checkpoint stays."""
    before = {"w": torch.randn(4, 4)}
    save(before, tmp_path)
    files = sorted(os.listdir(tmp_path))
    with pytest.raises(CheckpointException) as err:
        save({"w": torch.randn(4, 4), "layer.weight": torch.empty(8, 4, device="meta")}, tmp_path)
    failure = next(iter(err.value.failures.values()))[0]
    assert isinstance(failure, InvalidRequestError)
    assert re.search(r"/__0_\w+\.distcp key 'layer\.weight': is a meta tensor, which holds no values to save", str(failure))
    assert sorted(os.listdir(tmp_path)) == files
    assert_state_dict_equal(load(before, tmp_path)[0], before)


class _Marker:
    """A Python attribute some frameworks hang on tensors (no allowlisted type)."""


def test_a_tensors_python_attributes_stay_out_of_its_record(tmp_path):
    """A record holds the tensor alone, as stock DCP's writer stores it (it saves a detached
    tensor): torch.save of a tensor carrying Python attributes pickles them too, which stock
    loads (``weights_only``) refuse for types they do not know, and a record's frames serve
    later records of the same kind."""
    tagged = torch.arange(16.0).reshape(4, 4)
    tagged.marker = _Marker()
    plain = torch.arange(16.0).reshape(4, 4) + 100
    save({"tagged": tagged, "plain": plain}, tmp_path, thread_count=1)
    stock = {"tagged": torch.full((4, 4), float("nan")), "plain": torch.full((4, 4), float("nan"))}
    dcp.load(stock, storage_reader=dcp.FileSystemReader(str(tmp_path)))
    assert_state_dict_equal(stock, {"tagged": tagged, "plain": plain})
    data = b"".join(path.read_bytes() for path in tmp_path.glob("*.distcp"))
    assert b"_Marker" not in data and b"_rebuild_from_type_v2" not in data


_FIRST_SAVE = """
import sys, warnings
import torch, torch.distributed.checkpoint as dcp
from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
warnings.simplefilter("ignore")  # dcp's no-process-group warning
path = sys.argv[1]
state = {f"t.{i}": torch.arange(i * 7, i * 7 + 64, dtype=torch.float32).reshape(8, 8) for i in range(12)}
dcp.save(state, storage_writer=ShardWriter(path), planner=ShardSavePlanner(), no_dist=True)
back = {k: torch.full_like(v, -3.0) for k, v in state.items()}
dcp.load(back, storage_reader=ShardReader(path), planner=ShardLoadPlanner(), no_dist=True)
assert all(torch.equal(back[k], v) for k, v in state.items())
print(" ".join(sorted(m for m in ("numpy.ma", "numpy.random") if m in sys.modules)))
"""


def test_a_fresh_process_saves_and_loads_without_numpys_slow_imports(tmp_path):
    """A job's first checkpoint pays every import its path triggers: ``np.unique`` and
    ``np.random`` in the global plan imported ``numpy.ma`` and ``numpy.random`` (18-24 ms
    of a fresh process's first save; ``runtime.arrays``)."""
    done = subprocess.run([sys.executable, "-c", _FIRST_SAVE, str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [], done.stdout  # neither module was imported
