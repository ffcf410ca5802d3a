"""The sidecar index: one Parquet row per stored item, readable without pickle.

Stock DCP only writes ``.metadata`` (a pickle). Beside it we write
``.dcp_ext_index.parquet``: fqn, chunk offsets and sizes, dtype, file, byte offset,
length, where the raw tensor bytes start and a CRC32C of the record. Tensor-level facts
(global shape, properties), the planner's key mapping and the storage meta live in the
file's key/value metadata as JSON. The index also records the CRC32C and size of the
``.metadata`` bytes it was written with, so a reader can tell whether the two belong to
the same commit before trusting the index.
"""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_ext.errors import CheckpointError, CorruptCheckpointError
from dcp_ext.formats.faults import chunk_outside_tensor, invalid_byte_range, invalid_tensor_facts, record_too_small

INDEX_NAME = ".dcp_ext_index.parquet"
INDEX_FORMAT = "dcp_ext-index/1"
_META_KEY = b"dcp_ext"

_SCHEMA = pa.schema(
    [
        ("fqn", pa.dictionary(pa.int32(), pa.string())),
        ("offsets", pa.list_(pa.int64())),
        ("sizes", pa.list_(pa.int64())),
        ("dtype", pa.dictionary(pa.int8(), pa.string())),
        ("file", pa.dictionary(pa.int32(), pa.string())),
        ("offset", pa.int64()),
        ("length", pa.int64()),
        ("payload_offset", pa.int64()),
        ("checksum", pa.uint32()),
        ("copy", pa.bool_()),  # an extra TP-replica copy of the chunk (dcp_ext.planning.locality)
    ]
)


class StoredItem(NamedTuple):
    """Where one saved item lives. ``payload_offset`` is absolute in the file (-1: unknown).
    A NamedTuple: an index load builds one per stored item, and tuples build fastest."""

    relative_path: str
    offset: int
    length: int
    payload_offset: int = -1
    checksum: int | None = None  # CRC32C of bytes [offset, offset + length)

    def storage_info(self) -> _StorageInfo:
        return _StorageInfo(self.relative_path, self.offset, self.length)


@dataclass
class IndexedCheckpoint:
    metadata: Metadata | None  # None: the planner data only survives in the pickle
    items: dict[MetadataIndex, StoredItem]
    metadata_crc32c: int
    metadata_size: int
    copies: dict[MetadataIndex, list[StoredItem]] = field(default_factory=dict)
    chunks: dict[MetadataIndex, tuple[TensorStorageMetadata, ChunkStorageMetadata]] = field(default_factory=dict)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, source: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"{source}: unknown dtype {name!r}")
    return dtype


def _planner_data_to_json(planner_data: Any) -> Any:
    """DefaultSavePlanner's mapping {flat key: path of str/int}; None if not that shape."""
    if planner_data is None:
        return {}
    if not isinstance(planner_data, dict):
        return None
    out = {}
    for key, path in planner_data.items():
        if not (isinstance(key, str) and isinstance(path, tuple) and all(type(p) in (str, int) for p in path)):
            return None
        out[key] = list(path)
    return out


