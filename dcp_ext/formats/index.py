"""The sidecar index: one Parquet row per stored item, readable without pickle.

Stock DCP only writes ``.metadata`` (a pickle). Beside it we write
``.dcp_ext_index.parquet``: fqn, chunk offsets and sizes, dtype, file, byte offset,
length, where the raw tensor bytes start and a CRC32C of the record. Tensor-level facts
(global shape, properties), the planner's key mapping and the storage meta live in the
file's key/value metadata as JSON. The index also records the CRC32C and size of the
``.metadata`` bytes it was written with, so a reader can tell whether the two belong to
the same commit before trusting the index. A commit moves the live index to
``.dcp_ext_index.prev.parquet`` before it puts the new one in place, so the ``.metadata``
still live until the commit point keeps an index that records it.
"""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
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
from dcp_ext.formats.arrow_columns import as_booleans, as_numbers, booleans, is_valid, lists, numbers, strings
from dcp_ext.formats.chunk_lists import ChunkListsOnDemand, torch_sizes
from dcp_ext.formats.data_files import check_relative_name
from dcp_ext.formats.faults import chunk_outside_tensor, invalid_byte_range, invalid_tensor_facts
from dcp_ext.formats.index_checks import INT64_MAX, KeyChecks, KeyGroups, chunk_boxes
from dcp_ext.runtime.frozen import frozen
from dcp_ext.runtime.gc_pause import gc_paused

INDEX_NAME = ".dcp_ext_index.parquet"
# the live index, set aside by a commit until the new .metadata is in place (dcp_ext.storage.commit)
PREVIOUS_INDEX_NAME = ".dcp_ext_index.prev.parquet"
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
        ("transforms", pa.dictionary(pa.int32(), pa.string())),  # DCP stream transforms, ","-joined; null: none
    ]
)
# What a read decodes: the per-row dtype is for other readers of the file (a key's dtype
# is in the header's tensor facts).
_READ_SCHEMA = pa.schema([field for field in _SCHEMA if field.name != "dtype"])
# Without the Arrow schema in the file (``encode_index``) Parquet knows these as plain strings
_DICTIONARY_COLUMNS = [field.name for field in _SCHEMA if pa.types.is_dictionary(field.type)]


class StoredItem(NamedTuple):
    """Where one saved item lives. ``payload_offset`` is absolute in the file (-1: unknown).
    A NamedTuple: an index load builds one per stored item, and tuples build fastest."""

    relative_path: str
    offset: int
    length: int
    payload_offset: int = -1
    checksum: int | None = None  # CRC32C of bytes [offset, offset + length)
    transforms: tuple[str, ...] = ()  # DCP stream transforms (compression): the record is read whole

    def storage_info(self) -> _StorageInfo:
        return _StorageInfo(self.relative_path, self.offset, self.length, list(self.transforms) or None)


@dataclass
class IndexedCheckpoint:
    metadata: Metadata | None  # None: the planner data only survives in the pickle
    items: Mapping[MetadataIndex, StoredItem]
    metadata_crc32c: int
    metadata_size: int
    copies: dict[MetadataIndex, list[StoredItem]] = field(default_factory=dict)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


QUANTIZED_DTYPES = frozenset(
    getattr(torch, name) for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, name)
)


