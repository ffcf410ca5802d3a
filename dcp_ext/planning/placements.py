"""Checkpoint placements: describe a parameter to DCP on its checkpoint mesh, not its FSDP mesh.

An expert weight under EP + FSDP2 is a DTensor on the FSDP (EDP) mesh only, and its name
carries the EP-local expert index, so every EP rank declares the same key and offsets and
DCP keeps one of them as a "replica". We rebuild the DTensor on the checkpoint mesh (EP/TP
axes of the full mesh) with the natural global shape, so each rank's shard gets its own
offsets. FSDP's shard moves onto the checkpoint axis over the same ranks as a
``_StridedShard`` (FSDP splits inside the EP-local block, so it is the innermost split even
though its axis may sit left of EP), which keeps chunk order natural and the global shape
identical on every rank even when FSDP shards are uneven.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from dcp_ext.errors import InvalidRequestError

PlacementFn = Callable[[str, torch.Tensor], Sequence[Placement] | None]
"""``placement_fn(fqn, tensor)``: checkpoint placements for a key, or None to leave it alone."""


def with_checkpoint_placements(
    param: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], *, name: str = "tensor"
) -> DTensor:
    """This rank's data of ``param`` as a DTensor laid out on the checkpoint ``mesh``.

    ``param`` is a DTensor (an FSDP2 parameter, or any DTensor) or a plain tensor holding
    this rank's model-parallel-local data; ``placements`` say how the checkpoint mesh splits
    the natural global tensor. The result shares storage with the local shard, so loading
    into it fills the parameter in place. When the checkpoint shards nothing (Replicate, or
    Shard on size-1 axes) a DTensor ``param`` is returned unchanged: no gather, and empty
    uneven shards stay valid. ``name`` appears in error messages.
    """
    placements = _checked_placements(mesh, placements, param.ndim, name)
    if isinstance(param, DTensor) and not any(
        isinstance(p, Shard) and mesh.size(axis) > 1 for axis, p in enumerate(placements)
    ):
        return param
    with torch.no_grad():
        local = param.to_local() if isinstance(param, DTensor) else param.detach()
        if local.device.type != mesh.device_type and not local.is_meta:
            raise InvalidRequestError(f"{name}: tensor on {local.device} but checkpoint mesh on {mesh.device_type}; wrapping would copy it")
        shape = list(param.shape)
        for axis, p in enumerate(placements):
            if isinstance(p, Shard):
                shape[p.dim] *= mesh.size(axis)
        for dim, ranks in _own_shards(param, name).items():
            axis = _axis_over(mesh, ranks, name)
            if isinstance(placements[axis], Shard):
                raise InvalidRequestError(
                    f"{name}: the parameter is already sharded over ranks {list(ranks)}, which the "
                    f"checkpoint placements {placements} also shard (axis {axis_name(mesh, axis)} of "
                    f"{describe_mesh(mesh)}); the parameter's own shards must lie on a replicated checkpoint axis"
                )
            placements[axis] = _inner_shard(mesh, placements, axis, dim)
        _check_local_shape(local, shape, mesh, placements, name)
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=_row_major(shape)
        )


def checkpoint_state_dict(state_dict: dict[str, Any], placement_fn: PlacementFn, mesh: DeviceMesh) -> dict[str, Any]:
    """A copy of ``state_dict`` with tensors rebuilt by :func:`with_checkpoint_placements`.

    Works on model and optimizer state dicts (and dicts nesting them, e.g. ``{"model": ...,
    "optim": ...}``). ``placement_fn`` gets each tensor's key in its own dict; optimizer
    states (``state[fqn][name]``, e.g. exp_avg) get their parameter's ``fqn``, so they follow
    the parameter; scalar states such as ``step`` stay as they are. Non-tensor values and
    tensors ``placement_fn`` returns None for are shared with the input, not copied.
    """

    def convert(fqn: str, value: Any) -> Any:
        if isinstance(value, dict):
            if _is_optimizer_state_dict(value):
                state = {
                    param_fqn: {
                        key: place(param_fqn, t) if isinstance(t, torch.Tensor) and t.ndim > 0 else t
                        for key, t in states.items()
                    }
                    for param_fqn, states in value["state"].items()
                }
                return {**value, "state": state}
            return {key: convert(key, item) for key, item in value.items()}
        return place(fqn, value) if isinstance(value, torch.Tensor) else value

    def place(fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        placements = placement_fn(fqn, tensor)
        return tensor if placements is None else with_checkpoint_placements(tensor, mesh, placements, name=fqn)

    return {key: convert(key, value) for key, value in state_dict.items()}


def _is_optimizer_state_dict(value: dict) -> bool:
    return isinstance(value.get("state"), dict) and isinstance(value.get("param_groups"), list)


def _checked_placements(mesh: DeviceMesh, placements: Sequence[Placement], ndim: int, name: str) -> list[Placement]:
    if not isinstance(mesh, DeviceMesh):
        raise InvalidRequestError(f"{name}: the checkpoint mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if not isinstance(placements, (list, tuple)):  # a bare Shard(0) was "not iterable", naming no key
        raise InvalidRequestError(
            f"{name}: checkpoint placements must be a list with one placement per mesh dim (or None from "
            f"placement_fn: leave the key alone), got {placements!r}"
        )
    placements = list(placements)
    if len(placements) != mesh.ndim:
        raise InvalidRequestError(f"{name}: {len(placements)} checkpoint placements for the {mesh.ndim}-D mesh {describe_mesh(mesh)}")
    bad = [p for p in placements if type(p) not in (Shard, Replicate)]
    if bad:
        raise InvalidRequestError(f"{name}: checkpoint placements must be Shard or Replicate, got {bad}")
    outside = [p for p in placements if type(p) is Shard and not -ndim <= p.dim < ndim]
    if outside:
        raise InvalidRequestError(f"{name}: checkpoint placements {outside} shard a dim the {ndim}-D tensor does not have")
    if mesh.get_coordinate() is None:
        raise InvalidRequestError(f"{name}: rank {dist.get_rank()} is not part of the checkpoint mesh {describe_mesh(mesh)}")
    return placements


def _own_shards(param: torch.Tensor, name: str) -> dict[int, tuple[int, ...]]:
    """Tensor dim -> ranks (in shard order) of every real split the parameter itself carries."""
    if not isinstance(param, DTensor):
        return {}
    shards: dict[int, tuple[int, ...]] = {}
    for dim, p in enumerate(param.placements):
        if p.is_replicate() or param.device_mesh.size(dim) == 1:
            continue
        if type(p) is not Shard:
            raise InvalidRequestError(f"{name}: parameter placement {p} on its mesh dim {dim} is not supported (Shard or Replicate only)")
        if p.dim in shards:
            raise InvalidRequestError(f"{name}: the parameter shards tensor dim {p.dim} over two mesh dims; not supported")
        shards[p.dim] = _group(param.device_mesh, dim)
    return shards


def _axis_over(mesh: DeviceMesh, ranks: tuple[int, ...], name: str) -> int:
    """The checkpoint axis whose ranks, in order, are ``ranks``; never falls back to replication."""
    groups = [_group(mesh, axis) for axis in range(mesh.ndim)]
    if ranks in groups:
        return groups.index(ranks)
    axes = ", ".join(f"{axis_name(mesh, a)}={list(g)}" for a, g in enumerate(groups))
    raise InvalidRequestError(
        f"{name}: the parameter is sharded over ranks {list(ranks)} (its FSDP mesh), but no axis of the "
        f"checkpoint mesh {describe_mesh(mesh)} spans exactly these ranks in this order (this rank's axes: {axes}); "
        "build the checkpoint mesh so that one axis is the FSDP group"
    )


def _inner_shard(mesh: DeviceMesh, placements: list[Placement], axis: int, dim: int) -> Placement:
    """FSDP's split of ``dim`` on ``axis``, innermost: strided by the checkpoint splits to its right."""
    right = range(axis + 1, mesh.ndim)
    split = math.prod(mesh.size(a) for a in right if type(placements[a]) is Shard and placements[a].dim == dim)
    return _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)


