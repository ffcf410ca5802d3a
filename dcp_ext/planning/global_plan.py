"""The coordinator's save planning over ``PlanTable`` columns, built for 10,000+ ranks.

Ranks with identical tables (data-parallel replicas) form one group and are planned once.
The distinct tables' rows are sorted once into unique chunks ("boxes"); everything after
that is a pass over boxes, not over ranks x items:

* validation: per key, a grid test (the distinct intervals along each dim partition the
  dim and every combination occurs once) settles the common case in numpy; other layouts
  go through a sweep that finds partial overlaps (nonuniform TP: refined, see
  ``dedup.refine_items``) or bounds/volume errors like DCP's own validation;
* replica check: chunk digests compared per group member and across groups;
* balanced dedup: boxes held by the same set of groups form a class; after every box with
  a single holder has been counted, each class's boxes (largest first) fill its members up
  to a common level of bytes (``_fill``), heaviest classes first;
* TP-replica copies (``replica_locality``) assigned the same way per TP coordinate;
* DCP ``Metadata`` with every key's chunks in offset order.

Each rank gets back row numbers into its own table (``RankAssignment``), not WriteItems.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.device_mesh import DeviceMesh

from dcp_ext.errors import InvalidRequestError
from dcp_ext.runtime.gc_pause import gc_paused
from dcp_ext.formats.index import torch_sizes
from dcp_ext.observe import PhaseClock
from dcp_ext.planning.dedup import Cuts, boundaries, partially_overlap, refine_items
from dcp_ext.planning.plan_table import PlanTable, TensorFacts, items_from_table, table_from_items
from dcp_ext.planning.replica_check import ReplicaMismatchError, mismatch_message

if TYPE_CHECKING:
    from dcp_ext.planning.replica_units import ReplicaUnits

NO_TP = -1


@dataclasses.dataclass(frozen=True, eq=False)
class RankAssignment:
    """What one rank writes: rows of its table (after ``cuts``), with DCP's index hint for
    each, and rows it writes again as TP-replica copies for TP coordinate ``copy_tp``."""

    rows: np.ndarray
    hints: np.ndarray
    copy_rows: np.ndarray
    copy_tp: np.ndarray
    cuts: Cuts | None
    units: ReplicaUnits | None = None  # of the rank's group: how to hash its digests in the next save


@dataclasses.dataclass(frozen=True, eq=False)
class GlobalPlan:
    assignments: list[RankAssignment]
    metadata: Metadata
    seconds: dict[str, float]  # per planning phase
    counts: dict[str, int]  # ranks, distinct tables, rows, unique chunks, ...
    structure: _Structure  # of the declared rows, so a cached plan can re-run the replica check
    classes: _Classes | None = None  # holder classes of ``structure``'s boxes (None: refined, not kept)


@dataclasses.dataclass(frozen=True, eq=False)
class _Groups:
    tables: list[PlanTable]  # one per group of ranks with identical tables
    of_rank: np.ndarray  # group of each rank
    members: list[np.ndarray]  # ranks of each group, ascending


@dataclasses.dataclass(frozen=True, eq=False)
class _Rows:
    """The distinct tables' rows, concatenated; keys interned across tables."""

    names: list[str]
    facts: list[TensorFacts | None]
    mappings: Any
    gid: np.ndarray
    lrow: np.ndarray
    fqn: np.ndarray
    ndim: np.ndarray
    off: np.ndarray
    size: np.ndarray
    nbytes: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class _Boxes:
    """Unique (key, offsets, sizes) over the rows, in (key, offsets, sizes) order."""

    order: np.ndarray  # rows sorted by box, then group
    box_of_sorted: np.ndarray  # box of each sorted row
    starts: np.ndarray  # first sorted row of each box
    ends: np.ndarray
    fqn: np.ndarray
    ndim: np.ndarray
    off: np.ndarray
    size: np.ndarray
    weight: np.ndarray  # bytes, at least 1 (non-tensor items count as tiny, not free)
    tensor: np.ndarray  # bool
    key_starts: np.ndarray  # first box of each key
    key_ends: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class _Structure:
    groups: _Groups
    rows: _Rows
    boxes: _Boxes