def encode_index(
    metadata: Metadata,
    items: dict[MetadataIndex, StoredItem],
    metadata_bytes: bytes,
    crc: int,
    copies: dict[MetadataIndex, list[StoredItem]] | None = None,
) -> bytes:
    """Serialize the index for ``metadata`` whose pickle is ``metadata_bytes`` (CRC32C ``crc``).

    ``copies`` are extra stored copies of chunks (TP-replica locality), recorded as rows
    with ``copy`` set; ``.metadata`` only knows the canonical ones in ``items``.
    """
    columns: dict[str, list[Any]] = {name: [] for name in _SCHEMA.names}
    tensors: dict[str, list[Any]] = {}
    order: list[str] = []
    for fqn, md in metadata.state_dict_metadata.items():
        order.append(fqn)
        if isinstance(md, TensorStorageMetadata):
            props = md.properties
            tensors[fqn] = [dtype_name(props.dtype), list(md.size), props.requires_grad, props.pin_memory]
            chunks = [(MetadataIndex(fqn, c.offsets), list(c.offsets), list(c.sizes)) for c in md.chunks]
            dtype = dtype_name(props.dtype)
        else:
            chunks, dtype = [(MetadataIndex(fqn), None, None)], None
        for index, offsets, sizes in chunks:
            for item, is_copy in [(items[index], False), *(((c, True) for c in (copies or {}).get(index, ())))]:
                columns["fqn"].append(fqn)
                columns["offsets"].append(offsets)
                columns["sizes"].append(sizes)
                columns["dtype"].append(dtype)
                columns["file"].append(item.relative_path)
                columns["offset"].append(item.offset)
                columns["length"].append(item.length)
                columns["payload_offset"].append(item.payload_offset)
                columns["checksum"].append(item.checksum)
                columns["copy"].append(is_copy)
    storage_meta = metadata.storage_meta
    header = {
        "format": INDEX_FORMAT,
        "version": metadata.version,
        "order": order,
        "tensors": tensors,
        "planner_data": _planner_data_to_json(metadata.planner_data),
        "storage_meta": None
        if storage_meta is None
        else {
            "checkpoint_id": None if storage_meta.checkpoint_id is None else str(storage_meta.checkpoint_id),
            "save_id": storage_meta.save_id,
            "modules": list(storage_meta.modules),
        },
        "metadata_crc32c": crc,
        "metadata_size": len(metadata_bytes),
    }
    table = pa.table(columns, schema=_SCHEMA.with_metadata({_META_KEY: json.dumps(header).encode()}))
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def decode_index(data: bytes, source: str) -> IndexedCheckpoint:
    """Parse and validate index bytes from ``source`` column by column (numpy), then build
    the DCP objects in bulk; malformed content raises CorruptCheckpointError naming the key.
    The checks are those ``validate.check_metadata`` applies to a pickled ``.metadata``."""
    try:
        # One thread: read_table's dataset thread pool sometimes aborts the interpreter at
        # exit ("terminate called without an active exception", pyarrow 26), and the
        # index is small enough that threads buy nothing.
        table = pq.ParquetFile(pa.BufferReader(data)).read(use_threads=False)
        header = json.loads(table.schema.metadata[_META_KEY])
        if header.get("format") != INDEX_FORMAT:
            raise ValueError(f"format {header.get('format')!r}, expected {INDEX_FORMAT!r}")
        if "copy" not in table.column_names:  # written before TP-replica copies existed
            table = table.append_column("copy", pa.array([False] * table.num_rows))
        columns = _Columns.read(table.select(_SCHEMA.names).cast(_SCHEMA))
        return _build(header, _Keys.read(header, source), columns, source)
    except CheckpointError:
        raise
    except Exception as exc:  # untrusted bytes: any decode failure is corruption
        raise CorruptCheckpointError(f"{source}: unreadable index ({type(exc).__name__}: {exc})") from None


@dataclass
class _Keys:
    """The header's keys: names in order, tensor facts, and numpy views for the checks."""

    names: list[str]
    state: dict[str, Any]  # fqn -> TensorStorageMetadata (chunks to fill) or BytesStorageMetadata
    is_tensor: np.ndarray  # per key
    ndim: np.ndarray
    itemsize: np.ndarray
    shape_start: np.ndarray  # where each key's shape starts in ``shapes``
    shapes: np.ndarray

    @classmethod
    def read(cls, header: dict[str, Any], source: str) -> _Keys:
        names, state, shapes = list(header["order"]), {}, []
        for fqn in names:
            if fqn not in header["tensors"]:
                state[fqn] = BytesStorageMetadata()
                shapes.append([])
                continue
            dtype_text, shape, requires_grad, pin_memory = header["tensors"][fqn]
            if not isinstance(shape, list) or not all(type(v) is int for v in shape):
                raise CorruptCheckpointError(f"{source}: {fqn!r} has a non-integer shape or offset {shape!r}")
            dtype = dtype_from_name(dtype_text, source)
            if any(v < 0 for v in shape):
                raise invalid_tensor_facts(source, fqn, dtype, shape)
            props = TensorProperties(dtype=dtype, requires_grad=bool(requires_grad), pin_memory=bool(pin_memory))
            state[fqn] = TensorStorageMetadata(props, torch.Size(shape), [])
            shapes.append(shape)
        tensor = [isinstance(md, TensorStorageMetadata) for md in state.values()]
        ndim = np.array([len(shape) for shape in shapes], np.int64)
        return cls(
            names=list(state),
            state=state,
            is_tensor=np.array(tensor, bool),
            ndim=ndim,
            itemsize=np.array([md.properties.dtype.itemsize if t else 1 for md, t in zip(state.values(), tensor)], np.int64),
            shape_start=np.concatenate([[0], np.cumsum(ndim)[:-1]]).astype(np.int64),
            shapes=np.array([v for shape in shapes for v in shape], dtype=np.float64),
        )


