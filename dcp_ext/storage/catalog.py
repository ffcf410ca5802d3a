"""A parsed checkpoint (metadata + item locations + tensor layouts) and its process-wide cache.

DCP calls ``read_metadata`` on every rank for every load; a job that loads model,
optimizer and extra state from one checkpoint, or retries, would parse the same metadata
again and again. Parsed catalogs are shared by every ShardReader in the process, keyed
by the directory's canonical location and validated against a cheap signature (size,
mtime, inode; or size/ETag on object stores) of ``.metadata`` and the index, so a
checkpoint rewritten in place is re-read, never served stale.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import crc32c
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from dcp_ext.errors import CheckpointError, CorruptCheckpointError
from dcp_ext.formats.index import INDEX_NAME, StoredItem, decode_index
from dcp_ext.formats.safe_pickle import load_metadata_pickle
from dcp_ext.formats.torch_record import TensorLayout, contiguous_strides, numel, parse_tensor_record
from dcp_ext.formats.validate import check_metadata, items_from_storage_data
from dcp_ext.storage.location import Location

METADATA_NAME = ".metadata"
_SIGNATURE_RETRIES = 3


@dataclass
class Catalog:
    """Everything a load needs to know about a checkpoint before it reads data."""

    url: str
    metadata: Metadata
    items: dict[MetadataIndex, StoredItem]
    indexed: bool  # True when our index supplied payload offsets and checksums
    _chunks: dict[MetadataIndex, tuple[TensorStorageMetadata, ChunkStorageMetadata]] = field(default_factory=dict)
    _layouts: dict[MetadataIndex, TensorLayout] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        for fqn, md in self.metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    self._chunks[MetadataIndex(fqn, chunk.offsets)] = (md, chunk)

    def item(self, index: MetadataIndex) -> StoredItem:
        try:
            return self.items[index]
        except KeyError:
            raise CheckpointError(f"{self.url}: no stored item for key {index.fqn!r} at offset {index.offset}") from None

    def chunk(self, index: MetadataIndex) -> tuple[TensorStorageMetadata, ChunkStorageMetadata]:
        try:
            return self._chunks[index]
        except KeyError:
            raise CheckpointError(f"{self.url}: key {index.fqn!r} has no chunk at offset {index.offset}") from None

    def known_layout(self, index: MetadataIndex) -> TensorLayout | None:
        """The tensor layout if known without touching data files (index or earlier parse)."""
        item = self.item(index)
        if item.payload_offset >= 0:
            md, chunk = self.chunk(index)
            shape = tuple(chunk.sizes)
            nbytes = numel(shape) * md.properties.dtype.itemsize
            return TensorLayout(item.payload_offset - item.offset, nbytes, md.properties.dtype, shape,
                                contiguous_strides(shape), 0, None)
        with self._lock:
            return self._layouts.get(index)

    def parse_layout(self, location: Location, index: MetadataIndex) -> TensorLayout:
        """Parse a stock record's zip headers (two small reads) and remember the result."""
        item = self.item(index)
        where = f"{self.url}: file {item.relative_path!r} key {index.fqn!r}"
        with location.open_reader(item.relative_path, index.fqn) as reader:
            def read_at(offset: int, n: int) -> bytes:
                buf = bytearray(n)
                reader.read_into(item.offset + offset, [memoryview(buf)])
                return bytes(buf)

            layout = parse_tensor_record(item.length, read_at, where)
        md, chunk = self.chunk(index)
        if layout.dtype != md.properties.dtype or layout.shape != tuple(chunk.sizes):
            raise CorruptCheckpointError(
                f"{where}: record holds {layout.dtype} {list(layout.shape)} but metadata says "
                f"{md.properties.dtype} {list(chunk.sizes)}"
            )
        with self._lock:
            self._layouts[index] = layout
        return layout


def read_catalog(location: Location) -> Catalog:
    """Read ``.metadata`` (and the index when it matches) from ``location``."""
    source = f"{location.url}/{METADATA_NAME}"
    try:
        metadata_bytes = location.read_bytes(METADATA_NAME)
    except FileNotFoundError:
        raise CheckpointError(
            f"{location.url}: no committed checkpoint here ({METADATA_NAME} is missing)"
        ) from None
    indexed = None
    if location.exists(INDEX_NAME):
        candidate = decode_index(location.read_bytes(INDEX_NAME), f"{location.url}/{INDEX_NAME}")
        if candidate.metadata_size == len(metadata_bytes) and candidate.metadata_crc32c == crc32c.crc32c(metadata_bytes):
            indexed = candidate
    if indexed is not None and indexed.metadata is not None:
        metadata, items = indexed.metadata, indexed.items
    else:
        metadata = load_metadata_pickle(metadata_bytes, source)
        items = indexed.items if indexed is not None else items_from_storage_data(metadata, source)
    check_metadata(metadata, items, source)
    return Catalog(location.url, metadata, items, indexed is not None)


def catalog_signature(location: Location) -> tuple[Any, ...]:
    return (location.signature(METADATA_NAME), location.signature(INDEX_NAME))


class MetadataCache:
    """Thread-safe LRU of parsed catalogs, one read per checkpoint version per process."""

    def __init__(self, max_entries: int = 16):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[tuple[Any, ...], Catalog]] = OrderedDict()
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._key_locks.clear()

    def _lookup(self, key: str, signature: tuple[Any, ...]) -> Catalog | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] != signature:
                return None
            self._entries.move_to_end(key)
            return entry[1]

    def _store(self, key: str, signature: tuple[Any, ...], catalog: Catalog) -> None:
        with self._lock:
            self._entries[key] = (signature, catalog)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def open(self, location: Location) -> tuple[Catalog, bool]:
        """Return (catalog, whether metadata was actually read from storage)."""
        key = location.cache_key()
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            catalog = None
            for _ in range(_SIGNATURE_RETRIES):
                before = catalog_signature(location)
                hit = self._lookup(key, before)
                if hit is not None:
                    return hit, False
                catalog = read_catalog(location)
                if catalog_signature(location) == before:  # not rewritten while we read
                    self._store(key, before, catalog)
                    return catalog, True
            assert catalog is not None
            return catalog, True


METADATA_CACHE = MetadataCache()


def clear_metadata_cache() -> None:
    """Forget every cached checkpoint metadata in this process."""
    METADATA_CACHE.clear()
