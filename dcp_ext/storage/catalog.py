"""A parsed checkpoint (metadata + item locations + tensor layouts) and its process-wide cache.

DCP calls ``read_metadata`` on every rank for every load; a job that loads model,
optimizer and extra state from one checkpoint, or retries, would parse the same metadata
again and again. Parsed catalogs are shared by every ShardReader in the process, keyed
by the directory's canonical location and validated against a cheap signature of
``.metadata``, the index and the commit marker, so a checkpoint rewritten in place is
re-read, never served stale. Locally that is size, mtime, inode and ctime of each (tar or
rsync restore mtimes and ext4 reuses inodes, but nothing sets a ctime back) plus the
marker's bytes, whose save id is new for every save of ours; on object stores size and
ETag or mtime. A load that finds a data file missing evicts the entry (``evict``), so the
next load reads the metadata again whatever the signature said.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, fields, replace
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from dcp_ext.errors import CheckpointError, CorruptCheckpointError
from dcp_ext.formats.data_files import rank_prefix
from dcp_ext.formats.index import (
    INDEX_NAME,
    PREVIOUS_INDEX_NAME,
    IndexedCheckpoint,
    IndexedItems,
    IndexedKeys,
    StoredItem,
    decode_index,
)
from dcp_ext.formats.marker import MARKER_NAME, CommitMarker
from dcp_ext.formats.safe_pickle import load_metadata_pickle
from dcp_ext.formats.torch_record import RecordLayouts, TensorLayout, check_holds, dense_layout, numel, probed_ranges
from dcp_ext.formats.validate import check_metadata, items_from_storage_data
from dcp_ext.runtime.lru import Lru, clear_caches
from dcp_ext.runtime.threads import StartedPool, in_background
from dcp_ext.storage.location import FetchedSpans, Location, RangeReader

METADATA_NAME = ".metadata"
PROBE_RUN_RECORDS = 16  # fewest records one probing thread takes (each opens its file)
ENDS_BATCH_RECORDS = 256  # records whose ends are read at once (8 KiB each, held until parsed)
_SIGNATURE_RETRIES = 3


@dataclass
class Catalog:
    """Everything a load needs to know about a checkpoint before it reads data."""

    url: str
    metadata: Metadata
    items: Mapping[MetadataIndex, StoredItem]  # a dict, or the index's IndexedItems
    indexed: bool  # True when our index supplied payload offsets and checksums
    committed: bool  # False: our index vouches for .metadata but no commit marker does
    signature: tuple[Any, ...]  # of .metadata, index and marker when read (see catalog_signature)
    copies: dict[MetadataIndex, list[StoredItem]] = field(default_factory=dict)  # TP-replica copies
    format: str = "dcp"  # "safetensors": no checksums recorded (see safetensors_catalog)
    fingerprint: int = 0  # CRC32C of the metadata as stored: tells one checkpoint from another
    inline: dict[MetadataIndex, bytes] = field(default_factory=dict)  # bytes items a format synthesizes (no I/O)
    saving_rank: int | None = None  # per-rank metadata (dcp.save(use_collectives=False)): the rank it describes
    index_name: str | None = None  # the file our index came from: INDEX_NAME, or PREVIOUS_INDEX_NAME mid-commit
    cache_key: Any = None  # the metadata cache entry it came from (set by MetadataCache.open)
    _chunks_by_key: dict[str, dict[tuple[int, ...], ChunkStorageMetadata]] = field(default_factory=dict)
    _layouts: dict[MetadataIndex, TensorLayout] = field(default_factory=dict)
    _parsed: set[MetadataIndex] = field(default_factory=set)  # layouts a load parsed from the record (not a format's)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def derived(self, **changes: Any) -> Catalog:
        """A view of the same checkpoint with ``changes`` (its metadata or items rewritten,
        e.g. by a Megatron view): every other fact kept (format, fingerprint, inline items,
        TP-replica copies), the per-key caches started afresh unless given."""
        caches = {f.name: f.default_factory() for f in fields(self) if f.name.startswith("_")}  # type: ignore[misc]
        return replace(self, **(caches | changes))

    def rows(self) -> int:
        """Keys plus stored items: what the catalog weighs in a cache."""
        return len(self.metadata.state_dict_metadata) + len(self.items)

    def files(self) -> set[str]:
        """Every data file the checkpoint references (stored items and TP-replica copies)."""
        names = {item.relative_path for item in self.items.values()}
        names.update(copy.relative_path for copies in self.copies.values() for copy in copies)
        return names

    def item(self, index: MetadataIndex) -> StoredItem:
        try:
            return self.items[index]
        except KeyError:
            raise CheckpointError(f"{self.url}: no stored item for key {index.fqn!r} at offset {index.offset}") from None

    def chunk(self, index: MetadataIndex) -> tuple[TensorStorageMetadata, ChunkStorageMetadata]:
        """The tensor (for its properties and size) and the chunk an item holds; an index
        load answers from its columns, other catalogs map each key's chunks on first use,
        so a load maps only the keys it reads."""
        state = self.metadata.state_dict_metadata
        if isinstance(state, IndexedKeys):
            found = state.chunk(index.fqn, index.offset, index.index)
            if found is not None:
                return self._tensor(index.fqn), found
        else:
            md = state.get(index.fqn)
            if isinstance(md, TensorStorageMetadata):
                by_offset = self._chunks_by_key.get(index.fqn)
                if by_offset is None:
                    by_offset = {tuple(chunk.offsets): chunk for chunk in md.chunks}
                    self._chunks_by_key[index.fqn] = by_offset  # a racing thread builds the same map
                chunk = by_offset.get(tuple(index.offset or ()))
                if chunk is not None:
                    return md, chunk
        raise CheckpointError(f"{self.url}: key {index.fqn!r} has no chunk at offset {index.offset}")

    def _chunk_shape(self, index: MetadataIndex) -> tuple[torch.dtype, tuple[int, ...]]:
        """(dtype, sizes) of the chunk an item holds; from the columns of an index load."""
        state = self.metadata.state_dict_metadata
        found = state.chunk_shape(index.fqn, index.offset, index.index) if isinstance(state, IndexedKeys) else None
        if found is not None:
            return found
        md, chunk = self.chunk(index)
        return md.properties.dtype, tuple(chunk.sizes)

    def _tensor(self, fqn: str) -> TensorStorageMetadata:
        """A tensor key's facts without its chunk list (an index load builds that on demand)."""
        facts = self.metadata.state_dict_metadata.facts(fqn)  # type: ignore[attr-defined]
        return TensorStorageMetadata(facts[0], facts[1], [])

    def chunk_nbytes(self, index: MetadataIndex) -> int | None:
        """Bytes of the tensor chunk an item holds; None for a bytes item."""
        state = self.metadata.state_dict_metadata
        if isinstance(state, IndexedKeys):
            tensor = index.fqn in state and state.facts(index.fqn) is not None
        else:
            tensor = isinstance(state.get(index.fqn), TensorStorageMetadata)
        if not tensor:
            return None
        md, chunk = self.chunk(index)
        return numel(tuple(chunk.sizes)) * md.properties.dtype.itemsize

    def stored_items(self, indices: list[MetadataIndex], rank: int | None = None) -> list[StoredItem]:
        """``item`` of each index, or with ``rank`` its ``item_for_rank``: an index load's
        found at once (``IndexedItems.items_of``), a load's first lookups in a fresh index."""
        if isinstance(self.items, IndexedItems) and not (rank is not None and self.copies):
            found = self.items.items_of(indices)
            return [self.item(index) if item is None else item for item, index in zip(found, indices)]
        return [self.item(index) if rank is None else self.item_for_rank(index, rank) for index in indices]

    def item_for_rank(self, index: MetadataIndex, rank: int) -> StoredItem:
        """The copy of an item in ``rank``'s own data files if one exists, else the canonical one."""
        canonical = self.item(index)
        if not self.copies:
            return canonical
        own = rank_prefix(rank)
        if canonical.relative_path.startswith(own):
            return canonical
        return next((c for c in self.copies.get(index, ()) if c.relative_path.startswith(own)), canonical)

    def known_layout(self, index: MetadataIndex, item: StoredItem | None = None) -> TensorLayout | None:
        """The tensor layout if known without touching data files (index or earlier parse).

        ``item`` selects a TP-replica copy instead of the canonical record.
        """
        item = item or self.item(index)
        if item.payload_offset >= 0:
            return dense_layout(item.payload_offset - item.offset, *self._chunk_shape(index))
        with self._lock:
            return self._layouts.get(index)

    def parsed_before(self, index: MetadataIndex) -> bool:
        """Whether ``index``'s known layout was parsed from its record by a load: its zip
        CRC-32 is the record's as it was then (a data file replaced alone changes it)."""
        with self._lock:
            return index in self._parsed

    def parse_layout(self, location: Location, index: MetadataIndex) -> TensorLayout:
        """Parse a stock record's zip headers (two small reads) and remember the result."""
        return self.parse_layouts(location, [index])[0]

    def parse_layouts(
        self,
        location: Location,
        indices: Sequence[MetadataIndex],
        threads: int = 1,
        records: RecordLayouts | None = None,
        cold: bool | None = None,
    ) -> list[TensorLayout]:
        """``parse_layout`` of many records, recognizing records framed like one parsed
        before without parsing them (``RecordLayouts``). For more than one record, unless
        the first one's head is in memory, storage is asked for the ends of every record of
        a file at once (``RangeReader.prefetch``: the kernel queues the reads of a local
        file, an object store's requests go out together), then one thread parses them:
        a stock checkpoint one process wrote is one file, and its 1,180 records took
        93-100 ms cold, 48 ms prefetched (and 58 ms parsed on four threads: CPU work under
        the GIL); the ends are then dropped from the page cache again (``release``): left
        there, they broke the readahead of the data reads that follow. Where storage takes
        no prefetch, runs of the file's records, the file opened once per run, go to up to
        ``threads`` threads, so their small reads wait together. Either way the ends are
        read ``ENDS_BATCH_RECORDS`` records at a time (``RangeReader.fetch``), a record's
        tail and the next one's head as one span: 590 back-to-back records, warm, 1,180
        reads of Python-wrapped ``preadv`` (~11 us each) -> 591 ``pread`` calls, parse 32
        -> 20 ms. ``records``: where the frames of the records parsed are kept (a load's
        guessed reads check against them: ``GuessedLayout``); ``cold``: whether the first
        record's head is not in memory, where the caller asked already (a second probe
        finds what the first one's readahead brought in)."""
        files: dict[str, list[tuple[int, MetadataIndex, StoredItem]]] = {}  # each record: its place in indices, item
        for position, index in enumerate(indices):
            item = self.item(index)
            files.setdefault(item.relative_path, []).append((position, index, item))
        records = RecordLayouts() if records is None else records
        cold = None if cold is None else cold and len(indices) > 1
        layouts: list[TensorLayout | None] = [None] * len(indices)
        runs: list[list[tuple[int, MetadataIndex, StoredItem]]] = []  # of files whose storage took no prefetch

        def parse(reader: RangeReader, run: list[tuple[int, MetadataIndex, StoredItem]]) -> None:
            for first in range(0, len(run), ENDS_BATCH_RECORDS):
                batch = run[first : first + ENDS_BATCH_RECORDS]
                ends = reader.fetch([(item.offset + start, n) for _, _, item in batch for start, n in probed_ranges(item.length)])
                for position, index, item in batch:
                    layouts[position] = self._parse_layout(reader, ends, records, index, item)

        def parse_run(run: list[tuple[int, MetadataIndex, StoredItem]]) -> None:
            _, index, item = run[0]
            with location.open_reader(item.relative_path, index.fqn) as reader:
                parse(reader, run)

        for path, found in files.items():
            _, first_index, first_item = found[0]
            with location.open_reader(path, first_index.fqn) as reader:
                if cold is None:  # one record (verify parses one at a time): nothing to queue
                    cold = len(indices) > 1 and not reader.holds([first_item.offset])
                if not cold:
                    parse(reader, found)
                    continue
                ends = [(item.offset + start, n) for _, _, item in found for start, n in probed_ranges(item.length)]
                if reader.prefetch(ends):
                    parse(reader, found)
                    reader.release(ends)  # the data reads stream from the disk past them
                    continue
            size = max(PROBE_RUN_RECORDS, -(-len(found) // max(1, threads)))
            runs += [found[i : i + size] for i in range(0, len(found), size)]
        if threads > 1 and len(runs) > 1:
            with StartedPool(min(threads, len(runs)), "dcp_ext-probe") as pool:
                list(pool.map(parse_run, runs))
        else:
            for run in runs:
                parse_run(run)
        return layouts  # type: ignore[return-value]  # every one parsed

    def _parse_layout(
        self, reader: RangeReader, ends: FetchedSpans, records: RecordLayouts, index: MetadataIndex, item: StoredItem
    ) -> TensorLayout:
        """The layout of the record ``item`` (of ``index``), its ends taken from ``ends``
        (bytes further in from ``reader``)."""
        where = f"{self.url}: file {item.relative_path!r} key {index.fqn!r}"

        def read_at(offset: int, n: int) -> bytes:
            fetched = ends.view(item.offset + offset, n)
            if fetched is not None:
                return fetched.tobytes()
            buf = bytearray(n)
            reader.read_into(item.offset + offset, [memoryview(buf)])
            return bytes(buf)

        try:
            layout = records.parse(item.length, read_at, where)
        except OSError as exc:
            raise CheckpointError(f"{where}: cannot read the record ({exc})") from exc
        md, chunk = self.chunk(index)
        check_holds(layout, md.properties.dtype, tuple(chunk.sizes), where)
        self.learn_layout(index, layout)
        return layout

    def learn_layout(self, index: MetadataIndex, layout: TensorLayout) -> None:
        """Remember the layout a load parsed from ``index``'s record (``known_layout``)."""
        with self._lock:
            self._layouts[index] = layout
            self._parsed.add(index)


def _read_optional(location: Location, name: str) -> bytes | None:
    try:
        return location.read_bytes(name)
    except FileNotFoundError:
        return None


@dataclass
class _MetadataFile:
    """``.metadata`` as a read needs it: size and CRC32C always, the bytes only when the
    pickle must be decoded. With an index, the size and CRC come from the commit marker
    when the file is the one it committed (``_committed_metadata``), else the file is
    streamed through the CRC in blocks: at a million chunks that spares every rank
    reading ~170 MB, or at least holding it."""

    facts: tuple[int, int]  # size, CRC32C
    data: bytes | None

    BLOCK = 4 << 20

    @classmethod
    def read(cls, location: Location, keep_bytes: bool) -> _MetadataFile:
        try:
            if keep_bytes:
                data = location.read_bytes(METADATA_NAME)
                return cls((len(data), crc32c.crc32c(data)), data)
            size, crc, block = 0, 0, bytearray(cls.BLOCK)  # one buffer, refilled: no 8 MB object per step
            view = memoryview(block)
            with location.open_file(METADATA_NAME) as f:
                while n := f.readinto(block):
                    size, crc = size + n, crc32c.crc32c(view[:n], crc)
            return cls((size, crc), None)
        except FileNotFoundError:
            if location.is_file():  # an object store's key (a local file is named where it is opened)
                raise CheckpointError(f"{location.url}: is a file, not a checkpoint directory") from None
            names = location.listdir()
            why = f"{METADATA_NAME} is missing" if names else "no such directory, or it is empty"
            if rank_metadata_name(0) in names:
                why += (f"; its {rank_metadata_name(0)}, ... are per-rank metadata of dcp.save(use_collectives=False), "
                        "which dcp.load reads at the saving world size, each rank its own")
            raise CheckpointError(f"{location.url}: no committed checkpoint here ({why})") from None

    def contents(self, location: Location) -> bytes:
        """The bytes (read again if only streamed; a changed file fails the catalog's signature check)."""
        if self.data is None:
            self.data = location.read_bytes(METADATA_NAME)
            self.facts = (len(self.data), crc32c.crc32c(self.data))
        return self.data


@dataclass
class CatalogInputs:
    """What a catalog is built from, as read from storage: small enough to send to other
    ranks (``dcp_ext.storage.shared_metadata``), so one rank can read it for a group.

    With an index, ``.metadata`` is not read when the commit marker's stamp shows it is
    the committed file; otherwise it is streamed through its CRC on a thread while the
    index is decoded (both release the GIL: at a million chunks 169 MB, ~40 ms from the
    page cache and far more from a disk); ``metadata_file`` waits for it."""

    signature: tuple[Any, ...]
    index_bytes: bytes | None
    pending_metadata: Future[_MetadataFile] | _MetadataFile  # the bytes only when there is no index to decode instead
    marker_bytes: bytes | None

    @property
    def metadata_file(self) -> _MetadataFile:
        if isinstance(self.pending_metadata, Future):
            self.pending_metadata = self.pending_metadata.result()
        return self.pending_metadata

    def complete(self) -> CatalogInputs:
        """These inputs with ``.metadata`` read (raising what its read raised): before they
        are sent to other ranks."""
        self.metadata_file  # noqa: B018
        return self

    def __getstate__(self) -> dict[str, Any]:
        return self.complete().__dict__


def read_catalog_inputs(location: Location) -> CatalogInputs:
    """The storage half of ``read_catalog``: every read it needs, nothing decoded."""
    signature = catalog_signature(location)
    index_bytes = _read_optional(location, INDEX_NAME)
    marker_bytes = _read_optional(location, MARKER_NAME)
    metadata: Future[_MetadataFile] | _MetadataFile | None
    if index_bytes is None:
        metadata = _MetadataFile.read(location, keep_bytes=True)
    else:
        metadata = _committed_metadata(location, marker_bytes, signature[0])
        if metadata is None:
            metadata = in_background(lambda: _MetadataFile.read(location, keep_bytes=False), "dcp_ext-metadata-crc")
    return CatalogInputs(signature, index_bytes, metadata, marker_bytes)


def _committed_metadata(location: Location, marker_bytes: bytes | None, metadata_signature: tuple[Any, ...] | None) -> _MetadataFile | None:
    """``.metadata``'s size and CRC32C as the commit marker records them, without reading
    the file, when the file is still the one the marker committed (the same
    ``Location.stamp``, taken from the signature already read: not rewritten, replaced or
    copied since); None otherwise."""
    if marker_bytes is None:
        return None
    try:
        marker = CommitMarker.decode(marker_bytes, MARKER_NAME)
    except CorruptCheckpointError:
        return None  # catalog_from_inputs decides what a torn marker means
    if marker.metadata_stamp is None or marker.metadata_stamp != location.stamp_of(metadata_signature):
        return None
    return _MetadataFile((marker.metadata_size, marker.metadata_crc32c), None)


def stored_metadata_facts(location: Location) -> tuple[int, int]:
    """Size and CRC32C of ``.metadata`` as stored, read through (``dcp-ext verify``: a
    load trusts the commit marker's stamp instead)."""
    return _MetadataFile.read(location, keep_bytes=False).facts


def read_catalog(location: Location) -> Catalog:
    """Read ``.metadata``, the index when it belongs to it, and the commit marker."""
    return catalog_from_inputs(location, read_catalog_inputs(location))


def catalog_from_inputs(location: Location, inputs: CatalogInputs) -> Catalog:
    """Decode and check what ``read_catalog_inputs`` read.

    The index is used only when it records this very ``.metadata`` (size and CRC32C; an
    index of an interrupted newer save does not); a commit marker that commits this
    ``.metadata`` must then also commit the index bytes, else the index is corrupt. ``Catalog.committed`` is False when our index vouches for
    ``.metadata`` but no marker commits it: a save into a store without atomic rename
    was interrupted or is running (checkpoints without our index are stock: committed).
    Where our index is missing or records another ``.metadata`` beside a commit marker (a
    commit between setting the live index aside and its commit point, running or killed),
    the set-aside index is read too: the one read that a load pays only then.
    """
    source = f"{location.url}/{METADATA_NAME}"
    index_name, index_bytes = INDEX_NAME, inputs.index_bytes
    decoded = _decoded_index(location, index_name, index_bytes)  # while .metadata streams through its CRC (CatalogInputs)
    metadata_file = inputs.metadata_file
    if inputs.marker_bytes is not None and not isinstance(decoded, CorruptCheckpointError) and not _records(decoded, metadata_file):
        previous = _read_optional(location, PREVIOUS_INDEX_NAME)
        set_aside = _decoded_index(location, PREVIOUS_INDEX_NAME, previous)
        if _records(set_aside, metadata_file):
            index_name, index_bytes, decoded = PREVIOUS_INDEX_NAME, previous, set_aside
    marker = None
    if inputs.marker_bytes is not None:
        with contextlib.suppress(CorruptCheckpointError):  # a torn marker commits nothing
            marker = CommitMarker.decode(inputs.marker_bytes, f"{location.url}/{MARKER_NAME}")
    marked = marker is not None and (marker.metadata_size, marker.metadata_crc32c) == metadata_file.facts

    def check_committed() -> None:
        """A marker that commits this ``.metadata`` must commit these index bytes too."""
        if marked and not marker.commits_index(index_bytes):
            raise CorruptCheckpointError(
                f"{location.url}/{index_name}: index bytes differ from what the commit marker recorded "
                f"(corrupt); delete {index_name} to load from {METADATA_NAME} alone"
            )

    if isinstance(decoded, CorruptCheckpointError):
        check_committed()
        raise decoded
    indexed = None
    if _records(decoded, metadata_file):
        check_committed()
        indexed = decoded
    if indexed is not None and indexed.metadata is not None:  # decode_index checked its own rows
        metadata, items, copies = indexed.metadata, indexed.items, indexed.copies
        if not marked:  # nothing vouches for the index bytes: the pickle must agree, records give their layouts
            _check_index_agrees(indexed, load_metadata_pickle(metadata_file.contents(location), source), f"{location.url}/{index_name}")
            items, copies = _PayloadsUnknown(items), {}  # TP-replica copies: in the index alone, unchecked
        return Catalog(location.url, metadata, items, True, marked, inputs.signature, copies,
                       fingerprint=metadata_file.facts[1], index_name=index_name)
    metadata = load_metadata_pickle(metadata_file.contents(location), source)
    return _checked_catalog(
        location, metadata, source, inputs.signature, metadata_file.facts[1], indexed, marked or indexed is None,
        index_name if indexed is not None else None,
    )


def _check_index_agrees(indexed: IndexedCheckpoint, pickled: Metadata, where: str) -> None:
    """An index no commit marker vouches for (a crash between the renames of ``.metadata``
    and of the marker, or a lost marker) has no checksum of its own: one flipped bit sent a
    key's read to another record, or read a tensor as another dtype. Such an index must say
    what the pickled ``.metadata`` says of every key (kind, dtype, shape) and of every stored
    item (file, offset, length); where a tensor starts inside its record is then read from
    the record (its layout parsed, as for a stock checkpoint), not taken from the index."""
    disagreeing = _first_disagreement(indexed, pickled, where)
    if disagreeing is not None:
        raise CorruptCheckpointError(
            f"{where}: {disagreeing} disagrees with {METADATA_NAME}, and no commit marker vouches for the index "
            f"(corrupt); delete it to load from {METADATA_NAME} alone"
        )


def _first_disagreement(indexed: IndexedCheckpoint, pickled: Metadata, where: str) -> str | None:
    keys = indexed.metadata.state_dict_metadata if indexed.metadata is not None else None
    assert isinstance(keys, IndexedKeys)  # an index load's keys: their facts come from its columns, no per-key objects
    state, saved = pickled.state_dict_metadata, items_from_storage_data(pickled, where)
    for fqn, md in state.items():
        if not _same_key(keys, fqn, md):
            return f"key {fqn!r}"
    for index, item in saved.items():
        mine = indexed.items.get(index)
        if mine is None or mine[:3] != item[:3]:  # (file, offset, length)
            return f"the location of key {index.fqn!r}"
    if len(state) != len(keys) or len(saved) != len(indexed.items):
        return "its list of keys"
    return None


def _same_key(keys: IndexedKeys, fqn: str, md: Any) -> bool:
    """Whether the index holds ``fqn`` as ``md`` says: a bytes key, or a tensor of its dtype and shape."""
    if fqn not in keys:
        return False
    facts = keys.facts(fqn)
    if not isinstance(md, TensorStorageMetadata):
        return facts is None
    return facts is not None and facts[0].dtype == md.properties.dtype and tuple(facts[1]) == tuple(md.size)


class _PayloadsUnknown(Mapping[MetadataIndex, StoredItem]):
    """Stored items with their payload offsets dropped, so that layouts are parsed from the
    records (a view: an index's items are built on demand, a copy of them all cost 0.36 s
    at 20,000 keys)."""

    def __init__(self, items: Mapping[MetadataIndex, StoredItem]):
        self._items = items

    def __getitem__(self, index: MetadataIndex) -> StoredItem:
        return self._items[index]._replace(payload_offset=-1)

    def __iter__(self) -> Iterator[MetadataIndex]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def _decoded_index(location: Location, name: str, data: bytes | None) -> IndexedCheckpoint | CorruptCheckpointError | None:
    """Index bytes decoded, or the corruption they hold (raised only if they are the index to use)."""
    if data is None:
        return None
    try:
        return decode_index(data, f"{location.url}/{name}")
    except CorruptCheckpointError as exc:
        return exc


def _records(decoded: IndexedCheckpoint | CorruptCheckpointError | None, metadata_file: _MetadataFile) -> bool:
    """Whether a decoded index was written with this ``.metadata`` (its size and CRC32C)."""
    return isinstance(decoded, IndexedCheckpoint) and (decoded.metadata_size, decoded.metadata_crc32c) == metadata_file.facts


def _checked_catalog(
    location: Location, metadata: Metadata, source: str, signature: tuple[Any, ...], fingerprint: int,
    indexed: IndexedCheckpoint | None = None, committed: bool = True, index_name: str | None = None,
) -> Catalog:
    """The catalog of an unpickled ``.metadata`` (items from the index that records it, or
    from its ``storage_data``), checked against each other (``check_metadata``)."""
    try:
        items = indexed.items if indexed is not None else items_from_storage_data(metadata, source)
        copies = indexed.copies if indexed is not None else {}
        check_metadata(metadata, items, source, copies)
        return Catalog(location.url, metadata, items, indexed is not None, committed, signature, copies,
                       fingerprint=fingerprint, index_name=index_name)
    except CheckpointError:
        raise
    except Exception as exc:  # untrusted structure: whatever validation trips over is corruption
        raise CorruptCheckpointError(f"{source}: malformed metadata ({type(exc).__name__}: {exc})") from None


def rank_metadata_name(rank: int) -> str:
    """Where a stock ``dcp.save(use_collectives=False)`` puts a rank's own metadata."""
    return f"__{rank}{METADATA_NAME}"


def read_rank_catalog(location: Location, rank: int) -> Catalog:
    """The catalog of one rank's part of a save made without collectives: a stock
    ``.metadata`` pickle per rank, describing that rank's data alone. DCP asks a reader for
    it (``read_metadata(rank=r)``) when the checkpoint has no ``.metadata``."""
    name = rank_metadata_name(rank)
    source = f"{location.url}/{name}"
    try:
        data = location.read_bytes(name)
    except FileNotFoundError:
        raise CheckpointError(f"{location.url}: no committed checkpoint here (neither {METADATA_NAME} nor {name})") from None
    metadata = load_metadata_pickle(data, source)
    catalog = _checked_catalog(location, metadata, source, (location.signature(name),), crc32c.crc32c(data))
    catalog.saving_rank = rank
    return catalog


def catalog_signature(location: Location) -> tuple[Any, ...]:
    """Stats of ``.metadata``, index and marker; locally also the marker's bytes (one small
    read), whose save id never repeats across saves even when every stat does."""
    stats = tuple(location.signature(name) for name in (METADATA_NAME, INDEX_NAME, MARKER_NAME))
    marker = _read_optional(location, MARKER_NAME) if location.is_local and stats[-1] is not None else None
    return (*stats, marker)


CACHED_ROWS = 1 << 19  # keys and chunks the metadata cache holds in all: ~450 MB of one-chunk keys


class MetadataCache:
    """Thread-safe LRU of parsed catalogs, one read per checkpoint version per process.

    Bounded by count and by keys plus chunks (``CACHED_ROWS``; about 900 bytes a key, less
    a chunk): 16 entries of a 20,000-key checkpoint held 570 MB after their loads."""

    def __init__(self, max_entries: int = 16, max_rows: int = CACHED_ROWS):
        # each entry valid while its signature holds
        self._catalogs: Lru[Catalog] = Lru(max_entries, Catalog.rows, max_rows)
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}

    def clear(self) -> None:
        self._catalogs.clear()

    def evict(self, catalog: Catalog) -> None:
        """Forget ``catalog``'s entry if it still holds it: a load found one of its data
        files missing, so the entry may be stale in a way no signature showed."""
        held = None if catalog.cache_key is None else self._catalogs.get(catalog.cache_key)
        if held is not None and held.signature == catalog.signature:  # it, or the one a view was made of
            self._catalogs.discard(catalog.cache_key, held)

    def peek(self, location: Location, variant: tuple[Any, ...] = ()) -> Catalog | None:
        """The entry held for ``location`` read as ``variant``, without checking storage."""
        return self._catalogs.get((location.cache_key(), *variant))

    def open(
        self,
        location: Location,
        read: Callable[[Location], Catalog] = read_catalog,
        signature: Callable[[Location], tuple[Any, ...]] = catalog_signature,
        variant: tuple[Any, ...] = (),
    ) -> tuple[Catalog, bool]:
        """Return (catalog, whether metadata was actually read from storage).

        ``read`` / ``signature``: how this checkpoint's format is parsed and fingerprinted
        (DCP by default; see ``catalog_formats``); ``variant``: the format and its options,
        so one directory read two ways keeps two entries."""
        key = (location.cache_key(), *variant)
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            catalog = None
            for _ in range(_SIGNATURE_RETRIES):
                current = signature(location)
                hit = self._catalogs.get(key, lambda cached: cached.signature == current)
                if hit is not None:
                    return hit, False
                catalog = read(location)
                if signature(location) == catalog.signature:  # not rewritten while we read
                    catalog.cache_key = key
                    self._catalogs.put(key, catalog)
                    return catalog, True
            assert catalog is not None
            return catalog, True


METADATA_CACHE = MetadataCache()


def clear_metadata_cache() -> None:
    """Forget everything cached in this process (an alias of ``dcp_ext.clear_caches``,
    kept for code written before there was one cache class)."""
    clear_caches()