@dataclass
class _Columns:
    """The index's columns as numpy arrays (offsets/sizes flattened, as Arrow stores them)."""

    fqn: np.ndarray  # code into fqn_names
    fqn_names: list[Any]
    box_null: np.ndarray  # rows without offsets or sizes (non-tensor items)
    off_start: np.ndarray  # each row's first element in off_values
    off_len: np.ndarray
    off_values: np.ndarray
    size_start: np.ndarray
    size_len: np.ndarray
    size_values: np.ndarray
    file: np.ndarray  # code into file_names
    file_names: list[Any]
    offset: np.ndarray
    length: np.ndarray
    payload: np.ndarray
    checksum: list[int | None]
    copy: np.ndarray
    nulls: dict[str, int]

    @classmethod
    def read(cls, table: pa.Table) -> _Columns:
        col = {name: table.column(name).combine_chunks() for name in _SCHEMA.names}
        off, size = col["offsets"], col["sizes"]
        off_ends, size_ends = _numpy(off.offsets), _numpy(size.offsets)
        return cls(
            fqn=_numpy(col["fqn"].indices),
            fqn_names=col["fqn"].dictionary.to_pylist(),
            box_null=~(_valid(off) & _valid(size)),
            off_start=off_ends[:-1],
            off_len=np.diff(off_ends),
            off_values=_numpy(off.values),
            size_start=size_ends[:-1],
            size_len=np.diff(size_ends),
            size_values=_numpy(size.values),
            file=_numpy(col["file"].indices),
            file_names=col["file"].dictionary.to_pylist(),
            offset=_numpy(col["offset"]),
            length=_numpy(col["length"]),
            payload=_numpy(col["payload_offset"]),
            checksum=col["checksum"].to_pylist(),
            copy=_numpy(col["copy"]).astype(bool) & _valid(col["copy"]),
            nulls={
                **{name: col[name].null_count for name in ("fqn", "file", "offset", "length", "payload_offset")},
                "box values": off.values.null_count + size.values.null_count,
            },
        )


def _numpy(array: pa.Array) -> np.ndarray:
    return array.to_numpy(zero_copy_only=False)


def _valid(array: pa.Array) -> np.ndarray:
    """Per row, not null: read from the validity bitmap (no Arrow compute kernels, whose
    thread pool can abort the interpreter at exit, see ``decode_index``)."""
    bitmap = array.buffers()[0]
    if bitmap is None or array.null_count == 0:
        return np.ones(len(array), bool)
    bits = np.unpackbits(np.frombuffer(bitmap, np.uint8), bitorder="little")
    return bits[array.offset : array.offset + len(array)].astype(bool)


def _build(header: dict[str, Any], keys: _Keys, cols: _Columns, source: str) -> IndexedCheckpoint:
    key_of_name = {name: n for n, name in enumerate(keys.names)}
    lookup = np.array([key_of_name.get(name, -1) for name in cols.fqn_names] + [-1], np.int64)
    if cols.nulls["fqn"] or cols.nulls["file"]:
        raise CorruptCheckpointError(f"{source}: index rows without a key or file name")
    key = lookup[cols.fqn] if len(cols.fqn) else np.zeros(0, np.int64)
    if np.any(key < 0):
        fqn = cols.fqn_names[cols.fqn[np.argmax(key < 0)]]
        raise CorruptCheckpointError(f"{source}: index row for {fqn!r} has no tensor or bytes entry")
    names = [keys.names[k] for k in key.tolist()]
    tensor = keys.is_tensor[key]
    _check_locations(names, cols, source)
    off_rows, size_rows = _check_boxes(names, key, tensor, keys, cols, source)
    return _objects(header, keys, cols, names, key, tensor, off_rows, size_rows, source)


