"""Interoperability with stock DCP storage, in both directions.

* a checkpoint written by ShardWriter loads bit-exact with stock
  ``FileSystemReader`` + ``DefaultLoadPlanner``;
* checkpoints written by stock ``FileSystemWriter`` (1 and 2 threads) and
  ``FsspecWriter`` load bit-exact with ShardReader + ShardLoadPlanner;

each at the saving world size (2 processes) and resharded to 1 process (where
the DTensors are loaded into plain full tensors), bytes items included.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dcp_ext import InvalidRequestError, ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.cli.main import main as cli

from mp import run_job
from support import assert_state_dict_equal, garbage_like, garbage_state, make_globals

# name -> (global shape, dtype, placement when saved on 2 ranks)
DT_SPECS = {
    "w": ((9, 4), torch.float32, Shard(0)),  # 5 / 4 rows
    "b": ((3, 5), torch.bfloat16, Shard(1)),  # 3 / 2 cols
    "r": ((4,), torch.float16, Replicate()),
    "e": ((1, 4), torch.int64, Shard(0)),  # rank 1 holds an empty shard
    "m": ((6,), torch.bool, Shard(0)),
}

WRITERS = ("ours", "stock_t1", "stock_t2", "fsspec")


GLOBAL_SPECS = {
    **DT_SPECS,
    "plain": ((5, 5), torch.float32),
    "plain_i": ((3,), torch.int64),
    "nested_x": ((2, 2), torch.bfloat16),
}


def _objects() -> dict:
    return {"step": 11, "name": "interop", "cfg": {"lr": 0.1, "sched": [1, 2, 3]}, "hist": [0.5, "y"]}


def _placeholders() -> dict:
    return {"step": 0, "name": "", "cfg": {"lr": 0.0, "sched": []}, "hist": []}


def build(mesh, *, destination: bool):
    """(state_dict, expected).  mesh=None: DTensor entries become plain full tensors."""
    glob = make_globals(GLOBAL_SPECS, 2024)
    sd, exp = {}, {}
    for name, (_, _, placement) in DT_SPECS.items():
        src = garbage_like(glob[name]) if destination else glob[name].clone()
        if mesh is None:
            sd[name] = src
            exp[name] = glob[name]
        else:
            sd[name] = distribute_tensor(src, mesh, [placement], src_data_rank=None)
            exp[name] = distribute_tensor(glob[name], mesh, [placement], src_data_rank=None).to_local().clone()
    for name in ("plain", "plain_i"):
        sd[name] = garbage_like(glob[name]) if destination else glob[name].clone()
        exp[name] = glob[name]
    sd["empty"] = torch.empty(0, 3)
    exp["empty"] = torch.empty(0, 3)
    sd["nested"] = {
        "x": garbage_like(glob["nested_x"]) if destination else glob["nested_x"].clone(),
        "obj": {"a": 0, "b": ""} if destination else {"a": 1, "b": "two"},
    }
    exp["nested"] = {"x": glob["nested_x"], "obj": {"a": 1, "b": "two"}}
    sd["objects"] = _placeholders() if destination else _objects()
    exp["objects"] = _objects()
    return sd, exp


def _dirs(base: str) -> dict[str, str]:
    return {w: os.path.join(base, w) for w in WRITERS}


def _save_all(sd: dict, base: str) -> None:
    d = _dirs(base)
    dcp.save(sd, storage_writer=ShardWriter(d["ours"]), planner=ShardSavePlanner())
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(d["stock_t1"], thread_count=1), planner=DefaultSavePlanner())
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(d["stock_t2"], thread_count=2), planner=DefaultSavePlanner())
    dcp.save(sd, storage_writer=FsspecWriter(d["fsspec"]), planner=DefaultSavePlanner())


def _load_all(mesh, base: str, where: str) -> None:
    d = _dirs(base)
    # Ours -> stock reader and stock planner.
    dest, expected = build(mesh, destination=True)
    dcp.load(dest, storage_reader=dcp.FileSystemReader(d["ours"]), planner=DefaultLoadPlanner())
    assert_state_dict_equal(dest, expected, f"{where} ours->FileSystemReader")
    # Stock writers -> ours.
    for writer in ("stock_t1", "stock_t2", "fsspec"):
        dest, expected = build(mesh, destination=True)
        reader = ShardReader(d[writer])
        dcp.load(dest, storage_reader=reader, planner=ShardLoadPlanner())
        assert_state_dict_equal(dest, expected, f"{where} {writer}->ShardReader")
        assert reader.stats.items_read > 0 and reader.stats.bytes_read > 0, (writer, reader.stats)


def save_and_load_job(rank: int, world: int, base: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    sd, _ = build(mesh, destination=False)
    _save_all(sd, base)
    dist.barrier()
    _load_all(mesh, base, f"same world ({world}) rank {rank}")


def resharded_load_job(rank: int, world: int, base: str) -> None:
    _load_all(None, base, f"resharded to world {world} rank {rank}")


@pytest.mark.mp
def test_interop_with_stock_dcp(tmp_path):
    base = str(tmp_path)
    run_job(save_and_load_job, 2, base)
    for w, path in _dirs(base).items():
        assert os.path.exists(os.path.join(path, ".metadata")), f"{w} wrote no .metadata"
    run_job(resharded_load_job, 1, base)


# -- .metadata pickles as other producers write them (single process) ------------------------
def _stock_checkpoint_with(path, mutate) -> dict:
    """A stock-written checkpoint whose Metadata is rewritten by ``mutate`` (pickled as DCP does)."""
    import pickle

    state = {"w": torch.randn(6, 5), "b": torch.arange(7, dtype=torch.int32), "step": 3}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # written just above: trusted
    mutate(metadata, state)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    return state


def _load_into_garbage(path, like: dict) -> dict:
    out = {k: garbage_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in like.items()}
    dcp.load(out, storage_reader=ShardReader(path), planner=ShardLoadPlanner())
    return out


def test_metadata_carrying_local_save_plans_loads(tmp_path):
    """megatron-core's torch_dist strategy pickles the local SavePlans into .metadata."""
    from support import local_save_plans

    state = _stock_checkpoint_with(tmp_path, lambda md, sd: setattr(md, "planner_data", local_save_plans(sd)))
    assert_state_dict_equal(_load_into_garbage(tmp_path, state), state)


