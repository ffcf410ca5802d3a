"""The small collective before DCP's plan gather: ranks agree on table digests first.

DCP gathers the local plans once, with no second round to ask for something missing. So
a rank may send only its table's digest if it knows beforehand that the coordinator can
get the table elsewhere: from the tables of its cached plans (``plan_cache.held_tables``)
or from the one rank that sends that table in this gather. Before DCP's gather every rank
contributes ~30 bytes to an all-gather (table digest, TP coordinate, whether it is the
coordinator, whether its local planning failed); the coordinator then broadcasts one bit
per rank (send your table) and the id of its cached plan for exactly this layout, if it
has one (each rank then sends one hash per replica class instead of its digest rows, see
``replica_units``). A restarted coordinator holds nothing: each distinct table is sent
once, by its lowest rank, and the plan is made afresh.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable

import numpy as np
import torch.distributed as dist

from dcp_ext.errors import InvalidRequestError

_RECORD = struct.Struct("<16sqB")  # table digest, TP coordinate (-1: none), flags
_COORDINATOR, _FAILED = 1, 2

# coordinator: (every rank's digest, every rank's TP coordinate or None) -> (cached plan id or None, send flag per rank)
Decide = Callable[[list[bytes], list[int | None]], tuple[bytes | None, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Agreement:
    world: int  # ranks that took part
    send_table: bool  # this rank's table must travel with its plan
    plan_id: bytes | None  # the coordinator reuses this cached plan; None: it plans afresh


def exchange_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None | bool:
    """``group`` when a digest exchange can run on it, False when there is nobody to agree with."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return False
    return group


def agree(
    group: dist.ProcessGroup | None, digest: bytes | None, tp_rank: int | None, is_coordinator: bool, decide: Decide
) -> Agreement:
    """Every rank of ``group`` calls this with its table digest (None: its local planning
    failed; it still takes part so no rank waits forever, then raises its own error)."""
    record = _RECORD.pack(
        digest or bytes(16), -1 if tp_rank is None else tp_rank, (_COORDINATOR if is_coordinator else 0) | (_FAILED if digest is None else 0)
    )
    records: list[bytes | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(records, record, group=group)
    fields = [_RECORD.unpack(r) for r in records]  # type: ignore[arg-type]
    coordinators = [n for n, (_, _, flags) in enumerate(fields) if flags & _COORDINATOR]
    if len(coordinators) != 1:
        raise InvalidRequestError(
            f"ShardSavePlanner: the table-digest exchange on its process group found {len(coordinators)} "
            "coordinators, expected 1: pass ShardSavePlanner(group=...) the group given to dcp.save, or "
            "cache_plans=False for a save without collectives (no_dist=True, use_collectives=False)"
        )
    decision: list[object] = [None]
    if is_coordinator:
        if any(flags & _FAILED for _, _, flags in fields):  # the save fails anyway: ask for everything
            decision[0] = (None, np.packbits(np.ones(len(fields), bool)).tobytes())
        else:
            tps = [None if tp < 0 else tp for _, tp, _ in fields]
            cached, send = decide([d for d, _, _ in fields], tps)
            decision[0] = (cached, np.packbits(send).tobytes())
    dist.broadcast_object_list(decision, group=group, group_src=coordinators[0])
    cached, bits = decision[0]  # type: ignore[misc]
    me = dist.get_rank(group)
    send = bool(np.unpackbits(np.frombuffer(bits, np.uint8))[me])
    return Agreement(len(fields), send, cached)


def first_senders(digests: list[bytes], held: set[bytes] | dict[bytes, object]) -> np.ndarray:
    """Per rank: whether it sends its table (the lowest rank of each digest the coordinator lacks)."""
    send = np.zeros(len(digests), bool)
    seen: set[bytes] = set()
    for rank, digest in enumerate(digests):
        if digest not in held and digest not in seen:
            send[rank] = True
            seen.add(digest)
    return send
