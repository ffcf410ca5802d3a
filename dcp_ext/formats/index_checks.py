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

    def stacked(self, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows of keys ``ks`` (a key may repeat) one key after another, and where each
        key's rows begin among them (``len(ks) + 1`` bounds)."""
        first, counts = self.bounds[ks], self.bounds[ks + 1] - self.bounds[ks]
        bounds = np.concatenate([[0], np.cumsum(counts)])
        if len(ks) and bool((first[1:] == first[:-1] + counts[:-1]).all()):  # adjacent keys: a view
            return self.order[first[0] : first[0] + bounds[-1]], bounds
        return self.order[np.arange(bounds[-1]) + np.repeat(first - bounds[:-1], counts)], bounds


def row_span(rows: np.ndarray) -> slice | np.ndarray:
    """``rows`` as a slice when they are consecutive and ascending, as a key's rows (and
    several keys' rows in key order) are in an index our writer wrote: columns are then
    read as views, not gathered."""
    n = len(rows)
    if n and int(rows[-1]) - int(rows[0]) == n - 1 and (n < 3 or bool((np.diff(rows) == 1).all())):
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
    ``copies_of`` the canonical group's checks) key by key, once each, before a key is
    used: a load that never reads a copy never checks one. Many keys are checked together,
    a few numpy passes over their rows (one key at a time, numpy's fixed costs are ~25 us a
    key: a tenth of a second for a rank loading 3,000 keys): those a load plan asks for
    (``check_stacked``), and when the index opens, the keys with one canonical chunk (most
    keys of a small checkpoint). Raises CorruptCheckpointError naming the source, the key
    and what was expected."""

    def __init__(self, keys: _Keys, cols: _Columns, groups: KeyGroups, source: str, copies_of: KeyChecks | None = None) -> None:
        self._keys, self._cols, self._groups, self._source = keys, cols, groups, source
        self._canonical = copies_of
        self._done = bytearray(len(keys.names))  # racing threads may both check a key: harmless
        self._plain = not bool((cols.transforms >= 0).any())  # no compressed record anywhere
        if copies_of is None:
            self.ensure_all(np.flatnonzero(np.diff(groups.bounds) == 1))

    def ensure(self, k: int) -> None:
        if not self._done[k]:
            self.ensure_all(np.array([k]))

    def ensure_all(self, ks: np.ndarray) -> None:
        """``ensure`` for each of keys ``ks``."""
        done = np.frombuffer(self._done, np.uint8)
        wanted = np.zeros(len(done), bool)
        wanted[ks] = True
        todo = np.flatnonzero(wanted & (done == 0) & self._keys.is_tensor)  # not np.unique: it imports numpy.ma (11 ms)
        ndim = self._keys.ndim[todo]
        for nd in np.flatnonzero(np.bincount(ndim)).tolist():
            of_nd = todo[ndim == nd]
            rows, bounds = self._groups.stacked(of_nd)
            self.check_stacked(of_nd, rows, bounds, *chunk_boxes(self._cols, rows, nd))
        done[ks] = 1

    def check_stacked(self, ks: np.ndarray, rows: np.ndarray, bounds: np.ndarray, off: np.ndarray, size: np.ndarray) -> None:
        """Checks tensor keys ``ks`` (of one ndim; a key may repeat), unless all are checked,
        from their rows stacked key after key (``KeyGroups.stacked``) and those rows' boxes."""
        done = np.frombuffer(self._done, np.uint8)
        if done[ks].all():
            return
        counts = np.diff(bounds)
        shapes = self._keys.extents[self._keys.shape_start[ks][:, None] + np.arange(off.shape[1])]
        self._check_rows(np.repeat(ks, counts), rows, np.repeat(shapes, counts, axis=0), off, size)
        if self._canonical is None:
            self._check_unique(ks, bounds, off, shapes)
        else:
            self._canonical.ensure_all(ks)
            for i, k in enumerate(ks.tolist()):  # copies: few keys have them
                self._check_copies(k, self._canonical.offsets(k), off[bounds[i] : bounds[i + 1]], shapes[i])
        done[ks] = 1

    def offsets(self, k: int) -> np.ndarray:
        """The chunk offsets of tensor key ``k``'s rows in this group, (rows, ndim)."""
        return chunk_boxes(self._cols, self._groups.rows(k), int(self._keys.ndim[k]))[0]

    def _check_rows(self, key: np.ndarray, rows: np.ndarray, shape: np.ndarray, off: np.ndarray, size: np.ndarray) -> None:
        """Each row's chunk (``off``, ``size``) lies inside its tensor (``shape``, one per
        row) and its plain record holds the chunk's bytes after its payload start (a
        compressed record may be any size: its decoding is bounded instead). ``key``: each
        row's key."""
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

    def _fqn(self, key: np.ndarray, n: int) -> str:
        """The name of row ``n``'s key."""
        return self._keys.names[int(key[n])]

    def _check_unique(self, ks: np.ndarray, bounds: np.ndarray, off: np.ndarray, shapes: np.ndarray) -> None:
        """No two canonical rows of a key at one offset (``off``: keys ``ks``' rows, key
        ``i``'s at ``bounds[i]:bounds[i + 1]``). Our writer stores a key's chunks in offset
        order, so strictly increasing offset codes need no sort; a key whose codes are not,
        or do not fit 63 bits, is sorted."""
        counts = np.diff(bounds)
        codes, fits = _chunk_codes(off, shapes, counts)
        key_of_row = np.repeat(np.arange(len(ks)), counts)
        unordered = (key_of_row[1:] == key_of_row[:-1]) & (codes[1:] <= codes[:-1])
        suspect = ~fits & (counts > 1)
        suspect[key_of_row[1:][unordered]] = True
        for i in np.flatnonzero(suspect).tolist():
            keyed = off[bounds[i] : bounds[i + 1]]
            ordered = keyed[np.lexsort(keyed.T[::-1])] if keyed.shape[1] else keyed  # 0-d: every row at ()
            same = (ordered[1:] == ordered[:-1]).all(axis=1)
            if same.any():
                at = ordered[int(np.argmax(same))].tolist()
                raise CorruptCheckpointError(f"{self._source}: key {self._keys.names[int(ks[i])]!r} has two index rows at offset {at}")

    def _check_copies(self, k: int, canonical: np.ndarray, copies: np.ndarray, shape: np.ndarray) -> None:
        """Every TP-replica copy row copies one of the key's canonical chunks."""
        codes, fits = _chunk_codes(np.concatenate([canonical, copies]), shape[None], np.array([len(canonical) + len(copies)]))
        if fits[0]:
            known, wanted = np.sort(codes[: len(canonical)]), codes[len(canonical) :]
            at = np.minimum(np.searchsorted(known, wanted), len(known) - 1) if len(known) else None
            orphan = at is None or bool((known[at] != wanted).any())
        else:
            known_rows = set(map(tuple, canonical.tolist()))
            orphan = not all(tuple(offsets) in known_rows for offsets in copies.tolist())
        if orphan:
            raise CorruptCheckpointError(f"{self._source}: replica copies of {self._keys.names[k]!r} have no canonical chunk")


def _chunk_codes(off: np.ndarray, shapes: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's offsets as one int64 in mixed radix (its key's shape + 1 per dim), which
    orders a key's chunks like their offsets, and whether each key's radix fits 63 bits
    (the codes of a key whose radix does not are meaningless). Key ``i`` has shape
    ``shapes[i]`` and the next ``counts[i]`` rows of ``off``."""
    keys, nd = shapes.shape
    codes = np.zeros(len(off), np.int64)
    if nd == 0:
        return codes, np.ones(keys, bool)
    fits = np.prod(shapes.astype(float) + 1, axis=1) < 2.0**62  # float: a product cannot wrap; rounding stays below 2**63
    radix = np.ones_like(shapes)
    radix[:, :-1] = np.cumprod(shapes[:, :0:-1] + 1, axis=1)[:, ::-1]  # wraps only where it does not fit
    row_radix = np.repeat(radix, counts, axis=0)
    for d in range(nd):
        codes += off[:, d] * row_radix[:, d]
    return codes, fits
