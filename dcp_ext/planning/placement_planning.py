"""Planner mixins: checkpoint placements and the replica check inside ShardSave/LoadPlanner.

Mixins (rather than code in planners.py) keep the placement logic in one place that both
planners share, on top of whatever else the planners do. Their set-up hands the state dict
to DCP's, or, where DCP's walks would only flatten it, sets what DCP's sets from its flat
view (``flat_state``).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.device_mesh import DeviceMesh

from dcp_ext.errors import InvalidRequestError
from dcp_ext.planning.flat_state import FlatView, flat_view
from dcp_ext.planning.placements import PlacementFn, checkpoint_state_dict
from dcp_ext.runtime import options


class _Placements:
    """``placement_fn`` and ``mesh``, given together or not at all."""

    def __init__(self, placement_fn: PlacementFn | None, mesh: DeviceMesh | None, owner: str) -> None:
        if (placement_fn is None) != (mesh is None):
            raise InvalidRequestError("placement_fn and mesh go together: pass both or neither")
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise InvalidRequestError(f"{owner}(mesh=...) must be a DeviceMesh, got {type(mesh).__name__}")
        self.placement_fn = options.callback(owner, "placement_fn", placement_fn)
        self.mesh = mesh

    def apply(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.placement_fn is None or self.mesh is None:
            return state_dict
        return checkpoint_state_dict(state_dict, self.placement_fn, self.mesh)


class PlacementSaveMixin:
    """Save side: ``placement_fn``/``mesh`` re-lay tensors before planning; with
    ``check_replicas`` (default) the coordinator refuses chunks declared by several ranks
    with different data, which DCP would otherwise dedup silently (the planner attaches
    the digests, ``global_plan.check_replicas`` compares them)."""

    def __init__(
        self,
        *args: Any,
        placement_fn: PlacementFn | None = None,
        mesh: DeviceMesh | None = None,
        check_replicas: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._placements = _Placements(placement_fn, mesh, type(self).__name__)
        self.check_replicas = options.flag(type(self).__name__, "check_replicas", check_replicas)

    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None, is_coordinator: bool = False
    ) -> None:
        state_dict = self._placements.apply(state_dict)
        view = _flat_view_for(self, PlacementSaveMixin, DefaultSavePlanner, state_dict)
        if view is None:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)  # type: ignore[misc]
            return
        self.state_dict, self.mappings = view  # what DefaultSavePlanner.set_up_planner sets
        self.is_coordinator = is_coordinator


class PlacementLoadMixin:
    """Load side: the same ``placement_fn``/``mesh`` as at save time, so every rank reads its
    own shard straight into its parameters (the re-laid DTensors share their storage)."""

    def __init__(
        self, *args: Any, placement_fn: PlacementFn | None = None, mesh: DeviceMesh | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._placements = _Placements(placement_fn, mesh, type(self).__name__)

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        placed = self._placements.apply(state_dict)
        view = _flat_view_for(self, PlacementLoadMixin, DefaultLoadPlanner, placed)
        if view is None:
            super().set_up_planner(placed, metadata, is_coordinator)  # type: ignore[misc]
        else:  # what DefaultLoadPlanner.set_up_planner sets
            self.state_dict, self.mappings = view
            self.metadata, self.is_coordinator = metadata, is_coordinator
        # Non-tensor items (param_groups, ...) must land in the caller's dict, not our copy.
        self.original_state_dict = state_dict


def _flat_view_for(planner: Any, mixin: type, default: type, state_dict: dict[str, Any]) -> FlatView | None:
    """The state dict's flat view (``flat_state``) when the set-up ``mixin`` hands over to
    is ``default``'s own, with both of its flattening options on (each off changes what it
    sets), and the state dict is one the view serves; else None."""
    mro = type(planner).__mro__
    following = next(c for c in mro[mro.index(mixin) + 1 :] if "set_up_planner" in c.__dict__)
    if following is not default or not (planner.flatten_state_dict and planner.flatten_sharded_tensors):
        return None
    return flat_view(state_dict)
