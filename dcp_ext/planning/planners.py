"""ShardSavePlanner / ShardLoadPlanner: DCP's default planners with our improvements."""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, WriteItem, WriteItemType

from dcp_ext.errors import CorruptCheckpointError, UnsafeCheckpointError
from dcp_ext.formats.safe_load import safe_torch_load
from dcp_ext.planning.local_plan import plain, with_extras
from dcp_ext.planning.locality import add_replica_copies, canonical_index, tp_coordinate

from dcp_ext.planning.dedup import balanced_dedup, chunk_view, refine_overlapping_chunks
from dcp_ext.planning.placement_planning import PlacementLoadMixin, PlacementSaveMixin


class ShardSavePlanner(PlacementSaveMixin, DefaultSavePlanner):
    """DefaultSavePlanner with replicated items balanced by bytes across their holders,
    and partially overlapping chunks (nonuniform TP) refined so each element is saved once.
    ``placement_fn``/``mesh``/``check_replicas``: see PlacementSaveMixin.

    ``replica_locality=True``: tensors replicated across the tensor-parallel mesh dim
    ``tp_dim`` are also written once per TP rank, into that rank's own file, so each rank
    later loads them from its own file (``dcp_ext.planning.locality``).
    """

    def __init__(self, *args: Any, replica_locality: bool = False, tp_dim: str = "tp", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replica_locality = replica_locality
        self.tp_dim = tp_dim

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if self.replica_locality and plan.usable:
            plan = with_extras(plan, tp_rank=tp_coordinate(self.state_dict, self.tp_dim))
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if not self.replica_locality:
            return super().create_global_plan(all_plans)
        tp_ranks = [getattr(plan, "tp_rank", None) for plan in all_plans]
        local_plans = [plain(plan) for plan in all_plans]
        global_plans, metadata = super().create_global_plan(all_plans)
        global_plans = add_replica_copies(local_plans, global_plans, tp_ranks)
        self.global_plan = global_plans
        return global_plans, metadata

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        return balanced_dedup(refine_overlapping_chunks(all_plans))

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
    allowlist (containers, numbers, strings, tensors, ``argparse.Namespace``, numpy arrays,
    and classes registered with ``torch.serialization.add_safe_globals``);
    ``allow_unsafe_bytes=True`` restores DCP's behaviour for checkpoints you trust. ``placement_fn``/``mesh``: see PlacementLoadMixin.
    """

    def __init__(self, *args: Any, allow_unsafe_bytes: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allow_unsafe_bytes = allow_unsafe_bytes

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
            try:
                obj = safe_torch_load(value.getvalue(), f"key {fqn!r}")
            except UnsafeCheckpointError as exc:
                raise UnsafeCheckpointError(
                    f"{exc}; register classes you trust with torch.serialization.add_safe_globals, "
                    "or pass ShardLoadPlanner(allow_unsafe_bytes=True) for a checkpoint you trust"
                ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