PLAN_PHASES = ("group", "concat", "sort", "validate", "replica_check", "refine", "balance", "locality", "assign", "metadata")


def plan_globally(
    tables: Sequence[PlanTable],
    *,
    chunk_digests: Sequence[np.ndarray | None] | None = None,
    tp_ranks: Sequence[int | None] | None = None,
    mesh: DeviceMesh | None = None,
) -> GlobalPlan:
    """Global plan for ranks whose local plans are ``tables``.

    ``chunk_digests[rank]``: (rows, 2) uint64 per row of the rank's table, zero where there
    is nothing to compare; conflicting replicas raise ReplicaMismatchError. ``tp_ranks``:
    each rank's tensor-parallel coordinate; given, replicated tensors get one copy per TP
    coordinate holding them.
    """
    clock = PhaseClock(PLAN_PHASES)
    with clock.phase("group"):
        groups = _group_ranks(tables)
    structure, cuts = _structure(groups, clock, multi_rank=len(tables) > 1)
    declared = structure  # the rows the ranks sent, which their chunk digests describe
    if chunk_digests is not None:
        with clock.phase("replica_check"):
            check_replicas(declared, chunk_digests, mesh)
    if cuts:
        with clock.phase("refine"):
            refined = [table_from_items(refine_items(items_from_table(t), cuts), t.mappings) for t in groups.tables]
            groups = dataclasses.replace(groups, tables=refined)
        structure, again = _structure(groups, clock, multi_rank=len(tables) > 1)
        assert not again, "refined chunks still overlap"
    result = _assign(structure, cuts, tp_ranks, clock)
    return dataclasses.replace(result, structure=declared, classes=None if cuts else result.classes)


def _structure(groups: _Groups, clock: PhaseClock, *, multi_rank: bool) -> tuple[_Structure, Cuts]:
    with clock.phase("concat"):
        rows = _concat(groups.tables)
    with clock.phase("sort"):
        boxes = _unique_boxes(rows)
    with clock.phase("validate"):
        cuts = _validate(rows, boxes, multi_rank)
    return _Structure(groups, rows, boxes), cuts


def _assign(structure: _Structure, cuts: Cuts, tp_ranks: Sequence[int | None] | None, clock: PhaseClock) -> GlobalPlan:
    groups, rows, boxes = structure.groups, structure.rows, structure.boxes
    ranks = len(groups.of_rank)
    with clock.phase("balance"):
        classes = holder_classes(groups, rows, boxes)
        load = np.zeros(ranks, np.int64)
        writer = _balance(classes, boxes.weight, load)
        writer_row = _row_of(structure, np.arange(len(boxes.fqn)), writer)
    copy_box = copy_rank = copy_tp = np.zeros(0, np.int64)
    if tp_ranks is not None:
        with clock.phase("locality"):
            tp = np.array([NO_TP if t is None else t for t in tp_ranks], np.int64)
            refined_keys = {n for n, name in enumerate(rows.names) if name in cuts}
            copy_box, copy_rank, copy_tp = _replica_copies(classes, boxes, writer, tp, load, refined_keys)
    with clock.phase("assign"):
        hints = np.arange(len(boxes.fqn)) - np.repeat(boxes.key_starts, boxes.key_ends - boxes.key_starts)
        written = _per_rank(ranks, writer, writer_row, hints)
        copies = _per_rank(ranks, copy_rank, _row_of(structure, copy_box, copy_rank), copy_tp)
        shared_cuts = cuts or None
        assignments = [RankAssignment(w[0], w[1], c[0], c[1], shared_cuts) for w, c in zip(written, copies)]
    with clock.phase("metadata"):
        metadata = _metadata(rows, boxes)
    counts = {
        "ranks": ranks,
        "distinct_tables": len(groups.tables),
        "rows": len(rows.gid),
        "rank_rows": int(sum(len(t) * len(m) for t, m in zip(groups.tables, groups.members))),
        "unique_chunks": len(boxes.fqn),
        "keys": len(boxes.key_starts),
        "copies": len(copy_box),
        "max_rank_bytes": int(load.max(initial=0)),
        "mean_rank_bytes": int(load.mean()) if ranks else 0,
    }
    return GlobalPlan(assignments, metadata, clock.seconds, counts, structure, classes)


