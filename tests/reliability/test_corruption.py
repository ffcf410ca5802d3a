"""Corrupted data files: every corruption is detected, and never turns into a bad tensor.

A seeded generator applies byte flips, truncations, zero-filled ranges, deleted files
and swapped files to copies of one checkpoint. For every case:

* ``verify_checkpoint`` (what ``dcp-ext verify`` runs) reports it, naming the file and a
  key whose bytes changed;
* a load with ``verify_checksums=True`` fails with a ``CheckpointError`` naming the file
  and an affected key;
* a load without verification either fails with a ``CheckpointError`` or fills every
  tensor with the right shape and dtype (values may be wrong: nothing checked them),
  and the interpreter survives.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import shutil
from dataclasses import dataclass

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_ext import CheckpointError, ChecksumMismatchError, CorruptCheckpointError, ShardLoadPlanner, ShardReader
from dcp_ext.storage.verify import verify_checkpoint

from support import assert_state_dict_equal, garbage_state, load, load_error, sample_state, save

CASES_PER_KIND = {"flip": 150, "truncate": 40, "zero": 50}


def corruption_state() -> dict:
    g = torch.Generator().manual_seed(5)
    state: dict = {f"w{i}": torch.randn(32 + i, 24, generator=g) for i in range(6)}
    state["half"] = torch.randn(40, 8, generator=g).half()
    state["ids"] = torch.randint(0, 10**6, (50,), generator=g)
    state["empty"] = torch.empty(0, 4)
    state["flag"] = torch.rand(16, generator=g) > 0.5
    state["config"] = {"lr": 0.1, "name": "corruption"}  # a bytes item
    return state


# DCP plans no read for an empty tensor, so no load checks that record (verify does)
LOADED_KEYS = {k for k, v in corruption_state().items() if isinstance(v, torch.Tensor) and v.numel()} | {
    "config.lr",
    "config.name",
}


@dataclass
class Corruption:
    """What was done, and which (file, key) pairs it may have damaged."""

    label: str
    damaged: set[tuple[str, str]]

    @property
    def files(self) -> set[str]:
        return {f for f, _ in self.damaged}


def stored_items(path) -> list[tuple[str, str, int, int]]:
    """(file, key, offset, length) of every stored item."""
    reader = ShardReader(path, cache_metadata=False)
    reader.read_metadata()
    return [(i.relative_path, index.fqn, i.offset, i.length) for index, i in reader.catalog.items.items()]


def overlapping(items, name: str, start: int, end: int) -> set[tuple[str, str]]:
    return {(f, k) for f, k, off, n in items if f == name and off < end and start < off + n}


def corrupt(path, items, rng: random.Random, kind: str) -> Corruption:
    files = sorted({f for f, *_ in items})
    name = rng.choice(files)
    target = path / name
    size = target.stat().st_size
    if kind == "flip":
        pos = rng.randrange(size)
        with open(target, "r+b") as f:
            f.seek(pos)
            byte = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([byte ^ rng.randrange(1, 256)]))
        return Corruption(f"flip {name}@{pos}", overlapping(items, name, pos, pos + 1))
    if kind == "truncate":
        new_size = rng.randrange(size)
        os.truncate(target, new_size)
        return Corruption(f"truncate {name} to {new_size}", overlapping(items, name, new_size, size))
    if kind == "zero":
        data = bytearray(target.read_bytes())
        while True:  # a range that is not already all zeros, else nothing changed
            start = rng.randrange(size)
            end = min(size, start + rng.randrange(1, 4096))
            if any(data[start:end]):
                break
        data[start:end] = bytes(end - start)
        target.write_bytes(bytes(data))
        return Corruption(f"zero {name}[{start}:{end}]", overlapping(items, name, start, end))
    if kind == "delete":
        target.unlink()
        return Corruption(f"delete {name}", overlapping(items, name, 0, size))
    other = path / rng.choice([f for f in files if f != name])  # swap two files' contents
    a, b = target.read_bytes(), other.read_bytes()
    target.write_bytes(b)
    other.write_bytes(a)
    return Corruption(f"swap {name} {other.name}", overlapping(items, name, 0, size) | overlapping(items, other.name, 0, len(b)))


def names_damage(message: str, corruption: Corruption) -> bool:
    return any(f in message and f"'{k}'" in message for f, k in corruption.damaged)


def check_detected(path, state: dict, corruption: Corruption) -> None:
    report = verify_checkpoint(str(path))
    assert not report.ok, f"{corruption.label}: verify found nothing"
    assert any(names_damage(fault, corruption) or (
        "missing" in fault and any(f in fault for f in corruption.files)
    ) for fault in report.faults), (corruption.label, report.faults)
    if not any(k in LOADED_KEYS for _, k in corruption.damaged):  # only a record no load reads
        assert_state_dict_equal(load(state, path, verify_checksums=True, cache_metadata=False)[0], state)
        return
    error = load_error(state, path, verify_checksums=True, cache_metadata=False)
    assert isinstance(error, CheckpointError), (corruption.label, error)
    assert names_damage(str(error), corruption), (corruption.label, str(error))


def check_unverified_load(path, state: dict, corruption: Corruption) -> None:
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    out = garbage_state(tensors)
    try:
        dcp.load(out, storage_reader=ShardReader(path, cache_metadata=False), planner=ShardLoadPlanner())
    except CheckpointException as exc:
        error = next(iter(exc.failures.values()))[0]
        assert isinstance(error, CheckpointError), (corruption.label, error)
        return
    for key, value in tensors.items():
        assert out[key].shape == value.shape and out[key].dtype == value.dtype, (corruption.label, key)


def corruption_kinds() -> list[tuple[str, int]]:
    cases = [(kind, n) for kind, count in CASES_PER_KIND.items() for n in range(count)]
    return cases + [("delete", n) for n in range(3)] + [("swap", n) for n in range(3)]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("pristine")
    state = corruption_state()
    save(state, path, thread_count=3)
    return path, state, stored_items(path)


@pytest.mark.parametrize("kind, seed", corruption_kinds())
def test_every_corruption_is_detected(tmp_path, pristine, kind, seed):
    source, state, items = pristine
    work = tmp_path / "ckpt"
    shutil.copytree(source, work)
    corruption = corrupt(work, items, random.Random(f"{kind}-{seed}"), kind)
    check_detected(work, state, corruption)
    check_unverified_load(work, state, corruption)


# -- targeted cases with exact messages --------------------------------------------------
def test_truncated_data_file_names_file_and_key(tmp_path):
    state = {"only": torch.arange(4096, dtype=torch.float32)}
    save(state, tmp_path, thread_count=1)
    data_file = next(p for p in tmp_path.iterdir() if p.suffix == ".distcp")
    os.truncate(data_file, data_file.stat().st_size // 2)
    error = load_error(state, tmp_path)
    assert isinstance(error, CorruptCheckpointError)
    assert data_file.name in str(error) and "'only'" in str(error) and "truncated" in str(error)


def test_missing_data_file_names_file_and_key(tmp_path):
    state = {"only": torch.arange(10.0)}
    save(state, tmp_path, thread_count=1)
    data_file = next(p for p in tmp_path.iterdir() if p.suffix == ".distcp")
    data_file.unlink()
    error = load_error(state, tmp_path)
    assert isinstance(error, CheckpointError) and data_file.name in str(error) and "missing" in str(error)


def _flip_payload_byte(path, key: str) -> str:
    """Flip one byte in the middle of ``key``'s tensor data; returns the file name."""
    reader = ShardReader(path, cache_metadata=False)
    reader.read_metadata()
    index = next(i for i in reader.catalog.items if i.fqn == key)
    item = reader.catalog.items[index]
    layout = reader.catalog.known_layout(index) or reader.catalog.parse_layout(reader.location, index)
    target = os.path.join(path, item.relative_path)
    with open(target, "r+b") as f:
        f.seek(item.offset + layout.payload_offset + layout.payload_nbytes // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    return item.relative_path


@pytest.mark.parametrize("writer", ["ours", "ours, checksums=False", "stock"])
def test_flipped_payload_byte_is_caught_with_verify_checksums(tmp_path, writer):
    """Every record carries one checksum a verified load checks: our CRC32C in the index, or
    the zip CRC-32 that ``checksums=False`` and stock DCP keep in the record."""
    state = sample_state()
    if writer == "stock":
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path))
    else:
        save(state, tmp_path, checksums=writer == "ours")
    intact, _ = load(state, tmp_path, verify_checksums=True)
    assert_state_dict_equal(intact, state)
    name = _flip_payload_byte(tmp_path, "w")
    silent, _ = load(state, tmp_path)  # without verification the bytes load as stored
    assert not torch.equal(silent["w"], state["w"]) and silent["w"].shape == state["w"].shape
    error = load_error(state, tmp_path, verify_checksums=True)
    assert isinstance(error, ChecksumMismatchError)
    assert name in str(error) and "'w'" in str(error)


