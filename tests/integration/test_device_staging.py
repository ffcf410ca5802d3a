"""Loads into device memory through bounded host staging buffers (``device_staging``).

The pipeline is device-agnostic: on machines without a GPU the tests force CPU
destinations through it (``tensor_requests(staged=True)``: unpinned buffers, synchronous
copies) and run the real ``ScatterReads`` executor over real files. The CUDA tests at the
end load into CUDA tensors and DTensors through ``dcp.load`` and are skipped without a GPU.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dcp_ext import ShardReader, ShardWriter
from dcp_ext.errors import CheckpointError, ChecksumMismatchError
from dcp_ext.storage.device_staging import DeviceSpan, DeviceStaging, StagingPool
from dcp_ext.storage.executors import LoadIdentity, ReadSettings, ScatterReads
from dcp_ext.storage.location import Location
from dcp_ext.storage.read_plan import Request, tensor_requests

from mp import run_job
from support import DESTINATION_KINDS, READ_BOXES, box_destination, assert_tensor_equal, garbage, write_records

ROOT = Path(__file__).resolve().parents[2]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _run(tmp_path: Path, requests: list[Request], buffers: int = 2, buffer_bytes: int = 4096, threads: int = 2) -> ScatterReads:
    settings = ReadSettings(
        Location(tmp_path),
        threads,
        lambda path, key: CheckpointError(f"{path} {key}: missing"),
        staging_buffers=buffers,
        staging_buffer_bytes=buffer_bytes,
    )
    executor = ScatterReads(settings)
    executor.run(requests, LoadIdentity(str(tmp_path), 0))
    return executor


def _assert_pool_bounded(executor: ScatterReads, count: int) -> None:
    staging = executor.staging
    assert staging is not None, "the requests did not go through host staging"
    assert 1 <= staging.pool.allocated <= count
    assert staging.pool.idle == staging.pool.allocated  # every buffer came back


@pytest.mark.parametrize("offsets,lengths", READ_BOXES)
@pytest.mark.parametrize("dest_kind", DESTINATION_KINDS)
@pytest.mark.parametrize("verify", [False, True])
def test_staged_boxes_are_bit_exact(tmp_path, offsets, lengths, dest_kind, verify):
    source = torch.randn(64, 48)
    [(item, layout)] = write_records(tmp_path, [source])
    want = source[offsets[0] : offsets[0] + lengths[0], offsets[1] : offsets[1] + lengths[1]]
    dest = box_destination(dest_kind, lengths)
    requests = tensor_requests(item, layout, offsets, lengths, dest, "k", "f.distcp k", verify, staged=True)
    assert requests and all(r.device == torch.device("cpu") for r in requests)
    executor = _run(tmp_path, requests)  # 4 KiB buffers: the 12 KiB chunk spans several
    assert torch.equal(dest, want.to(dest.dtype))
    _assert_pool_bounded(executor, 2)


def test_a_request_larger_than_a_buffer_flows_through_it_in_pieces(tmp_path):
    source = torch.randn(256, 1024)  # 1 MiB, one record, read by one request
    [(item, layout)] = write_records(tmp_path, [source])
    dest = garbage((256, 1024))
    requests = tensor_requests(item, layout, (0, 0), (256, 1024), dest, "k", "w", verify=False, staged=True)
    assert len(requests) == 1 and requests[0].nbytes == source.nbytes
    executor = _run(tmp_path, requests, buffers=3, buffer_bytes=64 << 10, threads=1)
    assert torch.equal(dest, source)
    _assert_pool_bounded(executor, 3)


@pytest.mark.parametrize("buffers,threads", [(2, 4), (1, 8)])  # (1, 8): seven threads wait for their turn
def test_many_requests_and_threads_share_a_small_pool(tmp_path, buffers, threads):
    g = torch.Generator().manual_seed(3)
    sources = [torch.randn(n, 33, generator=g) for n in range(1, 120)]
    dests = [garbage(tuple(s.shape)) for s in sources]
    requests = []
    for (item, layout), source, dest in zip(write_records(tmp_path, sources), sources, dests):
        requests += tensor_requests(item, layout, (0, 0), tuple(source.shape), dest, "k", "w", verify=True, staged=True)
    executor = _run(tmp_path, requests, buffers=buffers, buffer_bytes=8192, threads=threads)
    for source, dest in zip(sources, dests):
        assert torch.equal(dest, source)
    _assert_pool_bounded(executor, buffers)


def test_a_buffer_leaves_for_the_device_in_one_copy_call(tmp_path, monkeypatch):
    """Every copy out of a filled buffer goes in one ``_foreach_copy_`` call: each torch call a
    reading thread makes hands the GIL over, and a buffer holds hundreds of small tensors.
    Whole tensors are copied to without a view being made of them."""
    g = torch.Generator().manual_seed(5)
    sources = [torch.randn(n % 7 + 1, 16, generator=g) for n in range(40)]  # 64-448 B each
    dests = [garbage(tuple(s.shape)) for s in sources]
    requests = []
    for (item, layout), source, dest in zip(write_records(tmp_path, sources), sources, dests):
        requests += tensor_requests(item, layout, (0, 0), tuple(source.shape), dest, "k", "w", verify=False, staged=True)
    calls: list[list[torch.Tensor]] = []
    copy_all = torch._foreach_copy_

    def counted(dests_, sources_, **kwargs):
        calls.append(list(dests_))
        return copy_all(dests_, sources_, **kwargs)

    monkeypatch.setattr(torch, "_foreach_copy_", counted)
    _run(tmp_path, requests, buffers=1, buffer_bytes=4096, threads=1)
    for source, dest in zip(sources, dests):
        assert torch.equal(dest, source)
    staged = sum(s.nbytes for s in sources)
    assert len(calls) == -(-staged // 4096)  # one call per buffer's worth, not one per tensor
    targets = {t.untyped_storage().data_ptr() for t in dests}
    assert sum(len(c) for c in calls) < len(sources) + len(calls)  # a tensor is cut only at a buffer's end
    assert all(t.untyped_storage().data_ptr() in targets for c in calls for t in c)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(6, 10).t(),  # stored as a transposed view: a strided read
        lambda: torch.randn(12, 5, dtype=torch.complex64).conj(),  # conj bit on the record
        lambda: torch.arange(60, dtype=torch.int64).reshape(12, 5),
        lambda: torch.randn(12, 5).to(torch.bfloat16),
    ],
    ids=["strided", "conj", "int64", "bf16"],
)
def test_record_kinds_are_bit_exact(tmp_path, make):
    source = make()
    [(item, layout)] = write_records(tmp_path, [source])
    box = (2, 1), (4, 3)
    want = source[2:6, 1:4].resolve_conj()
    dest = garbage((4, 3), source.dtype)
    requests = tensor_requests(item, layout, *box, dest, "k", "w", verify=False, staged=True)
    executor = _run(tmp_path, requests, buffer_bytes=64)
    assert torch.equal(dest, want)
    _assert_pool_bounded(executor, 2)


def test_staged_and_host_requests_in_one_file(tmp_path):
    a, b = torch.randn(40, 40), torch.randn(40, 40)
    (item_a, layout_a), (item_b, layout_b) = write_records(tmp_path, [a, b])
    dest_a, dest_b = garbage((40, 40)), garbage((40, 40))
    host = tensor_requests(item_a, layout_a, (0, 0), (40, 40), dest_a, "a", "w", verify=False)
    staged = tensor_requests(item_b, layout_b, (0, 0), (40, 40), dest_b, "b", "w", verify=False, staged=True)
    assert all(r.device is None for r in host) and all(r.device is not None for r in staged)
    _run(tmp_path, host + staged, buffer_bytes=1000)
    assert torch.equal(dest_a, a) and torch.equal(dest_b, b)


def test_host_destinations_do_not_stage(tmp_path):
    source = torch.randn(8, 8)
    [(item, layout)] = write_records(tmp_path, [source])
    dest = garbage((8, 8))
    requests = tensor_requests(item, layout, (0, 0), (8, 8), dest, "k", "w", verify=False)
    assert all(r.device is None for r in requests)
    assert _run(tmp_path, requests).staging is None
    assert torch.equal(dest, source)


def test_a_failing_read_releases_the_buffers_and_names_the_file(tmp_path):
    sources = [torch.randn(64, 64) for _ in range(4)]
    records = write_records(tmp_path, sources)
    dests = [garbage((64, 64)) for _ in sources]
    requests = []
    for (item, layout), dest in zip(records, dests):
        requests += tensor_requests(item, layout, (0, 0), (64, 64), dest, "k", "w", verify=False, staged=True)
    path = tmp_path / "f.distcp"
    path.write_bytes(path.read_bytes()[: records[2][0].offset])  # the last two records are gone
    settings = ReadSettings(Location(tmp_path), 2, lambda p, k: CheckpointError("missing"), staging_buffers=2, staging_buffer_bytes=4096)
    executor = ScatterReads(settings)
    with pytest.raises(CheckpointError, match="f.distcp: unexpected end of file at byte .*, reading key 'k'"):
        executor.run(requests, LoadIdentity(str(tmp_path), 0))
    _assert_pool_bounded(executor, 2)


def test_a_corrupt_staged_record_fails_its_checksum(tmp_path):
    source = torch.randn(64, 64)
    [(item, layout)] = write_records(tmp_path, [source])
    path = tmp_path / "f.distcp"
    data = bytearray(path.read_bytes())
    data[item.offset + layout.payload_offset + 5000] ^= 1
    path.write_bytes(bytes(data))
    dest = garbage((64, 64))
    requests = tensor_requests(item, layout, (0, 0), (64, 64), dest, "k", "f.distcp k", verify=True, staged=True)
    with pytest.raises(ChecksumMismatchError, match="f.distcp k: crc32c mismatch"):
        _run(tmp_path, requests, buffer_bytes=4096)


def test_assigned_bytes_verify_as_staged_ones(tmp_path):
    """The two-stage exchange fills targets by assignment, in file order; a verified
    staged request checks its checksum over those bytes too."""
    source = torch.randn(30, 30)
    [(item, layout)] = write_records(tmp_path, [source])
    data = bytearray((tmp_path / "f.distcp").read_bytes())
    dest = garbage((30, 30))
    [request] = tensor_requests(item, layout, (0, 0), (30, 30), dest, "k", "w", verify=True, staged=True)
    offset = request.start
    for target in request.targets():
        for a in range(0, target.nbytes, 1000):
            n = min(1000, target.nbytes - a)
            target[a : a + n] = memoryview(data)[offset + a : offset + a + n]
        offset += target.nbytes
    request.complete()
    assert torch.equal(dest, source)


def test_pool_never_holds_more_than_its_count():
    pool = StagingPool(count=2, buffer_bytes=16)
    first, second = pool.acquire(), pool.acquire()
    pool.release(first)
    assert pool.acquire() is first and pool.allocated == 2
    with pytest.raises(ValueError, match="at least one buffer"):
        StagingPool(count=0)
    pool.release(second)
    span = DeviceSpan(torch.zeros(8, dtype=torch.uint8))
    span[2:4] = memoryview(bytearray(b"\x01\x02"))
    assert span.tensor.tolist() == [0, 0, 1, 2, 0, 0, 0, 0]


def test_span_slices_are_byte_ranges_of_their_tensor():
    """Slicing a span keeps numbers, not views: slices of slices land where the tensor's
    slices would, clamp as they would, and refuse steps."""
    base = torch.zeros(16, dtype=torch.uint8)
    inner = DeviceSpan(base)[3:13][2:]
    assert inner.nbytes == 8 and inner[6:100].nbytes == 2 and inner[9:].nbytes == 0
    inner[1:3] = memoryview(bytearray(b"\x07\x08"))
    assert base.tolist() == [0] * 6 + [7, 8] + [0] * 8
    assert inner.tensor.data_ptr() == base[5:13].data_ptr()
    assert DeviceSpan(base)[0:16].tensor is base  # the whole base: no view made
    with pytest.raises(ValueError, match="step 1"):
        inner[::2]


def test_one_thread_per_staging_buffer_works_at_a_time():
    """Reading threads beyond the buffers wait outside (each torch call they made would hand
    the GIL over): two buffers, six threads, never more than two inside at once."""
    staging = DeviceStaging(StagingPool(count=2, buffer_bytes=16))
    pair = threading.Barrier(2, timeout=30)  # two at a time do get in together
    lock, inside, most = threading.Lock(), [0], [0]

    def work() -> None:
        with staging.device_work():
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            pair.wait()
            time.sleep(0.02)
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert most[0] == 2 and not pair.broken



@pytest.mark.mp
def test_gpu_benchmark_says_it_needs_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the benchmark would run")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_io.py"), "--out", str(tmp_path / "gpu_io.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 77, done.stderr
    assert done.stderr.strip().splitlines() == ["gpu_io.py: no CUDA device: nothing measured (exit 77: skipped)"]
    assert not (tmp_path / "gpu_io.json").exists()


# -- CUDA: dcp.load into device memory ----------------------------------------------------------
def _mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(3000, 4096, generator=g),  # ~47 MiB: spans several staging buffers
        "rows": torch.randn(1000, 33, generator=g),
        "half": torch.randn(64, 48, generator=g).half(),
        "bf16": torch.randn(17, 5, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1 << 40, (999,), generator=g),
        "flag": torch.rand(100, generator=g) > 0.5,
        "complex": torch.randn(9, 4, dtype=torch.complex64, generator=g),
    }


@CUDA
@pytest.mark.parametrize("writer", ["ours", "stock"])
@pytest.mark.parametrize("verify", [False, True])
def test_cuda_load_is_bit_exact(tmp_path, writer, verify):
    state = _mixed_state()
    if writer == "ours":
        dcp.save(state, storage_writer=ShardWriter(tmp_path))
    else:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path))
    dest = {k: torch.full_like(v, 7).cuda() if not v.is_floating_point() else torch.full_like(v, float("nan")).cuda() for k, v in state.items()}
    dcp.load(dest, storage_reader=ShardReader(tmp_path, verify_checksums=verify and writer == "ours"))
    for key, value in state.items():
        assert dest[key].is_cuda
        assert_tensor_equal(dest[key].cpu(), value, key)


@CUDA
def test_cuda_load_casts_and_fills_views(tmp_path):
    state = _mixed_state()
    dcp.save(state, storage_writer=ShardWriter(tmp_path))
    backing = torch.full((1000, 40), float("nan"), device="cuda")
    dest = {"rows": backing[:, 3:36], "big": torch.full((3000, 4096), float("nan"), dtype=torch.float64, device="cuda")}
    dcp.load(dest, storage_reader=ShardReader(tmp_path))
    assert torch.equal(dest["rows"].cpu(), state["rows"])
    assert torch.equal(dest["big"].cpu(), state["big"].double())
    assert torch.isnan(backing[:, :3]).all() and torch.isnan(backing[:, 36:]).all()


def _cuda_dtensor_job(rank: int, world: int, path: str) -> None:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    g = torch.Generator().manual_seed(11)
    full = {"w": torch.randn(96, 80, generator=g), "v": torch.randn(1000, generator=g)}
    cpu_mesh = init_device_mesh("cpu", (world,))
    saved = {k: distribute_tensor(v, cpu_mesh, [Shard(0)]) for k, v in full.items()}
    dcp.save(saved, storage_writer=ShardWriter(path))
    cuda_mesh = init_device_mesh("cuda", (world,))
    want = {"w": full["w"].chunk(world, 1)[rank], "v": full["v"].chunk(world, 0)[rank]}  # resharded: Shard(1)
    placements = {"w": [Shard(1)], "v": [Shard(0)]}
    dest = {
        k: DTensor.from_local(torch.full_like(v, float("nan"), device="cuda"), cuda_mesh, placements[k], run_check=False)
        for k, v in want.items()
    }
    dcp.load(dest, storage_reader=ShardReader(path))
    for key, value in dest.items():
        assert isinstance(value, DTensor) and value.to_local().is_cuda
        assert_tensor_equal(value.to_local().cpu(), want[key], key)


@pytest.mark.mp
@CUDA
def test_cuda_dtensors_load_resharded(tmp_path):
    run_job(_cuda_dtensor_job, 2, str(tmp_path))
