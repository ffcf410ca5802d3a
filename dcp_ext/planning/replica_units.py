"""The replica check in a few bytes per rank, for a layout whose plan the coordinator holds.

The full check (``global_plan.check_replicas``) needs a digest per chunk from every rank:
16 bytes x rows, ~66 KB for 4,000 items, on every save. Once a plan exists, the coordinator
knows who holds each chunk. Chunks held by exactly the same ranks form a class (the
balancer's ``holder_classes``), and every holder of a class holds all of its chunks, so
the holders agree on every chunk of the class iff they agree on one hash over the class's
chunk digests taken in chunk order. Each rank learns its classes ("units": which rows, in
which order) with its assignment and, on the next save of that plan, sends one 16-byte
hash per class it shares with other ranks (a handful: its replicated shards, its norms,
the optimizer steps) instead of its digest rows.

A rank without a digest for some chunk of a class (zero row: no data at hand) sends zero
for that class, which compares equal to anything, as a zero row does in the full check.
A mismatch names the ranks and the class's chunks, not the one chunk that differs (the
hashes cannot tell): ``cache_plans=False`` runs the full check, which does.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np
from torch.distributed.device_mesh import DeviceMesh

from dcp_ext.planning.global_plan import GlobalPlan
from dcp_ext.planning.replica_check import ReplicaMismatchError, mismatch_message
from dcp_ext.runtime.arrays import unique


@dataclasses.dataclass(frozen=True, eq=False)
class ReplicaUnits:
    """One group's shared classes: unit ``i`` is class ``classes[i]``, whose chunks are the
    table rows ``rows[bounds[i] : bounds[i + 1]]`` in chunk order."""

    plan_id: bytes
    classes: np.ndarray  # int64 (units,)
    bounds: np.ndarray  # int64 (units + 1,)
    rows: np.ndarray  # int32


def units_per_group(plan: GlobalPlan, plan_id: bytes) -> list[ReplicaUnits]:
    """Units of each group of ``plan`` (its declared rows): classes held by more than one rank."""
    shared = plan.structure.shared
    out = []
    for g in range(len(plan.structure.groups.tables)):  # a few slices per group: 16,384 groups in ~0.2 s
        lo, hi = int(shared.group_bounds[g]), int(shared.group_bounds[g + 1])
        first, last = int(shared.unit_bounds[g]), int(shared.unit_bounds[g + 1])
        bounds = np.append(shared.unit_start[first:last] - lo, hi - lo)
        out.append(ReplicaUnits(plan_id, shared.unit_class[first:last], bounds, shared.rows[lo:hi]))
    return out


def with_units(plan: GlobalPlan, plan_id: bytes) -> GlobalPlan:
    """``plan`` whose assignments carry each rank's units."""
    units = units_per_group(plan, plan_id)
    of_rank = plan.structure.groups.of_rank.tolist()
    assignments = [dataclasses.replace(a, units=units[g]) for a, g in zip(plan.assignments, of_rank)]
    return dataclasses.replace(plan, assignments=assignments)


def unit_hashes(digests: np.ndarray, units: ReplicaUnits) -> np.ndarray:
    """(units, 2) uint64: per unit, a hash of the rows' chunk digests (zero if one is unknown)."""
    out = np.zeros((len(units.classes), 2), np.uint64)
    picked = digests.take(units.rows, axis=0)
    known = (picked[:, 0] | picked[:, 1]) != 0
    for unit, (lo, hi) in enumerate(zip(units.bounds[:-1].tolist(), units.bounds[1:].tolist())):
        if known[lo:hi].all():
            out[unit] = np.frombuffer(hashlib.blake2b(picked[lo:hi].tobytes(), digest_size=16).digest(), np.uint64)
    return out


def check_units(plan: GlobalPlan, hashes: Sequence[np.ndarray], mesh: DeviceMesh | None) -> None:
    """Raise ReplicaMismatchError where holders of one class sent different hashes.
    ``hashes[rank]`` follows the units of the rank's group in ``plan``."""
    classes = np.concatenate([a.units.classes for a in plan.assignments] or [np.zeros(0, np.int64)])
    ranks = np.repeat(np.arange(len(hashes)), [len(h) for h in hashes])
    values = np.concatenate(list(hashes) or [np.zeros((0, 2), np.uint64)])
    known = (values[:, 0] | values[:, 1]) != 0
    classes, ranks, values = classes[known], ranks[known], values[known]
    order = np.lexsort((ranks, classes))
    classes, ranks, values = classes[order], ranks[order], values[order]
    first = np.flatnonzero(np.diff(classes, prepend=-1))
    reference = values[np.repeat(first, np.diff(np.append(first, len(classes))))]
    bad = unique(classes[np.any(values != reference, axis=1)])
    if not len(bad):
        return
    conflicts = []
    for cls in bad[:5].tolist():
        mine = classes == cls
        versions: dict[bytes, list[int]] = {}
        for rank, value in zip(ranks[mine].tolist(), values[mine]):
            versions.setdefault(value.tobytes(), []).append(rank)
        conflicts.append((_class_chunks(plan, cls), list(versions.values()), []))  # units hash real digests only
    raise ReplicaMismatchError(
        mismatch_message(conflicts, len(bad), mesh)
        + "\n(The save reused a cached plan, which compares one hash per set of chunks held by the same ranks: "
        "each line names the first chunk of such a set, and some chunk of it differs; "
        "ShardSavePlanner(cache_plans=False) names the exact chunk.)"
    )


def _class_chunks(plan: GlobalPlan, cls: int) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """The first chunk of class ``cls`` (fqn, offsets, sizes), as the message's example."""
    structure = plan.structure
    classes = structure.classes
    boxes = structure.boxes
    box = int(np.flatnonzero(classes.of_box == cls)[0])
    ndim = int(boxes.ndim[box])
    name = structure.rows.names[int(boxes.fqn[box])]
    return name, tuple(boxes.off[box, :ndim].tolist()), tuple(boxes.size[box, :ndim].tolist())
