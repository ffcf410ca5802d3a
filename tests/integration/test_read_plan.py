"""Byte-exact partial reads: a resharded load reads only the bytes it needs."""

from __future__ import annotations

import uuid

import pytest
import torch

from dcp_ext.formats.torch_record import host_bytes
from dcp_ext.storage import executors
from dcp_ext.storage.executors import LoadIdentity, ReadSettings, ScatterReads, coalesce, file_tasks, task_limit
from dcp_ext.storage.location import Location
from dcp_ext.errors import CorruptCheckpointError
from dcp_ext.storage.read_plan import SLAB_BYTES, Request, copy_record_box, tensor_requests

from support import DESTINATION_KINDS, READ_BOXES, box_destination, garbage, write_records


def _run(tmp_path, requests) -> int:
    location = Location(tmp_path)
    total = 0
    with location.open_reader("f.distcp") as reader:
        for offset, buffers in coalesce(requests):
            total += reader.read_into(offset, buffers)
    for r in requests:
        r.complete()
    return total


@pytest.mark.parametrize("offsets,lengths", READ_BOXES)
@pytest.mark.parametrize("dest_kind", DESTINATION_KINDS)
def test_box_reads_land_bit_exact_in_any_destination(tmp_path, offsets, lengths, dest_kind):
    source = torch.randn(64, 48)
    [(item, layout)] = write_records(tmp_path, [source])
    want = source[offsets[0] : offsets[0] + lengths[0], offsets[1] : offsets[1] + lengths[1]]
    dest = box_destination(dest_kind, lengths)
    requests = tensor_requests(item, layout, offsets, lengths, dest, "k", "f.distcp k", verify=False)
    read = _run(tmp_path, requests)
    assert torch.equal(dest, want.to(dest.dtype))
    needed = want.numel() * 4
    if lengths[1] * 4 >= 4096 or lengths[0] == 1 or lengths[1] == 48:
        assert read <= needed * 1.05 + 64 * 1024  # holes under 64 KiB may be read through


def test_half_rows_read_amplification(tmp_path):
    source = torch.randn(512, 2048)  # 8 KiB rows
    [(item, layout)] = write_records(tmp_path, [source])
    dest = garbage((512, 1024))
    requests = tensor_requests(item, layout, (0, 1024), (512, 1024), dest, "k", "w", verify=False)
    assert all(r.nbytes == dest.numel() * 4 for r in requests)
    _run(tmp_path, requests)
    assert torch.equal(dest, source[:, 1024:])


