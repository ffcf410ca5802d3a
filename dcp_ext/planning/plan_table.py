"""A rank's save plan as columns: what travels to the coordinator instead of WriteItems.

DCP gathers every rank's ``SavePlan`` (a Python object per item) on the coordinator, which
then loops over all of them. At 16,384 ranks x ~4,000 items that is ~65 M objects, far
beyond seconds. A ``PlanTable`` holds the same facts as numpy columns (one row per item)
plus the distinct keys and tensor facts once, and a digest of it all: ranks whose plans
are identical (data-parallel replicas) send identical tables, so the coordinator plans
each distinct table once (``dcp_ext.planning.global_plan``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from dcp_ext.runtime.frozen import frozen

BYTE_IO = WriteItemType.BYTE_IO.value

TensorFacts = tuple[TensorProperties, torch.Size]  # what .metadata records per tensor key


@dataclasses.dataclass(frozen=True, eq=False)
class PlanTable:
    """One row per write item; ``fqns``/``facts`` hold each key once (``facts`` is None
    for non-tensor keys). Offsets and sizes are padded to ``offsets.shape[1]`` dims."""

    fqns: tuple[str, ...]
    facts: PackedFacts  # per key
    fqn_id: np.ndarray  # int32 (rows,)
    kind: np.ndarray  # int8 (rows,): WriteItemType values
    ndim: np.ndarray  # int8 (rows,)
    offsets: np.ndarray  # int64 (rows, dims)
    sizes: np.ndarray  # int64 (rows, dims)
    nbytes: np.ndarray  # int64 (rows,): bytes of the chunk (DCP's tensor_storage_size is the whole tensor's)
    mappings: Any  # DCP's flatten_state_dict mappings (SavePlan.planner_data)
    keys_digest: bytes  # of fqns, facts and mappings
    digest: bytes  # of everything above

    def __len__(self) -> int:
        return len(self.fqn_id)


_PROPERTY_FIELDS = tuple(f.name for f in dataclasses.fields(TensorProperties))


class PackedFacts(Sequence[TensorFacts | None]):
    """A table's ``facts``, each key's properties and size, also as plain values: what
    its pickle holds (DCP gathers every rank's table, every save; the dataclass reduce of
    590 keys' ``TensorProperties`` was 0.7 of the table's 0.75 ms) and what its digest
    is made of. Unpickled, the objects are made when first read: a save whose plan is
    reused never reads them (the coordinator compares digests)."""

    def __init__(self, rows: list[tuple[Any, ...] | None], facts: tuple[TensorFacts | None, ...] | None = None) -> None:
        self.rows = rows  # per key: its properties' fields, then its size as a tuple; None: not a tensor
        self._facts = facts

    @classmethod
    def of(cls, facts: Sequence[TensorFacts | None]) -> PackedFacts:
        """``facts`` packed; read back as themselves."""
        if isinstance(facts, PackedFacts):
            return facts
        facts = tuple(facts)
        return cls([None if f is None else (*(getattr(f[0], name) for name in _PROPERTY_FIELDS), tuple(f[1])) for f in facts], facts)

    def _unpacked(self) -> tuple[TensorFacts | None, ...]:
        if self._facts is None:  # a racing thread makes an equal tuple
            self._facts = tuple(
                None if row is None else (frozen(TensorProperties, **dict(zip(_PROPERTY_FIELDS, row))), torch.Size(row[-1]))
                for row in self.rows
            )
        return self._facts

    def __getitem__(self, key: Any) -> Any:
        return self._unpacked()[key]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[TensorFacts | None]:
        return iter(self._unpacked())

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return PackedFacts, (self.rows,)


def table_from_items(items: list[WriteItem], mappings: Any = None) -> PlanTable:
    """Encode a rank's write items (in order: row n is ``items[n]``)."""
    ids: dict[str, int] = {}
    facts: list[TensorFacts | None] = []
    fqn_id, kind = [], []
    offsets: list[Any] = []
    sizes: list[Any] = []
    for item in items:
        fqn = item.index.fqn
        data = item.tensor_data
        n = ids.get(fqn)
        if n is None:
            n = ids[fqn] = len(facts)
            facts.append(None if data is None else (data.properties, data.size))
        fqn_id.append(n)
        kind.append(item.type.value)
        if data is None:
            offsets.append(())
            sizes.append(())
        else:
            offsets.append(data.chunk.offsets)
            sizes.append(data.chunk.sizes)
    ndim = np.array([len(box) for box in offsets], np.int8)
    dims = int(ndim.max(initial=0)) or 1
    if len(items) and bool(np.all(ndim == dims)):  # one array each, no row by row (all boxes one length)
        offset_rows, size_rows = np.array(offsets, np.int64).reshape(-1, dims), np.array(sizes, np.int64).reshape(-1, dims)
    else:
        offset_rows, size_rows = np.zeros((len(items), dims), np.int64), np.ones((len(items), dims), np.int64)
        for row, (off, size) in enumerate(zip(offsets, sizes)):
            offset_rows[row, : len(off)] = off
            size_rows[row, : len(size)] = size
    itemsize = np.array([0 if f is None else f[0].dtype.itemsize for f in facts] or [0], np.int64)
    ids_column = np.array(fqn_id, np.int32)
    nbytes = np.prod(size_rows, axis=1) * itemsize[ids_column]  # padding sizes are 1; a bytes key's itemsize 0
    return make_table(tuple(ids), tuple(facts), ids_column, kind, ndim, offset_rows, size_rows, nbytes, mappings)