def _check_locations(names: list[str], cols: _Columns, source: str) -> None:
    from dcp_ext.storage.location import check_relative_name  # storage builds on formats

    codes, first_rows = np.unique(cols.file, return_index=True)
    for code, row in zip(codes.tolist(), first_rows.tolist()):
        check_relative_name(source, cols.file_names[code], names[row])
    if cols.nulls["offset"] or cols.nulls["length"] or cols.nulls["payload_offset"]:
        raise CorruptCheckpointError(f"{source}: an index item has missing location fields")
    offset, length, payload = cols.offset, cols.length, cols.payload
    bad = (offset < 0) | (length < 0) | ~((payload == -1) | ((offset <= payload) & (payload <= offset + length)))
    if np.any(bad):
        row = int(np.argmax(bad))
        raise invalid_byte_range(source, names[row], int(offset[row]), int(length[row]), int(payload[row]))


def _check_boxes(
    names: list[str], key: np.ndarray, tensor: np.ndarray, keys: _Keys, cols: _Columns, source: str
) -> tuple[np.ndarray, np.ndarray]:
    """Check every tensor row's chunk against its key's shape and its record's length;
    return the rows' (offsets, sizes) element positions grouped for object building."""
    if np.any(tensor & cols.box_null):
        row = int(np.argmax(tensor & cols.box_null))
        raise CorruptCheckpointError(f"{source}: tensor {names[row]!r} has a row without offsets/sizes")
    if cols.nulls["box values"]:
        raise CorruptCheckpointError(f"{source}: an index row has a missing chunk offset or size")
    ndim = keys.ndim[key]
    wrong = tensor & ((cols.off_len != ndim) | (cols.size_len != ndim))
    if np.any(wrong):
        row = int(np.argmax(wrong))
        raise _chunk_fault(source, names[row], cols, row, keys.state[names[row]].size)
    rows = np.flatnonzero(tensor)
    elems = ndim[rows]
    within = np.arange(int(elems.sum())) - np.repeat(np.cumsum(elems) - elems, elems)
    off = cols.off_values[np.repeat(cols.off_start[rows], elems) + within]
    size = cols.size_values[np.repeat(cols.size_start[rows], elems) + within]
    extent = keys.shapes[np.repeat(keys.shape_start[key[rows]], elems) + within]
    outside = (off < 0) | (size < 0) | (off.astype(np.float64) + size > extent)
    if np.any(outside):
        row = int(rows[np.repeat(np.arange(len(rows)), elems)[np.argmax(outside)]])
        raise _chunk_fault(source, names[row], cols, row, keys.state[names[row]].size)
    numel = np.ones(len(rows), np.float64)
    has = elems > 0
    if np.any(has):
        numel[has] = np.multiply.reduceat(size.astype(np.float64), (np.cumsum(elems) - elems)[has])
    need = numel * keys.itemsize[key[rows]]
    payload, offset, length = cols.payload[rows], cols.offset[rows], cols.length[rows]
    short = (need > length) | ((payload >= 0) & (payload + need > offset + length))
    if np.any(short):
        n = int(np.argmax(short))
        row = int(rows[n])
        raise record_too_small(
            source, names[row], _box(cols, row)[0], int(need[n]), cols.file_names[cols.file[row]],
            int(offset[n]), int(length[n]), int(payload[n]),
        )
    return off, size


def _box(cols: _Columns, row: int) -> tuple[list[int], list[int]]:
    off = cols.off_values[cols.off_start[row] : cols.off_start[row] + cols.off_len[row]].tolist()
    size = cols.size_values[cols.size_start[row] : cols.size_start[row] + cols.size_len[row]].tolist()
    return off, size


