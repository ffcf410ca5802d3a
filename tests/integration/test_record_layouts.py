"""Stock records recognized by their frame (``RecordLayouts``) instead of parsed one by one.

A stock DCP file holds one ``torch.save`` record per tensor. Once one record of a kind is
parsed, later ones of the same length are compared with it, leaving out only the bytes
no parse reads (storage bytes, serialization id, their CRC-32s). The claim to test is
that this never changes an answer: for every record, and for every byte flipped in the
parts a parse reads, the result is exactly what a full parse gives, error included.
"""

from __future__ import annotations

import io
import os
import re
import struct
import threading
import uuid
import zipfile

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_ext import ShardLoadPlanner, ShardReader
from dcp_ext.errors import CheckpointError, CorruptCheckpointError
from dcp_ext.formats import torch_record
from dcp_ext.formats.torch_record import PROBE_BYTES, RecordLayouts, _save_record, parse_tensor_record, probed_ranges
from dcp_ext.storage import executors
from dcp_ext.storage import reader as reader_module
from dcp_ext.storage import location as location_module
from dcp_ext.storage.location import LocalRangeReader

from support import evict, garbage, load_error


def record(tensor: torch.Tensor, zip_crc: bool = True) -> bytes:
    out = io.BytesIO()
    _save_record(tensor, out, zip_crc)
    return out.getvalue()


def reader_of(data: bytes):
    return lambda offset, n: data[offset : offset + n]


def outcome(parse, data: bytes):
    """A parse's layout, or the type and text of what it raised."""
    try:
        return parse(len(data), reader_of(data), "f key 'k'")
    except CheckpointError as exc:
        return type(exc), str(exc)


KINDS = {  # name -> several tensors of one kind (bf16 and fp32 kinds share a byte size)
    "fp32": lambda n: torch.randn(64, 64) + n,
    "bf16 of the same bytes": lambda n: torch.randn(64, 128).to(torch.bfloat16) + n,
    "large": lambda n: torch.randn(300, 100) + n,  # head and tail apart
    "transposed view": lambda n: (torch.randn(40, 30) + n).t(),
    "conj view": lambda n: torch.randn(8, 8, dtype=torch.complex64).conj(),
    "narrowed view": lambda n: torch.randn(50, 60)[5:45],
    "int8 0-d": lambda n: torch.tensor(n, dtype=torch.int8),
    "empty": lambda n: torch.empty(0, 7),
}


def test_records_of_a_kind_after_the_first_need_no_full_parse():
    records = [record(make(n)) for n in range(6) for make in KINDS.values()]
    layouts = RecordLayouts()
    for data in records:
        assert outcome(layouts.parse, data) == outcome(parse_tensor_record, data)
    assert layouts.parsed_in_full <= len(KINDS) + 2  # a view's varying offset can make a second kind
    assert layouts.parsed_in_full < len(records) / 2


def test_a_record_is_compared_only_with_frames_that_begin_as_it_does(monkeypatch):
    """fp32 [64, 64] and bf16 [64, 128] records have one length; interleaved (as a model's
    weights and biases are), each is compared with its own kind's frame alone, never first
    with the other's (their zip headers are alike; their pickles' first bytes are not)."""
    compared: list[torch.dtype] = []
    match = torch_record._Frame.match
    monkeypatch.setattr(torch_record._Frame, "match", lambda self, ends: compared.append(self.parsed.layout.dtype) or match(self, ends))
    makers = [KINDS["fp32"], KINDS["bf16 of the same bytes"]]
    records = [(make(n).dtype, record(make(n))) for n in range(5) for make in makers]
    assert len({len(data) for _, data in records}) == 1
    layouts = RecordLayouts()
    for dtype, data in records:
        compared.clear()
        assert outcome(layouts.parse, data) == outcome(parse_tensor_record, data)
        assert set(compared) <= {dtype}
    assert layouts.parsed_in_full == 2


