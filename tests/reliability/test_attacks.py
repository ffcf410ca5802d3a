"""Hostile checkpoints: rejected with a clear error, and nothing they ask for ever runs.

Every code-running payload would create a canary file; its absence proves nothing ran.
Attacks on the index rewrite the commit marker too (the marker detects corruption, it
is no defence against an attacker), so they reach the index decoder and validation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import re
import shutil
import struct
import subprocess
import tracemalloc
import zipfile

import crc32c
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dcp_ext import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidRequestError,
    ShardLoadPlanner,
    ShardReader,
    ShardWriter,
    UnsafeCheckpointError,
)
from dcp_ext.formats.index import INDEX_NAME, decode_index, encode_index
from dcp_ext.formats.marker import MARKER_NAME, CommitMarker
from dcp_ext.megatron import load_common_state
from dcp_ext.ntp import ntp_shard

from megatron_fixtures import write_legacy, write_zarr
from support import FIXTURES, assert_state_dict_equal, load, load_error, local_save_plans, sample_state, save


class Payload:
    """Pickles as a call of ``func(*args)``: what a crafted pickle runs on plain ``pickle.load``."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def code_payloads(canary: str, metadata_path: str) -> dict[str, Payload]:
    touch = f"open({canary!r}, 'w').close()"
    return {
        "os.system": Payload(os.system, f"touch {canary}"),
        "eval": Payload(eval, touch),
        "builtins.exec": Payload(exec, touch),
        "subprocess": Payload(subprocess.getoutput, f"touch {canary}"),
        "torch.load recursion": Payload(torch.load, metadata_path),
    }


def read_metadata_pickle(path):
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)  # our own fresh checkpoint: trusted here


def write_metadata_pickle(path, metadata, drop_index: bool = True) -> None:
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    if drop_index:
        (path / INDEX_NAME).unlink(missing_ok=True)


def rewrite_metadata(path, mutate) -> None:
    metadata = read_metadata_pickle(path)
    mutate(metadata)
    write_metadata_pickle(path, metadata)


# -- .metadata pickles -----------------------------------------------------------------------
@pytest.mark.parametrize("attack", ["os.system", "eval", "builtins.exec", "subprocess", "torch.load recursion"])
@pytest.mark.parametrize("where", ["whole-file", "inside-valid-metadata"])
def test_code_running_metadata_is_refused(tmp_path, attack, where):
    ckpt, canary = tmp_path / "ckpt", tmp_path / "canary"
    save(sample_state(), ckpt)
    payload = code_payloads(str(canary), str(ckpt / ".metadata"))[attack]
    if where == "whole-file":
        (ckpt / ".metadata").write_bytes(pickle.dumps(payload))
    else:  # a real Metadata with the payload tucked into planner_data; our index left in place
        metadata = read_metadata_pickle(ckpt)
        metadata.planner_data = {"x": payload}
        write_metadata_pickle(ckpt, metadata, drop_index=False)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refuses to load \w+\.\w+"):
        ShardReader(ckpt).read_metadata()
    assert not canary.exists()


def hide_in_save_plan(plan: SavePlan, where: str, payload: Payload) -> SavePlan:
    """``plan`` with ``payload`` in one field of its first tensor WriteItem (or the plan)."""
    item = next(i for i in plan.items if i.tensor_data is not None)
    if where == "SavePlan.planner_data":
        return dataclasses.replace(plan, planner_data={"x": payload})
    if where == "WriteItem.index":
        hidden = dataclasses.replace(item, index=payload)
    else:  # TensorWriteData.size
        hidden = dataclasses.replace(item, tensor_data=dataclasses.replace(item.tensor_data, size=payload))
    return dataclasses.replace(plan, items=[hidden, *plan.items[1:]])


@pytest.mark.parametrize("attack", ["os.system", "eval"])
@pytest.mark.parametrize("where", ["WriteItem.index", "SavePlan.planner_data", "TensorWriteData.size"])
def test_code_hidden_in_save_plans_is_refused(tmp_path, attack, where):
    """megatron-core stores local SavePlans in .metadata, so their classes are admitted: not their payloads."""
    ckpt, canary = tmp_path / "ckpt", tmp_path / "canary"
    state = sample_state()
    save(state, ckpt)
    payload = code_payloads(str(canary), str(ckpt / ".metadata"))[attack]
    metadata = read_metadata_pickle(ckpt)
    metadata.planner_data = [hide_in_save_plan(plan, where, payload) for plan in local_save_plans(state)]
    write_metadata_pickle(ckpt, metadata)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refuses to load (posix\.system|builtins\.eval)"):
        ShardReader(ckpt).read_metadata()
    assert not canary.exists()


