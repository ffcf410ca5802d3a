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
import json
from dataclasses import dataclass, field
from typing import Any

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

from dcp_ext.errors import CorruptCheckpointError

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


@dataclass(frozen=True)
class StoredItem:
    """Where one saved item lives. ``payload_offset`` is absolute in the file (-1: unknown)."""

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
    """Parse index bytes from ``source``; malformed content raises CorruptCheckpointError."""
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
        rows = table.cast(_plain_schema()).to_pydict()
        return _build(header, rows, source)
    except CorruptCheckpointError:
        raise
    except Exception as exc:  # untrusted bytes: any decode failure is corruption
        raise CorruptCheckpointError(f"{source}: unreadable index ({type(exc).__name__}: {exc})") from None


def _plain_schema() -> pa.Schema:
    return pa.schema([pa.field(f.name, f.type.value_type if pa.types.is_dictionary(f.type) else f.type) for f in _SCHEMA])


def _build(header: dict[str, Any], rows: dict[str, list[Any]], source: str) -> IndexedCheckpoint:
    state: dict[str, Any] = {}
    for fqn in header["order"]:
        if fqn in header["tensors"]:
            dtype, shape, requires_grad, pin_memory = header["tensors"][fqn]
            props = TensorProperties(dtype=dtype_from_name(dtype, source), requires_grad=bool(requires_grad), pin_memory=bool(pin_memory))
            state[fqn] = TensorStorageMetadata(props, torch.Size(_ints(shape, source, fqn)), [])
        else:
            state[fqn] = BytesStorageMetadata()
    items: dict[MetadataIndex, StoredItem] = {}
    copies: dict[MetadataIndex, list[StoredItem]] = {}
    for fqn, offsets, sizes, file, offset, length, payload, checksum, is_copy in zip(
        rows["fqn"], rows["offsets"], rows["sizes"], rows["file"], rows["offset"], rows["length"],
        rows["payload_offset"], rows["checksum"], rows["copy"],
    ):
        md = state.get(fqn)
        if md is None:
            raise CorruptCheckpointError(f"{source}: index row for {fqn!r} has no tensor or bytes entry")
        if isinstance(md, TensorStorageMetadata):
            if offsets is None or sizes is None:
                raise CorruptCheckpointError(f"{source}: tensor {fqn!r} has a row without offsets/sizes")
            chunk = ChunkStorageMetadata(torch.Size(_ints(offsets, source, fqn)), torch.Size(_ints(sizes, source, fqn)))
            index = MetadataIndex(fqn, chunk.offsets)
            if not is_copy:
                md.chunks.append(chunk)
        else:
            index = MetadataIndex(fqn)
        if offset is None or length is None or payload is None or file is None:
            raise CorruptCheckpointError(f"{source}: item {fqn!r} has missing location fields")
        stored = StoredItem(file, offset, length, payload, checksum)
        if is_copy:
            copies.setdefault(index, []).append(stored)
        else:
            items[index] = stored
    orphans = [index.fqn for index in copies if index not in items]
    if orphans:
        raise CorruptCheckpointError(f"{source}: replica copies of {orphans[:3]} have no canonical chunk")
    planner_data = header["planner_data"]
    meta = header["storage_meta"]
    metadata = None
    if planner_data is not None:
        metadata = Metadata(
            state_dict_metadata=state,
            planner_data={k: tuple(v) for k, v in planner_data.items()},
            storage_data={index: item.storage_info() for index, item in items.items()},
            storage_meta=None if meta is None else StorageMeta(meta["checkpoint_id"], meta["save_id"], None, list(meta["modules"])),
            version=header["version"],
        )
    return IndexedCheckpoint(metadata, items, int(header["metadata_crc32c"]), int(header["metadata_size"]), copies)


def _ints(values: Any, source: str, fqn: str) -> list[int]:
    if not isinstance(values, list) or not all(type(v) is int for v in values):
        raise CorruptCheckpointError(f"{source}: {fqn!r} has a non-integer shape or offset {values!r}")
    return values
