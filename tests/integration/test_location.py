"""The file-system seam: one ``Location`` interface, a local and an fsspec implementation.

Remote range reads go through ``cat_ranges`` and fetch exactly the bytes asked for; the
local disk and a real fsspec filesystem over the same files answer listing and reading
questions alike.
"""

from __future__ import annotations

import os
import pickle
import re
import uuid
import zipfile

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.errors import CheckpointError, InvalidRequestError
import dcp_ext.storage.location as location_module
from dcp_ext.storage.location import (
    COLD_READ_BYTES,
    PART_BYTES,
    PROBE_BYTES,
    FsspecLocation,
    LocalLocation,
    LocalRangeReader,
    Location,
)

from dcp_ext.storage import page_cache
from support import MeteredFileSystem, evict




def test_location_picks_implementation_by_address(tmp_path) -> None:
    assert isinstance(Location(tmp_path), LocalLocation)
    assert isinstance(Location(f"file://{tmp_path}"), LocalLocation)
    assert isinstance(Location(f"memory://{uuid.uuid4().hex}"), FsspecLocation)
    with pytest.raises(InvalidRequestError, match="storage_options"):
        Location(tmp_path, {"anon": True})  # would be ignored on a local path
    for loc in (Location(tmp_path), Location(f"metered://{tmp_path}")):  # async saves pickle them
        copy = pickle.loads(pickle.dumps(loc))
        assert type(copy) is type(loc) and copy.url == loc.url


def test_local_and_fsspec_answer_alike(tmp_path) -> None:
    (tmp_path / "sub" / "deep").mkdir(parents=True)
    (tmp_path / "a.bin").write_bytes(bytes(range(200)))
    (tmp_path / "sub" / "b.bin").write_bytes(b"bb")
    (tmp_path / "sub" / "deep" / "c.bin").write_bytes(b"c")
    local, remote = Location(tmp_path), Location(f"metered://{tmp_path}")
    for loc in (local, remote):
        assert sorted(loc.listdir()) == ["a.bin", "sub"]
        assert sorted(loc.listdir("sub")) == ["b.bin", "deep"]
        assert loc.listdir("nope") == []
        assert sorted(loc.walk()) == ["a.bin", "sub/b.bin", "sub/deep/c.bin"]
        assert loc.size("a.bin") == 200 and loc.size("missing") is None
        assert loc.read_bytes("sub/b.bin") == b"bb"
        with pytest.raises(CheckpointError, match="outside|relative|escape|unsafe|\\.\\."):
            loc.path("../x")
    assert local.local_file("a.bin") == str(tmp_path / "a.bin") and remote.local_file("a.bin") is None


def test_local_and_fsspec_fetch_ranges_alike_touching_ones_as_one_span(tmp_path) -> None:
    """``RangeReader.fetch``: the bytes of many small ranges (a stock file's record ends),
    touching ones read as one span, answering reads inside a span and nothing else; a range
    past the end of the file fails naming it."""
    data = os.urandom(10_000)
    (tmp_path / "f.bin").write_bytes(data)
    ranges = [(0, 100), (100, 50), (300, 10), (5_000, 4_000), (9_000, 1_000)]
    for loc in (Location(tmp_path), Location(f"metered://{tmp_path}")):
        with loc.open_reader("f.bin", "k") as reader:
            spans = reader.fetch(ranges)
            assert [len(d) for d in spans.data] == [150, 10, 5_000] and spans.starts == [0, 300, 5_000]
            for offset, n in [*ranges, (120, 30), (6_000, 4_000)]:
                assert bytes(spans.view(offset, n)) == data[offset : offset + n]
            for offset, n in ((140, 20), (299, 2), (10, 1_000), (9_999, 2)):  # across a span's end, or outside
                assert spans.view(offset, n) is None
            assert spans.covers(ranges[:2]) and not spans.covers([(200, 1)])
            with pytest.raises(CheckpointError, match=r"f\.bin: unexpected end of file at byte 10000, reading key 'k'"):
                reader.fetch([(9_990, 20)])