@pytest.mark.parametrize("kind", ["fp32", "large", "conj view"])
@pytest.mark.parametrize("first_crc, crc", [(True, True), (True, False), (False, False), (False, True)])
def test_every_flipped_byte_gives_the_full_parse_answer(kind, first_crc, crc):
    """A record framed like the first in all but one byte of its ends (head and tail),
    with or without zip CRC-32s on either: same layout or same error as a full parse."""
    make = KINDS[kind]
    first, second = record(make(0), first_crc), bytearray(record(make(1), crc))
    assert len(first) == len(second)
    head_and_tail = sorted(set(range(min(len(second), PROBE_BYTES))) | set(range(max(0, len(second) - PROBE_BYTES), len(second))))
    for position in head_and_tail[:: 3 if len(head_and_tail) > 4096 else 1]:
        second[position] ^= 0xFF
        layouts = RecordLayouts()
        layouts.parse(len(first), reader_of(first), "f key 'k'")
        assert outcome(layouts.parse, bytes(second)) == outcome(parse_tensor_record, bytes(second)), position
        second[position] ^= 0xFF


def padded_record(tensor: torch.Tensor, pad: int) -> bytes:
    """A ``torch.save`` record rewritten with ``pad`` bytes of a pickled string (popped at
    once: the same tensor) before the pickle's tensor."""
    archive = zipfile.ZipFile(io.BytesIO(record(tensor)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as rewritten:
        for info in archive.infolist():
            data = archive.read(info.filename)
            if info.filename.endswith("data.pkl"):  # PROTO 2, then BINUNICODE + POP, then the rest
                data = data[:2] + b"X" + struct.pack("<I", pad) + b"p" * pad + b"0" + data[2:]
            rewritten.writestr(info.filename, data)
    return out.getvalue()


def central_crc_fields(data: bytes) -> dict[str, int]:
    """Where each entry's CRC-32 lies in the record's central directory."""
    check = zipfile.ZipFile(io.BytesIO(data))
    fields, at = {}, check.start_dir
    for info in check.infolist():
        fields[info.filename] = at + 16
        at += 46 + sum(struct.unpack("<HHH", data[at + 28 : at + 34]))
    return fields


def padded_record_without_crcs(tensor: torch.Tensor, pad: int) -> bytes:
    """``padded_record`` with every zip CRC-32 set to 0 as in a record written without
    them (ours, or ``set_crc32_options(False)``)."""
    data = bytearray(padded_record(tensor, pad))
    for info in zipfile.ZipFile(io.BytesIO(bytes(data))).infolist():
        data[info.header_offset + 14 : info.header_offset + 18] = bytes(4)  # local header CRC-32
    for field in central_crc_fields(bytes(data)).values():
        data[field : field + 4] = bytes(4)
    return bytes(data)


def test_a_crc_field_across_the_end_of_the_head_is_read_from_the_tail():
    """A record under two probes long holds its middle twice (head and tail overlap); its
    storage entry's CRC-32 field across the head's end is whole only in the tail, where a
    frame match must read it: the second record's CRC-32 is its own, as a full parse says."""
    tensor = lambda n: torch.arange(16.0) + n  # noqa: E731

    def storage_crc_field(data: bytes) -> int:
        return next(at for name, at in central_crc_fields(data).items() if name.endswith("/data/0"))

    pad = next(p for p in range(3000, 4200) if storage_crc_field(padded_record(tensor(0), p)) in range(PROBE_BYTES - 3, PROBE_BYTES))
    first, second = padded_record(tensor(0), pad), padded_record(tensor(1), pad)
    assert len(first) == len(second) < 2 * PROBE_BYTES
    layouts = RecordLayouts()
    layouts.parse(len(first), reader_of(first), "f key 'k'")
    assert outcome(layouts.parse, second) == outcome(parse_tensor_record, second)
    assert layouts.parsed_in_full == 1


def test_a_record_whose_pickle_reaches_past_the_head_is_always_parsed_in_full():
    """Two records of one length whose pickles differ only beyond the probed head (no CRC
    to tell them apart): the second is not taken for the first's frame. Before, it was
    given the first's shape, (64, 64) for a (32, 128) tensor."""
    first = padded_record_without_crcs(torch.randn(64, 64), PROBE_BYTES + 2000)
    second = padded_record_without_crcs(torch.randn(32, 128), PROBE_BYTES + 2000)
    assert len(first) == len(second) and first[:PROBE_BYTES] == second[:PROBE_BYTES]
    layouts = RecordLayouts()
    assert outcome(layouts.parse, first).shape == (64, 64)
    assert outcome(layouts.parse, second) == outcome(parse_tensor_record, second)
    assert outcome(layouts.parse, second).shape == (32, 128)
    assert layouts.parsed_in_full == 3


def test_a_stock_checkpoint_of_mixed_kinds_loads_bit_exact(tmp_path):
    """Stock DCP's own files (two per rank, several kinds of one byte size) through the
    reader, into destinations that start as garbage."""
    state = {f"{name}.{n}": make(n).contiguous() for n in range(5) for name, make in KINDS.items() if "view" not in name}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=2), no_dist=True)
    dst = {k: garbage(v.shape, v.dtype) for k, v in state.items()}
    dcp.load(dst, storage_reader=ShardReader(tmp_path, cache_metadata=False), planner=ShardLoadPlanner(), no_dist=True)
    for key, want in state.items():
        assert torch.equal(dst[key], want), key