def make_table(
    fqns: tuple[str, ...],
    facts: Sequence[TensorFacts | None],
    fqn_id: Any,
    kind: Any,
    ndim: Any,
    offsets: np.ndarray,
    sizes: np.ndarray,
    nbytes: Any,
    mappings: Any = None,
) -> PlanTable:
    """A table from its columns (any array-likes), digests included."""
    columns = (
        np.asarray(fqn_id, np.int32),
        np.asarray(kind, np.int8),
        np.asarray(ndim, np.int8),
        np.asarray(offsets, np.int64),
        np.asarray(sizes, np.int64),
        np.asarray(nbytes, np.int64),
    )
    packed = PackedFacts.of(facts)
    keys_digest = _keys_digest(fqns, packed, mappings)
    return PlanTable(fqns, packed, *columns, mappings, keys_digest, _digest(keys_digest, columns))


def items_from_table(table: PlanTable) -> list[WriteItem]:
    """The write items a table encodes (index hints left unset, as a local plan has them)."""
    items = []
    for fqn_id, kind, ndim, off, size in zip(
        table.fqn_id.tolist(), table.kind.tolist(), table.ndim.tolist(), table.offsets.tolist(), table.sizes.tolist()
    ):
        fqn, facts = table.fqns[fqn_id], table.facts[fqn_id]
        if kind == BYTE_IO or facts is None:
            items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType(kind)))
            continue
        chunk = ChunkStorageMetadata(offsets=torch.Size(off[:ndim]), sizes=torch.Size(size[:ndim]))
        items.append(
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType(kind),
                tensor_data=TensorWriteData(chunk=chunk, properties=facts[0], size=facts[1]),
            )
        )
    return items


def _keys_digest(fqns: tuple[str, ...], facts: PackedFacts, mappings: Any) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update("\0".join(fqns).encode("utf-8", "surrogatepass"))
    h.update(repr(facts.rows).encode())  # each key's properties as their values (a dataclass repr: 4 us a key)
    h.update(repr(mappings).encode())
    return h.digest()


def _digest(keys_digest: bytes, columns: tuple[np.ndarray, ...]) -> bytes:
    h = hashlib.blake2b(keys_digest, digest_size=16)
    for column in columns:
        h.update(repr((column.dtype.str, column.shape)).encode())
        h.update(np.ascontiguousarray(column).data)
    return h.digest()
