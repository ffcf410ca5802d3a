"""Checks of an index key's chunk rows, made the first time the key is used.

At a million chunks, checking every row of the job when the index opens costs each rank
~0.6 s and ~150 MB of temporaries, though a rank reads a few thousand of those chunks.
The decoder checks per row what is cheap in one pass (dictionary codes, byte ranges,
that each tensor row has one offset and one size per dimension); what needs a key's shape
and its other rows (chunks inside the tensor, records large enough, no two chunks at one
offset, every TP-replica copy copying a chunk) is checked here, for all rows of a key at
once, before any lookup answers from that key. So a load pays for the keys it asks
about, a corrupt row still never reaches a read, and ``dcp-ext verify`` (which asks about
every key) checks them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from dcp_ext.errors import CorruptCheckpointError
from dcp_ext.formats.faults import chunk_outside_tensor, record_too_small

if TYPE_CHECKING:
    from dcp_ext.formats.index import _Columns, _Keys

INT64_MAX = np.iinfo(np.int64).max  # what _Keys caps the extents at, which chunks are checked against


class KeyGroups(NamedTuple):
    """Rows of the index (canonical, or TP-replica copies) grouped by key."""

    order: np.ndarray  # row numbers, key by key, ascending within a key
    bounds: np.ndarray  # key k's rows are order[bounds[k] : bounds[k + 1]]

    @classmethod
    def of(cls, key: np.ndarray, rows: np.ndarray, keys: int) -> KeyGroups:
        """``rows`` stably grouped by ``key`` (our writer already writes them so: no sort)."""
        row_keys = key[rows]
        if len(rows) > 1 and np.any(row_keys[1:] < row_keys[:-1]):
            rows = rows[np.argsort(row_keys, kind="stable")]
            row_keys = key[rows]
        order = rows.astype(np.int32) if len(rows) < 2**31 else rows
        return cls(order, np.concatenate([[0], np.cumsum(np.bincount(row_keys, minlength=keys))]))

    def rows(self, k: int) -> np.ndarray:
        return self.order[self.bounds[k] : self.bounds[k + 1]]


def row_span(rows: np.ndarray) -> slice | np.ndarray:
    """``rows`` (ascending and distinct: then first and last tell) as a slice when they are
    consecutive, as a key's rows are in an index our writer wrote: columns are then read
    as views, not gathered."""
    if len(rows) and int(rows[-1]) - int(rows[0]) == len(rows) - 1:
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows


def chunk_boxes(cols: _Columns, rows: np.ndarray, nd: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, sizes) of ``rows``, (rows, nd) int64 each, from the Arrow list values (the
    decoder checked that each tensor row holds its key's ndim of each, so the values of
    consecutive rows of one ndim are one run: a view)."""
    span = row_span(rows)
    if isinstance(span, slice):
        first, count = int(rows[0]), len(rows) * nd
        off_at, size_at = int(cols.off_start[first]), int(cols.size_start[first])
        return (
            cols.off_values[off_at : off_at + count].reshape(len(rows), nd),
            cols.size_values[size_at : size_at + count].reshape(len(rows), nd),
        )
    dims = np.arange(nd)
    return cols.off_values[cols.off_start[rows][:, None] + dims], cols.size_values[cols.size_start[rows][:, None] + dims]