def test_remote_runs_split_into_bounded_parts_land_exactly(tmp_path) -> None:
    data = torch.randint(0, 256, (3 * PART_BYTES + 12345,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    (tmp_path / "f.bin").write_bytes(data.numpy().tobytes())
    big = torch.full((2 * PART_BYTES + 7,), 9, dtype=torch.uint8)  # one buffer spanning three parts
    small = [torch.full((n,), 9, dtype=torch.uint8) for n in (1, 4096, 3)]
    runs = [(5, [memoryview(big.numpy())]), (2 * PART_BYTES + 100, [memoryview(t.numpy()) for t in small])]
    MeteredFileSystem.reset()
    with Location(f"metered://{tmp_path}").open_reader("f.bin") as reader:
        total = reader.read_runs(runs)
    assert total == big.numel() + sum(t.numel() for t in small) == sum(MeteredFileSystem.fetched.values())
    assert torch.equal(big, data[5 : 5 + big.numel()])
    start = 2 * PART_BYTES + 100
    assert torch.equal(torch.cat(small), data[start : start + sum(t.numel() for t in small)])
    with Location(f"metered://{tmp_path}").open_reader("f.bin") as reader, pytest.raises(CheckpointError, match="end of file"):
        reader.read_into(data.numel() - 2, [memoryview(bytearray(10))])


def test_remote_partial_load_fetches_only_needed_bytes(tmp_path) -> None:
    """A load of a few keys from a checkpoint over fsspec fetches their records, not the
    files around them (a cached file handle would read ahead by whole blocks)."""
    gen = torch.Generator().manual_seed(5)
    state = {f"w{i}": torch.randn(256, 64, generator=gen) for i in range(24)}
    url = f"metered://{tmp_path}/ckpt"
    dcp.save(state, storage_writer=ShardWriter(url, thread_count=1), planner=ShardSavePlanner())
    wanted = {k: torch.full_like(state[k], float("nan")) for k in ("w3", "w17")}
    MeteredFileSystem.reset()
    dcp.load(wanted, storage_reader=ShardReader(url, cache_metadata=False), planner=ShardLoadPlanner())
    for key, value in wanted.items():
        assert torch.equal(value, state[key])
    needed = sum(v.numel() * v.element_size() for v in wanted.values())
    data_fetched = sum(n for path, n in MeteredFileSystem.fetched.items() if path.endswith(".distcp"))
    assert needed <= data_fetched <= needed * 1.05, (needed, MeteredFileSystem.fetched)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_save_onto_a_file_says_so(tmp_path, where) -> None:
    """Loads said '<path>: is a file'; saves raised a bare FileExistsError (memory://: once
    the first data file was opened under it)."""
    if where == "local":
        path = str(tmp_path / "f")
        (tmp_path / "f").write_text("not a checkpoint")
    else:
        path = f"memory://{uuid.uuid4().hex}/f"
        Location(path).fs.pipe(path, b"not a checkpoint")
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(2)}, storage_writer=ShardWriter(path), planner=ShardSavePlanner(), no_dist=True)
    error = next(iter(info.value.failures.values()))[0]
    assert isinstance(error, CheckpointError) and str(error).endswith("is a file (or under one), not a checkpoint directory"), error
    assert Location(path).url in str(error)


