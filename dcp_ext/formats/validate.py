"""Structural checks on checkpoint metadata before any of it is trusted.

Metadata comes from disk and may be corrupt or hostile. Before a load plans a single
read we check types, that every chunk lies inside its tensor, that every item names a
safe relative file and a non-negative byte range large enough for the chunk it claims
to hold (which also stops a chunk claiming 2**60 bytes from becoming an allocation).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata

from dcp_ext.errors import CorruptCheckpointError
from dcp_ext.formats.faults import (
    chunk_outside_tensor,
    invalid_byte_range,
    invalid_tensor_facts,
    record_too_small,
)
from dcp_ext.formats.index import StoredItem
from dcp_ext.formats.torch_record import numel
from dcp_ext.formats.data_files import check_relative_name
from dcp_ext.runtime.frozen import frozen

_INT = int


def _non_negative_ints(values: Any) -> bool:
    if type(values) is torch.Size:  # holds ints only (its constructor converts or refuses): the common case, in C
        return not values or min(values) >= 0
    return all(type(v) is _INT and v >= 0 for v in values)


def is_dims(value: Any) -> bool:
    """A shape read from JSON or a pickle: a list or tuple of sizes a ``torch.Size`` holds
    (ints, not bools or floats, 0 to 2**63-1)."""
    return isinstance(value, (list, tuple)) and _non_negative_ints(value) and all(v < 2**63 for v in value)


class ItemsByPlace(Mapping[MetadataIndex, StoredItem]):
    """{MetadataIndex: StoredItem}, held by each index's place, ``(fqn, offset)``: what
    DCP's ``MetadataIndex`` hashes and compares (its ``index`` hint is neither). Its hash and
    equality are a dataclass's Python functions, ~1 us a lookup, and a load of a stock
    checkpoint looks each record up four to six times (the plan's items, their layouts);
    a tuple's are C's."""

    def __init__(self) -> None:
        self._items: dict[tuple[str, Any], StoredItem] = {}
        self._indices: dict[tuple[str, Any], MetadataIndex] = {}

    def add(self, index: MetadataIndex, item: StoredItem) -> None:
        place = (index.fqn, index.offset)
        self._indices[place] = index
        self._items[place] = item

    def __getitem__(self, index: MetadataIndex) -> StoredItem:
        try:
            return self._items[index.fqn, index.offset]
        except AttributeError:  # not an index: as a dict keyed by indices answers
            raise KeyError(index) from None

    def at(self, fqn: str, offset: Any) -> StoredItem | None:
        """The item of key ``fqn`` whose chunk starts at ``offset`` (a torch.Size or tuple), if any."""
        return self._items.get((fqn, offset))

    def get(self, index: MetadataIndex, default: Any = None) -> Any:  # type: ignore[override]
        try:
            return self._items.get((index.fqn, index.offset), default)
        except AttributeError:
            return default

    def __contains__(self, index: object) -> bool:
        return isinstance(index, MetadataIndex) and (index.fqn, index.offset) in self._items

    def __iter__(self) -> Iterator[MetadataIndex]:
        return iter(self._indices.values())

    def __len__(self) -> int:
        return len(self._items)


def items_from_storage_data(metadata: Metadata, source: str) -> ItemsByPlace:
    """Stored-item locations from a pickled metadata's ``storage_data``."""
    if not isinstance(metadata.storage_data, dict):
        raise CorruptCheckpointError(f"{source}: storage_data is {type(metadata.storage_data).__name__}, expected a dict")
    items = ItemsByPlace()
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CorruptCheckpointError(f"{source}: storage_data entry {index!r} is not a DCP file location")
        transforms = tuple(info.transform_descriptors or ())
        if transforms and not all(isinstance(t, str) for t in transforms):
            raise CorruptCheckpointError(f"{source}: item {index.fqn!r} has stream transforms {transforms!r}, expected names")
        items.add(index, StoredItem(info.relative_path, info.offset, info.length, transforms=transforms))
    return items


def check_metadata(
    metadata: Metadata,
    items: Mapping[MetadataIndex, StoredItem],
    source: str,
    copies: dict[MetadataIndex, list[StoredItem]] | None = None,
) -> None:
    """Raise CorruptCheckpointError/UnsafeCheckpointError naming the key on any fault.

    ``copies`` (TP-replica copies from our index) get the same checks as the chunk they copy.
    """
    copies = copies or {}
    if not isinstance(metadata.state_dict_metadata, dict):
        raise CorruptCheckpointError(f"{source}: state_dict_metadata is not a dict")
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        raise CorruptCheckpointError(f"{source}: storage_meta is a {type(metadata.storage_meta).__name__}, expected a StorageMeta or None")
    named: set[str] = set()  # file names checked: a checkpoint has a few files for thousands of items
    for index, item in items.items():
        for stored in (item, *copies.get(index, ())) if copies else (item,):
            _check_location(index, stored, source, named)
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise CorruptCheckpointError(f"{source}: key {fqn!r} is not a string")
        if isinstance(md, BytesStorageMetadata):
            if MetadataIndex(fqn) not in items:
                raise CorruptCheckpointError(f"{source}: bytes item {fqn!r} has no stored location")
        elif isinstance(md, TensorStorageMetadata):
            _check_tensor(fqn, md, items, copies, source)
        else:
            raise CorruptCheckpointError(f"{source}: key {fqn!r} has unknown metadata {type(md).__name__}")


def _check_location(index: MetadataIndex, item: StoredItem, source: str, named: set[str]) -> None:
    path = item.relative_path
    if type(path) is not str or path not in named:  # anything but a str is refused right there
        named.add(check_relative_name(source, path, index.fqn))
    offset, length, payload = item.offset, item.length, item.payload_offset
    if (
        type(offset) is not _INT or type(length) is not _INT or offset < 0 or length < 0  # _non_negative_ints, unrolled
        or type(payload) is not int
        or not (payload == -1 or offset <= payload <= offset + length)
    ):
        raise invalid_byte_range(source, index.fqn, offset, length, payload)


def _check_tensor(
    fqn: str,
    md: TensorStorageMetadata,
    items: Mapping[MetadataIndex, StoredItem],
    copies: dict[MetadataIndex, list[StoredItem]],
    source: str,
) -> None:
    by_place = isinstance(items, ItemsByPlace)  # looked up without a MetadataIndex per chunk
    dtype = getattr(md.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype) or not _non_negative_ints(md.size):
        raise invalid_tensor_facts(source, fqn, dtype, md.size)
    if not isinstance(md.chunks, list):
        raise CorruptCheckpointError(f"{source}: tensor {fqn!r} has no chunk list")
    for chunk in md.chunks:
        offsets, sizes = chunk.offsets, chunk.sizes
        if (
            len(offsets) != len(md.size)
            or len(sizes) != len(md.size)
            or not _non_negative_ints(offsets)
            or not _non_negative_ints(sizes)
            or not all(map(operator.le, map(operator.add, offsets, sizes), md.size))  # every o + s <= n, in C
        ):
            raise chunk_outside_tensor(source, fqn, offsets, sizes, md.size)
        # DCP's constructor copies the offsets into a new torch.Size; the pickle's already are one
        offset = offsets if type(offsets) is torch.Size else torch.Size(offsets)
        index = frozen(MetadataIndex, fqn=fqn, offset=offset, index=None) if copies or not by_place else None
        item = items.get(index) if index is not None else items.at(fqn, offset)  # type: ignore[union-attr]
        if item is None:
            raise CorruptCheckpointError(f"{source}: tensor {fqn!r} chunk at {list(offsets)} has no stored location")
        nbytes = numel(sizes) * dtype.itemsize
        for stored in (item, *copies.get(index, ())) if copies else (item,):
            if stored.transforms:  # compressed: any stored size; decoding is bounded instead
                continue
            if nbytes > stored.length or (
                stored.payload_offset >= 0 and stored.payload_offset + nbytes > stored.offset + stored.length
            ):
                raise record_too_small(
                    source, fqn, offsets, nbytes, stored.relative_path, stored.offset, stored.length, stored.payload_offset
                )


def chunk_faults(fqn: str, md: TensorStorageMetadata) -> list[str]:
    """Chunks must lie inside the tensor, not overlap, and cover it exactly once."""
    faults = []
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
    covered = sum(numel(sizes) for _, sizes in boxes)
    if covered != numel(md.size):
        faults.append(f"{fqn}: chunks cover {covered} elements of {numel(md.size)}")
    faults.extend(f"{fqn}: chunk at {list(a)} overlaps chunk at {list(b)}" for a, b in overlapping_boxes(boxes))
    return faults


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def overlapping_boxes(boxes: list[Box]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets of one box, offsets of an earlier one) for each pair that shares an element:
    a sweep along the dimension the boxes start at the most places in, comparing a box only
    with those still open there (along dim 0 alone, column pieces all start at row 0 and
    every pair was compared: 4 s for 4,096 pieces)."""
    if not boxes or not boxes[0][0]:  # 0-d: nothing to sweep along
        return [(b[0], a[0]) for a, b in zip(boxes, boxes[1:])]
    dim = max(range(len(boxes[0][0])), key=lambda d: len({offsets[d] for offsets, _ in boxes}))
    pairs = []
    active: list[Box] = []
    for offsets, sizes in sorted(boxes, key=lambda box: box[0][dim]):
        if numel(sizes) == 0:
            continue
        active = [(o, s) for o, s in active if o[dim] + s[dim] > offsets[dim]]
        pairs.extend((offsets, o) for o, s in active if all(a < b + m and b < a + n for a, n, b, m in zip(offsets, sizes, o, s)))
        active.append((offsets, sizes))
    return pairs