def dtype_from_name(name: str, source: str) -> torch.dtype:
    """A dtype our records can hold; quantized ones are refused (``ShardWriter`` refuses to
    store them, and a record read as one fails inside torch with an internal assert)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or dtype in QUANTIZED_DTYPES:
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
    with ``copy`` set after the canonical rows; ``.metadata`` only knows those in ``items``.
    Columns are built per key and per column, not per row (a million-chunk save).
    """
    rows = _Rows.collect(metadata, items, copies or {})
    storage_meta = metadata.storage_meta
    header = {
        "format": INDEX_FORMAT,
        "version": metadata.version,
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
    table = pa.Table.from_arrays(rows.arrays(), schema=_SCHEMA)
    sink = io.BytesIO()
    # the header once, in the file's key-value metadata (Arrow reads it as the schema's): with
    # the Arrow schema stored too, it was there a second time, base64-encoded inside that
    # schema: 60% of a 1,180-key index's bytes, and of the time to write and to read it.
    # Snappy, Parquet's default: zstd's columns were 3% smaller (179 against 184 KB at 1,180
    # keys, the header is 165 KB of it) and took 0.72 ms to write and 0.41 to read, against 0.41 / 0.23
    with pq.ParquetWriter(sink, _SCHEMA, compression="snappy", store_schema=False) as writer:
        writer.write_table(table, row_group_size=max(table.num_rows, 1))  # one group: no concat on read
        # the keys' part as made with their layout ("order", "tensors": half the header's JSON)
        writer.add_key_value_metadata({_META_KEY: ("{" + rows.keys_json + ", " + json.dumps(header)[1:]).encode()})
    return sink.getvalue()


@dataclass(frozen=True)
class _KeyLayout:
    """What the index rows take from the state dict's metadata alone: the keys, their
    facts and every row's box, canonical chunks in metadata order. Worked out once per
    ``ChunkListsOnDemand`` (``derived``): a training loop's saves reuse one global plan."""

    names: list[str]
    tensors: dict[str, list[Any]]  # fqn -> [dtype, shape, requires_grad, pin_memory(, strides: torch >= 2.15)]
    key: np.ndarray  # per row: position in names
    ndim: np.ndarray  # per row: box length (-1: bytes row, no box)
    offsets: np.ndarray  # boxes back to back
    sizes: np.ndarray
    spans: dict[str, tuple[int, list[Any]]]  # fqn -> (first row, each row's chunk offsets; [None]: bytes)
    keys_json: str  # the index header's "order" and "tensors" members, as JSON

    @classmethod
    def of(cls, state_dict_metadata: Mapping[str, Any]) -> _KeyLayout:
        names = list(state_dict_metadata)
        tensors: dict[str, list[Any]] = {}
        spans: dict[str, tuple[int, list[Any]]] = {}
        counts, ndims = [], []  # per key: rows, box length
        # every row's offsets (and sizes) back to back over all keys, turned into numpy once:
        # a conversion per key cost 1.2 s of a million-chunk save
        flat_off: list[int] = []
        flat_size: list[int] = []
        rows = 0
        for fqn, md in state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                props = md.properties
                tensors[fqn] = [dtype_name(props.dtype), list(md.size), props.requires_grad, props.pin_memory]
                if getattr(props, "strides", None) is not None:  # torch >= 2.15 records the saving rank's strides
                    tensors[fqn].append(list(props.strides))
                n, nd = len(md.chunks), len(md.size)
                offsets = [chunk.offsets for chunk in md.chunks]
                sizes = [chunk.sizes for chunk in md.chunks]
                if any(len(box) != nd for box in itertools.chain(offsets, sizes)):  # would shift later keys' boxes
                    raise CheckpointError(f"key {fqn!r}: a chunk's offsets or sizes do not have the tensor's {nd} dimensions")
                flat_off.extend(itertools.chain.from_iterable(offsets))
                flat_size.extend(itertools.chain.from_iterable(sizes))
            else:
                n, nd, offsets = 1, -1, [None]
            spans[fqn] = (rows, offsets)
            rows += n
            counts.append(n)
            ndims.append(nd)
        key = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
        ndim = np.repeat(np.array(ndims, np.int64), counts)
        keys_json = json.dumps({"order": names, "tensors": tensors})[1:-1]
        return cls(names, tensors, key, ndim, np.array(flat_off, np.int64), np.array(flat_size, np.int64), spans, keys_json)


@dataclass
class _Rows:
    """The index rows of a save, column by column: canonical chunks in metadata order,
    then the TP-replica copies."""

    names: list[str]
    tensors: dict[str, list[Any]]
    keys_json: str  # the header's "order" and "tensors" (``_KeyLayout``)
    key: np.ndarray
    ndim: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    stored: list[StoredItem]
    copy: np.ndarray

    @classmethod
    def collect(
        cls, metadata: Metadata, items: dict[MetadataIndex, StoredItem], copies: dict[MetadataIndex, list[StoredItem]]
    ) -> _Rows:
        keys = metadata.state_dict_metadata
        layout = keys.derived(_KeyLayout.of) if isinstance(keys, ChunkListsOnDemand) else _KeyLayout.of(keys)
        by_key: dict[str, dict[Any, StoredItem]] = {}  # fqn -> {chunk offsets (None: bytes): item}
        for index, item in items.items():
            by_key.setdefault(index.fqn, {})[index.offset] = item
        stored: list[StoredItem] = []
        for fqn, (_, offsets) in layout.spans.items():
            stored.extend(map(by_key.get(fqn, {}).__getitem__, offsets))  # no item for a chunk: a bug upstream
        key, ndim, offsets, sizes = layout.key, layout.ndim, layout.offsets, layout.sizes
        copy = np.zeros(len(stored), bool)
        if copies:
            rows = np.array(_copied_rows(copies, layout.spans), np.int64)
            stored.extend(item for extra in copies.values() for item in extra)
            elems = np.maximum(ndim, 0)
            starts, lengths = (np.cumsum(elems) - elems)[rows], elems[rows]
            offsets = np.concatenate([offsets, ragged_take(offsets, starts, lengths)])
            sizes = np.concatenate([sizes, ragged_take(sizes, starts, lengths)])
            key, ndim = np.concatenate([key, key[rows]]), np.concatenate([ndim, ndim[rows]])
            copy = np.concatenate([copy, np.ones(len(rows), bool)])
        return cls(layout.names, layout.tensors, layout.keys_json, key, ndim, offsets, sizes, stored, copy)

    def arrays(self) -> list[pa.Array]:
        bytes_row = self.ndim < 0
        box_ends = np.concatenate([[0], np.cumsum(np.maximum(self.ndim, 0))]).astype(np.int32)
        dtypes = sorted({facts[0] for facts in self.tensors.values()})
        dtype_of_key = np.array([dtypes.index(self.tensors[n][0]) if n in self.tensors else 0 for n in self.names] or [0], np.int8)
        files, offset, length, payload, checksum, transforms = zip(*self.stored) if self.stored else ((),) * 6
        file_codes: dict[str, int] = {}
        file_column = np.array([file_codes.setdefault(f, len(file_codes)) for f in files], np.int32)
        transform_codes: dict[str, int] = {}
        transform_column = np.array([transform_codes.setdefault(",".join(t), len(transform_codes)) if t else -1
                                     for t in transforms], np.int32)
        has_checksum = np.array([c is not None for c in checksum], bool)
        return [
            pa.DictionaryArray.from_arrays(numbers(self.key, pa.int32()), strings(self.names)),
            lists(box_ends, numbers(self.offsets, pa.int64()), valid=~bytes_row),
            lists(box_ends, numbers(self.sizes, pa.int64()), valid=~bytes_row),
            pa.DictionaryArray.from_arrays(numbers(dtype_of_key[self.key], pa.int8(), valid=~bytes_row), strings(dtypes)),
            pa.DictionaryArray.from_arrays(numbers(file_column, pa.int32()), strings(list(file_codes))),
            numbers(offset, pa.int64()),
            numbers(length, pa.int64()),
            numbers(payload, pa.int64()),
            numbers([c or 0 for c in checksum], pa.uint32(), valid=has_checksum),
            booleans(self.copy),
            pa.DictionaryArray.from_arrays(
                numbers(np.maximum(transform_column, 0), pa.int32(), valid=transform_column >= 0), strings(list(transform_codes))
            ),
        ]


def _copied_rows(copies: dict[MetadataIndex, list[StoredItem]], spans: dict[str, tuple[int, list[Any]]]) -> list[int]:
    """For each copy, in ``copies`` order, the row of the canonical chunk it copies."""
    row_maps: dict[str, dict[Any, int]] = {}
    rows = []
    for index, extra in copies.items():
        row_of = row_maps.get(index.fqn)
        if row_of is None:
            first, offsets = spans[index.fqn]
            row_of = row_maps[index.fqn] = dict(zip(offsets, range(first, first + len(offsets))))
        rows.extend([row_of[index.offset]] * len(extra))
    return rows


def ragged_take(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``values[starts[i] : starts[i] + lengths[i]]`` for every i, back to back.

    One repeat and one arange (each element's source is its run's shift plus its place in
    the output): at a million rows the temporaries, not the gather, cost the time."""
    shift = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    shift += np.arange(len(shift))
    return values[shift]


def decode_index(data: bytes, source: str) -> IndexedCheckpoint:
    """Parse index bytes from ``source`` column by column (numpy) and check what one pass
    over the rows can; malformed content raises CorruptCheckpointError naming the key. A
    key's chunks are checked when the key is first used (``index_checks``). Together these
    are the checks ``validate.check_metadata`` applies to a pickled ``.metadata``."""
    with gc_paused():  # objects per key, no garbage
        return _decode(data, source)


def _decode(data: bytes, source: str) -> IndexedCheckpoint:
    try:
        table = _read_table(pq.ParquetFile(pa.BufferReader(data), read_dictionary=_DICTIONARY_COLUMNS))
        header = json.loads(table.schema.metadata[_META_KEY])
        if header.get("format") != INDEX_FORMAT:
            raise ValueError(f"format {header.get('format')!r}, expected {INDEX_FORMAT!r}")
        if "copy" not in table.column_names:  # written before TP-replica copies existed
            table = table.append_column("copy", booleans(np.zeros(table.num_rows, bool)))
        # no "transforms": written before compressed records existed, or not one record is compressed
        schema = pa.schema([field for field in _READ_SCHEMA if field.name in table.column_names])
        table = table.select(schema.names)
        columns = _Columns.read(table if table.schema.equals(schema) else table.cast(schema), source)
        return _build(header, _Keys.read(header, source), columns, source)
    except CheckpointError:
        raise
    except Exception as exc:  # untrusted bytes: any decode failure is corruption
        raise CorruptCheckpointError(f"{source}: unreadable index ({type(exc).__name__}: {exc})") from None


_HAS_STRIDES = "strides" in {f.name for f in dataclass_fields(TensorProperties)}  # torch >= 2.15
_WHOLE_READ_ROWS = 65_536  # about 8 MB of decode buffers


def _read_table(file: pq.ParquetFile) -> pa.Table:
    """The index table, read column by column: a whole-table read holds every column's
    decode buffers at once (+250 MB at a million chunks for 116 MB of columns); one column
    at a time, the next reuses the last one's. The pool's free memory is handed back once,
    at the end (after every column, later reads fault it back in: +0.2 s at a million chunks).
    A "transforms" column whose statistics say every row is null (no compressed record) is
    not read: the decoder takes its absence as that. One thread: read_table's dataset
    thread pool sometimes aborts the interpreter at exit ("terminate called without an
    active exception", pyarrow 26), and the index is small enough that threads buy nothing.
    An index of up to ``_WHOLE_READ_ROWS`` rows is read in one call: its buffers are small,
    and a call per column was a third of a 118-row index's read time."""
    schema = file.schema_arrow
    fields = [
        field for field in schema
        if field.name in _READ_SCHEMA.names and not (field.name == "transforms" and _all_null(file, schema.get_field_index(field.name)))
    ]
    if file.metadata.num_rows <= _WHOLE_READ_ROWS:
        return file.read(columns=[field.name for field in fields], use_threads=False)
    columns = [file.read(columns=[field.name], use_threads=False).column(0) for field in fields]
    pa.default_memory_pool().release_unused()
    return pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata=schema.metadata))


def _all_null(file: pq.ParquetFile, column: int) -> bool:
    """Whether every row group's statistics say column ``column`` holds nulls only."""
    meta = file.metadata
    for group in range(meta.num_row_groups):
        chunk = meta.row_group(group)
        stats = chunk.column(column).statistics
        if stats is None or not stats.has_null_count or stats.null_count != chunk.num_rows:
            return False
    return True


@dataclass
class _Keys:
    """The header's keys: names in order, tensor facts, and numpy views for the checks."""

    names: list[str]
    state: dict[str, Any]  # fqn -> TensorStorageMetadata (chunks to fill) or BytesStorageMetadata
    is_tensor: np.ndarray  # per key
    ndim: np.ndarray
    itemsize: np.ndarray
    shape_start: np.ndarray  # where each key's shape starts in ``extents``
    extents: np.ndarray  # the shapes back to back, int64, capped at its range (a chunk ending past is refused anyway)

    @classmethod
    def read(cls, header: dict[str, Any], source: str) -> _Keys:
        """The keys of ``header``: one pass builds DCP's objects, then every shape is
        checked at once (a key's own checks, as ``_check_shape`` words them, run only
        when that finds a bad one): 590 keys, 0.9 -> 0.6 ms."""
        names, state, shapes = list(header["order"]), {}, []
        tensors = header["tensors"]
        dtypes: dict[str, torch.dtype] = {}  # a model has a few dtypes for thousands of keys
        for fqn in names:
            if fqn not in tensors:
                state[fqn] = BytesStorageMetadata()
                shapes.append(())
                continue
            dtype_text, shape, requires_grad, pin_memory, *strides = tensors[fqn]
            dtype = dtypes.get(dtype_text) if isinstance(dtype_text, str) else None
            if dtype is None:
                dtype = dtypes[dtype_text] = dtype_from_name(dtype_text, source)
            if type(shape) is not list:
                _check_shape(source, fqn, dtype, shape)
            props = TensorProperties(dtype=dtype, requires_grad=bool(requires_grad), pin_memory=bool(pin_memory))
            if strides and _HAS_STRIDES:  # written by torch >= 2.15; an older torch has no field for them
                if not isinstance(strides[0], list) or not all(type(v) is int for v in strides[0]):
                    raise CorruptCheckpointError(f"{source}: {fqn!r} has non-integer strides {strides[0]!r}")
                props.strides = tuple(strides[0])
            state[fqn] = TensorStorageMetadata(props, shape, [])  # its torch.Size once the shapes are checked
            shapes.append(shape)
        extents = list(itertools.chain.from_iterable(shapes))
        if not {*map(type, extents)} <= {int} or min(extents, default=0) < 0:
            for fqn, md in state.items():
                if isinstance(md, TensorStorageMetadata):
                    _check_shape(source, fqn, md.properties.dtype, md.size)
        for md in state.values():
            if isinstance(md, TensorStorageMetadata):
                md.size = torch.Size(md.size)
        tensor = [isinstance(md, TensorStorageMetadata) for md in state.values()]
        ndim = np.fromiter(map(len, shapes), np.int64, len(shapes))
        try:
            extent_values = np.array(extents, np.int64)
        except OverflowError:  # an extent past int64 (a chunk ending past it is refused anyway)
            extent_values = np.array([min(v, INT64_MAX) for v in extents], np.int64)
        return cls(
            names=list(state),
            state=state,
            is_tensor=np.array(tensor, bool),
            ndim=ndim,
            itemsize=np.array([md.properties.dtype.itemsize if t else 1 for md, t in zip(state.values(), tensor)], np.int64),
            shape_start=np.concatenate([[0], np.cumsum(ndim)[:-1]]).astype(np.int64),
            extents=extent_values,
        )


def _check_shape(source: str, fqn: str, dtype: torch.dtype, shape: Any) -> None:
    """Refuse a tensor key's shape that is not a list of non-negative integers."""
    if not (isinstance(shape, list) and all(type(v) is int for v in shape)):
        raise CorruptCheckpointError(f"{source}: {fqn!r} has a non-integer shape or offset {shape!r}")
    if any(v < 0 for v in shape):
        raise invalid_tensor_facts(source, fqn, dtype, shape)


@dataclass
class _Columns:
    """The index's columns as numpy arrays (offsets/sizes flattened, as Arrow stores them)."""

    fqn: np.ndarray  # code into fqn_names
    fqn_names: list[Any]
    box_null: np.ndarray  # rows without offsets or sizes (non-tensor items)
    off_start: np.ndarray  # each row's first element in off_values (views of Arrow's list offsets)
    off_end: np.ndarray
    off_values: np.ndarray
    size_start: np.ndarray
    size_end: np.ndarray
    size_values: np.ndarray
    file: np.ndarray  # code into file_names
    file_names: FileNames
    offset: np.ndarray
    length: np.ndarray
    payload: np.ndarray
    checksum: np.ndarray  # uint32; meaningless where has_checksum is False
    has_checksum: np.ndarray
    copy: np.ndarray
    transforms: np.ndarray  # code into transform_names; -1: none
    transform_names: list[Any]
    nulls: dict[str, int]

    @classmethod
    def read(cls, table: pa.Table, source: str) -> _Columns:
        col = {name: _one_array(table.column(name)) for name in table.column_names}
        transforms = col.get("transforms")
        off, size = col["offsets"], col["sizes"]
        off_ends, size_ends = as_numbers(off.offsets, np.int32), as_numbers(size.offsets, np.int32)
        return cls(
            fqn=as_numbers(col["fqn"].indices, np.int32),
            fqn_names=col["fqn"].dictionary.to_pylist(),
            box_null=~(is_valid(off) & is_valid(size)),
            off_start=off_ends[:-1],
            off_end=off_ends[1:],
            off_values=as_numbers(off.values, np.int64),
            size_start=size_ends[:-1],
            size_end=size_ends[1:],
            size_values=as_numbers(size.values, np.int64),
            file=as_numbers(col["file"].indices, np.int32),
            file_names=FileNames(col["file"].dictionary, source),
            offset=as_numbers(col["offset"], np.int64),
            length=as_numbers(col["length"], np.int64),
            payload=as_numbers(col["payload_offset"], np.int64),
            checksum=as_numbers(col["checksum"], np.uint32),
            has_checksum=is_valid(col["checksum"]),
            copy=as_booleans(col["copy"]) & is_valid(col["copy"]),
            transforms=_codes_or_minus_one(transforms, table.num_rows),
            transform_names=[] if transforms is None else transforms.dictionary.to_pylist(),
            nulls={
                **{name: col[name].null_count for name in ("fqn", "file", "offset", "length", "payload_offset")},
                "box values": off.values.null_count + size.values.null_count,
            },
        )


def _one_array(column: pa.ChunkedArray) -> pa.Array:
    """The column as one array, copied only when it spans several row groups (older indexes)."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def _codes_or_minus_one(array: pa.DictionaryArray | None, rows: int) -> np.ndarray:
    """A dictionary column's codes, -1 where null; an absent or all-null column (which
    may have no buffer) reads as one read-only -1 broadcast over the rows."""
    if array is None or array.null_count == len(array):
        return np.broadcast_to(np.int32(-1), (rows,))
    return np.where(is_valid(array), as_numbers(array.indices, np.int32), -1)


def _build(header: dict[str, Any], keys: _Keys, cols: _Columns, source: str) -> IndexedCheckpoint:
    key_of_name = {name: n for n, name in enumerate(keys.names)}
    lookup = np.array([key_of_name.get(name, -1) for name in cols.fqn_names] + [-1], np.int32)
    if cols.nulls["fqn"] or cols.nulls["file"]:
        raise CorruptCheckpointError(f"{source}: index rows without a key or file name")
    for column, codes, names, lowest in (
        ("fqn", cols.fqn, cols.fqn_names, 0),
        ("file", cols.file, cols.file_names, 0),
        ("transforms", cols.transforms, cols.transform_names, -1),  # -1: none
    ):
        _check_codes(source, column, codes, len(names), lowest)
    key = lookup[cols.fqn] if len(cols.fqn) else np.zeros(0, np.int32)
    if np.any(key < 0):
        fqn = cols.fqn_names[cols.fqn[np.argmax(key < 0)]]
        raise CorruptCheckpointError(f"{source}: index row for {fqn!r} has no tensor or bytes entry")
    names = _RowNames(keys.names, key)
    _check_locations(names, cols, source)
    _check_row_boxes(names, key, keys, cols, source)
    return _objects(header, keys, cols, key, source)


def _check_codes(source: str, column: str, codes: np.ndarray, count: int, lowest: int) -> None:
    """Dictionary codes Arrow does not check on read: one out of range would pick another
    entry (numpy wraps negative indices) or fail later, at lookup."""
    if len(codes) and (int(codes.min()) < lowest or int(codes.max()) >= count):
        raise CorruptCheckpointError(f"{source}: index column {column!r} refers past its {count} dictionary entries")


class FileNames:
    """The index's data-file names (a dictionary column), each made a str and checked to
    stay inside the checkpoint the first time a row uses it: a job's index names a file
    per rank and writer thread (131 K at 16,384 ranks), of which a rank reads a few."""

    def __init__(self, names: pa.Array, source: str) -> None:
        self._names, self._source = names, source
        self._made: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._names)

    def name(self, code: int, fqn: str) -> str:
        """Name ``code`` (a row of key ``fqn`` uses it), or UnsafeCheckpointError."""
        name = self._made.get(code)
        if name is None:
            try:
                text = self._names[code].as_py()
            except UnicodeDecodeError:  # Parquet pages carry no checksum: a changed byte is read as it is
                raise CorruptCheckpointError(f"{self._source}: the data-file name of key {fqn!r} is not UTF-8 text") from None
            name = self._made[code] = check_relative_name(self._source, text, fqn)
        return name


class _RowNames:
    """Each row's key name, looked up when an error or a check names a row (not 1 M strings up front)."""

    def __init__(self, names: list[str], key: np.ndarray) -> None:
        self._names, self._key = names, key

    def __getitem__(self, row: int) -> str:
        return self._names[int(self._key[row])]