def test_deeply_nested_metadata_is_refused(tmp_path):
    depth = 1_000_000  # a list nested a million deep: built by the stack machine, no recursion
    (tmp_path / ".metadata").write_bytes(b"\x80\x04" + b"]" * depth + b"a" * (depth - 1) + b".")
    with pytest.raises(CorruptCheckpointError, match="expected a DCP Metadata object"):
        ShardReader(tmp_path).read_metadata()
    (tmp_path / ".metadata").write_bytes(b"\x80\x04" + b"]" * 200_000 + b".")  # a very tall stack
    with pytest.raises(CheckpointError, match="metadata"):
        ShardReader(tmp_path).read_metadata()


def test_deeply_nested_state_dict_metadata_is_refused(tmp_path):
    save(sample_state(), tmp_path)
    rewrite_metadata(tmp_path, lambda md: setattr(md, "state_dict_metadata", {"w": "SENTINEL"}))
    depth = 100_000  # pickle.dumps cannot nest this deep, so splice the opcodes in
    nested = b"]" * depth + b"a" * (depth - 1)
    raw = (tmp_path / ".metadata").read_bytes()
    (tmp_path / ".metadata").write_bytes(raw.replace(b"\x8c\x08SENTINEL", nested, 1))
    with pytest.raises(CorruptCheckpointError, match="'w' has unknown metadata list"):
        ShardReader(tmp_path).read_metadata()


@pytest.mark.parametrize("bits", [40, 60])
def test_chunk_claiming_a_huge_size_is_refused_before_any_allocation(tmp_path, bits):
    save(sample_state(), tmp_path)

    def inflate(md):
        md.state_dict_metadata["w"].size = torch.Size([2**bits, 48])
        md.state_dict_metadata["w"].chunks[0].sizes = torch.Size([2**bits, 48])

    rewrite_metadata(tmp_path, inflate)
    with pytest.raises(CorruptCheckpointError, match=r"'w'.*needs \d+ bytes"):
        ShardReader(tmp_path).read_metadata()


def test_bytes_item_claiming_2_pow_60_bytes_is_refused_before_any_allocation(tmp_path):
    state = sample_state()
    save(state, tmp_path)

    def inflate(md):
        index = next(i for i in md.storage_data if i.fqn == "name")
        md.storage_data[index].length = 2**60

    rewrite_metadata(tmp_path, inflate)
    error = load_error(state, tmp_path)
    assert isinstance(error, CorruptCheckpointError) and "'name'" in str(error) and "truncated" in str(error)


@pytest.mark.parametrize("field, value", [("offset", -1), ("length", -1), ("offset", True), ("length", 1.5), ("offset", "0")])
def test_a_stored_byte_range_that_is_no_range_is_refused(tmp_path, field, value):
    """A pickled ``.metadata`` whose stored item for 'w' has a negative, boolean, fractional
    or textual offset or length is refused naming the key, before any read."""
    save(sample_state(), tmp_path)

    def corrupt(md):
        index = next(i for i in md.storage_data if i.fqn == "w")
        setattr(md.storage_data[index], field, value)

    rewrite_metadata(tmp_path, corrupt)
    with pytest.raises(CorruptCheckpointError, match=r"key 'w' has an invalid byte range"):
        ShardReader(tmp_path, cache_metadata=False).read_metadata()


@pytest.mark.parametrize("bad_path", ["../outside.distcp", "/etc/passwd", "a/../../x", "C:\\x", "a\x00b"])
def test_path_escape_in_metadata_is_refused(tmp_path, bad_path):
    save(sample_state(), tmp_path / "ckpt")

    def escape(md):
        index = next(i for i in md.storage_data if i.fqn == "w")
        md.storage_data[index].relative_path = bad_path

    rewrite_metadata(tmp_path / "ckpt", escape)
    with pytest.raises(UnsafeCheckpointError, match=r"key 'w'.*escapes the checkpoint directory"):
        ShardReader(tmp_path / "ckpt").read_metadata()


def test_symlinked_data_file_out_of_the_directory_is_refused(tmp_path):
    state = sample_state()
    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside.distcp"
    save(state, ckpt)
    victim = next(n for n in os.listdir(ckpt) if n.endswith(".distcp"))
    os.replace(ckpt / victim, outside)
    os.symlink(outside, ckpt / victim)
    error = load_error(state, ckpt)
    assert isinstance(error, UnsafeCheckpointError) and victim in str(error) and "outside" in str(error)