# -- grouping and rows ------------------------------------------------------------------


def _group_ranks(tables: Sequence[PlanTable]) -> _Groups:
    index: dict[bytes, int] = {}
    distinct: list[PlanTable] = []
    of_rank = np.empty(len(tables), np.int64)
    for rank, table in enumerate(tables):
        group = index.setdefault(table.digest, len(distinct))
        if group == len(distinct):
            distinct.append(table)
        of_rank[rank] = group
    order = np.argsort(of_rank, kind="stable")
    members = np.split(order, np.cumsum(np.bincount(of_rank, minlength=len(distinct)))[:-1])
    return _Groups(distinct, of_rank, members)


def _concat(tables: list[PlanTable]) -> _Rows:
    ids: dict[str, int] = {}
    facts: list[TensorFacts | None] = []
    lookups: dict[bytes, np.ndarray] = {}  # keys_digest -> local key id -> global key id
    mappings: dict[Any, Any] | None = None
    for table in tables:
        if table.keys_digest in lookups:
            continue
        lookups[table.keys_digest] = np.fromiter(
            (_intern(ids, facts, fqn, fact) for fqn, fact in zip(table.fqns, table.facts)), np.int64, len(table.fqns)
        )
        if table.mappings is not None:
            mappings = {**(mappings or {}), **table.mappings}
    dims = max((t.offsets.shape[1] for t in tables), default=1)
    return _Rows(
        names=list(ids),
        facts=facts,
        mappings=mappings,
        gid=np.repeat(np.arange(len(tables)), [len(t) for t in tables]),
        lrow=np.concatenate([np.arange(len(t)) for t in tables] or [np.zeros(0, np.int64)]),
        fqn=np.concatenate([lookups[t.keys_digest][t.fqn_id] for t in tables] or [np.zeros(0, np.int64)]),
        ndim=np.concatenate([t.ndim for t in tables] or [np.zeros(0, np.int8)]),
        off=_stack_padded([t.offsets for t in tables], dims, 0),
        size=_stack_padded([t.sizes for t in tables], dims, 1),
        nbytes=np.concatenate([t.nbytes for t in tables] or [np.zeros(0, np.int64)]),
    )


def _intern(ids: dict[str, int], facts: list[TensorFacts | None], fqn: str, fact: TensorFacts | None) -> int:
    n = ids.get(fqn)
    if n is None:
        ids[fqn] = n = len(facts)
        facts.append(fact)
    elif facts[n] != fact:
        raise InvalidRequestError(
            f"Failed to validate global plan: key {fqn!r} is declared with different tensor facts by "
            f"different ranks: {_describe(facts[n])} vs {_describe(fact)}"
        )
    return n


def _describe(fact: TensorFacts | None) -> str:
    return "a non-tensor item" if fact is None else f"size {list(fact[1])} dtype {fact[0].dtype}"


def _stack_padded(arrays: list[np.ndarray], dims: int, fill: int) -> np.ndarray:
    out = np.full((sum(len(a) for a in arrays), dims), fill, np.int64)
    row = 0
    for a in arrays:
        out[row : row + len(a), : a.shape[1]] = a
        row += len(a)
    return out


def _unique_boxes(rows: _Rows) -> _Boxes:
    dims = rows.off.shape[1]
    keys = [rows.gid, *(rows.size[:, d] for d in reversed(range(dims)))]
    keys += [*(rows.off[:, d] for d in reversed(range(dims))), rows.ndim, rows.fqn]
    order = np.lexsort(keys)
    matrix = np.column_stack([rows.fqn, rows.ndim, rows.off, rows.size])[order]
    new = np.ones(len(order), bool)
    new[1:] = np.any(matrix[1:] != matrix[:-1], axis=1)
    starts = np.flatnonzero(new)
    first = order[starts]
    fqn = rows.fqn[first]
    key_new = np.ones(len(starts), bool)
    key_new[1:] = fqn[1:] != fqn[:-1]
    key_starts = np.flatnonzero(key_new)
    tensor = np.array([rows.facts[k] is not None for k in fqn[key_starts].tolist()], bool)
    return _Boxes(
        order=order,
        box_of_sorted=np.cumsum(new) - 1,
        starts=starts,
        ends=np.append(starts[1:], len(order)),
        fqn=fqn,
        ndim=rows.ndim[first],
        off=rows.off[first],
        size=rows.size[first],
        weight=np.maximum(rows.nbytes[first], 1),
        tensor=np.repeat(tensor, np.diff(np.append(key_starts, len(starts)))),
        key_starts=key_starts,
        key_ends=np.append(key_starts[1:], len(starts)),
    )


