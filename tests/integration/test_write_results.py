"""A rank's write results reach the coordinator's ``finish`` as columns (``WrittenItems``)
and come out as the very results the rank made: plain items, TP-replica copies, the
piece digests, compressed records and records without a checksum."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_ext import ShardSavePlanner, ShardWriter
from dcp_ext.formats.index import StoredItem
from dcp_ext.formats.replica_copy import ReplicaCopyIndex
from dcp_ext.storage.piece_digests import with_piece_digests
from dcp_ext.storage.write_results import WrittenItems

from mp import run_job
from support import garbage_like


def _mixed_results() -> list[WriteResult]:
    results = [
        WriteResult(MetadataIndex(f"layer.{n}.weight", [n * 4, 0], n or None), 1000 + n,
                    StoredItem(f"__0_abc_{n % 2}.distcp", n * 2000, 1000 + n, n * 2000 + 64, None if n == 3 else 7 * n,
                               ("zstd",) if n == 2 else ()))
        for n in range(6)
    ]
    results.insert(2, WriteResult(MetadataIndex("extra_state"), 40, StoredItem("__0_abc_0.distcp", 9000, 40)))  # bytes: no offset
    results.insert(4, WriteResult(ReplicaCopyIndex("norm.weight", [0], 3, tp_rank=1), 16, StoredItem("__1_abc_0.distcp", 0, 16)))
    return with_piece_digests(results, 0, (("layer.1.weight", (4, 0), (2, 8), b"\1" * 16),))


def test_results_round_trip_through_their_pickle():
    results = _mixed_results()
    sent = WrittenItems(results)
    back = pickle.loads(pickle.dumps(sent))
    assert type(back) is WrittenItems and back == results
    assert [type(r.index) for r in back] == [type(r.index) for r in results]
    assert [type(r.storage_data) for r in back] == [type(r.storage_data) for r in results]
    # keys of .metadata's storage_data: equal and hashing alike, offsets as DCP makes them
    assert {r.index: n for n, r in enumerate(back)} == {r.index: n for n, r in enumerate(results)}
    assert all(type(r.index.offset) in (torch.Size, type(None)) for r in back)
    assert len(pickle.dumps(sent)) < len(pickle.dumps(list(results)))


class _RecordingWriter(ShardWriter):
    """What this rank's ``write_data`` handed DCP, and what the coordinator's ``finish`` got."""

    returned: list[WriteResult] | None = None
    received: list[list[WriteResult]] | None = None

    def write_data(self, plan, planner):
        done = super().write_data(plan, planner)
        self.returned = done.value()
        return done

    def finish(self, metadata, results):
        self.received = results
        super().finish(metadata, results)


def _save_job(rank: int, world: int, path: str) -> tuple[list[WriteResult], list[list[WriteResult]] | None]:
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(3)
    state = {f"w.{n}": distribute_tensor(torch.randn(8 + n, 6, generator=g), mesh, [Shard(0)]) for n in range(40)}
    state["bias"] = torch.randn(5, generator=g).to(torch.bfloat16)  # replicated: one rank writes it
    writer = _RecordingWriter(path, compression="zstd")
    dcp.save(state, storage_writer=writer, planner=ShardSavePlanner())
    return writer.returned, writer.received


@pytest.mark.mp
def test_the_coordinator_finishes_with_every_ranks_own_results(tmp_path):
    (returned0, received), (returned1, nothing) = run_job(_save_job, 2, str(tmp_path))
    assert nothing is None and received is not None
    assert [type(r) for r in received] == [WrittenItems, WrittenItems]
    assert received == [returned0, returned1]
    assert len(returned0) + len(returned1) == 81  # 40 keys x 2 shards, the bias once
    # the checkpoint those results committed reads back with stock DCP
    g = torch.Generator().manual_seed(3)
    want = {f"w.{n}": torch.randn(8 + n, 6, generator=g) for n in range(40)}
    want["bias"] = torch.randn(5, generator=g).to(torch.bfloat16)
    out = {k: garbage_like(v) for k, v in want.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(tmp_path))
    for name, value in want.items():
        assert torch.equal(out[name], value), name
