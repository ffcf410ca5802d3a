"""Hostile and corrupt checkpoints give clear errors naming file and key; nothing executes."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import load, load_error, sample_state, save

from dcp_ext import (
    CheckpointError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    ShardReader,
    UnsafeCheckpointError,
)
from dcp_ext.formats.index import INDEX_NAME


class _RunsShell:
    def __init__(self, canary: str):
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


def _rewrite_metadata(path, mutate) -> None:
    """Replace .metadata with a mutated copy (and drop our index so the pickle is used)."""
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own fresh checkpoint: trusted here
    mutate(metadata)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    (path / INDEX_NAME).unlink(missing_ok=True)


def test_metadata_pickle_that_runs_code_is_refused(tmp_path):
    canary = tmp_path / "canary"
    save(sample_state(), tmp_path / "ckpt")
    _rewrite_metadata(tmp_path / "ckpt", lambda md: setattr(md, "planner_data", _RunsShell(str(canary))))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refuses to load posix\.system"):
        ShardReader(tmp_path / "ckpt").read_metadata()
    assert not canary.exists()


@pytest.mark.parametrize("payload", ["builtins eval", "subprocess Popen", "torch load", "builtins exec"])
def test_metadata_globals_outside_the_allowlist_are_refused(tmp_path, payload):
    module, name = payload.split()
    (tmp_path / ".metadata").write_bytes(
        b"\x80\x04c" + module.encode() + b"\n" + name.encode() + b"\n" + b"(S'print(1)'\ntR."
    )
    with pytest.raises(UnsafeCheckpointError, match=f"{module}.{name}"):
        ShardReader(tmp_path).read_metadata()


def test_deeply_nested_metadata_is_refused(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"\x80\x04" + b"]" * 200_000 + b".")
    with pytest.raises(CheckpointError, match="metadata"):
        ShardReader(tmp_path).read_metadata()


@pytest.mark.parametrize("bad_path", ["../outside.distcp", "/etc/passwd", "a/../../x"])
def test_path_traversal_in_relative_path_is_refused(tmp_path, bad_path):
    state = sample_state()
    save(state, tmp_path / "ckpt")

    def escape(md):
        index = next(i for i in md.storage_data if i.fqn == "w")
        md.storage_data[index].relative_path = bad_path

    _rewrite_metadata(tmp_path / "ckpt", escape)
    with pytest.raises(UnsafeCheckpointError, match=r"key 'w'.*escapes the checkpoint directory"):
        ShardReader(tmp_path / "ckpt").read_metadata()


def test_symlink_out_of_the_directory_is_refused(tmp_path):
    state = sample_state()
    save(state, tmp_path / "ckpt")
    outside = tmp_path / "outside.distcp"
    ckpt = tmp_path / "ckpt"
    victim = next(n for n in os.listdir(ckpt) if n.endswith(".distcp"))
    os.replace(ckpt / victim, outside)
    os.symlink(outside, ckpt / victim)
    error = load_error(state, ckpt)
    assert isinstance(error, UnsafeCheckpointError) and victim in str(error) and "outside" in str(error)


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


@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_flipped_byte_is_caught_with_verify_checksums(tmp_path, writer):
    state = sample_state()
    if writer == "ours":
        save(state, tmp_path)
    else:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path))
    name = _flip_payload_byte(tmp_path, "w")
    silent, _ = load(state, tmp_path)  # without verification the bytes load as stored
    assert not torch.equal(silent["w"], state["w"]) and silent["w"].shape == state["w"].shape
    error = load_error(state, tmp_path, verify_checksums=True)
    assert isinstance(error, ChecksumMismatchError)
    assert name in str(error) and "'w'" in str(error)


def test_chunk_claiming_more_bytes_than_its_record_is_refused(tmp_path):
    save(sample_state(), tmp_path)

    def inflate(md):
        md.state_dict_metadata["w"].size = torch.Size([2**40, 48])
        md.state_dict_metadata["w"].chunks[0].sizes = torch.Size([2**40, 48])

    _rewrite_metadata(tmp_path, inflate)
    with pytest.raises(CorruptCheckpointError, match=r"'w'.*needs \d+ bytes"):
        ShardReader(tmp_path).read_metadata()


def test_directory_without_metadata_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match=r"no committed checkpoint.*\.metadata is missing"):
        ShardReader(tmp_path).read_metadata()