# -- validation -------------------------------------------------------------------------


def _validate(rows: _Rows, boxes: _Boxes, multi_rank: bool) -> Cuts:
    """Cuts for keys whose chunks partially overlap; raise on invalid chunks."""
    cuts: Cuts = {}
    errors: list[str] = []
    for start, end in zip(boxes.key_starts.tolist(), boxes.key_ends.tolist()):
        key = int(boxes.fqn[start])
        fact = rows.facts[key]
        if fact is None:
            continue
        shape = tuple(fact[1])
        name = rows.names[key]
        if np.any(boxes.ndim[start:end] != len(shape)):
            errors.append(f"key:{name} has chunks whose rank differs from the tensor's {len(shape)} dims")
            continue
        off, size = boxes.off[start:end, : len(shape)], boxes.size[start:end, : len(shape)]
        if not shape or _tiles(off, size, shape):
            continue
        found = {(tuple(o), tuple(s)) for o, s in zip(off.tolist(), size.tolist())}
        if partially_overlap(found):
            cuts[name] = boundaries(found)
            continue
        errors.extend(_bounds_and_volume(name, off, size, shape, multi_rank))
    if errors:
        summary = "; ".join(errors)
        raise InvalidRequestError(f"Failed to validate global plan: {summary[:500]}{'... (truncated)' if len(summary) > 500 else ''}")
    return cuts


def _tiles(off: np.ndarray, size: np.ndarray, shape: tuple[int, ...]) -> bool:
    """Whether the boxes tile ``shape`` exactly as a grid (the usual sharded layout)."""
    if np.any(off < 0) or np.any(size < 0) or np.any(off + size > np.asarray(shape)):
        return False
    cells = 1
    for d, extent in enumerate(shape):
        code = np.unique(off[:, d] * (extent + 1) + size[:, d])
        starts, lengths = code // (extent + 1), code % (extent + 1)
        ends = starts + lengths
        if starts[0] != 0 or ends[-1] != extent or np.any(starts[1:] != ends[:-1]):
            return False
        cells *= len(code)
    return cells == len(off)


def _bounds_and_volume(name: str, off: np.ndarray, size: np.ndarray, shape: tuple[int, ...], multi_rank: bool) -> list[str]:
    errors = []
    bad = np.flatnonzero(np.any((off < 0) | (size < 0) | (off + size > np.asarray(shape)), axis=1))
    for row in bad[:3].tolist():
        errors.append(f"key:{name} has out of bounds chunk: tensor-size:{list(shape)} chunk offsets {off[row].tolist()} sizes {size[row].tolist()}")
    volume = int(np.prod(size, axis=1).sum())
    if multi_rank and volume != int(np.prod(shape)):
        errors.append(f"key:{name} invalid fill tensor-volume: {int(np.prod(shape))} chunks-volume: {volume}")
    return errors


# -- replica check ----------------------------------------------------------------------


def check_replicas(structure: _Structure, digests: Sequence[np.ndarray | None], mesh: DeviceMesh | None) -> None:
    """Raise ReplicaMismatchError where holders of one chunk report different digests."""
    groups, boxes = structure.groups, structure.boxes
    empty = np.zeros((0, 2), np.uint64)
    per_rank = [empty if d is None else d for d in digests]
    bad_rows: list[np.ndarray] = []
    base = np.concatenate([[0], np.cumsum([len(t) for t in groups.tables])])
    for group, members in enumerate(groups.members):
        first = per_rank[members[0]]
        for rank in members[1:].tolist():
            bad = np.flatnonzero(_differ(per_rank[rank], first))
            bad_rows.append(base[group] + bad)
    representative = np.concatenate(
        [_padded(per_rank[m[0]], len(t)) for t, m in zip(groups.tables, groups.members)] or [empty]
    )[boxes.order]
    first_of_box = representative[boxes.starts][boxes.box_of_sorted]
    bad_rows.append(boxes.order[_differ(representative, first_of_box)])
    found = np.concatenate(bad_rows) if bad_rows else np.zeros(0, np.int64)
    if not len(found):
        return
    position = np.empty(len(boxes.order), np.int64)
    position[boxes.order] = np.arange(len(boxes.order))
    conflicted = np.unique(boxes.box_of_sorted[position[found]])
    raise ReplicaMismatchError(mismatch_message([_versions(structure, per_rank, int(b)) for b in conflicted], len(conflicted), mesh))


