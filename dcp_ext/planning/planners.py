"""ShardSavePlanner / ShardLoadPlanner: DCP's default planners with our improvements."""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem, WriteItemType

from dcp_ext.errors import CorruptCheckpointError, InvalidRequestError
from dcp_ext.formats.safe_load import safe_load_bytes
from dcp_ext.planning.dedup import chunk_view
from dcp_ext.planning.global_plan import GlobalPlan, RankAssignment, check_replicas, plan_globally
from dcp_ext.planning.local_plan import ShardLocalPlan, assigned_items
from dcp_ext.planning.locality import canonical_index, tp_coordinate
from dcp_ext.planning.placement_planning import PlacementLoadMixin, PlacementSaveMixin
from dcp_ext.planning.plan_cache import cached_plan, remember_plan
from dcp_ext.planning.plan_table import table_from_items
from dcp_ext.planning.replica_check import chunk_digest_rows


class ShardSavePlanner(PlacementSaveMixin, DefaultSavePlanner):
    """DefaultSavePlanner's local plans, planned globally as columns (``global_plan``):
    replicated items balanced by bytes across their holders, partially overlapping chunks
    (nonuniform TP) refined so each element is saved once, ranks with identical plans planned
    once. ``placement_fn``/``mesh``/``check_replicas``: see PlacementSaveMixin.

    ``replica_locality=True``: tensors replicated across the tensor-parallel mesh dim
    ``tp_dim`` (default ``"tp"``) are also written once per TP rank, into that rank's own
    file, so each rank later loads them from its own file (``dcp_ext.planning.locality``).
    A state dict with no DTensor on a mesh with that dim name is an error, as is
    ``tp_dim`` without ``replica_locality``: neither could take effect.

    ``cache_plans=True``: the coordinator reuses the global plan of an earlier save whose
    every local plan was identical (``dcp_ext.planning.plan_cache``); DCP's
    ``enable_plan_caching`` is accepted as the same switch.

    After a save, the coordinator's ``last_global_plan`` holds the plan with per-phase
    seconds and counts, and ``plan_reused`` says whether it came from the cache.
    """

    def __init__(
        self,
        *args: Any,
        replica_locality: bool = False,
        tp_dim: str | None = None,
        cache_plans: bool = True,
        **kwargs: Any,
    ) -> None:
        if tp_dim is not None and not replica_locality:
            raise InvalidRequestError("ShardSavePlanner: tp_dim only applies with replica_locality=True")
        cache_plans = kwargs.pop("enable_plan_caching", False) or cache_plans
        super().__init__(*args, **kwargs)
        self.replica_locality = replica_locality
        self.tp_dim = tp_dim or "tp"
        self.cache_plans = cache_plans
        self.last_global_plan: GlobalPlan | None = None
        self.plan_reused = False
        self._local_items: list[WriteItem] = []

    def create_local_plan(self) -> SavePlan:
        items = super().create_local_plan().items  # DCP's WriteItems for this rank
        self._local_items = items
        return ShardLocalPlan(
            items=[],
            table=table_from_items(items, self.mappings if self.flatten_state_dict else None),
            chunk_digests=chunk_digest_rows(items, self.lookup_object) if self.check_replicas else None,
            tp_rank=tp_coordinate(self.state_dict, self.tp_dim) if self.replica_locality else None,
        )

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        tables = [plan.table for plan in all_plans]
        digests = [plan.chunk_digests for plan in all_plans] if self.check_replicas else None
        tp_ranks = [plan.tp_rank for plan in all_plans] if self.replica_locality else None
        key = (tuple(table.digest for table in tables), None if tp_ranks is None else tuple(tp_ranks))
        result = cached_plan(key) if self.cache_plans else None
        self.plan_reused = result is not None
        if result is None:
            result = plan_globally(tables, chunk_digests=digests, tp_ranks=tp_ranks, mesh=self._placements.mesh)
            if self.cache_plans:
                remember_plan(key, result)
        elif digests is not None:
            check_replicas(result.structure, digests, self._placements.mesh)
        self.last_global_plan = result
        self.global_plan = [SavePlan(items=[], planner_data=a) for a in result.assignments]
        self.metadata = dataclasses.replace(result.metadata)  # the writer fills in storage data
        return self.global_plan, self.metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        assignment = new_plan.planner_data
        if not isinstance(assignment, RankAssignment):
            raise InvalidRequestError(
                "ShardSavePlanner: the plan this rank received carries no assignment in planner_data "
                f"(found {type(assignment).__name__}); the storage writer's prepare_global_plan must keep "
                "each plan's planner_data, e.g. dataclasses.replace(plan, storage_data=...)"
            )
        self.plan = SavePlan(assigned_items(self._local_items, assignment), storage_data=new_plan.storage_data)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        original = canonical_index(write_item.index)
        if original is not None:  # a TP-replica copy: the same data as the canonical item
            write_item = dataclasses.replace(write_item, index=original)
        if write_item.type == WriteItemType.SHARD:  # possibly a refined sub-chunk
            return chunk_view(self.state_dict[write_item.index.fqn], write_item)
        return super().resolve_data(write_item)


class ShardLoadPlanner(PlacementLoadMixin, DefaultLoadPlanner):
    """DefaultLoadPlanner that never runs code from a checkpoint's non-tensor items.

    DCP's ``load_bytes`` decodes them with ``torch.load(weights_only=False)``: a hostile
    checkpoint runs arbitrary code there. We use ``weights_only=True`` with a small
    allowlist (``dcp_ext.formats.safe_load``: containers, numbers, strings, bytes, tensors,
    ``argparse.Namespace``, numpy arrays and scalars, and classes registered with
    ``torch.serialization.add_safe_globals``); ``allow_unsafe_bytes=True`` restores DCP's
    behaviour for checkpoints you trust (and tells ``ShardReader``, which checks bytes
    items itself for any planner, to skip its check). ``placement_fn``/``mesh``: see
    PlacementLoadMixin.

    Read items stay on their rank: DCP's global load step decides nothing for them, yet
    gathering them costs O(ranks x items) pickled objects through the coordinator. The
    local plan sent up is empty and ``finish_plan`` puts the rank's own items back, so the
    gather is one small message per rank. Storage readers see the items in ``read_data``.
    """

    def __init__(self, *args: Any, allow_unsafe_bytes: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allow_unsafe_bytes = allow_unsafe_bytes
        self._local_items: list[ReadItem] = []

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        self._local_items = plan.items
        return dataclasses.replace(plan, items=[])

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        return super().finish_plan(dataclasses.replace(new_plan, items=self._local_items))

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        if isinstance(self.state_dict.get(fqn), torch.Tensor):  # DCP would swap the tensor out
            raise CorruptCheckpointError(
                f"key {fqn!r}: the state dict holds a tensor here but the checkpoint stores a non-tensor "
                "item; refusing to replace the tensor with it"
            )
        if self.allow_unsafe_bytes:
            obj = torch.load(value, weights_only=False)
        else:
            obj = safe_load_bytes(value.getvalue(), f"key {fqn!r}", "ShardLoadPlanner(allow_unsafe_bytes=True)")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