def test_a_corrupt_record_in_a_later_file_fails_the_load_by_name(tmp_path):
    """Files are planned one after the other while the earlier ones are read: a record of
    the last file that cannot be parsed fails the load naming it, and no read is left running."""
    state = {f"w{n}": torch.randn(64, 64) for n in range(8)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=2), no_dist=True)
    last = sorted(tmp_path.glob("*.distcp"))[-1]
    data = bytearray(last.read_bytes())
    at = data.rindex(b"_rebuild_tensor_v2")  # the pickle of the file's last record
    data[at : at + 18] = b"_rebuild_tensor_vX"
    last.write_bytes(bytes(data))
    error = load_error(state, tmp_path, ShardLoadPlanner())
    assert isinstance(error, CorruptCheckpointError), error
    assert re.search(rf"file '{last.name}' key 'w\d': zip entry 'archive/data.pkl' fails its CRC-32$", str(error)), error
    assert not [t for t in threading.enumerate() if t.name.startswith("dcp_ext-read")]


def _stock_one_file(tmp_path) -> dict[str, torch.Tensor]:
    """A stock checkpoint one process wrote: one file of many records (one per tensor)."""
    state = {f"{name}.{n}": make(n).contiguous() for n in range(12) for name, make in KINDS.items() if "view" not in name}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=1), no_dist=True)
    return state


def _note_parsing_threads(monkeypatch) -> list[str]:
    """The name of the thread that parses each record's layout, in order."""
    parsed_on: list[str] = []
    real_parse = RecordLayouts.parse

    def noted(self, *args):
        parsed_on.append(threading.current_thread().name)
        return real_parse(self, *args)

    monkeypatch.setattr(RecordLayouts, "parse", noted)
    return parsed_on


def _load_bit_exact(path: str, state: dict[str, torch.Tensor], **options) -> None:
    dst = {k: garbage(v.shape, v.dtype) for k, v in state.items()}
    dcp.load(dst, storage_reader=ShardReader(path, cache_metadata=False, thread_count=4, **options),
             planner=ShardLoadPlanner(), no_dist=True)
    for key, want in state.items():
        assert torch.equal(dst[key], want), key