def test_metadata_with_pre_2_2_tensor_properties_loads(tmp_path):
    """torch < 2.2 pickled sharded_tensor's TensorProperties; it decodes as DCP's own class."""
    from torch.distributed._shard.sharded_tensor import metadata as old
    from torch.distributed.checkpoint.metadata import TensorProperties

    def to_old_properties(metadata, _):
        for md in metadata.state_dict_metadata.values():
            if hasattr(md, "properties"):
                p = md.properties
                md.properties = old.TensorProperties(p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)

    state = _stock_checkpoint_with(tmp_path, to_old_properties)
    assert b"sharded_tensor.metadata" in (tmp_path / ".metadata").read_bytes()
    metadata = ShardReader(tmp_path).read_metadata()
    assert type(metadata.state_dict_metadata["w"].properties) is TensorProperties
    assert metadata.state_dict_metadata["b"].properties.dtype == torch.int32
    assert_state_dict_equal(_load_into_garbage(tmp_path, state), state)


# -- our save planner with other storage writers -----------------------------------------------
class PlanRebuildingWriter(dcp.FileSystemWriter):
    """A writer whose prepare_global_plan builds new SavePlan objects (no dataclasses.replace)."""

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            SavePlan(plan.items, storage_data=_StoragePrefix(f"__{i}_"), planner_data=plan.planner_data)
            for i, plan in enumerate(plans)
        ]


def planner_with_other_writers_job(rank: int, world: int, base: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    sd, _ = build(mesh, destination=False)
    writers = {
        "rebuilding": PlanRebuildingWriter(os.path.join(base, "rebuilding")),
        "FileSystemWriter": dcp.FileSystemWriter(os.path.join(base, "fs")),
        "FsspecWriter": FsspecWriter(os.path.join(base, "fsspec")),
    }
    for name, writer in writers.items():
        dcp.save(sd, storage_writer=writer, planner=ShardSavePlanner())
        dest, expected = build(mesh, destination=True)
        dcp.load(dest, storage_reader=dcp.FileSystemReader(writer.path), planner=DefaultLoadPlanner())
        assert_state_dict_equal(dest, expected, f"rank {rank}: ShardSavePlanner + {name}")
        # and by ours, whose .metadata unpickler admits only DCP's classes: the planner's
        # on-demand metadata must pickle as stock Metadata with a plain dict
        dest, expected = build(mesh, destination=True)
        dcp.load(dest, storage_reader=ShardReader(writer.path), planner=ShardLoadPlanner())
        assert_state_dict_equal(dest, expected, f"rank {rank}: ShardSavePlanner + {name} -> ShardReader")


@pytest.mark.mp
def test_save_planner_with_stock_and_plan_rebuilding_writers(tmp_path):
    run_job(planner_with_other_writers_job, 2, str(tmp_path))


def test_save_planner_with_hugging_face_writer(tmp_path):
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

    state = {"w": torch.randn(4, 3), "ids": torch.arange(5), "h": torch.randn(2, 2).to(torch.bfloat16)}
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(tmp_path)), planner=ShardSavePlanner())
    dest = {k: garbage_like(v) for k, v in state.items()}
    dcp.load(dest, storage_reader=HuggingFaceStorageReader(str(tmp_path)))
    assert_state_dict_equal(dest, state)


