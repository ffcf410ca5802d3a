"""TP-replica file locality: each TP rank saves and reloads replicated tensors from its own file."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.cli.inspect_cmd import describe
from dcp_ext.storage.catalog import read_catalog
from dcp_ext.storage.location import Location

from mp import run_job
from support import assert_tensor_equal, garbage_like

SPECS = {  # name -> (shape, placement on the tp dim)
    "attn.qkv.weight": ((16, 8), Shard(0)),
    "attn.proj.weight": ((8, 16), Shard(1)),
    "norm1.weight": ((8,), Replicate()),
    "norm2.weight": ((8,), Replicate()),
    "proj.bias": ((8,), Replicate()),
    "router.weight": ((4, 8), Replicate()),
}


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {name: torch.randn(shape, generator=g) for name, (shape, _) in SPECS.items()}


def _state(world: int) -> dict[str, DTensor]:
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    return {k: distribute_tensor(v, mesh, [Replicate(), SPECS[k][1]]) for k, v in full_tensors().items()}


def _save_and_reload_with(reader: ShardReader, world: int, locality: bool) -> None:
    """Save at TP=world into the reader's checkpoint, reload through it at the same layout
    into garbage, and check every local shard."""
    state = _state(world)
    dcp.save(state, storage_writer=ShardWriter(reader.location.url), planner=ShardSavePlanner(replica_locality=locality))
    expected = {k: v.to_local().clone() for k, v in state.items()}
    for value in state.values():
        value.to_local().copy_(garbage_like(value.to_local()))
    dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner())
    for name, value in state.items():
        assert_tensor_equal(value.to_local(), expected[name], name)


def _save_and_reload(rank: int, world: int, path: str, locality: bool) -> tuple[int, int]:
    """Save at TP=world, reload at the same layout; return (files opened, own data files)."""
    reader = ShardReader(path)
    _save_and_reload_with(reader, world, locality)
    own = [n for n in os.listdir(path) if n.startswith(f"__{rank}_") and n.endswith(".distcp")]
    return reader.stats.files_opened, len(own)


@pytest.mark.mp
def test_each_tp_rank_reads_only_its_own_files(tmp_path):
    local = run_job(_save_and_reload, 4, str(tmp_path / "locality"), True)
    assert all(opened == own for opened, own in local), local
    plain = run_job(_save_and_reload, 4, str(tmp_path / "plain"), False)
    assert sum(opened for opened, _ in plain) > sum(opened for opened, _ in local), (plain, local)
    catalog = read_catalog(Location(tmp_path / "locality"))
    replicated = [n for n, (_, p) in SPECS.items() if isinstance(p, Replicate)]
    for name in replicated:  # one canonical + 3 copies, one per TP rank file
        index = next(i for i in catalog.items if i.fqn == name)
        files = [catalog.items[index].relative_path] + [c.relative_path for c in catalog.copies[index]]
        assert sorted(f.split("_")[2] for f in files) == ["0", "1", "2", "3"]
    assert len(catalog.metadata.state_dict_metadata) == len(SPECS)  # plain keys only
    stats = describe(str(tmp_path / "locality"), stats=True)["stats"]  # dcp-ext inspect --stats
    assert stats["replica_copies"] == 3 * len(replicated)
    assert sorted(stats["bytes_per_rank"]) == [0, 1, 2, 3]
    assert stats["largest"][0]["key"] in ("attn.qkv.weight", "attn.proj.weight")


def _two_stage_reload(rank: int, world: int, path: str, locality: bool) -> tuple[int, int]:
    """Save at TP=world, reload two-stage; return the group's (bytes read, bytes received)."""
    reader = ShardReader(path, two_stage=True)
    _save_and_reload_with(reader, world, locality)
    counts = torch.tensor([reader.stats.bytes_read, reader.stats.bytes_received])
    torch.distributed.all_reduce(counts)
    return int(counts[0]), int(counts[1])


@pytest.mark.mp
def test_two_stage_reads_a_locality_checkpoint_once_per_group(tmp_path):
    """Each rank asked for its own copy of a replicated tensor, so a two-stage load of a
    locality checkpoint shared none of them: every copy was read (the group read 1.75x
    the bytes it needs at TP=2 here) and nothing was exchanged. It reads the canonical
    records, as for a checkpoint saved without locality."""
    plain = run_job(_two_stage_reload, 2, str(tmp_path / "plain"), False)
    local = run_job(_two_stage_reload, 2, str(tmp_path / "locality"), True)
    assert local[0] == plain[0] and local[0][1] > 0, (plain, local)
    unique = sum(v.numel() * v.element_size() for v in full_tensors().values())
    assert local[0][0] == unique, (local, unique)


def _save_replicated_only(rank: int, world: int, path: str) -> None:
    state = {k: v for k, v in _state(world).items() if isinstance(SPECS[k][1], Replicate)}
    dcp.save(state, storage_writer=ShardWriter(path), planner=ShardSavePlanner(replica_locality=True))