class KeyChecks:
    """Checks the rows of one group (the canonical chunks, or the TP-replica copies,
    ``copies_of`` the canonical group's checks) key by key, once each, on ``ensure(k)``:
    a load that never reads a copy never checks one. Keys with one canonical chunk (most
    keys of a small checkpoint) are checked together when the index opens: one at a time,
    numpy's fixed costs would be most of a small load's planning. Raises
    CorruptCheckpointError naming the source, the key and what was expected."""

    def __init__(self, keys: _Keys, cols: _Columns, groups: KeyGroups, source: str, copies_of: KeyChecks | None = None) -> None:
        self._keys, self._cols, self._groups, self._source = keys, cols, groups, source
        self._canonical = copies_of
        self._done = bytearray(len(keys.names))  # racing threads may both check a key: harmless
        self._plain = not bool((cols.transforms >= 0).any())  # no compressed record anywhere
        if copies_of is None:
            self._check_single_chunks()

    def ensure(self, k: int) -> None:
        if not self._done[k]:
            if self._keys.is_tensor[k]:
                self._check_key(k)
            self._done[k] = 1

    def offsets(self, k: int) -> np.ndarray:
        """The chunk offsets of tensor key ``k``'s rows in this group, (rows, ndim)."""
        return chunk_boxes(self._cols, self._groups.rows(k), int(self._keys.ndim[k]))[0]

    def _check_single_chunks(self) -> None:
        keys, groups = self._keys, self._groups
        single = np.flatnonzero((np.diff(groups.bounds) == 1) & keys.is_tensor)
        for nd in np.unique(keys.ndim[single]).tolist():
            of_nd = single[keys.ndim[single] == nd]
            rows = groups.order[groups.bounds[of_nd]]
            ascending = np.argsort(rows, kind="stable")  # row_span's precondition (another writer's row order)
            of_nd, rows = of_nd[ascending], rows[ascending]
            shapes = keys.extents[keys.shape_start[of_nd][:, None] + np.arange(nd)]
            self._check_rows(of_nd, rows, shapes)
        np.frombuffer(self._done, np.uint8)[single] = 1  # one row: unique by itself

    def _check_key(self, k: int) -> None:
        start = int(self._keys.shape_start[k])
        shape = self._keys.extents[start : start + int(self._keys.ndim[k])]
        off = self._check_rows(k, self._groups.rows(k), shape)
        if self._canonical is None:
            self._check_unique(k, off, _chunk_codes(off, shape))
        else:
            self._canonical.ensure(k)
            self._check_copies(k, self._canonical.offsets(k), off, shape)

    def _check_rows(self, key: int | np.ndarray, rows: np.ndarray, shape: np.ndarray) -> np.ndarray:
        """Each row's chunk lies inside its tensor (``shape``: (ndim,), or one per row) and
        its plain record holds the chunk's bytes after its payload start (a compressed
        record may be any size: its decoding is bounded instead). ``key``: the rows' key,
        or each row's. Returns the offsets."""
        off, size = chunk_boxes(self._cols, rows, shape.shape[-1])
        if ((off | size) < 0).any() or (off > shape - size).any():  # size >= 0 there: no overflow
            n = int(np.argmax(((off | size) < 0).any(axis=1) | (off > shape - size).any(axis=1)))
            fqn = self._fqn(key, n)
            raise chunk_outside_tensor(self._source, fqn, off[n].tolist(), size[n].tolist(), self._keys.state[fqn].size)
        cols, span = self._cols, row_span(rows)
        need = np.ones(len(rows)) * self._keys.itemsize[key]  # float: a forged size cannot wrap
        for extent in size.T:  # column by column: numpy's per-row reductions cost ~20 us a key
            need *= extent
        offset, length, payload = cols.offset[span], cols.length[span], cols.payload[span]
        short = need > length - np.where(payload >= 0, payload - offset, 0)  # the decoder checked offset <= payload <= end
        if not self._plain:
            short &= cols.transforms[span] < 0
        if short.any():
            n = int(np.argmax(short))
            raise record_too_small(
                self._source, self._fqn(key, n), off[n].tolist(), int(need[n]), cols.file_names.name(int(cols.file[int(rows[n])]), self._fqn(key, n)),
                int(offset[n]), int(length[n]), int(payload[n]),
            )
        return off

    def _fqn(self, key: int | np.ndarray, n: int) -> str:
        """The name of row ``n``'s key."""
        return self._keys.names[int(key if np.ndim(key) == 0 else key[n])]

    def _check_unique(self, k: int, off: np.ndarray, codes: np.ndarray | None) -> None:
        """No two canonical rows at one offset. Our writer stores a key's chunks in offset
        order, so strictly increasing codes need no sort."""
        if len(off) < 2 or (codes is not None and bool((codes[1:] > codes[:-1]).all())):
            return
        ordered = off[np.lexsort(off.T[::-1])] if off.shape[1] else off  # 0-d: every row at ()
        same = (ordered[1:] == ordered[:-1]).all(axis=1)
        if same.any():
            at = ordered[int(np.argmax(same))].tolist()
            raise CorruptCheckpointError(f"{self._source}: key {self._keys.names[k]!r} has two index rows at offset {at}")

    def _check_copies(self, k: int, canonical: np.ndarray, copies: np.ndarray, shape: np.ndarray) -> None:
        """Every TP-replica copy row copies one of the key's canonical chunks."""
        known, wanted = _chunk_codes(canonical, shape), _chunk_codes(copies, shape)
        if known is not None and wanted is not None:
            known = np.sort(known)
            at = np.minimum(np.searchsorted(known, wanted), len(known) - 1) if len(known) else None
            orphan = at is None or bool((known[at] != wanted).any())
        else:
            known_rows = set(map(tuple, canonical.tolist()))
            orphan = not all(tuple(offsets) in known_rows for offsets in copies.tolist())
        if orphan:
            raise CorruptCheckpointError(f"{self._source}: replica copies of {self._keys.names[k]!r} have no canonical chunk")


def _chunk_codes(off: np.ndarray, shape: np.ndarray) -> np.ndarray | None:
    """Each chunk's offsets as one int64 in mixed radix (shape + 1 per dim), which orders
    like the offsets themselves; None when the radix does not fit 63 bits."""
    radix, place = [], 1
    for extent in reversed(shape.tolist()):
        radix.append(place)
        place *= extent + 1
    if place > INT64_MAX:
        return None
    return off @ np.array(radix[::-1], np.int64) if off.shape[1] else np.zeros(len(off), np.int64)
