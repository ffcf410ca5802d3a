"""What a ``torch.save`` tensor record can carry besides the storage, read right or refused.

A record rebuilds its tensor with ``_rebuild_tensor_v2`` (``_v3`` for uint16/32/64 and the
float8 dtypes), whose last argument may carry the conj and neg bits of a view: stock
``torch.save`` writes the unresolved storage plus the flag. ShardReader must apply the
flags (stock ``FileSystemReader`` does), ShardWriter writes resolved values, the save-time
replica digest hashes values, and records we cannot read byte-exactly fail loudly, naming
the file and key.
"""

from __future__ import annotations

import io
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support import garbage_like, load_error

from dcp_ext import (
    CheckpointError,
    ShardLoadPlanner,
    ShardReader,
    ShardSavePlanner,
    ShardWriter,
)
from dcp_ext.errors import CorruptCheckpointError
from dcp_ext.formats.torch_record import parse_tensor_record
from dcp_ext.planning.replica_check import chunk_digest


def complex_base() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.complex(torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g))


def views() -> dict[str, torch.Tensor]:
    """Tensors whose records carry math bits; two are strided views of a larger storage."""
    real = torch.randn(4, 7, generator=torch.Generator().manual_seed(4))
    return {
        "conj": complex_base().conj(),
        "neg": torch._neg_view(real),
        "conj_imag": complex_base().conj().imag,  # neg bit on a strided view (offset 1, stride 2)
        "conj_rows": complex_base().conj()[2:5],  # conj bit, storage offset 10 of a larger storage
        "neg_half": torch._neg_view(real.half()),
    }


def resolved(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}


def save_with(writer: str, state: dict, path) -> None:
    if writer == "ours":
        dcp.save(state, storage_writer=ShardWriter(path), planner=ShardSavePlanner())
    else:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path))


def load_into(want: dict[str, torch.Tensor], path, **reader_kwargs) -> dict[str, torch.Tensor]:
    out = {k: garbage_like(v) for k, v in want.items()}
    dcp.load(out, storage_reader=ShardReader(path, **reader_kwargs), planner=ShardLoadPlanner())
    return out


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert not got[key].is_conj() and not got[key].is_neg(), key
        assert torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_conj_and_neg_views_load_resolved(tmp_path, writer, verify):
    state = views()
    want = resolved(state)
    save_with(writer, state, tmp_path)
    assert_bit_exact(load_into(want, tmp_path, verify_checksums=verify), want)


@pytest.mark.parametrize("verify", [False, True])
def test_flagged_records_cast_into_other_dtypes(tmp_path, verify):
    """A destination of another dtype gets the values cast, signs included: torch's
    float16-to-float32 copy drops a neg bit (stock FileSystemReader loads ``neg_half``
    into float32 with its signs flipped)."""
    state = views()
    save_with("stock", state, tmp_path)
    wider = {torch.float32: torch.float64, torch.float16: torch.float32, torch.complex64: torch.complex128}
    want = {k: v.to(wider[v.dtype]) for k, v in resolved(state).items()}
    assert_bit_exact(load_into(want, tmp_path, verify_checksums=verify), want)


def test_our_records_hold_resolved_values_for_stock_readers(tmp_path):
    """Stock FileSystemReader reads our file right, and our records carry no math bits."""
    state = views()
    want = resolved(state)
    save_with("ours", state, tmp_path)
    out = {k: garbage_like(v) for k, v in want.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(tmp_path))
    assert_bit_exact(out, want)
    for path in tmp_path.glob("*.distcp"):
        assert b"conj" not in path.read_bytes() and b"neg" not in path.read_bytes()


def test_flagged_destination_gets_values(tmp_path):
    """A destination that is itself a conj view is filled with the stored values."""
    want = {"c": complex_base()}
    save_with("stock", {"c": complex_base().conj()}, tmp_path)
    dest = garbage_like(want["c"]).conj()
    dcp.load({"c": dest}, storage_reader=ShardReader(tmp_path), planner=ShardLoadPlanner())
    assert torch.equal(dest.resolve_conj(), complex_base().conj().resolve_conj())