def test_large_boxes_are_split_into_bounded_slabs(tmp_path):
    source = torch.arange(3 * SLAB_BYTES // 4, dtype=torch.float32).reshape(-1, 1024)  # 3 slabs
    [(item, layout)] = write_records(tmp_path, [source])
    dest = garbage((source.shape[0], 512))  # needs a copy: not direct
    requests = tensor_requests(item, layout, (0, 0), tuple(dest.shape), dest, "k", "w", verify=False)
    assert len(requests) >= 3 and all(r.nbytes <= SLAB_BYTES for r in requests)
    _run(tmp_path, requests)
    assert torch.equal(dest, source[:, :512])


def test_strided_stock_record_is_read_exactly(tmp_path):
    source = torch.randn(6, 10).t()  # stored as a transposed view
    [(item, layout)] = write_records(tmp_path, [source])
    assert not layout.is_dense()
    dest = garbage((4, 3))
    _run(tmp_path, tensor_requests(item, layout, (2, 1), (4, 3), dest, "k", "w", verify=False))
    assert torch.equal(dest, source[2:6, 1:4])


@pytest.mark.parametrize("verify", [False, True])
def test_a_one_column_record_lands_in_a_column_major_destination(tmp_path, verify):
    """A (7, 1) box of a transposed (3, 7) tensor has strides (1, 7): torch calls it
    contiguous (a size-1 dim's stride does not count) but refuses ``view(torch.uint8)``
    of it. A resharded load into a column-major tensor narrows to such boxes."""
    source = torch.randn(7, 1)
    [(item, layout)] = write_records(tmp_path, [source])
    whole = garbage((3, 7)).t()
    dest = whole[:, 2:3]
    assert dest.is_contiguous() and dest.stride() == (1, 7)
    _run(tmp_path, tensor_requests(item, layout, (0, 0), (7, 1), dest, "k", "w", verify=verify))
    assert torch.equal(dest, source) and torch.equal(whole[:, :2], garbage((3, 7)).t()[:, :2])


def test_a_whole_tensor_over_a_slab_is_read_in_pieces_threads_can_share(tmp_path):
    source = torch.arange(5 * SLAB_BYTES // 8, dtype=torch.float32).reshape(-1, 1024)  # 2.5 slabs
    [(item, layout)] = write_records(tmp_path, [source])
    dest = garbage(tuple(source.shape))  # contiguous, same dtype: read straight into it
    requests = tensor_requests(item, layout, (0, 0), tuple(dest.shape), dest, "k", "w", verify=False)
    assert [r.nbytes for r in requests] == [SLAB_BYTES, SLAB_BYTES, source.nbytes - 2 * SLAB_BYTES]
    assert [r.start for r in requests] == [requests[0].start + n * SLAB_BYTES for n in range(3)]
    assert len(list(file_tasks(requests, task_limit(source.nbytes, threads=4)))) == 3  # one stretch per thread
    assert _run(tmp_path, requests) == source.nbytes
    assert torch.equal(dest, source)


@pytest.mark.parametrize("decoded", [True, False])
def test_a_verified_record_that_is_no_zip_names_what_it_lacks(decoded):
    """A whole record read with its zip CRC-32s checked, whose bytes are no zip at all
    (a record overwritten, or the stream transform gave other bytes): the error names the
    key, the state of the bytes and why they are no ``torch.save`` archive."""
    where = "__0_0.distcp layer.weight"
    with pytest.raises(CorruptCheckpointError) as caught:
        copy_record_box(b"\0" * 100, (torch.float32, (5, 5)), (0, 0), (5, 5), torch.empty(5, 5), where, True, decoded)
    prefix = f"{where}: decoded record" if decoded else where
    assert str(caught.value) == f"{prefix} is no torch.save archive (no zip directory in its 100 bytes)"


@pytest.mark.parametrize("where,in_memory,least_mib", [("disk", False, 2), ("disk", True, 1), ("store", False, 1)])
def test_a_load_from_a_local_disk_gives_each_thread_a_longer_stretch(tmp_path, monkeypatch, where, in_memory, least_mib):
    """The kernel reads ahead of each stream from a local disk, and fewer, longer streams
    read faster there (0.12 GB cold: four 32 MiB stretches of one file 47.4 ms, two of 60
    MB 43.8): such a load's tasks are at least DISK_TASK_BYTES; one from the page cache
    keeps even shares of at least TASK_BYTES (its copies wait for nothing), as does one
    from an fsspec store (whose requests wait on latency: more of them in flight). Sizes
    scaled down (1 and 2 MiB for 32 and 64), each stretch's bytes bit-exact."""
    monkeypatch.setattr(executors, "TASK_BYTES", 1 << 20)
    monkeypatch.setattr(executors, "DISK_TASK_BYTES", 2 << 20)
    data = torch.randint(0, 256, (6 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    root = str(tmp_path) if where == "disk" else f"memory://{uuid.uuid4().hex}"
    location = Location(root)
    location.write_bytes("f.distcp", data.numpy().tobytes(), sync=False)
    dest = garbage((6 << 20,), torch.uint8)
    step = 512 << 10  # twelve requests, each a stretch of the file into its part of dest
    requests = [Request("f.distcp", "k", [(start, step)], lambda start=start: [host_bytes(dest[start : start + step])])
                for start in range(0, 6 << 20, step)]
    tasks: list[int] = []

    def recording(requests, limit):  # noqa: ANN001, ANN202 (executors.file_tasks, each task's bytes noted)
        for task in file_tasks(requests, limit):
            tasks.append(sum(r.nbytes for r in task))
            yield task

    monkeypatch.setattr(executors, "file_tasks", recording)
    settings = ReadSettings(location, 4, lambda path, key: FileNotFoundError(path), in_memory_thread_count=4)
    total, files = ScatterReads(settings).run(
        requests, LoadIdentity(root, 0), expected_bytes=6 << 20, expected_files=1, in_memory=in_memory)
    assert (total, files) == (6 << 20, {"f.distcp"}) and torch.equal(dest, data)
    assert tasks == ([2 << 20] * 3 if least_mib == 2 else [3 << 19] * 4)  # a quarter of the load each: 1.5 MiB