def test_data_file_replaced_by_a_directory_is_a_checkpoint_error(tmp_path):
    state = {"only": torch.arange(10.0)}
    save(state, tmp_path, thread_count=1)
    data_file = next(p for p in tmp_path.iterdir() if p.suffix == ".distcp")
    data_file.unlink()
    data_file.mkdir()
    error = load_error(state, tmp_path)
    assert isinstance(error, CheckpointError) and data_file.name in str(error)


def _overwrite_record_byte(path, key: str, at: int, value: int) -> str:
    reader = ShardReader(path, cache_metadata=False)
    reader.read_metadata()
    item = reader.catalog.item(next(i for i in reader.catalog.items if i.fqn == key))
    with open(os.path.join(path, item.relative_path), "r+b") as f:
        f.seek(item.offset + at)
        f.write(bytes([value]))
    return item.relative_path


def test_a_stock_non_tensor_item_whose_value_changed_is_caught_by_its_zip_crc(tmp_path):
    """A stock bytes item is a torch.save archive whose entries carry zip CRC-32s. One byte
    of its pickle changed (step 7 -> 6) still unpickles, so nothing but the CRC can tell:
    stock loads 6, and so did we, and ``dcp-ext verify`` (then convert, which would have
    signed the damage with fresh checksums) passed it."""
    state = {"w": torch.arange(6.0), "step": 7}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    reader = ShardReader(tmp_path, cache_metadata=False)
    reader.read_metadata()
    item = reader.catalog.item(next(i for i in reader.catalog.items if i.fqn == "step"))
    path = tmp_path / item.relative_path
    data = bytearray(path.read_bytes())
    at = data.index(b"\x80\x02K\x07.", item.offset, item.offset + item.length)  # the pickle of 7
    data[at + 3] = 6
    path.write_bytes(data)
    for verify in (False, True):
        error = load_error({"w": torch.zeros(6), "step": 0}, tmp_path, verify_checksums=verify)
        assert isinstance(error, ChecksumMismatchError), repr(error)
        assert item.relative_path in str(error) and "'step'" in str(error) and "crc32 mismatch" in str(error), error
    report = verify_checkpoint(str(tmp_path))
    assert any("'step'" in fault and "crc32 mismatch" in fault for fault in report.faults), report.faults