def _covered(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether the ``(offset, length)`` ranges cover ``[start, end)``."""
    for offset, length in sorted(ranges):
        if offset <= start < offset + length:
            start = offset + length
    return start >= end


def test_records_not_in_memory_are_prefetched_then_parsed_bit_exact(tmp_path, monkeypatch):
    """When the page cache lacks a stock file's records, the kernel is asked for the head
    and tail of the first record of each length, dtype and shape at once
    (``POSIX_FADV_WILLNEED``), then the planning thread parses them (CPU work under the
    GIL, which threads slow down), and their pages are dropped again
    (``POSIX_FADV_DONTNEED``: left cached, they broke the readahead of the data reads that
    follow); the records like one of them are read whole and parsed as they land
    (``GuessedLayout``). When the cache holds them, nothing is asked or dropped. Either
    way every record is parsed once and every tensor lands bit-exact."""
    state = _stock_one_file(tmp_path)
    (data_file,) = tmp_path.glob("*.distcp")
    stored = dcp.FileSystemReader(tmp_path).read_metadata().storage_data.items()
    records = [record for index, record in stored if state[index.fqn].numel()]  # an empty one is not parsed
    kinds, firsts = set(), []  # the first record of each kind in the file, read ahead of the data
    for index, record in sorted(stored, key=lambda pair: pair[1].offset):
        kind = (record.length, state[index.fqn].dtype, state[index.fqn].shape)
        if state[index.fqn].numel() and kind not in kinds:
            kinds.add(kind)
            firsts.append(record)
    assert len(firsts) < len(records)  # some are guessed
    parsed_on = _note_parsing_threads(monkeypatch)
    advised: list[tuple[int, int]] = []
    released: list[tuple[int, int]] = []
    real_fadvise = os.posix_fadvise

    def noted(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            advised.append((offset, length))
        if advice == os.POSIX_FADV_DONTNEED:
            released.append((offset, length))
        real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(location_module.os, "posix_fadvise", noted)
    for attempt in ("cold", "warm"):
        if attempt == "cold":
            evict(data_file)
            if LocalRangeReader(str(data_file)).holds([0]):
                pytest.skip("this file system keeps the file's pages (tmpfs) or has no RWF_NOWAIT")
            evict(data_file)  # the probe may have started reading ahead
        parsed_on.clear(), advised.clear(), released.clear()
        _load_bit_exact(str(tmp_path), state)
        assert len(parsed_on) == sum(v.numel() > 0 for v in state.values())  # an empty one reads nothing
        assert not [name for name in parsed_on if name.startswith("dcp_ext-probe")], parsed_on
        if attempt == "warm":
            assert not advised and not released
            continue
        assert len(advised) < 2 * len(records), advised  # neighbouring ends asked together
        for record in firsts:
            head, tail = min(record.length, PROBE_BYTES), max(0, record.length - PROBE_BYTES)
            for ranges in (advised, released):
                assert _covered(ranges, record.offset, record.offset + head), (record, ranges)
                assert _covered(ranges, record.offset + tail, record.offset + record.length), (record, ranges)


def _read_syscalls() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("syscr:"))


def test_a_stock_files_record_ends_are_read_a_span_at_a_time_and_parse_as_in_full(tmp_path):
    """A stock file's records lie back to back, so the tail of one and the head of the next
    touch: the parse reads each such span once (the kernel counts the read calls: about
    one a record, where two small reads a record took 2-5 us each of Python around them),
    and every layout is what a full parse of that record alone gives."""
    if not os.path.exists("/proc/self/io"):
        pytest.skip("no /proc/self/io to count read calls")
    state = _stock_one_file(tmp_path)
    reader = ShardReader(tmp_path, cache_metadata=False)
    reader.read_metadata()
    stored = [(index, record) for index, record in reader.catalog.metadata.storage_data.items() if state[index.fqn].numel()]
    (data_file,) = tmp_path.glob("*.distcp")
    data = data_file.read_bytes()  # in the page cache too: the warm path, which reads as it parses
    spans = location_module.merged_ranges([(r.offset + start, n) for _, r in stored for start, n in probed_ranges(r.length)])
    assert len(spans) < 1.2 * len(stored)
    counting = -(_read_syscalls() - _read_syscalls())  # the count's own reads
    before = _read_syscalls()
    layouts = reader.catalog.parse_layouts(reader.location, [index for index, _ in stored])
    assert _read_syscalls() - before - counting <= len(spans) + 1  # and one asking whether the file is in memory
    for (index, record), layout in zip(stored, layouts):
        assert layout == parse_tensor_record(record.length, reader_of(data[record.offset : record.offset + record.length]), "")


def _in_memory_store(tmp_path) -> str:
    """The files of ``tmp_path`` copied into fsspec's memory filesystem (a remote store
    that answers one request at a time): its root."""
    fs, root = fsspec.filesystem("memory"), f"/dcp_ext_probe_{uuid.uuid4().hex}"
    for file in tmp_path.iterdir():
        fs.pipe(f"{root}/{file.name}", file.read_bytes())
    return root


def test_records_on_a_store_that_takes_no_prefetch_are_probed_on_several_threads_bit_exact(tmp_path, monkeypatch):
    """A store that answers one request at a time and cannot fetch ahead (a synchronous
    fsspec filesystem; an async one, S3, is tested in test_s3): the records' heads and
    tails are read on the reader's threads, sharing the frames, their small reads waiting
    together, and every record is read into its destination (none whole)."""
    state = _stock_one_file(tmp_path)
    root = _in_memory_store(tmp_path)
    parsed_on = _note_parsing_threads(monkeypatch)
    try:
        _load_bit_exact(f"memory://{root}", state, require_commit_marker=False)
    finally:
        fsspec.filesystem("memory").rm(root, recursive=True)
    assert len(parsed_on) == sum(v.numel() > 0 for v in state.values())
    assert all(name.startswith("dcp_ext-probe") for name in parsed_on), parsed_on


def test_whole_stock_records_are_read_in_shared_requests_bit_exact(tmp_path, monkeypatch):
    """A stock file's records that land as they are in their destinations (most of them)
    are read as one request per run of neighbours (``StraightRecords``), as our own
    checkpoint's direct pieces are; a conjugated view (its bit resolved after the read)
    and a strided view each keep a request of their own. Every destination lands bit-exact."""
    state = {f"w{n}": torch.randn(32, 16 + n) for n in range(40)}
    state["conj"] = torch.randn(4, 4, dtype=torch.complex64).conj()
    state["transposed"] = torch.randn(12, 10).t()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=1), no_dist=True)
    handed: list = []  # the requests the reader hands its executor
    real_file_tasks = executors.file_tasks

    def noted(requests, limit):
        handed.extend(requests)
        return real_file_tasks(handed, limit)

    monkeypatch.setattr(executors, "file_tasks", noted)
    dst = {k: garbage(v.shape, v.dtype) for k, v in state.items()}
    dcp.load(dst, storage_reader=ShardReader(tmp_path, cache_metadata=False), planner=ShardLoadPlanner(), no_dist=True)
    for key, want in state.items():
        assert torch.equal(dst[key].resolve_conj(), want.resolve_conj()), key
    assert len(handed) <= 4, [(r.key, len(r.ranges)) for r in handed]  # the 40 records in one or two, the views alone


def test_a_record_guessed_wrong_still_lands_bit_exact(tmp_path, monkeypatch):
    """A stock record not in the page cache, of the length, dtype and shape of one parsed
    before, is read whole, guessed to be framed as that one (``GuessedLayout``), and parsed
    as it lands. A record
    that shares all three but not its layout (a transposed or a conjugated tensor after
    plain ones) is found out by that parse and copied through its true layout; a kind whose
    first record no straight read takes (transposed or conjugated first) guesses nothing.
    Every tensor lands bit-exact, every record is parsed once, and every layout found as
    a record landed is remembered, as a parse ahead of the data remembers it."""
    state = {
        **{f"p{n}": torch.randn(24, 24) for n in range(4)}, "p_transposed": torch.randn(24, 24).t(),
        "q_transposed": torch.randn(20, 20).t(), **{f"q{n}": torch.randn(20, 20) for n in range(3)},
        **{f"c{n}": torch.randn(6, 6, dtype=torch.complex64) for n in range(3)},
        "c_conj": torch.randn(6, 6, dtype=torch.complex64).conj(),
        "d_conj": torch.randn(5, 5, dtype=torch.complex64).conj(), **{f"d{n}": torch.randn(5, 5, dtype=torch.complex64) for n in range(2)},
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=1), no_dist=True)
    stored = dcp.FileSystemReader(tmp_path).read_metadata().storage_data
    at = {index.fqn: (index, record) for index, record in stored.items()}
    for first, *others in (["p0", "p1", "p_transposed"], ["q_transposed", "q0"], ["c0", "c1", "c_conj"], ["d_conj", "d0"]):
        assert {at[key][1].length for key in others} == {at[first][1].length}  # one kind
        assert all(at[first][1].offset < at[key][1].offset for key in others)  # its first record in the file
    parsed_on = _note_parsing_threads(monkeypatch)
    guessed: list[str] = []
    real_request = reader_module.guessed_record_request

    def noted(item, guess, chunk, dest, key, where, learned):
        guessed.append(key)
        return real_request(item, guess, chunk, dest, key, where, learned)

    monkeypatch.setattr(reader_module, "guessed_record_request", noted)
    dst = {k: garbage(v.shape, v.dtype) for k, v in state.items()}
    (data_file,) = tmp_path.glob("*.distcp")
    evict(data_file)  # guessed only where the ends would wait for the disk
    if LocalRangeReader(str(data_file)).holds([0]):
        pytest.skip("this file system keeps the file's pages (tmpfs) or has no RWF_NOWAIT")
    evict(data_file)
    reader = ShardReader(str(tmp_path), cache_metadata=False)
    dcp.load(dst, storage_reader=reader, planner=ShardLoadPlanner(), no_dist=True)
    for key, want in state.items():
        assert torch.equal(dst[key].resolve_conj(), want.resolve_conj()), key
    assert len(parsed_on) == len(state)  # each record once, ahead of the data or as it landed
    assert sorted(guessed) == sorted(["p1", "p2", "p3", "p_transposed", "c1", "c2", "c_conj"])
    data = (tmp_path / at["p0"][1].relative_path).read_bytes()
    for key in state:
        index, record = at[key]
        assert reader.catalog.known_layout(index) == parse_tensor_record(
            record.length, reader_of(data[record.offset : record.offset + record.length]), key), key


def test_guessed_records_into_another_dtype_are_read_whole_and_cast(tmp_path, monkeypatch):
    """Guessed stock records (not in the page cache) whose destinations take no straight
    read (bf16 destinations of fp32 records) are read whole and copied out as they land,
    still without a read of their ends ahead of the data; every value is the cast."""
    state = {f"w{n}": torch.randn(16, 40) for n in range(6)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=1), no_dist=True)
    (data_file,) = tmp_path.glob("*.distcp")
    evict(data_file)
    if LocalRangeReader(str(data_file)).holds([0]):
        pytest.skip("this file system keeps the file's pages (tmpfs) or has no RWF_NOWAIT")
    evict(data_file)
    whole: list[str] = []
    real_request = reader_module.whole_record_request

    def noted(stored, key, *args):
        whole.append(key)
        return real_request(stored, key, *args)

    monkeypatch.setattr(reader_module, "whole_record_request", noted)
    dst = {k: garbage(v.shape, torch.bfloat16) for k, v in state.items()}
    dcp.load(dst, storage_reader=ShardReader(str(tmp_path), cache_metadata=False), planner=ShardLoadPlanner(), no_dist=True)
    for key, want in state.items():
        assert torch.equal(dst[key], want.to(torch.bfloat16)), key
    stored = dcp.FileSystemReader(tmp_path).read_metadata().storage_data
    first = min(stored, key=lambda index: stored[index].offset).fqn  # parsed ahead of the data
    assert sorted(whole) == sorted(key for key in state if key != first)
