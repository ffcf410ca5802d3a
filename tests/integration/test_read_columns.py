"""ShardLoadPlanner hands ShardReader a load's tensor pieces as columns (``read_columns``)
only where both ends are ours; every other pairing gets the same pieces as ReadItems.

The DCP load protocol is run step by step here (as ``dcp.load`` runs it in one process)
so the final plan can be looked at; the bytes land through the reader's own ``read_data``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan

from dcp_ext import ShardLoadPlanner, ShardReader, ShardWriter
from dcp_ext.errors import ChecksumMismatchError, CorruptCheckpointError
from dcp_ext.storage.executors import EXECUTORS, ScatterReads
from dcp_ext.storage.read_columns import TensorReads
from dcp_ext.storage.read_plan import SLAB_BYTES, Request

from support import assert_tensor_equal, garbage_like, load_error


def _saved(path, **writer_options) -> dict:
    g = torch.Generator().manual_seed(11)
    state = {
        "w": torch.randn(6, 5, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "step": 12,
    }
    dcp.save(state, storage_writer=ShardWriter(path, **writer_options), no_dist=True)
    return state


def _final_plan(reader: ShardReader, planner: ShardLoadPlanner, state: dict) -> LoadPlan:
    """DCP's load steps up to the plan ``read_data`` receives (one process, coordinator)."""
    metadata = reader.read_metadata()
    planner.set_up_planner(state, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    local = reader.prepare_local_plan(planner.create_local_plan())
    central = reader.prepare_global_plan(planner.create_global_plan([local]))[0]
    return planner.finish_plan(central)


def _load(reader: ShardReader, planner: ShardLoadPlanner, state: dict) -> LoadPlan:
    plan = _final_plan(reader, planner, state)
    reader.read_data(plan, planner).wait()
    return plan


def _garbage(saved: dict) -> dict:
    return {k: garbage_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in saved.items()}


def _check(got: dict, saved: dict) -> None:
    for key, want in saved.items():
        if isinstance(want, torch.Tensor):
            assert_tensor_equal(got[key], want, key)
        else:
            assert got[key] == want, key


def test_our_planner_and_reader_pass_tensor_pieces_as_columns(tmp_path):
    saved = _saved(tmp_path)
    got = _garbage(saved)
    reader = ShardReader(tmp_path)
    plan = _load(reader, ShardLoadPlanner(), got)
    assert isinstance(plan.planner_data, TensorReads) and len(plan.planner_data) == 3
    assert [item.dest_index.fqn for item in plan.items] == ["step"]  # the bytes item stays a ReadItem
    _check(got, saved)
    assert reader.last_report.items_read == 4


class ReadsItself(ShardReader):
    def read_data(self, plan, planner):  # noqa: ANN001, ANN201
        self.seen = plan
        return super().read_data(plan, planner)


class CountsCommits(ShardLoadPlanner):
    def __init__(self) -> None:
        super().__init__()
        self.committed: list[str] = []

    def commit_tensor(self, read_item, tensor):  # noqa: ANN001, ANN201
        self.committed.append(read_item.dest_index.fqn)


@pytest.mark.parametrize("pairing", ["reader subclass", "planner hook", "stock reader"])
def test_any_other_pairing_gets_every_piece_as_a_read_item(tmp_path, pairing):
    """A reader whose read_data is its own, a planner with a per-item hook of its own, and
    stock's reader (which offers nothing) get DCP's ReadItems, the hooks called per item."""
    saved = _saved(tmp_path)
    got = _garbage(saved)
    planner = CountsCommits() if pairing == "planner hook" else ShardLoadPlanner()
    if pairing == "stock reader":
        dcp.load(got, storage_reader=dcp.FileSystemReader(tmp_path), planner=planner, no_dist=True)
    else:
        reader = ReadsItself(tmp_path) if pairing == "reader subclass" else ShardReader(tmp_path)
        plan = _load(reader, planner, got)
        assert plan.planner_data is None
        assert sorted(item.dest_index.fqn for item in plan.items) == ["b", "scalar", "step", "w"]
    _check(got, saved)
    if pairing == "planner hook":
        assert sorted(planner.committed) == ["b", "scalar", "w"]


def test_columns_read_items_are_the_ones_handed_to_other_readers(tmp_path):
    _saved(tmp_path)
    state = _garbage(_saved(tmp_path))
    reads = _final_plan(ShardReader(tmp_path), ShardLoadPlanner(), state).planner_data
    items = _final_plan(ReadsItself(tmp_path), ShardLoadPlanner(), state).items
    assert reads.read_items() == [item for item in items if item.dest_index.fqn != "step"]


def test_pieces_whose_records_need_more_than_the_index_go_as_read_items(tmp_path):
    """Compressed records (decoded whole) are read through ReadItems inside our reader."""
    saved = _saved(tmp_path, compression="zstd")
    got = _garbage(saved)
    reader = ShardReader(tmp_path)
    plan = _load(reader, ShardLoadPlanner(), got)
    assert isinstance(plan.planner_data, TensorReads)
    _check(got, saved)
    assert reader.last_report.items_read == 4


def test_a_verified_load_of_records_without_crc32c_checks_their_zip_crc32(tmp_path):
    """A record the index gives no CRC32C for (checksums=False) is parsed for its zip
    CRC-32 when checksums are verified: a ReadItem, and a flipped payload byte is caught."""
    saved = _saved(tmp_path, checksums=False)
    record = ShardReader(tmp_path)._require_catalog().item(MetadataIndex("w", torch.Size([0, 0])))
    with open(tmp_path / record.relative_path, "r+b") as f:
        f.seek(record.payload_offset + 5)
        byte = f.read(1)
        f.seek(record.payload_offset + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    got = _garbage(saved)
    _load(ShardReader(tmp_path, verify_checksums=True, cache_metadata=False), ShardLoadPlanner(), {"b": got["b"]})
    assert_tensor_equal(got["b"], saved["b"], "b")
    with pytest.raises(ChecksumMismatchError, match="crc32 mismatch"):
        _load(ShardReader(tmp_path, verify_checksums=True, cache_metadata=False), ShardLoadPlanner(), got)


def test_a_fresh_process_loads_without_importing_numpy_ma(tmp_path):
    """``np.unique`` imports ``numpy.ma`` on its first call, 10 ms of a resumed job's first
    load; the load path (record lookups included) dedupes rows without it."""
    import subprocess
    import sys

    _saved(tmp_path)
    script = (
        "import sys, torch, torch.distributed.checkpoint as dcp\n"
        "from dcp_ext import ShardLoadPlanner, ShardReader\n"
        "state = {'w': torch.empty(6, 5), 'b': torch.empty(7, dtype=torch.bfloat16), 'scalar': torch.empty(()), 'step': 0}\n"
        "before = 'numpy.ma' in sys.modules\n"
        f"dcp.load(state, storage_reader=ShardReader({str(tmp_path)!r}), planner=ShardLoadPlanner(), no_dist=True)\n"
        "assert state['step'] == 12, state['step']\n"
        "print(before, 'numpy.ma' in sys.modules, 'pandas' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    before, after, pandas = done.stdout.split()
    if before == "True" or pandas == "True":  # pyarrow's Parquet reader imports pandas where it is installed
        pytest.skip("numpy.ma or pandas (which imports it) is imported outside our code in this environment")
    assert after == "False"


class RecordingReads(ScatterReads):
    """The local executor, keeping the requests it was handed (it still reads them all)."""

    handed: list[Request] = []

    def run(self, requests, identity, **kwargs):  # noqa: ANN001, ANN003, ANN201
        taken = list(requests)
        RecordingReads.handed = taken
        return super().run(taken, identity, **kwargs)


def test_whole_records_going_straight_share_requests_in_file_order(tmp_path, monkeypatch):
    """Whole chunks filling whole host destinations are read as one request per ~SLAB_BYTES
    of records (``StraightRecords``); a destination that needs its layout (strided, another
    dtype) gets its own requests between them, a record over SLAB_BYTES its slabs, an empty
    one none; every byte lands."""
    g = torch.Generator().manual_seed(5)
    saved = {f"small.{i}": torch.randn(64, 33 + i, generator=g) for i in range(40)}
    saved["empty"] = torch.empty(0, 8)
    saved["big"] = torch.randn(SLAB_BYTES // 4 + 1000, generator=g)  # over one slab
    saved["strided"] = torch.randn(12, 10, generator=g)
    saved["as_bf16"] = torch.randn(9, 7, generator=g)
    dcp.save(saved, storage_writer=ShardWriter(tmp_path), no_dist=True)
    got = {k: garbage_like(v) for k, v in saved.items()}
    got["strided"] = garbage_like(saved["strided"].t().contiguous()).t()  # same shape, not contiguous
    got["as_bf16"] = garbage_like(saved["as_bf16"]).to(torch.bfloat16)
    monkeypatch.setitem(EXECUTORS, "local", RecordingReads)
    dcp.load(got, storage_reader=ShardReader(tmp_path), planner=ShardLoadPlanner(), no_dist=True)
    for key, want in saved.items():
        assert_tensor_equal(got[key], want.to(got[key].dtype), key)
    handed = RecordingReads.handed
    spans = [(r.path, r.ranges[0][0], r.ranges[-1][0] + r.ranges[-1][1]) for r in handed]
    for (path, _, end), (next_path, start, _) in zip(spans, spans[1:]):
        assert path != next_path or end <= start  # in file order, none inside another
    ranges = sorted((r.path, *rng) for r in handed for rng in r.ranges)
    assert all(a[0] != b[0] or a[1] + a[2] <= b[1] for a, b in zip(ranges, ranges[1:]))  # no byte asked twice
    packed = [r for r in handed if len(r.ranges) > 1]
    assert sum(len(r.ranges) for r in packed) >= 40  # the small records, together
    assert len(handed) < 12  # 44 records: one request per record before


def test_read_items_and_direct_pieces_sharing_files_are_read_file_by_file_in_record_order(tmp_path, monkeypatch):
    """Values read through ReadItems (numbers and strings; tensors whose destination is an
    ``nn.Parameter``, which the planner resolves) share data files with tensor pieces read
    as columns, their records interleaved: each file's requests come together and in
    record order, and every value lands. A file cut short is refused naming the key of its
    last record."""
    g = torch.Generator().manual_seed(8)
    saved: dict = {}
    for i in range(12):
        saved[f"t{i}"] = torch.randn(40 + i, 9, generator=g)
        saved[f"n{i}"] = 7 * i
        saved[f"s{i}"] = f"text {i}"
    dcp.save(saved, storage_writer=ShardWriter(tmp_path, thread_count=2), no_dist=True)
    got = _garbage(saved)
    got.update({k: "" for k in saved if k.startswith("s")})
    params = {f"t{i}" for i in range(1, 12, 2)}
    got.update({k: torch.nn.Parameter(got[k], requires_grad=False) for k in params})
    monkeypatch.setitem(EXECUTORS, "local", RecordingReads)
    reader = ShardReader(tmp_path, cache_metadata=False)
    dcp.load(got, storage_reader=reader, planner=ShardLoadPlanner(), no_dist=True)
    _check(got, saved)
    assert reader.last_report.items_read == len(saved)
    handed = RecordingReads.handed
    paths = [request.path for request in handed]
    assert len(set(paths)) == 2 and paths == sorted(paths)  # file by file
    spans = [(r.path, r.ranges[0][0], r.ranges[-1][0] + r.ranges[-1][1]) for r in handed]
    for (path, _, end), (next_path, start, _) in zip(spans, spans[1:]):
        assert path != next_path or end <= start, spans  # in record order: no request reaches into the next
    for request in handed:  # and within each request (records read together)
        assert all(a + n <= b for (a, n), (b, _) in zip(request.ranges, request.ranges[1:])), request.ranges

    catalog = reader._require_catalog()
    last = max((item for item in catalog.items.values() if item.relative_path == paths[0]), key=lambda item: item.offset)
    last_key = next(index.fqn for index, item in catalog.items.items() if item == last)
    os.truncate(tmp_path / paths[0], last.offset + last.length - 1)
    error = load_error(saved, tmp_path, cache_metadata=False)
    assert isinstance(error, CorruptCheckpointError)
    assert f"file {paths[0]!r} key {last_key!r}: item needs bytes up to {last.offset + last.length} " in str(error)