def test_links_that_stay_inside_the_checkpoint_load(tmp_path):
    """The directory reached through a link, and a data file linked to another name inside
    it, are not escapes: the load is bit-exact."""
    state = sample_state()
    save(state, tmp_path / "step_1")
    os.symlink(tmp_path / "step_1", tmp_path / "latest")
    victim = next(n for n in os.listdir(tmp_path / "step_1") if n.endswith(".distcp"))
    os.replace(tmp_path / "step_1" / victim, tmp_path / "step_1" / "moved.bin")
    os.symlink("moved.bin", tmp_path / "step_1" / victim)
    out, _ = load(state, tmp_path / "latest")
    assert_state_dict_equal(out, state)


@pytest.mark.parametrize("name", [".metadata", INDEX_NAME])
def test_symlinked_metadata_out_of_the_directory_is_refused(tmp_path, name):
    ckpt = tmp_path / "ckpt"
    save(sample_state(), ckpt)
    os.replace(ckpt / name, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", ckpt / name)
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint directory"):
        ShardReader(ckpt).read_metadata()


def reindex(path, metadata) -> None:
    """Our index and commit marker re-made for the ``.metadata`` just written from
    ``metadata`` (a chunk it adds is stored where the key's first chunk is)."""
    items = dict(decode_index((path / INDEX_NAME).read_bytes(), "old index").items)
    for index in metadata.storage_data:
        items.setdefault(index, items[MetadataIndex(index.fqn, torch.Size([0] * len(index.offset)))])
    metadata_bytes = (path / ".metadata").read_bytes()
    index_bytes = encode_index(metadata, items, metadata_bytes, crc32c.crc32c(metadata_bytes), {})
    (path / INDEX_NAME).write_bytes(index_bytes)
    marker = CommitMarker.decode((path / MARKER_NAME).read_bytes(), "test")
    (path / MARKER_NAME).write_bytes(CommitMarker.for_bytes(marker.save_id, metadata_bytes, index_bytes).encode())


@pytest.mark.parametrize("planner", [None, DefaultLoadPlanner()], ids=["ShardLoadPlanner", "DefaultLoadPlanner"])
@pytest.mark.parametrize("indexed", [False, True], ids=["pickle", "index"])
def test_chunks_that_do_not_fill_the_destination_are_refused_not_loaded_around(tmp_path, planner, indexed):
    """A .metadata whose tensor is larger than its chunks (rows 3-5 of the destination
    would keep their old values), or with a chunk doubled over another (stock DCP loads
    both silently); through the pickle and through our index (re-encoded from it)."""
    state = {"w": torch.arange(12.0).reshape(3, 4)}

    def gap(md) -> None:
        md.state_dict_metadata["w"].size = torch.Size([6, 4])

    def doubled(md) -> None:
        md.state_dict_metadata["w"].chunks.append(ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([2, 4])))
        md.storage_data[MetadataIndex("w", torch.Size([1, 0]))] = next(iter(md.storage_data.values()))

    for name, mutate, like, message in (
        ("gap", gap, {"w": torch.zeros(6, 4)}, "key 'w': the checkpoint holds 12 of the 24 elements this rank's destination needs"),
        ("overlap", doubled, state, "key 'w': the checkpoint's chunks overlap each other (damaged metadata)"),
    ):
        save(state, tmp_path / name)
        metadata = read_metadata_pickle(tmp_path / name)
        mutate(metadata)
        write_metadata_pickle(tmp_path / name, metadata, drop_index=not indexed)
        if indexed:
            reindex(tmp_path / name, metadata)
        reader = ShardReader(tmp_path / name)
        reader.read_metadata()
        assert reader.catalog.indexed == indexed
        error = load_error(like, tmp_path / name, planner)
        assert isinstance(error, CheckpointError) and message in str(error), error


