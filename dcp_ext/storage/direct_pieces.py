"""The pieces of a plan's columns (``read_columns``) that ``ShardReader`` reads without a
ReadItem, as columns, and the stretch of each file a load reads.

A direct piece is one whose record's layout the index gives (no parse, no decode) and
whose memory the planner handed over. Where its records lie, in which file and how far
each file is read are numpy columns (``IndexedItems.locations``), not a StoredItem per
piece: a rank built, sorted and walked those objects in five passes (a StoredItem each,
the checks of the files, the page-cache probe, the request order). Warm loads of our
checkpoints, old and new alternating: 0.54 GB at 2 processes (590 pieces a rank) paired
0.953-0.985, 1.07 GB in one process 0.970, 0.12 GB 0.981.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from dcp_ext.formats.index import IndexedItems, RowLocations, StoredItem
from dcp_ext.storage.read_columns import TensorReads
from dcp_ext.storage.read_plan import SLAB_BYTES, lands_straight


class FileSpan(NamedTuple):
    """The stretch of one file a load reads, from its first record's start to the end of
    the record reaching furthest, whose key an error about the file names."""

    start: int
    end: int
    key: str


def record_spans(records: Iterable[tuple[str, StoredItem]], spans: dict[str, FileSpan] | None = None) -> dict[str, FileSpan]:
    """The spans of the files of (key, record) pairs, added to ``spans``."""
    spans = {} if spans is None else spans
    for key, record in records:
        end = record.offset + record.length
        known = spans.get(record.relative_path)
        if known is None:
            spans[record.relative_path] = FileSpan(record.offset, end, key)
        elif record.offset < known.start or end > known.end:
            far = (end, key) if end > known.end else (known.end, known.key)
            spans[record.relative_path] = FileSpan(min(known.start, record.offset), *far)
    return spans


@dataclass(frozen=True, eq=False)
class DirectPieces:
    """Pieces of a plan's columns read without a ReadItem: their numbers in ``reads``,
    where their records lie, and for each the landing tensor it is read straight into
    as a whole record (``StraightRecords``; None: through its layout,
    ``ShardReader._direct_requests``). Each file's pieces come in record order."""

    reads: TensorReads
    pieces: list[int]
    straight: list[torch.Tensor | None]
    filled: frozenset[str]  # keys whose one shard one piece fills whole (the shard's only piece)
    partial: list[int]  # positions of the other pieces: the fill check adds up only these
    offsets: list[int]  # each piece's record's first byte in its file
    payloads: list[int]  # each piece's first tensor byte in its file
    by_file: dict[str, list[int]]  # positions (into ``pieces``) per file, in record order
    spans: dict[str, FileSpan]
    nbytes: int  # of the records, all of them
    items: IndexedItems | None  # where a piece's StoredItem comes from (``record``)

    @staticmethod
    def none() -> DirectPieces:
        return DirectPieces(TensorReads.empty(), [], [], frozenset(), [], [], [], {}, {}, 0, None)

    def __len__(self) -> int:
        return len(self.pieces)

    def fqn(self, position: int) -> str:
        return self.reads.fqn(self.pieces[position])

    def record(self, position: int) -> StoredItem:
        """The stored item of a piece read through its layout (a few; most go straight)."""
        assert self.items is not None
        return self.items.row_item(self.reads.rows[self.pieces[position]], self.fqn(position))


def direct_pieces(reads: TensorReads, items: IndexedItems, verify: bool) -> tuple[list[int], DirectPieces]:
    """The pieces of ``reads`` (columns made from the index ``items`` belongs to) that go
    as ReadItems, and the direct ones: those of a shard with a landing tensor whose record
    has its payload's place recorded, is stored plain (no stream transform) and, when
    ``verify``, carries a CRC32C."""
    shard = np.asarray(reads.shard, np.int64)
    where = items.locations(np.asarray(reads.rows, np.int64))
    landed = np.fromiter((landing is not None for landing in reads.landings), bool, len(reads.landings))
    direct = landed[shard] & (where.payload >= 0) & ~where.transformed
    if verify:
        direct &= where.has_checksum
    chosen = np.flatnonzero(direct)
    pieces = chosen.tolist()
    alone = (np.bincount(shard, minlength=len(reads.landings)) == 1)[shard[chosen]].tolist()  # the shard's only piece
    landings, lengths, saved, dtypes, fqns = reads.landings, reads.lengths, reads.saved_sizes, reads.dtypes, reads.fqns
    straight: list[torch.Tensor | None] = []
    filled: list[str] = []
    partial: list[int] = []
    for position, (piece, s, only) in enumerate(zip(pieces, shard[chosen].tolist(), alone)):
        landing = landings[s]
        assert landing is not None
        # a whole chunk filling a whole shard (most pieces): no layout to build, nothing to add up
        whole = lengths[piece] == saved[piece] == landing.shape
        if whole and only:
            filled.append(fqns[s])
        else:
            partial.append(position)
        straight.append(landing if not verify and whole and landing.nbytes <= SLAB_BYTES and lands_straight(landing, dtypes[s]) else None)
    by_file, spans = _files(reads, items, chosen, where)
    located = DirectPieces(reads, pieces, straight, frozenset(filled), partial, where.offset[chosen].tolist(),
                           where.payload[chosen].tolist(), by_file, spans, int(where.length[chosen].sum()), items)
    return np.flatnonzero(~direct).tolist(), located


def _files(reads: TensorReads, items: IndexedItems, chosen: np.ndarray, where: RowLocations) -> tuple[dict[str, list[int]], dict[str, FileSpan]]:
    """Per file of the chosen pieces: their positions in record order, and its span."""
    file, start = where.file[chosen], where.offset[chosen]
    end = start + where.length[chosen]
    order = np.lexsort((start, file))  # stable: pieces of one record stay in plan order
    bounds = [0, *(np.flatnonzero(np.diff(file[order])) + 1).tolist(), len(order)] if len(order) else [0]
    by_file: dict[str, list[int]] = {}
    spans: dict[str, FileSpan] = {}
    for first, stop in zip(bounds, bounds[1:]):
        positions = order[first:stop]
        furthest = int(positions[np.argmax(end[positions])])
        key = reads.fqn(int(chosen[furthest]))
        name = items.file_name(int(file[positions[0]]), key)
        by_file[name] = positions.tolist()
        spans[name] = FileSpan(int(start[positions[0]]), int(end[furthest]), key)
    return by_file, spans
