"""A rank's tensor reads as columns: what ``ShardLoadPlanner`` hands ``ShardReader``
instead of one ``ReadItem`` per piece of a destination.

DCP's load protocol carries a ``ReadItem`` per piece, which the planner builds and the
reader takes apart again: looking up the piece's record, its layout and its destination
(``resolve_tensor``), then ``commit_tensor``. At 590 pieces a rank that was ~25 ms of a
2-process warm load of ~110 ms, on a core the reads need. Where both ends are ours, the
reader offers to take columns (``ReaderMode.takes_columns`` in its local plan's
``storage_data``) and the planner's per-item hooks are its own (so skipping them changes
nothing), the planner puts its pieces in the final plan's ``planner_data`` as this
object: index rows, boxes, and the memory each destination's reads land in. Any other
reader gets the same pieces as ``ReadItem``s (``read_items``), in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from dcp_ext.runtime.frozen import frozen

Box = tuple[int, ...]


@dataclass(frozen=True, eq=False)
class TensorReads:
    """Pieces of tensor destinations read from an index load's records.

    Per destination (a local shard: ``shard`` numbers them): its key, DCP's chunk for it
    and the chunk's place in the key's local chunk list, the saved dtype, and the tensor
    its reads land in (``ShardLoadPlanner.resolve_tensor``'s for the whole shard; None:
    through the planner). Per piece, in DCP's order (shard by shard): the index row of
    the saved chunk, the chunk's place among its key's chunks, its offsets and sizes, and
    the box (DCP's ``dest_offsets``, ``storage_offsets``, ``lengths``).
    """

    keys: Any  # the IndexedKeys planned from: a reader takes only columns of its own index
    fqns: list[str]
    chunks: list[ChunkStorageMetadata]
    chunk_places: list[int]
    dtypes: list[torch.dtype]
    landings: list[torch.Tensor | None]
    shard: list[int]
    rows: list[int]
    places: list[int]
    saved_offsets: list[Box]
    saved_sizes: list[Box]
    dest_offsets: list[Box]
    storage_offsets: list[Box]
    lengths: list[Box]

    @staticmethod
    def empty() -> TensorReads:
        return TensorReads(None, *([] for _ in range(13)))

    def __len__(self) -> int:
        return len(self.rows)

    def fqn(self, piece: int) -> str:
        return self.fqns[self.shard[piece]]

    def read_item(self, piece: int) -> ReadItem:
        """DCP's ``ReadItem`` of a piece (``_create_read_item_for_tensor``'s fields), built
        without the dataclass constructors (``frozen``)."""
        s = self.shard[piece]
        fqn = self.fqns[s]
        return frozen(
            ReadItem,
            type=LoadItemType.TENSOR,
            dest_index=frozen(MetadataIndex, fqn=fqn, offset=self.chunks[s].offsets, index=self.chunk_places[s]),
            dest_offsets=torch.Size(self.dest_offsets[piece]),
            storage_index=frozen(MetadataIndex, fqn=fqn, offset=torch.Size(self.saved_offsets[piece]), index=self.places[piece]),
            storage_offsets=torch.Size(self.storage_offsets[piece]),
            lengths=torch.Size(self.lengths[piece]),
        )

    def read_items(self) -> list[ReadItem]:
        return [self.read_item(piece) for piece in range(len(self))]

    def destination(self, piece: int) -> torch.Tensor:
        """The memory a piece lands in: its box of the shard's landing tensor (narrowed as
        DCP's ``narrow_tensor_by_index`` does); only for a shard that has one."""
        whole = self.landings[self.shard[piece]]
        if whole is None:
            raise ValueError(f"piece {piece} of {self.fqn(piece)!r} lands where the planner resolves it (read it as a ReadItem)")
        lengths = self.lengths[piece]
        if whole.shape == lengths and not any(self.dest_offsets[piece]):
            return whole
        for dim, (start, length) in enumerate(zip(self.dest_offsets[piece], lengths)):
            if length < whole.size(dim):
                whole = whole.narrow(dim, start, length)
        return whole