def test_damaged_zip_structures_of_stock_records_are_faults_not_tracebacks(tmp_path):
    """Every byte of a stock record's local header and of its archive's end (central
    directory, zip64 end records) flipped in turn: ``verify`` reports a fault or OK, and a
    load fails with a ``CheckpointError`` or loads. zipfile raised UnicodeDecodeError (a
    damaged entry name), NotImplementedError (a zip version), ValueError (a negative seek),
    OverflowError and BadZipFile (from ``is_zipfile`` itself) through ``dcp-ext verify`` as
    tracebacks (found by the CLI sweep)."""
    dcp.save({"w": torch.arange(64.0), "step": 7}, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    reader = ShardReader(tmp_path, cache_metadata=False)
    reader.read_metadata()
    pristine = {}
    for key in ("step", "w"):
        item = reader.catalog.item(next(i for i in reader.catalog.items if i.fqn == key))
        pristine[key] = item
    path = tmp_path / pristine["w"].relative_path
    original = path.read_bytes()
    for key, item in pristine.items():
        start, end = item.offset, item.offset + item.length
        for at in [*range(start, start + 64), *range(end - 160, end)]:
            data = bytearray(original)
            data[at] ^= 0xFF
            path.write_bytes(data)
            verify_checkpoint(str(tmp_path))  # a report either way, never an exception
            for verify in (False, True):
                try:
                    load({"w": torch.zeros(64), "step": 0}, tmp_path, verify_checksums=verify)
                except CheckpointException as exc:
                    assert all(isinstance(error, CheckpointError) for error, *_ in exc.failures.values()), (key, at, exc)
    path.write_bytes(original)


@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_a_damaged_non_tensor_item_is_a_checkpoint_error_naming_it(tmp_path, writer):
    """A bytes item is read and decoded whole: ours is checked against its CRC32C on every
    load (a record of another key decoded to another key's value, of another type), a
    stock one (no checksum) that torch.load trips over gave bare KeyError / IndexError /
    struct.error naming nothing."""
    state = {"w": torch.arange(6.0), "name": "a string item long enough to hold the changed byte " * 3}
    if writer == "stock":
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    else:
        save(state, tmp_path)
    name = _overwrite_record_byte(tmp_path, "name", 67, 0)  # in the record's pickle: a memo key torch.load misses
    error = load_error({"w": torch.zeros(6), "name": ""}, tmp_path)
    assert isinstance(error, CheckpointError), repr(error)
    assert name in str(error) and "'name'" in str(error), error
    if writer == "ours":
        assert isinstance(error, ChecksumMismatchError), repr(error)


def test_a_storage_meta_that_lost_a_field_still_loads(tmp_path):
    """A ``.metadata`` whose StorageMeta pickles a renamed field (one damaged byte): stock
    never reads the fields and loads it; ours rebuilt it with ``dataclasses.replace`` and
    raised a bare AttributeError."""
    state = {"w": torch.arange(8.0), "n": 7}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    path = tmp_path / ".metadata"
    raw = path.read_bytes()
    assert raw.count(b"modules") == 1
    path.write_bytes(raw.replace(b"modules", b"modulas"))
    got, _ = load({"w": torch.full((8,), float("nan")), "n": 0}, tmp_path)
    assert_state_dict_equal(got, state)


@pytest.mark.parametrize("name", [".metadata", ".dcp_ext_index.parquet"])
def test_a_symlink_loop_in_place_of_a_metadata_file_is_named(tmp_path, name, capsys):
    """ELOOP passed as a bare OSError; dcp-ext verify answered 'error:' (rc 2) where a
    damaged checkpoint gets a FAULT line (rc 1)."""
    from dcp_ext.cli.main import main as cli

    state = {"w": torch.arange(3.0)}
    save(state, tmp_path)
    (tmp_path / name).unlink()
    (tmp_path / name).symlink_to(name)
    error = load_error(state, tmp_path)  # DCP wraps a metadata failure in an AssertionError with its message
    assert f"{tmp_path}: {name} is a symbolic link that loops, expected a file" in str(error), repr(error)
    assert cli(["verify", str(tmp_path)]) == 1
    assert f"FAULT {tmp_path}: {name} is a symbolic link that loops" in capsys.readouterr().out


def _stock_pair_with(tmp_path, change) -> dict[str, torch.Tensor]:
    """A stock checkpoint of 'a' and 'b' (one shape, one file, 'b' right after 'a'),
    whose pickled ``.metadata`` then gets ``change(storage_data, index_of_a, index_of_b)``."""
    g = torch.Generator().manual_seed(7)
    state = {"a": torch.randn(8, 8, generator=g), "b": torch.randn(8, 8, generator=g)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=1), no_dist=True)
    path = tmp_path / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    ka, kb = (next(k for k in metadata.storage_data if k.fqn == fqn) for fqn in ("a", "b"))
    change(metadata.storage_data, ka, kb)
    path.write_bytes(pickle.dumps(metadata))
    return state


@pytest.mark.parametrize("verify", [False, True])
def test_a_stored_length_spanning_the_next_record_is_refused_not_read_as_it(tmp_path, verify):
    """``.metadata`` giving record 'a' a length that covers 'b' too: zipfile reads such a
    span as 'b''s archive with bytes before it, and 'a' was silently loaded with 'b''s
    values (stock reads 'a' right: torch.load starts at the record's first byte). The
    archive must begin at the record's first byte."""
    def span_both(data, ka, kb):
        data[ka] = dataclasses.replace(data[ka], length=data[ka].length + data[kb].length)

    state = _stock_pair_with(tmp_path, span_both)
    error = load_error(state, tmp_path, verify_checksums=verify)
    assert isinstance(error, CorruptCheckpointError), error
    assert "key 'a'" in str(error) and "does not begin with its zip archive" in str(error), error