def _check_locations(names: _RowNames, cols: _Columns, source: str) -> None:
    """Every row's byte range is well formed (its file name is checked when the row's
    item is first built: ``FileNames``)."""
    if cols.nulls["offset"] or cols.nulls["length"] or cols.nulls["payload_offset"]:
        raise CorruptCheckpointError(f"{source}: an index item has missing location fields")
    offset, length, payload = cols.offset, cols.length, cols.payload
    # payload >= -1 and offset >= 0 where the subtraction counts: it cannot wrap
    bad = (offset < 0) | (length < 0) | ~((payload == -1) | ((offset <= payload) & (payload - offset <= length)))
    if np.any(bad):
        row = int(np.argmax(bad))
        raise invalid_byte_range(source, names[row], int(offset[row]), int(length[row]), int(payload[row]))


def _check_row_boxes(names: _RowNames, key: np.ndarray, keys: _Keys, cols: _Columns, source: str) -> None:
    """Every tensor row holds one chunk offset and one size per dimension of its key.
    Whether they fit the key's shape and record is checked per key, on first use
    (``index_checks``)."""
    tensor = keys.is_tensor[key]
    if np.any(tensor & cols.box_null):
        row = int(np.argmax(tensor & cols.box_null))
        raise CorruptCheckpointError(f"{source}: tensor {names[row]!r} has a row without offsets/sizes")
    if cols.nulls["box values"]:
        raise CorruptCheckpointError(f"{source}: an index row has a missing chunk offset or size")
    ndim = keys.ndim[key]
    wrong = tensor & ((cols.off_end - cols.off_start != ndim) | (cols.size_end - cols.size_start != ndim))
    if np.any(wrong):
        row = int(np.argmax(wrong))
        off, size = _box(cols, row)
        raise chunk_outside_tensor(source, names[row], off, size, keys.state[names[row]].size)