def test_chunk_digest_hashes_values():
    """A conj/neg view digests like its resolved copy (and differs from the raw storage)."""
    for key, view in views().items():
        assert chunk_digest(view) == chunk_digest(view.resolve_conj().resolve_neg().clone()), key
    c = complex_base()
    assert chunk_digest(c.conj()) != chunk_digest(c)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_rebuild_v3_dtypes_round_trip(tmp_path, writer, dtype):
    """uint16/32 and float8 records use ``_rebuild_tensor_v3`` (an untyped storage plus a dtype)."""
    bits = torch.randint(0, 120, (5, 3), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    full = bits.to(torch.int64).to(dtype) if dtype.is_floating_point is False else bits.view(dtype)
    state = {"t": full, "strided": full.t()[1:], "empty": full[:0]}
    want = {k: v.contiguous() for k, v in state.items()}
    save_with(writer, state, tmp_path)
    out = load_into(want, tmp_path)
    for key, value in want.items():
        assert torch.equal(out[key].view(torch.uint8), value.view(torch.uint8)), key


def replace_record(path, key: str, obj) -> None:
    """Overwrite a stock checkpoint's record for ``key`` with ``torch.save(obj)`` (end of file)."""
    import pickle

    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own fresh stock checkpoint: trusted here
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == key)
    record = io.BytesIO()
    torch.save(obj, record)
    data_file = path / info.relative_path
    info.offset, info.length = data_file.stat().st_size, len(record.getvalue())
    with open(data_file, "ab") as f:
        f.write(record.getvalue())
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def unknown_flag_tensor(monkeypatch) -> torch.Tensor:
    """A tensor whose record carries a metadata flag torch 2.13 never writes."""
    monkeypatch.setattr(torch._utils, "get_tensor_metadata", lambda t: {"neg": False, "future_bit": True})
    return torch.ones(3, 4)


UNREADABLE = {
    "quantized": (lambda mp: torch.quantize_per_tensor(torch.ones(3, 4), 0.1, 0, torch.qint8), "quantized"),
    "sparse": (lambda mp: torch.ones(3, 4).to_sparse(), "sparse"),
    "parameter": (lambda mp: torch.nn.Parameter(torch.ones(3, 4)), "Parameter"),
    "unknown flag": (unknown_flag_tensor, "future_bit"),
}


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions")
@pytest.mark.parametrize("kind", list(UNREADABLE))
def test_records_we_cannot_read_exactly_are_refused(tmp_path, monkeypatch, kind):
    make, detail = UNREADABLE[kind]
    state = {"w": torch.ones(3, 4)}
    save_with("stock", state, tmp_path)
    with monkeypatch.context() as patch:
        obj = make(patch)
        replace_record(tmp_path, "w", obj)
    error = load_error(state, tmp_path)
    assert isinstance(error, CheckpointError), error
    assert "'w'" in str(error) and ".distcp" in str(error) and detail in str(error)


def test_big_endian_record_is_refused(tmp_path, monkeypatch):
    state = {"w": torch.arange(12.0).reshape(3, 4)}
    save_with("stock", state, tmp_path)
    with monkeypatch.context() as patch:
        patch.setattr(sys, "byteorder", "big")
        replace_record(tmp_path, "w", torch.arange(12.0).reshape(3, 4))
    error = load_error(state, tmp_path)
    assert isinstance(error, CheckpointError) and "'w'" in str(error) and "big" in str(error)


def test_record_pickle_is_checked_against_its_crc():
    """A record's pickle is read from its zip entry and checked against the entry's CRC-32
    where torch.save computed one (a record written without CRCs has the index's CRC32C)."""
    out = io.BytesIO()
    torch.save(torch.arange(6.0), out)
    record = bytearray(out.getvalue())
    read = lambda o, n: bytes(record[o : o + n])
    assert parse_tensor_record(len(record), read, "r").payload_crc32 is not None
    at = record.index(b"_rebuild_tensor_v2")  # a byte of the pickle that parses either way
    record[at + 9] ^= 0x20  # "_rebuild_Tensor_v2"
    with pytest.raises(CorruptCheckpointError, match=r"r: zip entry '.*data.pkl' fails its CRC-32"):
        parse_tensor_record(len(record), read, "r")
