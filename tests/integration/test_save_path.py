"""The synchronous save path: each data file goes to disk while it is still being written
(early writeback), records are flushed once per file, and what lands reads back bit-exact
through our reader, through stock DCP's and through ``verify_checkpoint``."""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dcp_ext import ShardLoadPlanner, ShardReader, ShardWriter
from dcp_ext.storage.verify import verify_checkpoint
from dcp_ext.storage.writeback import WRITEBACK_BYTES, EarlyWriteback, early_writeback

from mp import run_job
from support import assert_state_dict_equal, garbage_like

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


def test_early_writeback_queues_each_stretch_once(tmp_path):
    target = tmp_path / "file"
    pieces = [bytes([n]) * size for n, size in enumerate((1000, 5000, 100, 3000, 9000), start=1)]
    with open(target, "wb", buffering=1 << 20) as out:
        writeback = EarlyWriteback(out, stretch=4096)
        queued, position = [], 0
        for piece in pieces:
            out.write(piece)
            position += len(piece)
            writeback.written(position)
            queued.append(writeback.started)
    assert queued == [0, 6000, 6000, 6000, 18100]  # queued once 4096 bytes are pending
    assert target.read_bytes() == b"".join(pieces)


def test_early_writeback_needs_a_real_file():
    assert early_writeback(io.BytesIO()) is None  # no file descriptor: nothing to hand the kernel
