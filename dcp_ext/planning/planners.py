"""ShardSavePlanner / ShardLoadPlanner: DCP's default planners with our improvements."""

from __future__ import annotations

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from dcp_ext.planning.dedup import balanced_dedup


class ShardSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner with replicated items balanced by bytes across their holders."""

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        return balanced_dedup(all_plans)


class ShardLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner; the documented default load planner for dcp_ext readers."""