def _box(cols: _Columns, row: int) -> tuple[list[int], list[int]]:
    off = cols.off_values[cols.off_start[row] : cols.off_end[row]].tolist()
    size = cols.size_values[cols.size_start[row] : cols.size_end[row]].tolist()
    return off, size


def _objects(header: dict[str, Any], keys: _Keys, cols: _Columns, key: np.ndarray, source: str) -> IndexedCheckpoint:
    """DCP objects for the columns. Nothing is built per row here: a key's chunk metadata
    is built the first time the key is asked for (``IndexedKeys``), a stored item the
    first time its row is (``IndexedItems``, ``IndexedCopies``), so a rank pays for the
    keys it loads, not for every chunk of the job."""
    groups = KeyGroups.of(key, np.flatnonzero(~cols.copy), len(keys.names))
    copy_groups = KeyGroups.of(key, np.flatnonzero(cols.copy), len(keys.names))
    checks = KeyChecks(keys, cols, groups, source)
    canonical = _KeyRows(keys, cols, groups, checks, one_per_offset=True)
    copied = _KeyRows(keys, cols, copy_groups, KeyChecks(keys, cols, copy_groups, source, copies_of=checks), one_per_offset=False)
    made: dict[int, StoredItem] = {}
    items = IndexedItems(canonical, cols, made)
    copies = IndexedCopies(copied, cols, made)
    missing = np.flatnonzero(~keys.is_tensor & (np.diff(groups.bounds) == 0))
    if len(missing):
        raise CorruptCheckpointError(f"{source}: bytes item {keys.names[missing[0]]!r} has no stored location")
    planner_data = header["planner_data"]
    meta = header["storage_meta"]
    metadata = None
    if planner_data is not None:
        metadata = Metadata(
            state_dict_metadata=IndexedKeys(keys, canonical),  # type: ignore[arg-type]
            planner_data={k: tuple(v) for k, v in planner_data.items()},
            storage_data=StorageDataView(items),
            storage_meta=None if meta is None else StorageMeta(meta["checkpoint_id"], meta["save_id"], None, list(meta["modules"])),
            version=header["version"],
        )
    return IndexedCheckpoint(metadata, items, int(header["metadata_crc32c"]), int(header["metadata_size"]), copies)