@pytest.mark.mp
def test_inspect_counts_files_that_hold_only_copies(tmp_path):
    run_job(_save_replicated_only, 2, str(tmp_path))
    info = describe(str(tmp_path), stats=True)
    data_files = sorted(n for n in os.listdir(tmp_path) if n.endswith(".distcp"))
    assert {n[:3] for n in data_files} == {"__0", "__1"}  # rank 1 writes only copies of rank 0's items
    assert info["files"] == len(data_files) and sorted(info["stats"]["files"]) == data_files


@pytest.mark.mp
@pytest.mark.parametrize("reader", ["stock", "ours-1proc"])
def test_locality_checkpoint_loads_anywhere(tmp_path, reader):
    run_job(_save_and_reload, 4, str(tmp_path), True)
    out = {k: garbage_like(v) for k, v in full_tensors().items()}
    storage = dcp.FileSystemReader(tmp_path) if reader == "stock" else ShardReader(tmp_path)
    dcp.load(out, storage_reader=storage)
    for name, value in full_tensors().items():
        assert torch.equal(out[name], value), name


def _reload_at_tp2(rank: int, world: int, path: str) -> None:
    state = _state(world)
    expected = {k: v.to_local().clone() for k, v in state.items()}
    for value in state.values():
        value.to_local().copy_(garbage_like(value.to_local()))
    dcp.load(state, storage_reader=ShardReader(path), planner=ShardLoadPlanner())
    for name, value in state.items():
        assert_tensor_equal(value.to_local(), expected[name], name)


@pytest.mark.mp
def test_locality_checkpoint_loads_at_another_tp_degree(tmp_path):
    run_job(_save_and_reload, 4, str(tmp_path), True)
    run_job(_reload_at_tp2, 2, str(tmp_path))


@pytest.mark.mp
def test_verify_checks_every_copy(tmp_path):
    import subprocess
    import sys

    run_job(_save_and_reload, 4, str(tmp_path), True)
    catalog = read_catalog(Location(tmp_path))
    index = next(i for i in catalog.copies if i.fqn == "router.weight")
    copy = catalog.copies[index][0]
    with open(tmp_path / copy.relative_path, "r+b") as f:  # corrupt one copy only
        f.seek(copy.payload_offset + 3)
        byte = f.read(1)
        f.seek(copy.payload_offset + 3)
        f.write(bytes([byte[0] ^ 0x10]))
    result = subprocess.run([sys.executable, "-m", "dcp_ext.cli.main", "verify", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 1 and copy.relative_path in result.stdout and "router.weight" in result.stdout


def _locality_without_tp_dim(rank: int, world: int, path: str) -> str:
    """A 1-D TP mesh made without mesh_dim_names: replica_locality cannot take effect."""
    from torch.distributed.checkpoint.api import CheckpointException

    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(v, mesh, [SPECS[k][1]]) for k, v in full_tensors().items()}
    try:
        dcp.save(state, storage_writer=ShardWriter(path), planner=ShardSavePlanner(replica_locality=True))
    except CheckpointException as exc:
        return str(next(iter(exc.failures.values()))[0])
    return "saved"


@pytest.mark.mp
def test_replica_locality_on_a_mesh_without_the_tp_dim_is_an_error(tmp_path):
    messages = run_job(_locality_without_tp_dim, 2, str(tmp_path))
    for message in messages:
        assert "replica_locality=True" in message and "tp_dim='tp'" in message and "unnamed" in message, message
    assert not os.path.exists(tmp_path / ".metadata")


def test_tp_dim_without_replica_locality_is_an_error():
    from dcp_ext import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="tp_dim only applies with replica_locality=True"):
        ShardSavePlanner(tp_dim="model")


def test_replica_locality_without_the_replica_check_is_an_error():
    """Unchecked TP replicas may differ (per-rank statistics): with locality the plain
    reader gave each rank its own copy back, two-stage and stock readers the canonical
    one, so the value loaded depended on the reader."""
    from dcp_ext import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=r"replica_locality=True, check_replicas=False\): .* depend on the reader"):
        ShardSavePlanner(replica_locality=True, check_replicas=False)
    assert not ShardSavePlanner(check_replicas=False).check_replicas  # each alone stays allowed
    assert ShardSavePlanner(replica_locality=True).replica_locality


def _locality_with_other_writer(rank: int, world: int, path: str, writer: str) -> str:
    storage = dcp.FileSystemWriter(path) if writer == "stock" else HuggingFaceStorageWriter(path)
    try:
        dcp.save(_state(world), storage_writer=storage, planner=ShardSavePlanner(replica_locality=True))
    except CheckpointException as exc:
        return str(next(iter(exc.failures.values()))[0])
    return "saved"


@pytest.mark.mp
@pytest.mark.parametrize("writer", ["stock", "hf"])
def test_locality_needs_shard_writer(tmp_path, writer):
    """Another writer recorded the copies in .metadata under dcp_ext's key class (stock
    readers without dcp_ext could not unpickle it) or wrote them as overlapping chunks:
    refused in the global plan, before any rank writes."""
    errors = run_job(_locality_with_other_writer, 2, str(tmp_path), writer)
    assert all("replica_locality=True) needs ShardWriter" in e for e in errors), errors
    assert not [n for n in os.listdir(tmp_path) if n.endswith((".distcp", ".safetensors", ".metadata"))]