@pytest.mark.parametrize("planner", [None, DefaultLoadPlanner()], ids=["ShardLoadPlanner", "DefaultLoadPlanner"])
def test_chunks_overlapping_by_as_much_as_they_leave_uncovered_are_refused(tmp_path, planner):
    """Rows [0, 4) and [4, 8) saved; the second chunk moved to [2, 6): rows 2-3 read twice,
    rows 6-7 never, the element count right (stock loads it, leaving rows 6-7 as they were)."""
    full = torch.arange(16.0).reshape(8, 2)
    dcp.save({"w": ntp_shard(full.clone(), [(0, 4), (4, 8)], (8, 2))}, storage_writer=ShardWriter(tmp_path), no_dist=True)

    def shifted(md) -> None:
        md.state_dict_metadata["w"].chunks[1] = ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([4, 2]))
        md.storage_data[MetadataIndex("w", torch.Size([2, 0]))] = md.storage_data.pop(MetadataIndex("w", torch.Size([4, 0])))

    rewrite_metadata(tmp_path, shifted)
    error = load_error({"w": full}, tmp_path, planner)
    assert isinstance(error, CorruptCheckpointError) and "key 'w': the checkpoint's chunks overlap each other" in str(error), error


class KeepsNewRowsPlanner(DefaultLoadPlanner):
    """A planner of one's own that reads less on purpose: a vocabulary grown from 6 to 8 rows
    loads the saved 6 and keeps its new rows' initial values."""

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]
            box = ChunkStorageMetadata(torch.Size([0] * len(md.size)), md.size)
            items += create_read_items_for_chunk_list(fqn, md, [box])
        return LoadPlan(items)


def test_a_planner_of_ones_own_may_leave_part_of_a_destination_unread(tmp_path):
    """The reader's every-element check is for the planners that plan every element."""
    saved = {"emb": torch.randn(6, 4), "w": torch.randn(3, 3)}
    save(saved, tmp_path)
    new_rows = torch.randn(2, 4)
    out = {"emb": torch.cat([torch.full((6, 4), float("nan")), new_rows]), "w": torch.full((3, 3), float("nan"))}
    dcp.load(out, storage_reader=ShardReader(tmp_path), planner=KeepsNewRowsPlanner(), no_dist=True)
    assert torch.equal(out["emb"], torch.cat([saved["emb"], new_rows])) and torch.equal(out["w"], saved["w"])


@pytest.mark.timeout(60)
def test_a_fifo_in_place_of_a_checkpoint_file_is_refused_not_waited_on(tmp_path):
    """Opening or reading a FIFO waits for a writer that never comes (stock DCP hangs)."""
    state = {"w": torch.arange(6.0)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "stock"))
    (tmp_path / "stock" / ".metadata").unlink()
    os.mkfifo(tmp_path / "stock" / ".metadata")
    with pytest.raises(CheckpointError, match=r"stock: \.metadata is not a regular file \(a FIFO, socket or device\)"):
        ShardReader(tmp_path / "stock").read_metadata()
    save(state, tmp_path / "ours")
    victim = next((tmp_path / "ours").glob("*.distcp"))
    victim.unlink()
    os.mkfifo(victim)
    error = load_error(state, tmp_path / "ours")
    assert isinstance(error, CheckpointError) and f"{victim.name} is not a regular file" in str(error)
    write_legacy(str(tmp_path / "legacy"), tp=1, pp=1, num_layers=1)  # opened by torch.load, which waits too
    rank_file = tmp_path / "legacy" / "iter_0000020" / "mp_rank_00" / "model_optim_rng.pt"
    rank_file.unlink()
    os.mkfifo(rank_file)
    with pytest.raises(CheckpointError, match=r"mp_rank_00/model_optim_rng.pt is not a regular file"):
        ShardReader(tmp_path / "legacy").read_metadata()


MEMO_BOMB = b"\x80\x04N" + b"r" + struct.pack("<I", 1 << 26) + b"."  # None, LONG_BINPUT 2**26, STOP


def test_a_metadata_pickle_naming_a_huge_memo_slot_is_refused_before_unpickling(tmp_path):
    """Nine bytes that make the C unpickler allocate a memo of 2**27 slots (1 GiB; 2**31 OOMs)."""
    save(sample_state(), tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".metadata").write_bytes(MEMO_BOMB)
    (tmp_path / "ckpt" / INDEX_NAME).unlink()
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata: metadata pickle names memo slot 67108864, more than its 9 bytes"):
        ShardReader(tmp_path / "ckpt", require_commit_marker=False).read_metadata()


