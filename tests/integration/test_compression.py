"""ShardWriter(compression="zstd"): records through DCP's ZStandard stream transform,
read back by ShardReader (plain, verified, resharded) and by stock FileSystemReader."""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_ext import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    InvalidRequestError,
    ShardLoadPlanner,
    ShardReader,
    ShardSavePlanner,
    ShardWriter,
)
from dcp_ext.cli.main import main as cli

from mp import run_job
from support import assert_state_dict_equal, garbage_like, load_error


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return {
        "zeros": torch.zeros(300, 64),  # compresses well
        "noise": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "ids": torch.arange(1000, dtype=torch.int64) % 7,
    }


def save_job(rank: int, world: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_tensors().items()}
    state["step"] = {"n": 12, "tag": "zstd"}
    dcp.save(state, storage_writer=ShardWriter(path, compression="zstd"), planner=ShardSavePlanner())


def load_all(path: str) -> None:
    want = {**full_tensors(), "step": {"n": 12, "tag": "zstd"}}
    for reader in (ShardReader(path), ShardReader(path, verify_checksums=True), dcp.FileSystemReader(path)):
        dest = {k: garbage_like(v) for k, v in full_tensors().items()}
        dest["step"] = {"n": 0, "tag": ""}
        dcp.load(dest, storage_reader=reader, planner=ShardLoadPlanner())
        assert_state_dict_equal(dest, want, type(reader).__name__)


@pytest.mark.mp
def test_compressed_save_loads_resharded_everywhere_and_is_smaller(tmp_path):
    run_job(save_job, 2, str(tmp_path / "zstd"))
    load_all(str(tmp_path / "zstd"))  # 2 -> 1 process, three readers
    metadata = dcp.FileSystemReader(str(tmp_path / "zstd")).read_metadata()
    assert all(info.transform_descriptors == ["stream.zstd/1"] for info in metadata.storage_data.values())
    dcp.save(full_tensors(), storage_writer=ShardWriter(tmp_path / "plain"), planner=ShardSavePlanner())
    size = {name: sum(f.stat().st_size for f in (tmp_path / name).glob("*.distcp")) for name in ("zstd", "plain")}
    assert size["zstd"] * 3 < size["plain"], size


def test_corrupt_compressed_bytes_are_caught_by_the_checksum(tmp_path):
    dcp.save(full_tensors(), storage_writer=ShardWriter(tmp_path, compression="zstd", thread_count=1))
    data = next(p for p in tmp_path.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    assert cli(["verify", str(tmp_path)]) == 1
    dest = {k: garbage_like(v) for k, v in full_tensors().items()}
    with pytest.raises(BaseException) as info:
        dcp.load(dest, storage_reader=ShardReader(tmp_path, verify_checksums=True))
    failure = next(iter(info.value.failures.values()))[0]
    assert isinstance(failure, ChecksumMismatchError) and data.name in str(failure)


@pytest.mark.parametrize("compression", ["lz4", "ZSTD"])
def test_unknown_compression_is_an_error(tmp_path, compression):
    with pytest.raises(InvalidRequestError, match=f"compression={compression!r} is not one of"):
        ShardWriter(tmp_path, compression=compression)
    assert not os.listdir(tmp_path)


class XorExtension(StreamTransformExtension):
    """A user's own stream transform: known to the registry its writer was given, nowhere else."""

    @staticmethod
    def registry_name() -> str:
        return "test.xor"

    @staticmethod
    def from_descriptor(version: str) -> XorExtension:
        return XorExtension()

    def get_descriptor(self) -> str:
        return "test.xor/1"

    def transform_to(self, output):  # noqa: ANN001, ANN201
        class Xored(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b) -> int:  # noqa: ANN001
                return output.write(bytes(x ^ 0x5A for x in bytes(b)))

        return Xored()

    def transform_from(self, input):  # noqa: ANN001, ANN201, A002
        return io.BytesIO(bytes(x ^ 0x5A for x in input.read()))


def test_a_writers_own_stream_extension_is_refused_by_name(tmp_path):
    """Stock loads it given the writer's registry; ShardReader cannot be given one, and says
    so (it said the checkpoint was corrupt)."""
    dcp.save({"w": torch.arange(6.0)}, storage_writer=dcp.FileSystemWriter(tmp_path, _extensions=[XorExtension()]))
    error = load_error({"w": torch.zeros(6)}, tmp_path)
    assert isinstance(error, InvalidRequestError) and not isinstance(error, CorruptCheckpointError)
    assert "key 'w': written through stream transforms ['test.xor/1']" in str(error) and "_extension_registry" in str(error)


def test_a_compressed_load_holds_the_records_in_flight_only(tmp_path):
    """Every compressed record read was kept (stored and decoded bytes) until the whole
    load had landed: a load of 1 GB held 2.1 GB beside its destinations, stock 0.5 GB.
    Python's allocator sees those buffers; one reader thread holds one record at a time."""
    import tracemalloc

    state = {f"w{i}": torch.randn(512, 1024) for i in range(16)}  # 2 MiB each, incompressible
    dcp.save(state, storage_writer=ShardWriter(tmp_path, compression="zstd"), planner=ShardSavePlanner(), no_dist=True)
    out = {k: garbage_like(v) for k, v in state.items()}
    tracemalloc.start()
    try:
        dcp.load(out, storage_reader=ShardReader(tmp_path, thread_count=1), planner=ShardLoadPlanner(), no_dist=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert_state_dict_equal(out, state)
    assert peak < 12 << 20, f"peak {peak >> 20} MiB of Python buffers for 2 MiB records"


@pytest.mark.parametrize("shape", ["same", "other"])
def test_a_compressed_record_of_another_chunk_is_refused(tmp_path, shape):
    """``.metadata`` pointing a key at another key's compressed record: the decoded record
    was copied without checking it holds the chunk (a dtype cast, or a bare size error),
    where an uncompressed one is refused. Stock casts silently."""
    import pickle

    from torch.distributed.checkpoint._extension import ZStandard

    state = {"f": torch.linspace(0.5, 4, 8), "i": torch.arange(100, 108) if shape == "same" else torch.arange(6)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, _extensions=[ZStandard()]), no_dist=True)
    path = tmp_path / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    index = {i.fqn: i for i in metadata.storage_data}
    metadata.storage_data[index["f"]], metadata.storage_data[index["i"]] = (
        metadata.storage_data[index["i"]], metadata.storage_data[index["f"]])
    path.write_bytes(pickle.dumps(metadata))
    error = load_error({k: garbage_like(v) for k, v in state.items()}, tmp_path)
    assert isinstance(error, CorruptCheckpointError), repr(error)
    assert "record holds" in str(error) and "but metadata says" in str(error), error