FIND_MEMO_ENTRIES = 1 << 16  # chunk lookups remembered per catalog (~300 bytes each)


class _KeyRows:
    """Rows of the index (canonical, or TP-replica copies) grouped by key, with each key's
    chunk boxes as numpy matrices on demand: the per-key view every lazy mapping reads.
    A key's rows are checked (``KeyChecks``) before anything is answered from them."""

    def __init__(self, keys: _Keys, cols: _Columns, groups: KeyGroups, checks: KeyChecks, one_per_offset: bool) -> None:
        self.keys = keys
        self.one_per_offset = one_per_offset  # canonical rows (checked unique); copies repeat offsets
        self._cols = cols
        self._groups = groups
        self.bounds = groups.bounds
        self._checks = checks
        self._found: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}  # a load asks for a chunk several times

    def rows(self, k: int) -> np.ndarray:
        self._checks.ensure(k)
        return self._groups.rows(k)

    def boxes(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, sizes) of key ``k``'s rows, (rows, ndim) int64 each."""
        return chunk_boxes(self._cols, self.rows(k), int(self.keys.ndim[k]))

    def stacked_boxes(self, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(bounds, offsets, sizes, rows) of tensor keys ``ks``' rows (keys of one ndim; a key
        may repeat), checked, key after key: key ``i``'s at ``bounds[i]:bounds[i + 1]``;
        ``rows`` are their index rows (``IndexedItems.locations``)."""
        ndim = self.keys.ndim[ks]
        if bool((ndim != ndim[0]).any()):  # one ndim's values per row, or rows would be misread
            raise ValueError(f"stacked_boxes takes keys of one ndim, got ndims {sorted(set(ndim.tolist()))}")
        rows, bounds = self._groups.stacked(ks)
        off, size = chunk_boxes(self._cols, rows, int(ndim[0]))
        self._checks.check_stacked(ks, rows, bounds, off, size)
        return bounds, off, size, rows

    def chunk(self, k: int, row: int) -> ChunkStorageMetadata:
        """Row ``row`` (of tensor key ``k``) as DCP's chunk object."""
        cols = self._cols
        return ChunkStorageMetadata(
            torch.Size(self._values(cols.off_values, cols.off_start, k, row)), torch.Size(self.sizes(k, row))
        )

    def find(self, k: int, offset: Any, hint: int | None = None) -> np.ndarray:
        """Rows of key ``k`` whose chunk starts at ``offset`` (None: a bytes key's row).

        ``hint`` is where the chunk may stand among the key's rows: ``MetadataIndex.index``,
        the chunk's place in the key's chunk list (the rows' order), as DCP's planner and
        ours set it. It is checked, and a miss searches every row; it spares the search
        over a key's chunks from every rank (~8 us at 2 rows, more with more) where rows
        are one per offset."""
        if not self.keys.is_tensor[k]:
            rows = self.rows(k)
            return rows if offset is None else rows[:0]
        if offset is None or len(offset) != self.keys.ndim[k]:
            return self._groups.order[:0]
        at = (k, tuple(offset))
        found = self._found.get(at)
        if found is None:
            rows = self.rows(k)
            if len(rows) == 1 or (self.one_per_offset and type(hint) is int and 0 <= hint < len(rows)):
                guess = rows[:1] if len(rows) == 1 else rows[hint : hint + 1]  # compared without a gather
                if self._values(self._cols.off_values, self._cols.off_start, k, int(guess[0])) == at[1]:
                    found = guess
                elif len(rows) == 1:
                    found = rows[:0]
            if found is None:
                off, _ = self.boxes(k)
                found = rows[np.all(off == np.asarray(offset, np.int64), axis=1)]
            if len(self._found) >= FIND_MEMO_ENTRIES:  # a whole-checkpoint load in one process: stay bounded
                self._found.clear()
            self._found[at] = found
        return found

    def find_hinted(self, ks: np.ndarray, offsets: list[tuple[int, ...]], hints: np.ndarray) -> np.ndarray:
        """``find`` for many chunks at once where the key's row is known without a search
        (the key's only row, or the hint's: the common case); their answers are remembered
        as ``find``'s. Returns, per chunk, its row, -1 where none starts at its offset, -2
        where ``find`` must search (no usable hint, a chunk of a bytes key or of another ndim).
        A load's first lookups of a fresh index took ~10 us a chunk one by one."""
        counts = self.bounds[ks + 1] - self.bounds[ks]
        ndim = np.array([len(offset) for offset in offsets], np.int64)
        usable = self.keys.is_tensor[ks] & (ndim == self.keys.ndim[ks]) & (
            (counts == 1) | (self.one_per_offset & (hints >= 0) & (hints < counts)))
        out = np.full(len(ks), -2, np.int64)
        picked = np.flatnonzero(usable)
        self._checks.ensure_all(ks[picked])
        at = self.bounds[ks[picked]] + np.where(counts[picked] == 1, 0, hints[picked])
        guess = self._groups.order[at].astype(np.int64)
        for nd in np.flatnonzero(np.bincount(ndim[picked])).tolist() if len(picked) else ():
            of_nd = np.flatnonzero(ndim[picked] == nd)
            wanted = np.array([offsets[i] for i in picked[of_nd].tolist()], np.int64).reshape(len(of_nd), nd)
            stored = self._cols.off_values[self._cols.off_start[guess[of_nd]][:, None] + np.arange(nd)]
            hit = (stored == wanted).all(axis=1)
            out[picked[of_nd]] = np.where(hit, guess[of_nd], np.where(counts[picked[of_nd]] == 1, -1, -2))
        if len(self._found) + len(picked) >= FIND_MEMO_ENTRIES:
            self._found.clear()
        order = self._groups.order
        for i, k, row, place in zip(picked.tolist(), ks[picked].tolist(), out[picked].tolist(), at.tolist()):
            if row != -2:  # what find would answer: the hinted row, or no row for a key's only chunk
                self._found[(k, offsets[i])] = order[place : place + 1] if row >= 0 else order[:0]
        return out

    def sizes(self, k: int, row: int) -> tuple[int, ...]:
        """The chunk sizes of row ``row`` (of tensor key ``k``)."""
        return self._values(self._cols.size_values, self._cols.size_start, k, row)

    def _values(self, values: np.ndarray, starts: np.ndarray, k: int, row: int) -> tuple[int, ...]:
        """Row ``row``'s values (one per dim of tensor key ``k``) of a list column (offsets or sizes)."""
        start = int(starts[row])
        return tuple(values[start : start + int(self.keys.ndim[k])].tolist())