def test_a_tensor_record_naming_a_huge_memo_slot_is_refused(tmp_path):
    state = {"w": torch.arange(6.0)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "ckpt"))
    info = next(iter(read_metadata_pickle(tmp_path / "ckpt").storage_data.values()))
    path = tmp_path / "ckpt" / info.relative_path
    with zipfile.ZipFile(io.BytesIO(path.read_bytes()[info.offset : info.offset + info.length])) as src:
        entries = {name: src.read(name) for name in src.namelist()}
    record = io.BytesIO()
    with zipfile.ZipFile(record, "w") as dst:
        for name, data in entries.items():
            dst.writestr(name, MEMO_BOMB if name.endswith("/data.pkl") else data)
    path.write_bytes(record.getvalue())
    metadata = read_metadata_pickle(tmp_path / "ckpt")
    next(iter(metadata.storage_data.values())).offset = 0
    next(iter(metadata.storage_data.values())).length = len(record.getvalue())
    write_metadata_pickle(tmp_path / "ckpt", metadata)
    error = load_error(state, tmp_path / "ckpt")
    assert isinstance(error, CorruptCheckpointError) and "memo slot 67108864 (at most 1023 expected)" in str(error)


def test_hostile_tensor_record_in_a_stock_checkpoint_is_refused(tmp_path):
    """No index: the record's own pickle is decoded, by an allowlist that runs nothing."""
    canary = tmp_path / "canary"
    state = {"w": torch.arange(6.0)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "ckpt"))
    ckpt = tmp_path / "ckpt"
    record = io.BytesIO()
    torch.save(Payload(os.system, f"touch {canary}"), record)
    metadata = read_metadata_pickle(ckpt)
    info = next(iter(metadata.storage_data.values()))
    (ckpt / info.relative_path).write_bytes(record.getvalue())
    info.offset, info.length = 0, len(record.getvalue())
    write_metadata_pickle(ckpt, metadata)
    error = load_error(state, ckpt)
    assert isinstance(error, UnsafeCheckpointError) and "posix.system" in str(error) and "'w'" in str(error)
    assert not canary.exists()


class Settings:
    """A harmless custom class nobody registered with add_safe_globals."""

    def __init__(self, lr: float):
        self.lr = lr


PLANNERS = {"default": DefaultLoadPlanner, "shard": ShardLoadPlanner}


def save_bytes_item(layout: str, obj, root) -> tuple[str, object]:
    """A checkpoint holding ``obj`` as a bytes item; returns (path, its key)."""
    path = root / "ckpt"
    if layout == "ours":
        save({"obj": obj}, path, checksums=False)
    elif layout == "stock":
        dcp.save({"obj": obj}, storage_writer=dcp.FileSystemWriter(path))
    else:  # a Megatron zarr checkpoint's ShardedObject file
        path.mkdir()
        write_zarr(str(path))
        torch.save(obj, path / "rng_state" / "shard_0_1.pt")
        return path, "rng_state/shard_0_1"
    return path, "obj"