# -- stock checkpoints written through stream transforms (compression) -------------------------
def zstd_save_job(rank: int, world: int, base: str) -> None:
    from torch.distributed.checkpoint._extension import ZStandard

    mesh = init_device_mesh("cpu", (world,))
    sd, _ = build(mesh, destination=False)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(base, _extensions=[ZStandard()]), planner=DefaultSavePlanner())


def zstd_load_job(rank: int, world: int, base: str, two_stage: bool) -> None:
    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None
    for verify in (False, True):
        dest, expected = build(mesh, destination=True)
        reader = ShardReader(base, verify_checksums=verify, two_stage=two_stage)
        dcp.load(dest, storage_reader=reader, planner=ShardLoadPlanner())
        assert_state_dict_equal(dest, expected, f"rank {rank} zstd verify={verify} two_stage={two_stage}")


@pytest.mark.mp
def test_zstd_compressed_stock_checkpoints_load_resharded(tmp_path):
    """Stock FileSystemWriter(_extensions=[ZStandard()]): records read whole and decoded
    through DCP's extension registry, at the saving world size, resharded, and two-stage."""
    run_job(zstd_save_job, 2, str(tmp_path))
    metadata = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    assert all(i.transform_descriptors == ["stream.zstd/1"] for i in metadata.storage_data.values())
    run_job(zstd_load_job, 1, str(tmp_path), False)
    run_job(zstd_load_job, 2, str(tmp_path), True)


def test_corrupt_compressed_record_is_reported_by_verify(tmp_path, capsys):
    from torch.distributed.checkpoint._extension import ZStandard

    from dcp_ext.cli.main import main as cli

    state = {"w": torch.arange(4096.0)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, _extensions=[ZStandard()]))
    assert cli(["verify", str(tmp_path)]) == 0
    data = next(p for p in tmp_path.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    assert cli(["verify", str(tmp_path)]) == 1
    assert "FAULT" in capsys.readouterr().out
    with pytest.raises(BaseException, match=r"stream transforms|crc32|unreadable"):
        dcp.load({"w": torch.zeros(4096)}, storage_reader=ShardReader(tmp_path, verify_checksums=True))


def per_rank_metadata_job(rank: int, world: int, path: str) -> None:
    """Stock ``dcp.save(use_collectives=False)``: each rank writes ``__{rank}.metadata`` for
    its own state, and DCP loads each rank's part from it (``read_metadata(rank=r)``)."""
    state = {"w": torch.arange(6.0) * (rank + 1), f"own{rank}": torch.full((2, 3), rank, dtype=torch.int64), "step": rank}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), use_collectives=False)
    dist.barrier()
    for planner in (ShardLoadPlanner(), DefaultLoadPlanner()):
        out = {k: garbage_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in state.items()}
        dcp.load(out, storage_reader=ShardReader(path, verify_checksums=True), planner=planner)
        assert_state_dict_equal(out, state, f"rank {rank}")
    with pytest.raises(dcp.api.CheckpointException) as info:
        dcp.load(dict(state), storage_reader=ShardReader(path, share_metadata=True), planner=ShardLoadPlanner())
    assert "has per-rank metadata (__" in str(info.value) and "each rank loads alone" in str(info.value)
    # a rank's metadata holds its own rows only: loading them resharded left the rest untouched, silently
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24.0).reshape(6, 4)
    dcp.save({"dt": distribute_tensor(full, mesh, [Shard(0)])}, storage_writer=dcp.FileSystemWriter(path + "_dt"),
             use_collectives=False)
    dist.barrier()
    out = {"dt": distribute_tensor(garbage_like(full), mesh, [Shard(0)])}
    dcp.load(out, storage_reader=ShardReader(path + "_dt"), planner=ShardLoadPlanner())
    assert_state_dict_equal({"dt": out["dt"].full_tensor()}, {"dt": full})
    with pytest.raises(InvalidRequestError) as info:  # raised as is: such a load runs without collectives
        replicated = {"dt": distribute_tensor(garbage_like(full), mesh, [Replicate()])}
        dcp.load(replicated, storage_reader=ShardReader(path + "_dt"), planner=ShardLoadPlanner())
    assert f"describes only what rank {rank} saved, 12 of the 24 elements" in str(info.value)
    # each rank saving its own shards alone (no_dist): a .metadata of the global shape with this rank's chunks
    for writer in (dcp.FileSystemWriter, ShardWriter):
        own = f"{path}_{writer.__name__}_{rank}"
        dcp.save({"dt": distribute_tensor(full, mesh, [Shard(0)])}, storage_writer=writer(own), no_dist=True)
        for reader in (dcp.FileSystemReader, ShardReader):
            out = {"dt": distribute_tensor(garbage_like(full), mesh, [Shard(0)])}
            dcp.load(out, storage_reader=reader(own), no_dist=True)
            assert torch.equal(out["dt"].to_local(), full[3 * rank : 3 * rank + 3]), (writer, reader)
        with pytest.raises(BaseException) as info:  # stock leaves the other rank's rows as they were
            dcp.load({"dt": garbage_like(full)}, storage_reader=ShardReader(own), no_dist=True)
        assert "key 'dt': the checkpoint holds 12 of the 24 elements this rank's destination needs" in str(info.value)