@pytest.mark.mp  # a server thread on loopback
def test_a_server_that_ignores_range_requests_is_named(tmp_path) -> None:
    """Python's http.server answers a range request with the whole file: the load said the
    file had shrunk since planning, at a byte past its end."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    dcp.save({"a": torch.arange(1000.0)}, storage_writer=ShardWriter(tmp_path / "ckpt"), no_dist=True)
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/ckpt"
        with pytest.raises(CheckpointException) as failed:
            dcp.load({"a": torch.full((1000,), float("nan"))}, storage_reader=ShardReader(url), no_dist=True)
        message = str(next(iter(failed.value.failures.values()))[0])
        assert f"{url}/" in message and "the server sent" in message and "ignores range requests" in message, message
    finally:
        server.shutdown()


def _noted_reads(monkeypatch) -> list[int]:  # noqa: ANN001
    """The bytes of each read call the location module makes from here on (probes, which
    pass flags, left out); the reads are real."""
    calls: list[int] = []
    real_preadv = os.preadv

    def noted(fd: int, buffers, offset: int, *flags: int) -> int:  # noqa: ANN001
        if not flags:
            calls.append(sum(memoryview(b).nbytes for b in buffers))
        return real_preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(location_module.os, "preadv", noted)
    return calls


def test_an_uncached_range_is_read_in_small_steps_into_the_right_places(tmp_path, monkeypatch) -> None:
    """A range the page cache does not hold is read COLD_READ_BYTES at a time (the kernel
    reads ahead of small reads), a cached one in one call, also when only the range's
    ends are cached (a stock record whose layout was parsed from them); on both paths,
    buffers of odd sizes straddling the steps, and more than IOV_MAX of them, get every
    byte in place. The reads are real; a wrapper notes their sizes."""
    data = torch.randint(0, 256, (5 * COLD_READ_BYTES + 12345,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    path = tmp_path / "f.bin"
    path.write_bytes(data.numpy().tobytes())
    sizes = [1, COLD_READ_BYTES - 1, 3 * COLD_READ_BYTES + 7, *[3] * 1500, 4096, COLD_READ_BYTES]
    start, end = 100, 100 + sum(sizes)
    calls = _noted_reads(monkeypatch)
    reader = LocalRangeReader(str(path))
    try:
        for attempt in ("cold", "ends cached", "warm"):
            if attempt != "warm":
                evict(path)
                for _ in range(3):  # writeback of a busy machine can keep pages a moment
                    if not reader.holds((start, start + COLD_READ_BYTES - PROBE_BYTES)):
                        break
                    evict(path)
                else:
                    pytest.skip("this file system keeps the file's pages (tmpfs) or has no RWF_NOWAIT")
                evict(path)  # the probe may have started reading ahead
            if attempt == "ends cached":  # what parsing a stock record's layout reads
                fd = os.open(path, os.O_RDONLY)
                try:  # without read-ahead: a device reading ahead 1 MiB or more cached the probed page too
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                    os.pread(fd, PROBE_BYTES, start), os.pread(fd, PROBE_BYTES, end - PROBE_BYTES)
                finally:
                    os.close(fd)
            calls.clear()
            buffers = [torch.full((n,), 0xA5, dtype=torch.uint8) for n in sizes]
            assert reader.read_into(start, [memoryview(b.numpy()) for b in buffers]) == sum(sizes)
            assert torch.equal(torch.cat(buffers), data[start:end]), attempt
            if attempt == "warm":
                assert len(calls) == 2, calls  # IOV_MAX buffers per call
            else:
                assert max(calls) <= COLD_READ_BYTES and len(calls) >= sum(sizes) // COLD_READ_BYTES, (attempt, calls)
    finally:
        reader.close()


def test_released_ranges_leave_the_page_cache_whole_pages_and_all(tmp_path) -> None:
    """``release`` drops what a ``prefetch`` of unaligned ranges brought in (whole pages,
    rounded outward: the kernel cached those), so the reads that follow find none of it."""
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 20))
    ranges = [(100, 5000), (200_000, 10), (500_000, 70_000)]
    reader = LocalRangeReader(str(path))
    try:
        evict(path)
        if page_cache.counts(reader.fd, 0, 1 << 20) is None or page_cache.cached(reader.fd, 0, 1 << 20):
            pytest.skip("no cachestat(2) here, or this file system keeps the file's pages (tmpfs)")
        os.posix_fadvise(reader.fd, 0, 0, os.POSIX_FADV_RANDOM)  # exactly the pages read, no read-ahead
        for offset, n in ranges:
            os.pread(reader.fd, n, offset)
        assert all(page_cache.cached(reader.fd, offset, offset + n) for offset, n in ranges)
        reader.release(ranges)
        assert page_cache.counts(reader.fd, 0, 1 << 20).nr_cache == 0
    finally:
        reader.close()


class _CountedLocation(location_module.LocalLocation):
    """A real local directory whose ``exists`` calls are counted (one per stat, or HEAD on a store)."""

    calls = 0

    def exists(self, name: str) -> bool:
        type(self).calls += 1
        return super().exists(name)


def test_format_detection_looks_for_zarr_arrays_once(tmp_path):
    """Both Megatron detectors looked under every entry for a zarr array: two stats (on an
    object store, two HEAD requests) per entry of a directory that holds no checkpoint, paid
    by every open of one and by the coordinator of every overwrite=False save."""
    from dcp_ext.storage.catalog_formats import held_format

    for n in range(50):
        (tmp_path / f"run{n}").mkdir()
    _CountedLocation.calls = 0
    assert held_format(_CountedLocation(tmp_path)) is None
    assert _CountedLocation.calls <= 50 + 4, _CountedLocation.calls


@pytest.mark.parametrize("url, refused", [
    ("memory://bucket//ckpt", True),  # s3fs lists nothing under such a prefix: every save failed
    ("memory://bucket/ckpt//", False),  # a trailing slash or two
    ("zip://ckpt::memory://archive.zip", False),  # chained: the innermost path is what a store keys
    ("https://host/ckpt?sig=a//b", False),  # a query string is no path
])
def test_an_empty_path_segment_is_refused_and_only_that(url, refused) -> None:
    if url.startswith("zip://"):  # the archive opens with the location
        with fsspec.open("memory://archive.zip", "wb") as f, zipfile.ZipFile(f, "w") as archive:
            archive.writestr("ckpt/.metadata", b"x")
    if refused:
        with pytest.raises(InvalidRequestError, match=r"the path has an empty segment \('//'\)"):
            Location(url)
    else:
        assert isinstance(Location(url), FsspecLocation)


@pytest.mark.parametrize("url", ["s3://", "s3:///ckpt"])
def test_an_object_store_url_without_a_bucket_is_refused(url) -> None:
    """Was an empty ValueError('') from s3fs at the save's mkdir, and at a load a
    complaint about credentials."""
    with pytest.raises(InvalidRequestError, match=rf"^{re.escape(url)}: the URL names no bucket; expected s3://BUCKET/PREFIX$"):
        Location(url)


def test_a_url_whose_store_has_no_buckets_keeps_its_leading_slash(tmp_path) -> None:
    """Only bucket stores are checked: a cache over a local path (root '/...') is a path."""
    assert isinstance(Location(f"filecache::file://{tmp_path}/ckpt"), FsspecLocation)
    assert isinstance(Location("webhdfs://namenode/ckpt"), FsspecLocation)


def test_a_backend_that_cannot_load_is_named_with_the_url() -> None:
    """hdfs:// without a JVM raised a bare OSError ("Unable to load libjvm", then "Prior
    attempt to load libhdfs failed") that named no URL."""
    pytest.importorskip("pyarrow.fs")
    with pytest.raises(InvalidRequestError, match=r"^hdfs://namenode/ckpt: cannot open this URL \(.+\)$"):
        Location("hdfs://namenode/ckpt")


class _SilentlyFailingFileSystem(fsspec.AbstractFileSystem):
    """A filesystem whose client fails with an empty message, as s3fs's ValueError('') does."""

    protocol = "dcpextsilent"

    def __init__(self, *args, **kwargs):
        raise ValueError()


def test_a_backend_failing_with_an_empty_message_is_named_by_its_error_type() -> None:
    fsspec.register_implementation("dcpextsilent", _SilentlyFailingFileSystem, clobber=True)
    with pytest.raises(InvalidRequestError, match=r"^dcpextsilent://b/ckpt: cannot open this URL \(ValueError\)$"):
        Location("dcpextsilent://b/ckpt")
