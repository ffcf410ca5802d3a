"""TP-replica file locality: replicated tensors saved once per TP rank, in its own file.

A tensor replicated across tensor-parallel ranks (norms, biases, router weights) is
normally written once, so on load every other TP rank opens someone else's file for it.
With locality on, after the usual balanced dedup every TP group that holds a replicated
item also writes its own copy (still once per data-parallel group). The checkpoint keeps
the plain key: ``.metadata`` points at the canonical copy, so stock readers see an
ordinary checkpoint; the extra copies are recorded only in our index, and ShardReader
serves each rank from a copy in its own file when there is one.

Copies travel through DCP under a typed key, ``dcp_ext.formats.replica_copy.ReplicaCopyIndex``
(the chunk's key plus the TP rank), that never reaches the metadata; the writer files them
under the chunk's plain key in our index. This module finds the TP rank for them.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor

from dcp_ext.errors import InvalidRequestError


def tp_coordinate(state_dict: dict[str, Any], dim_name: str) -> int:
    """This rank's coordinate on the mesh dim ``dim_name`` of the state dict's DTensors.

    Raises when no DTensor lives on a mesh with that dim: locality could not take effect.
    """
    seen: set[tuple[str, ...] | None] = set()
    for value in state_dict.values():
        if isinstance(value, DTensor):
            names = value.device_mesh.mesh_dim_names
            if dim_name in (names or ()):
                return value.device_mesh.get_local_rank(dim_name)
            seen.add(names)
    found = ", ".join(sorted(str(list(n)) if n else "unnamed" for n in seen)) or "none (no DTensors)"
    raise InvalidRequestError(
        f"ShardSavePlanner(replica_locality=True): no DTensor of the state dict lives on a mesh with a dim "
        f"named tp_dim={dim_name!r} (mesh dims found: {found}); name the tensor-parallel mesh dim with "
        "mesh_dim_names and pass it as tp_dim, or leave replica_locality off"
    )