class IndexedKeys(ChunkListsOnDemand):
    """``Metadata.state_dict_metadata`` of an index load, a key's chunk list built from
    its rows the first time the key is asked for. ``facts``/``boxes``/``chunk`` answer from
    the columns without building the list (``ShardLoadPlanner`` plans from them)."""

    def __init__(self, keys: _Keys, rows: _KeyRows) -> None:
        super().__init__(keys.state, rows.boxes)
        self._keys = keys
        self._rows = rows

    def facts(self, fqn: str) -> tuple[TensorProperties, torch.Size] | None:
        """(properties, global size) of a tensor key, None for a bytes key; KeyError if absent."""
        md = self._keys.state[fqn]
        return (md.properties, md.size) if isinstance(md, TensorStorageMetadata) else None

    def boxes(self, fqn: str) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, sizes) of a tensor key's chunks in metadata order, (chunks, ndim) each."""
        return self._rows.boxes(self._key_of[fqn])

    def key_facts(self, fqns: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(key numbers, ndims, chunk counts) of tensor keys ``fqns``: what
        ``stacked_boxes`` takes, and how many rows it gives each."""
        ks = np.array([self._key_of[fqn] for fqn in fqns], np.int64)
        bounds = self._rows.bounds
        return ks, self._keys.ndim[ks], bounds[ks + 1] - bounds[ks]

    def stacked_boxes(self, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``_KeyRows.stacked_boxes``: the chunks of many keys in one pair of matrices."""
        return self._rows.stacked_boxes(ks)

    def chunk(self, fqn: str, offset: Any, hint: int | None = None) -> ChunkStorageMetadata | None:
        """The chunk of tensor key ``fqn`` starting at ``offset``, if there is one (``hint``: ``_KeyRows.find``)."""
        found = self._chunk_row(fqn, offset, hint)
        return None if found is None else self._rows.chunk(*found)

    def chunk_shape(self, fqn: str, offset: Any, hint: int | None = None) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """(dtype, sizes) of the chunk of tensor key ``fqn`` starting at ``offset``, if there
        is one: what a read needs of it, without building DCP's objects."""
        found = self._chunk_row(fqn, offset, hint)
        return None if found is None else (self._keys.state[fqn].properties.dtype, self._rows.sizes(*found))

    def _chunk_row(self, fqn: str, offset: Any, hint: int | None) -> tuple[int, int] | None:
        """(key, row) of the chunk of tensor key ``fqn`` starting at ``offset``, if there is one."""
        k = self._key_of.get(fqn)
        if k is None or not self._keys.is_tensor[k]:
            return None
        rows = self._rows.find(k, offset, hint)
        return (k, int(rows[0])) if len(rows) else None


@dataclass(frozen=True, eq=False)
class RowLocations:
    """Where some index rows are stored, a numpy column each (``IndexedItems.locations``)."""

    file: np.ndarray  # code of the data file (``IndexedItems.file_name``)
    offset: np.ndarray  # the record's first byte in its file
    length: np.ndarray
    payload: np.ndarray  # the tensor bytes' first byte in the file (-1: unknown)
    transformed: np.ndarray  # stored through stream transforms (compressed): read whole
    has_checksum: np.ndarray  # a CRC32C of the record is recorded


class IndexedItems(Mapping[MetadataIndex, StoredItem]):
    """The canonical stored items of an index load, {MetadataIndex: StoredItem}, read from
    the index columns: a lookup finds its row among its key's rows (numpy) and builds the
    StoredItem the first time the row is asked for, so a rank that reads its own shards
    does not pay for a Python object per chunk of the whole job."""

    def __init__(self, rows: _KeyRows, cols: _Columns, made: dict[int, StoredItem]) -> None:
        self._rows = rows
        self._key_of = {name: k for k, name in enumerate(rows.keys.names)}
        self._made = made  # shared with the copies: a row's item is built once
        self._cols = cols

    def row_item(self, row: int, fqn: str) -> StoredItem:
        """The stored item of row ``row`` (of key ``fqn``, named if its file name is unsafe)."""
        item = self._made.get(row)
        if item is None:  # a read asks for its item several times: build it once
            cols = self._cols
            checksum = cols.checksum.item(row) if cols.has_checksum.item(row) else None
            code = cols.transforms.item(row)
            item = StoredItem(
                cols.file_names.name(cols.file.item(row), fqn), cols.offset.item(row), cols.length.item(row), cols.payload.item(row),
                checksum, _transform_names(cols.transform_names[code]) if code >= 0 else (),
            )
            self._made[row] = item
        return item

    def items_of(self, indices: list[MetadataIndex]) -> list[StoredItem | None]:
        """``self.get(index)`` for many indices: the rows found at once where hints allow
        (``_KeyRows.find_hinted``) and their items built from column slices; the rest one
        by one."""
        key_of = self._key_of
        ks = np.array([key_of.get(index.fqn, -1) if index.offset is not None else -1 for index in indices], np.int64)
        known = np.flatnonzero(ks >= 0)  # a key's index without an offset (a bytes item's) is looked up alone
        offsets = [tuple(indices[i].offset) for i in known.tolist()]
        hints = np.array([h if type(h := indices[i].index) is int else -1 for i in known.tolist()], np.int64)
        rows = np.full(len(indices), -2, np.int64)
        rows[known] = self._rows.find_hinted(ks[known], offsets, hints)
        found = rows.tolist()
        self._make({row: index.fqn for row, index in zip(found, indices) if row >= 0})
        made = self._made
        return [made[row] if row >= 0 else None if row == -1 else self.get(index) for index, row in zip(indices, found)]

    def locations(self, rows: np.ndarray) -> RowLocations:
        """Where index rows ``rows`` (checked rows, as ``stacked_boxes`` gives them) are
        stored, as columns: a load of hundreds of pieces looks at them all at once
        instead of building a StoredItem per piece (``row_item`` builds one on demand)."""
        cols = self._cols
        return RowLocations(
            cols.file[rows], cols.offset[rows], cols.length[rows], cols.payload[rows], cols.transforms[rows] >= 0,
            cols.has_checksum[rows],
        )

    def file_name(self, code: int, fqn: str) -> str:
        """The name of data file ``code`` of ``RowLocations.file`` (a row of key ``fqn`` uses it)."""
        return self._cols.file_names.name(code, fqn)

    def _make(self, fqn_of: dict[int, str]) -> None:
        """Build the items of rows ``fqn_of`` (of keys ``fqn_of[row]``) not built yet, from
        column slices. The rows come deduplicated by the dict: ``np.unique`` imports
        ``numpy.ma`` on its first call (10 ms of a fresh process's first load)."""
        made = self._made
        rows = np.fromiter((row for row in fqn_of if row not in made), np.int64)
        if not len(rows):
            return
        cols = self._cols
        names, codes = cols.file_names, cols.transforms[rows].tolist()
        checksums = np.where(cols.has_checksum[rows], cols.checksum[rows].astype(np.int64), -1).tolist()
        for row, file, offset, length, payload, checksum, code in zip(
            rows.tolist(), cols.file[rows].tolist(), cols.offset[rows].tolist(), cols.length[rows].tolist(),
            cols.payload[rows].tolist(), checksums, codes,
        ):
            self._made[row] = StoredItem(
                names.name(file, fqn_of[row]), offset, length, payload, None if checksum < 0 else checksum,
                _transform_names(cols.transform_names[code]) if code >= 0 else (),
            )

    def _found(self, index: object) -> np.ndarray:
        k = self._key_of.get(index.fqn) if isinstance(index, MetadataIndex) else None
        return np.zeros(0, np.int64) if k is None else self._rows.find(k, index.offset, index.index)  # type: ignore[union-attr]

    def __getitem__(self, index: MetadataIndex) -> StoredItem:
        rows = self._found(index)
        if not len(rows):
            raise KeyError(index)
        return self.row_item(int(rows[0]), index.fqn)

    def __contains__(self, index: object) -> bool:
        return len(self._found(index)) > 0

    def __iter__(self) -> Iterator[MetadataIndex]:
        yield from _indices(self._rows)

    def __len__(self) -> int:
        return int(self._rows.bounds[-1])


class IndexedCopies(Mapping[MetadataIndex, list[StoredItem]]):
    """The TP-replica copies of an index load, {MetadataIndex: [StoredItem, ...]}, looked up
    from the columns like ``IndexedItems``."""

    def __init__(self, rows: _KeyRows, cols: _Columns, made: dict[int, StoredItem]) -> None:
        self._items = IndexedItems(rows, cols, made)
        self._rows = rows
        self._count: int | None = None

    def __getitem__(self, index: MetadataIndex) -> list[StoredItem]:
        rows = self._items._found(index)
        if not len(rows):
            raise KeyError(index)
        return [self._items.row_item(row, index.fqn) for row in rows.tolist()]

    def __contains__(self, index: object) -> bool:
        return index in self._items

    def __iter__(self) -> Iterator[MetadataIndex]:
        seen: set[MetadataIndex] = set()
        for index in _indices(self._rows):
            if index not in seen:
                seen.add(index)
                yield index

    def __len__(self) -> int:
        if self._count is None:
            self._count = sum(1 for _ in self)
        return self._count

    def __bool__(self) -> bool:
        return bool(self._rows.bounds[-1])


def _indices(rows: _KeyRows) -> Iterator[MetadataIndex]:
    """Every row's MetadataIndex, key by key (without the constructor, which copies each
    offset into a new torch.Size: a third of an index load's time; each already is one)."""
    for k in np.flatnonzero(np.diff(rows.bounds)).tolist():
        name = rows.keys.names[k]
        if not rows.keys.is_tensor[k]:
            yield from (frozen(MetadataIndex, fqn=name, offset=None, index=None) for _ in range(len(rows.rows(k))))
            continue
        for offset in torch_sizes(rows.boxes(k)[0]):
            yield frozen(MetadataIndex, fqn=name, offset=offset, index=None)


class StorageDataView(Mapping[MetadataIndex, _StorageInfo]):
    """``Metadata.storage_data`` of an index load: DCP's {MetadataIndex: _StorageInfo},
    built on first use. Our reader reads ``Catalog.items`` and DCP's load path never
    looks at storage_data, so a load need not build a million objects nobody reads;
    whoever does look (or pickles the Metadata) gets the plain dict a pickle would hold."""

    def __init__(self, items: Mapping[MetadataIndex, StoredItem]) -> None:
        self._items = items
        self._built: dict[MetadataIndex, _StorageInfo] | None = None

    def _data(self) -> dict[MetadataIndex, _StorageInfo]:
        if self._built is None:
            self._built = {index: item.storage_info() for index, item in self._items.items()}
        return self._built

    def __getitem__(self, index: MetadataIndex) -> _StorageInfo:
        return self._data()[index]

    def __iter__(self) -> Iterator[MetadataIndex]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, index: object) -> bool:
        return index in self._items

    def __reduce__(self) -> tuple[type, tuple[dict[MetadataIndex, _StorageInfo]]]:
        return dict, (self._data(),)


def _transform_names(joined: object) -> tuple[str, ...]:
    if not isinstance(joined, str) or not joined:
        raise CorruptCheckpointError(f"index names stream transforms {joined!r}, expected descriptor names")
    return tuple(joined.split(","))