def _chunk_fault(source: str, fqn: str, cols: _Columns, row: int, shape: torch.Size) -> CorruptCheckpointError:
    off, size = _box(cols, row)
    return chunk_outside_tensor(source, fqn, off, size, shape)


def _objects(
    header: dict[str, Any], keys: _Keys, cols: _Columns, names: list[str], key: np.ndarray, tensor: np.ndarray,
    off: np.ndarray, size: np.ndarray, source: str,
) -> IndexedCheckpoint:
    """DCP objects for validated columns, built with ``map`` (most of the load's time)."""
    offsets: list[torch.Size | None] = [None] * len(names)
    chunks: list[ChunkStorageMetadata | None] = [None] * len(names)
    rows = np.flatnonzero(tensor)
    ndim = keys.ndim[key[rows]]
    starts = np.cumsum(ndim) - ndim
    for d in np.unique(ndim).tolist():  # rows of one rank reshape to a matrix
        picked = np.flatnonzero(ndim == d)
        at = (starts[picked][:, None] + np.arange(d)).reshape(-1)
        where = rows[picked].tolist()
        made = list(torch_sizes(off[at].reshape(len(picked), d)))
        made_sizes = torch_sizes(size[at].reshape(len(picked), d))
        for row, o, chunk in zip(where, made, map(ChunkStorageMetadata, made, made_sizes)):
            offsets[row], chunks[row] = o, chunk
    indices = list(map(_metadata_index, names, offsets))
    files = [cols.file_names[c] for c in cols.file.tolist()]
    offset, length = cols.offset.tolist(), cols.length.tolist()
    stored = list(map(StoredItem, files, offset, length, cols.payload.tolist(), cols.checksum))
    items: dict[MetadataIndex, StoredItem] = {}
    copies: dict[MetadataIndex, list[StoredItem]] = {}
    chunk_of: dict[MetadataIndex, tuple[TensorStorageMetadata, ChunkStorageMetadata]] = {}
    for index, item, chunk, is_copy in zip(indices, stored, chunks, cols.copy.tolist()):
        if is_copy:
            copies.setdefault(index, []).append(item)
            continue
        items[index] = item
        if chunk is not None:
            md = keys.state[index.fqn]
            md.chunks.append(chunk)
            chunk_of[index] = (md, chunk)
    missing = [fqn for fqn, md in keys.state.items() if isinstance(md, BytesStorageMetadata) and MetadataIndex(fqn) not in items]
    if missing:
        raise CorruptCheckpointError(f"{source}: bytes item {missing[0]!r} has no stored location")
    orphans = [index.fqn for index in copies if index not in items]
    if orphans:
        raise CorruptCheckpointError(f"{source}: replica copies of {orphans[:3]} have no canonical chunk")
    planner_data = header["planner_data"]
    meta = header["storage_meta"]
    metadata = None
    if planner_data is not None:
        metadata = Metadata(
            state_dict_metadata=keys.state,
            planner_data={k: tuple(v) for k, v in planner_data.items()},
            storage_data={index: _StorageInfo(item.relative_path, item.offset, item.length) for index, item in items.items()},
            storage_meta=None if meta is None else StorageMeta(meta["checkpoint_id"], meta["save_id"], None, list(meta["modules"])),
            version=header["version"],
        )
    return IndexedCheckpoint(metadata, items, int(header["metadata_crc32c"]), int(header["metadata_size"]), copies, chunk_of)


def _metadata_index(fqn: str, offset: torch.Size | None) -> MetadataIndex:
    """``MetadataIndex(fqn, offset)`` without its constructor, which copies ``offset`` into
    a new torch.Size (a third of an index load's time); ``offset`` already is one."""
    index = object.__new__(MetadataIndex)
    index.__dict__.update(fqn=fqn, offset=offset, index=None)
    return index


def torch_sizes(values: np.ndarray) -> Iterable[torch.Size]:
    """Rows of ``values`` as torch.Size objects; one shared object when all rows are equal
    (the chunks of a key mostly have one size), which also keeps a pickle small."""
    if len(values) and bool(np.all(values == values[0])):
        return itertools.repeat(torch.Size(values[0].tolist()), len(values))
    return map(torch.Size, values.tolist())