def _differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Rows where both have a digest and they differ (rows missing in ``a`` compare equal)."""
    b = b[: len(a)]
    a = a[: len(b)]
    changed = (a[:, 0] ^ b[:, 0]) | (a[:, 1] ^ b[:, 1])  # column-wise: 10x faster than any(axis=1)
    return (changed != 0) & ((a[:, 0] | a[:, 1]) != 0) & ((b[:, 0] | b[:, 1]) != 0)


def _padded(digests: np.ndarray, rows: int) -> np.ndarray:
    out = np.zeros((rows, 2), np.uint64)
    out[: len(digests)] = digests[:rows]
    return out


def _versions(structure: _Structure, digests: list[np.ndarray], box: int) -> tuple[tuple[str, tuple[int, ...], tuple[int, ...]], list[list[int]]]:
    groups, rows, boxes = structure.groups, structure.rows, structure.boxes
    by_digest: dict[bytes, list[int]] = {}
    for row in boxes.order[boxes.starts[box] : boxes.ends[box]].tolist():
        for rank in groups.members[rows.gid[row]].tolist():
            if rows.lrow[row] < len(digests[rank]) and digests[rank][rows.lrow[row]].any():
                by_digest.setdefault(digests[rank][rows.lrow[row]].tobytes(), []).append(rank)
    ndim = int(boxes.ndim[box])
    key = (rows.names[boxes.fqn[box]], tuple(boxes.off[box, :ndim].tolist()), tuple(boxes.size[box, :ndim].tolist()))
    return key, [sorted(r) for r in by_digest.values()]


# -- balanced assignment ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _Classes:
    """Boxes grouped by the set of groups holding them."""

    of_box: np.ndarray
    members: list[np.ndarray]  # ranks of each class, ascending


def holder_classes(groups: _Groups, rows: _Rows, boxes: _Boxes) -> _Classes:
    """Boxes grouped by the set of groups holding them (a box held by one group: that group's class)."""
    holders = boxes.ends - boxes.starts
    of_box = np.empty(len(holders), np.int64)
    single = holders == 1
    groups_of_sorted = rows.gid[boxes.order]
    of_box[single] = groups_of_sorted[boxes.starts[single]]
    members = list(groups.members)
    shared: dict[tuple[int, ...], int] = {}
    for box in np.flatnonzero(~single).tolist():
        holding = tuple(groups_of_sorted[boxes.starts[box] : boxes.ends[box]].tolist())
        cls = shared.get(holding)
        if cls is None:
            cls = shared[holding] = len(members)
            members.append(np.sort(np.concatenate([groups.members[g] for g in holding])))
        of_box[box] = cls
    return _Classes(of_box, members)


def _balance(classes: _Classes, weight: np.ndarray, load: np.ndarray) -> np.ndarray:
    """Writer rank of each box; ``load`` (bytes per rank) is updated."""
    writer = np.empty(len(weight), np.int64)
    sizes = np.array([len(m) for m in classes.members], np.int64)
    alone = sizes[classes.of_box] == 1
    sole = np.array([m[0] if len(m) == 1 else -1 for m in classes.members], np.int64)
    writer[alone] = sole[classes.of_box[alone]]
    np.add.at(load, writer[alone], weight[alone])
    shared = np.flatnonzero(~alone)
    order = shared[np.lexsort((-weight[shared], classes.of_box[shared]))]
    bounds = np.flatnonzero(np.diff(classes.of_box[order])) + 1
    batches = np.split(order, bounds) if len(order) else []
    batches.sort(key=lambda b: -int(weight[b].sum()))
    for batch in batches:
        members = classes.members[classes.of_box[batch[0]]]
        writer[batch] = _fill(members, weight[batch], load)
        np.add.at(load, writer[batch], weight[batch])
    return writer


def _fill(members: np.ndarray, weight: np.ndarray, load: np.ndarray) -> np.ndarray:
    """A member for each box (``weight`` largest first), levelling ``load``: the members
    are filled up to the common level that the boxes' total reaches (water filling), each
    taking a run of boxes in order, so no member ends more than one box above the level."""
    order = np.argsort(load[members], kind="stable")
    levels_from = load[members][order].astype(np.float64)
    counts = np.arange(1, len(order) + 1)
    levels = (float(weight.sum()) + np.cumsum(levels_from)) / counts
    next_load = np.append(levels_from[1:], np.inf)
    k = int(np.argmax((levels >= levels_from) & (levels <= next_load)))
    capacity = np.cumsum(np.maximum(levels[k] - levels_from, 0.0))
    midpoints = np.cumsum(weight) - weight / 2
    slot = np.minimum(np.searchsorted(capacity, midpoints), len(order) - 1)
    return members[order][slot]


def _replica_copies(
    classes: _Classes, boxes: _Boxes, writer: np.ndarray, tp: np.ndarray, load: np.ndarray, refined_keys: set[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(box, rank, tp coordinate) of each copy: every TP coordinate holding a replicated
    tensor chunk but not writing it gets one, from its least loaded holder."""
    out_box, out_rank, out_tp = [], [], []
    eligible = boxes.tensor & ~np.isin(boxes.fqn, list(refined_keys))
    for cls, members in enumerate(classes.members):
        coords = tp[members]
        present = np.unique(coords[coords != NO_TP])
        if len(present) < 2:
            continue
        in_class = np.flatnonzero((classes.of_box == cls) & eligible)
        if not len(in_class):
            continue
        in_class = in_class[np.argsort(-boxes.weight[in_class], kind="stable")]
        for coord in present.tolist():
            need = in_class[tp[writer[in_class]] != coord]
            if not len(need):
                continue
            picks = _fill(members[coords == coord], boxes.weight[need], load)
            np.add.at(load, picks, boxes.weight[need])
            out_box.append(need)
            out_rank.append(picks)
            out_tp.append(np.full(len(need), coord, np.int64))
    return _joined(out_box), _joined(out_rank), _joined(out_tp)


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _row_of(structure: _Structure, box: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """The row of ``rank``'s table holding ``box`` (vectorized)."""
    groups, rows, boxes = structure.groups, structure.rows, structure.boxes
    ngroups = len(groups.tables)
    sorted_keys = boxes.box_of_sorted * ngroups + rows.gid[boxes.order]
    found = np.searchsorted(sorted_keys, box * ngroups + groups.of_rank[rank])
    return rows.lrow[boxes.order[found]]


def _per_rank(ranks: int, rank: np.ndarray, first: np.ndarray, second: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    order = np.argsort(rank, kind="stable")
    bounds = np.cumsum(np.bincount(rank, minlength=ranks))[:-1]
    return list(zip(np.split(first[order], bounds), np.split(second[order], bounds)))


# -- metadata ---------------------------------------------------------------------------


@gc_paused()
def _metadata(rows: _Rows, boxes: _Boxes) -> Metadata:
    """DCP's Metadata: two objects per unique chunk, built with the collector paused."""
    entries: dict[str, Any] = {}
    for start, end in zip(boxes.key_starts.tolist(), boxes.key_ends.tolist()):
        key = int(boxes.fqn[start])
        fact = rows.facts[key]
        if fact is None:
            entries[rows.names[key]] = BytesStorageMetadata()
            continue
        ndim = len(fact[1])
        chunks = list(map(ChunkStorageMetadata, torch_sizes(boxes.off[start:end, :ndim]), torch_sizes(boxes.size[start:end, :ndim])))
        entries[rows.names[key]] = TensorStorageMetadata(properties=fact[0], size=fact[1], chunks=chunks)
    return Metadata(state_dict_metadata=entries, planner_data=rows.mappings)