@pytest.mark.mp
def test_stock_per_rank_metadata_checkpoint_loads(tmp_path, capsys):
    run_job(per_rank_metadata_job, 2, str(tmp_path))
    assert cli(["inspect", str(tmp_path)]) == 2
    assert "__0.metadata, ... are per-rank metadata of dcp.save(use_collectives=False)" in capsys.readouterr().err


def local_shards_wrapper_job(rank: int, world: int, path: str, writer: str, planner: str) -> None:
    """A DTensor over a LocalShardsWrapper (torchrec's layout: several shards per rank,
    the wrapper reporting a made-up concatenated shape of 90 elements for 60)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    mesh = init_device_mesh("cpu", (world,))
    table = torch.arange(60.0).reshape(6, 10)
    boxes = [(slice(0, 6), slice(0, 5)), (slice(0, 4), slice(5, 10)), (slice(4, 6), slice(5, 10))]

    def wrapped(fill: bool) -> tuple[DTensor, list[torch.Tensor]]:
        shards = [garbage_like(table[box]) if fill else table[box].clone() for box in boxes]
        local = LocalShardsWrapper(shards, [(0, 0), (0, 5), (4, 5)])
        return DTensor.from_local(local, mesh, [Replicate()], run_check=False, shape=table.shape, stride=table.stride()), shards

    storage_writer = dcp.FileSystemWriter(path) if writer == "stock" else ShardWriter(path)
    dcp.save({"t": wrapped(False)[0]}, storage_writer=storage_writer, planner=None if writer == "stock" else ShardSavePlanner())
    dest, shards = wrapped(True)
    dcp.load({"t": dest}, storage_reader=ShardReader(path), planner=DefaultLoadPlanner() if planner == "default" else ShardLoadPlanner())
    for shard, box in zip(shards, boxes):
        assert torch.equal(shard, table[box])


@pytest.mark.mp
@pytest.mark.parametrize("writer", ["stock", "ours"])
@pytest.mark.parametrize("planner", ["default", "ours"])
def test_a_dtensor_over_local_shards_wrapper_loads(tmp_path, writer, planner):
    """The every-element check counts the wrapper's own chunks, as DCP plans them (it
    refused this load: "holds 60 of the 90 elements"); ShardLoadPlanner narrowed the
    wrapper itself, which refuses ``aten.slice``: it leaves such a DTensor to DCP's lookup."""
    run_job(local_shards_wrapper_job, 1, str(tmp_path), writer, planner)


class _Tagged(torch.Tensor):
    """A plain tensor subclass, as training code makes with ``as_subclass``."""


def test_a_tensor_subclass_is_stored_as_a_plain_tensor_that_stock_loads(tmp_path):
    """The record named the subclass (``_rebuild_from_type_v2``), which stock's weights-only
    load refuses: stock FileSystemReader could not load our checkpoint, while ShardReader
    read it (and refused the same record in a stock checkpoint)."""
    state = {"x": (torch.arange(12.0) * 1.5).reshape(3, 4).as_subclass(_Tagged),
             "p": torch.nn.Parameter(torch.arange(5.0)), "plain": torch.ones(2, dtype=torch.bfloat16)}
    dcp.save(state, storage_writer=ShardWriter(tmp_path), planner=ShardSavePlanner())
    want = {k: v.detach().as_subclass(torch.Tensor).clone() for k, v in state.items()}
    for reader, planner in ((dcp.FileSystemReader(tmp_path), None), (ShardReader(tmp_path), ShardLoadPlanner())):
        got = garbage_state(want)
        dcp.load(got, storage_reader=reader, planner=planner)
        assert_state_dict_equal(got, want)
