"""The plans our save planner exchanges through DCP: columns up, row numbers down.

DCP gathers each rank's ``SavePlan`` on the coordinator and scatters one back. Ours carry
no WriteItems on the wire: the local plan holds the rank's ``PlanTable`` or only its digest
when the coordinator can get the table elsewhere (``digest_exchange``) (plus a digest per
chunk for the replica check and the rank's tensor-parallel coordinate for replica
locality), and the plan sent back holds a ``RankAssignment`` (rows of that table to write)
in ``planner_data``, the field DCP reserves for the planner: a storage writer may rebuild
the plans in its ``prepare_global_plan`` and keeps that field, where an attribute of a
SavePlan subclass would be lost. Each rank keeps its own WriteItems and expands the
assignment in ``finish_plan``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from dcp_ext.formats.replica_copy import ReplicaCopyIndex
from dcp_ext.planning.dedup import refine_items
from dcp_ext.planning.global_plan import RankAssignment
from dcp_ext.planning.plan_table import PlanTable
from dcp_ext.runtime.frozen import replaced


class TableItems(list):  # type: ignore[type-arg]
    """A ShardLocalPlan's ``items``: always empty, the plan travels as its table. A plan
    whose items come back as another list (a subclass's ``create_local_plan`` that filtered
    them) is refused: the table still holds every item, which would all be saved."""


@dataclasses.dataclass(frozen=True)
class ShardLocalPlan(SavePlan):
    table: PlanTable | None = None  # None: the coordinator gets it elsewhere (digest_exchange)
    table_digest: bytes = b""
    chunk_digests: np.ndarray | None = None  # (rows, 2) uint64, see replica_check
    unit_hashes: np.ndarray | None = None  # (units, 2) uint64 instead, for a reused plan (replica_units)
    tp_rank: int | None = None  # this rank's coordinate on the tensor-parallel mesh dim


def assigned_items(items: list[WriteItem], assignment: RankAssignment) -> list[WriteItem]:
    """The WriteItems a rank writes: its own ``items`` (refined like everyone's) picked by
    the coordinator's row numbers, with DCP index hints, then its TP-replica copies."""
    if assignment.cuts:
        items = refine_items(items, assignment.cuts)
    written = [_with_hint(items[row], hint) for row, hint in zip(assignment.rows.tolist(), assignment.hints.tolist())]
    copies = [
        dataclasses.replace(items[row], index=ReplicaCopyIndex.of(items[row].index, tp))
        for row, tp in zip(assignment.copy_rows.tolist(), assignment.copy_tp.tolist())
    ]
    return written + copies


def _with_hint(item: WriteItem, hint: int) -> WriteItem:
    """``item`` carrying DCP's index hint (its chunk's position in the metadata)."""
    if item.type == WriteItemType.BYTE_IO:
        return item
    return replaced(item, index=replaced(item.index, index=hint))