@contextlib.contextmanager
def one_process_group(root):
    """A one-rank gloo group, so ``two_stage=True`` takes the exchange path."""
    dist.init_process_group("gloo", store=dist.FileStore(str(root / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("planner", list(PLANNERS))
@pytest.mark.parametrize("layout", ["ours", "stock", "zarr", "two-stage"])
def test_hostile_bytes_item_runs_nothing(tmp_path, layout, planner):
    """The reader checks every bytes item before any planner decodes it: DCP's default
    planner would call ``torch.load(weights_only=False)`` on it."""
    canary = tmp_path / "canary"
    path, key = save_bytes_item("ours" if layout == "two-stage" else layout, Payload(os.system, f"touch {canary}"), tmp_path)
    with one_process_group(tmp_path) if layout == "two-stage" else contextlib.nullcontext():
        error = load_error({key: None}, path, PLANNERS[planner](), two_stage=layout == "two-stage")
    assert isinstance(error, UnsafeCheckpointError), error
    assert f"key {key!r}" in str(error) and "posix.system" in str(error) and "allow_unsafe_bytes=True" in str(error)
    assert not canary.exists()


@pytest.mark.parametrize("planner", list(PLANNERS))
def test_custom_class_bytes_item_is_refused_by_default(tmp_path, planner):
    path, key = save_bytes_item("ours", Settings(0.5), tmp_path)
    error = load_error({key: None}, path, PLANNERS[planner]())
    assert isinstance(error, UnsafeCheckpointError) and f"{__name__}.Settings" in str(error)
    assert f"key {key!r}" in str(error) and ".distcp" in str(error)


OPT_OUTS = {  # where the caller says it trusts the checkpoint: (planner, reader kwargs)
    "reader": (DefaultLoadPlanner, {"allow_unsafe_bytes": True}),
    "planner": (lambda: ShardLoadPlanner(allow_unsafe_bytes=True), {}),
    "both": (lambda: ShardLoadPlanner(allow_unsafe_bytes=True), {"allow_unsafe_bytes": True}),
}


@pytest.mark.parametrize("opt_out", list(OPT_OUTS))
def test_custom_class_bytes_item_loads_with_an_opt_out(tmp_path, opt_out):
    make_planner, reader_kwargs = OPT_OUTS[opt_out]
    path, key = save_bytes_item("ours", Settings(0.5), tmp_path)
    out, _ = load({key: None}, path, make_planner(), **reader_kwargs)
    assert type(out[key]) is Settings and out[key].lr == 0.5


def test_non_tensor_item_never_replaces_a_tensor(tmp_path):
    """A checkpoint (or a hostile index) storing a key as bytes cannot swap out a tensor:
    only a number loads into one, a 0-d one (tests/integration/test_roundtrip.py)."""
    for stored, dst, says in [
        (5, torch.ones(3), "non-tensor item (int) where the state dict holds a tensor of shape [3]"),
        ("text", torch.tensor(1.0), "non-tensor item (str)"),
        (b"raw", torch.ones(3), "non-tensor item (bytes)"),
        (2**70, torch.tensor(1), "the number 1180591620717411303424, which the state dict's torch.int64 tensor cannot hold"),
        (-1, torch.tensor(0, dtype=torch.uint8), "the number -1, which the state dict's torch.uint8 tensor cannot hold"),
        (1e40, torch.tensor(0.0, dtype=torch.float16), "which the state dict's torch.float16 tensor cannot hold"),
        (2.5, torch.tensor(0), "the number 2.5, which the state dict's torch.int64 tensor cannot hold"),
    ]:
        save({"w": stored}, tmp_path, overwrite=True)
        kept = dst.clone()
        state = {"w": dst}
        try:
            dcp.load(state, storage_reader=ShardReader(tmp_path), planner=ShardLoadPlanner())
        except CheckpointException as exc:
            error = next(iter(exc.failures.values()))[0]
        assert isinstance(error, InvalidRequestError) and "key 'w'" in str(error) and says in str(error), error
        assert state["w"] is dst and dst.equal(kept)


# -- the index ---------------------------------------------------------------------------
def rewrite_index(path, mutate) -> None:
    """Replace the index with ``mutate(rows, schema)``'s table; re-sign it in the marker."""
    table = pq.read_table(path / INDEX_NAME)
    rows = table.to_pydict()
    new_table = mutate(rows, table.schema)
    sink = io.BytesIO()
    pq.write_table(new_table, sink)
    (path / INDEX_NAME).write_bytes(sink.getvalue())
    marker = CommitMarker.decode((path / MARKER_NAME).read_bytes(), "test")
    metadata_bytes = (path / ".metadata").read_bytes()
    (path / MARKER_NAME).write_bytes(CommitMarker.for_bytes(marker.save_id, metadata_bytes, sink.getvalue()).encode())


def set_column(name: str, value, arrow_type=None):
    """A mutation setting column ``name`` of the row for key 'w' (optionally retyping it)."""

    def mutate(rows, schema):
        row = rows["fqn"].index("w")
        rows[name][row] = value
        if arrow_type is None:
            return pa.table(rows, schema=schema)
        fields = [pa.field(f.name, arrow_type if f.name == name else f.type) for f in schema]
        if arrow_type == pa.string():
            rows[name] = [str(v) for v in rows[name]]
        return pa.table(rows, schema=pa.schema(fields, metadata=schema.metadata))

    return mutate


def duplicate_row(rows, schema):
    """A second canonical row for 'w' at the same offset."""
    row = rows["fqn"].index("w")
    for values in rows.values():
        values.append(values[row])
    return pa.table(rows, schema=schema)


INDEX_ATTACKS = {
    "duplicate row": (duplicate_row, r"'w' has two index rows at offset \[0, 0\]"),
    "negative offset": (set_column("offset", -4096), r"'w' has an invalid byte range"),
    "negative length": (set_column("length", -1), r"'w' has an invalid byte range"),
    "negative chunk offset": (set_column("offsets", [-1, 0]), r"'w'.*does not fit its global shape"),
    "parent path": (set_column("file", "../../etc/passwd"), r"'w'.*escapes the checkpoint directory"),
    "absolute path": (set_column("file", "/etc/passwd"), r"'w'.*escapes the checkpoint directory"),
    "empty path": (set_column("file", ""), r"'w'.*is not a non-empty string"),
    "offset as text": (set_column("offset", "zero", pa.string()), r"unreadable index"),
    "huge chunk": (set_column("sizes", [2**60, 48]), r"'w'.*does not fit its global shape"),
}


@pytest.mark.parametrize("planner", [ShardLoadPlanner, DefaultLoadPlanner])
@pytest.mark.parametrize("attack", list(INDEX_ATTACKS))
def test_index_attacks_are_refused(tmp_path, attack, planner):
    """Refused whichever planner asks: a fault in a row's byte range or file name when the
    index opens, one in a key's chunks by the load that first uses the key."""
    mutate, message = INDEX_ATTACKS[attack]
    state = sample_state()
    save(state, tmp_path)
    rewrite_index(tmp_path, mutate)
    try:
        ShardReader(tmp_path, cache_metadata=False).read_metadata()
        error = load_error(state, tmp_path, planner(), cache_metadata=False)
    except CheckpointError as raised:
        error = raised
    assert isinstance(error, CheckpointError) and re.search(message, str(error)), error


@pytest.mark.parametrize(
    "header_change, message",
    [
        ({"tensors": {"w": ["load", [64, 48], False, False]}}, r"unknown dtype 'load'"),
        ({"tensors": {"w": ["qint8", [64, 48], False, False]}}, r"unknown dtype 'qint8'"),  # torch's internal assert
        ({"tensors": {"w": ["float32", ["64", 48], False, False]}}, r"non-integer shape"),
        ({"tensors": {"w": ["float32", [-64, 48], False, False]}}, r"invalid dtype .* or shape"),
        ({"tensors": {"w": ["load", [-64, 48], False, False]}}, r"unknown dtype 'load'"),  # the dtype is named first
        ({"tensors": {"w": ["float32", [-64, "48"], False, False]}}, r"non-integer shape"),
        ({"tensors": {"w": [["float32"], [64, 48], False, False]}}, r"unknown dtype \['float32'\]"),
        ({"order": 7}, r"unreadable index"),
        ({"format": "something-else"}, r"unreadable index"),
    ],
)
def test_index_header_attacks_are_refused(tmp_path, header_change, message):
    import json

    def mutate(rows, schema):
        header = json.loads(schema.metadata[b"dcp_ext"])
        for key, value in header_change.items():
            header[key] = {**header[key], **value} if isinstance(value, dict) else value
        return pa.table(rows, schema=schema.with_metadata({b"dcp_ext": json.dumps(header).encode()}))

    save(sample_state(), tmp_path)
    rewrite_index(tmp_path, mutate)
    with pytest.raises(CheckpointError, match=message):
        ShardReader(tmp_path).read_metadata()


def test_corrupt_index_under_a_valid_marker_is_named(tmp_path):
    state = sample_state()
    save(state, tmp_path)
    raw = bytearray((tmp_path / INDEX_NAME).read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (tmp_path / INDEX_NAME).write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"\.dcp_ext_index\.parquet: (index bytes differ|unreadable index)"):
        ShardReader(tmp_path).read_metadata()
    (tmp_path / INDEX_NAME).unlink()  # what the message advises: .metadata alone still loads
    assert load(state, tmp_path)[0]["w"].equal(state["w"])


def test_index_without_its_metadata_is_not_a_checkpoint(tmp_path):
    """``.metadata`` streams through its CRC on a thread while the index decodes: its
    absence is still the error, whether or not the index decodes."""
    save(sample_state(), tmp_path)
    (tmp_path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"no committed checkpoint.*\.metadata is missing"):
        ShardReader(tmp_path, cache_metadata=False).read_metadata()
    (tmp_path / INDEX_NAME).write_bytes(b"not parquet")
    with pytest.raises(CheckpointError, match=r"no committed checkpoint.*\.metadata is missing"):
        ShardReader(tmp_path, cache_metadata=False).read_metadata()


def test_directory_without_metadata_is_not_a_checkpoint(tmp_path):
    """An empty or absent directory is told apart from one holding files but no ``.metadata``
    (a typo in the path, against a save that never committed)."""
    for path in (tmp_path, tmp_path / "no" / "such"):
        with pytest.raises(CheckpointError, match=r"no committed checkpoint here \(no such directory, or it is empty\)"):
            ShardReader(path).read_metadata()
    (tmp_path / "__0_0.distcp").write_bytes(b"data of a save that never committed")
    with pytest.raises(CheckpointError, match=r"no committed checkpoint.*\.metadata is missing"):
        ShardReader(tmp_path).read_metadata()


def test_compressed_record_that_expands_without_bound_is_refused(tmp_path):
    """A stream-transformed (zstd) record is decoded to at most its chunk's bytes plus the
    record's zip entries: a hostile 16 MiB expansion of a 4-byte tensor is refused."""
    import zstandard
    from torch.distributed.checkpoint._extension import ZStandard

    state = {"w": torch.ones(1)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, _extensions=[ZStandard()]))
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (16 << 20))
    metadata = read_metadata_pickle(tmp_path)
    info = metadata.storage_data[next(iter(metadata.storage_data))]
    (tmp_path / info.relative_path).write_bytes(bomb)
    info.offset, info.length = 0, len(bomb)
    write_metadata_pickle(tmp_path, metadata)
    error = load_error(state, tmp_path)
    assert isinstance(error, CorruptCheckpointError) and "'w'" in str(error) and "expand past 65540 bytes" in str(error)


def test_common_state_claiming_more_bytes_than_its_file_is_refused_before_allocating(tmp_path):
    """load_common_state read a bytes item into a buffer of its claimed length first: a
    4 GiB claim in a 150 KB file allocated 4 GiB. Now the file size is checked, as loads do."""
    shutil.copytree(FIXTURES / "megatron" / "mcore019_tp2_dp2_ep2", tmp_path / "ckpt")  # written by megatron-core 0.19.2

    def inflate(md):
        index = next(i for i in md.storage_data if i.fqn == "common_state/shard_0_1")
        md.storage_data[index].length = 64 << 20  # kept small: before the fix this was allocated

    rewrite_metadata(tmp_path / "ckpt", inflate)
    tracemalloc.start()
    try:
        needs = r"__0_0.distcp key 'common_state/shard_0_1': item needs bytes up to 67110189 but the file has \d+ bytes \(truncated"
        with pytest.raises(CorruptCheckpointError, match=needs):
            load_common_state(tmp_path / "ckpt")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def _without_marker_then(path, mutate) -> None:
    """The index changed where no commit marker vouches for it (a crash between the renames
    of .metadata and of the marker, or a lost marker): it has no checksum of its own."""
    rewrite_index(path, mutate)
    (path / MARKER_NAME).unlink()


def test_an_unvouched_index_gives_no_payload_offset_of_its_own(tmp_path):
    """One flipped bit in such an index's payload offset loaded a tensor shifted inside its
    record, verified or not (the record's CRC covers the record, not where the tensor
    starts): without a marker the layouts come from the records themselves."""
    state = sample_state()
    save(state, tmp_path)

    def shift(rows, schema):
        row = rows["fqn"].index("w")
        rows["payload_offset"][row] += 64
        return pa.table(rows, schema=schema)

    _without_marker_then(tmp_path, shift)
    for verify in (False, True):
        got, _ = load(state, tmp_path, verify_checksums=verify, cache_metadata=False)
        assert_state_dict_equal(got, state)


@pytest.mark.parametrize("column, change", [("offset", 64), ("length", -4)])
def test_an_unvouched_index_must_agree_with_the_metadata(tmp_path, column, change):
    state = sample_state()
    save(state, tmp_path)

    def move(rows, schema):
        row = rows["fqn"].index("w")
        rows[column][row] += change
        return pa.table(rows, schema=schema)

    _without_marker_then(tmp_path, move)
    with pytest.raises(CheckpointError, match=r"the location of key 'w' disagrees with \.metadata"):
        ShardReader(tmp_path, cache_metadata=False).read_metadata()


def test_a_huggingface_hub_cache_snapshot_loads_and_other_links_out_do_not(tmp_path):
    """from_pretrained's downloads live in ``models--org--name/snapshots/<rev>/`` as symlinks
    to ``../../blobs/<hash>``: every such checkpoint was refused as reaching outside. Only
    that repository's blobs are let in; a link anywhere else still is refused."""
    from safetensors.torch import save_file

    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    tensors = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    save_file(tensors, blobs / "f3c1")
    os.symlink("../../blobs/f3c1", snapshot / "model.safetensors")
    got = {k: torch.full_like(v, float("nan")) for k, v in tensors.items()}
    dcp.load(got, storage_reader=ShardReader(snapshot), no_dist=True)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    save_file(tensors, tmp_path / "elsewhere.safetensors")
    os.replace(snapshot / "model.safetensors", snapshot / "old")
    os.symlink(tmp_path / "elsewhere.safetensors", snapshot / "model.safetensors")
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint directory"):
        ShardReader(snapshot, cache_metadata=False).read_metadata()