def _check_local_shape(
    local: torch.Tensor, shape: list[int], mesh: DeviceMesh, placements: list[Placement], name: str
) -> None:
    expected, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    if tuple(expected) != tuple(local.shape):
        raise InvalidRequestError(
            f"{name}: local shard {tuple(local.shape)} does not match {tuple(expected)}, its share of the "
            f"global {tuple(shape)} under {placements} on {describe_mesh(mesh)}"
        )


def _group(mesh: DeviceMesh, dim: int) -> tuple[int, ...]:
    """Global ranks along mesh ``dim`` through this rank, in coordinate order."""
    index: list[Any] = list(mesh.get_coordinate())
    index[dim] = slice(None)
    return tuple(mesh.mesh[tuple(index)].tolist())


def _row_major(shape: list[int]) -> tuple[int, ...]:
    return tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))


def axis_name(mesh: DeviceMesh, axis: int) -> str:
    return mesh.mesh_dim_names[axis] if mesh.mesh_dim_names else str(axis)


def describe_mesh(mesh: DeviceMesh) -> str:
    """``DeviceMesh(edp:2, ep:2; ranks [...])`` for error messages."""
    axes = ", ".join(f"{axis_name(mesh, a)}:{mesh.size(a)}" for a in range(mesh.ndim))
    return f"DeviceMesh({axes}; ranks {mesh.mesh.flatten().tolist()})"
