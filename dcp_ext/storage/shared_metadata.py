"""Checkpoint metadata read from storage once per group instead of once per rank.

``dcp.load`` calls ``read_metadata`` on every rank. For our checkpoints that reads the
index and streams all of ``.metadata`` through CRC32C (to prove the index belongs to it):
at 1.19 M chunks 5.7 MB plus 175 MB per rank, so 16,384 ranks on one shared file system
read ~3 TB before any tensor moves. With ``ShardReader(share_metadata=True)`` the
group's first rank reads those files and broadcasts what it read (the index and marker
bytes, ``.metadata``'s size and CRC32C; the pickle itself only when there is no index);
every rank decodes it and keeps the result in its metadata cache. A load whose ranks all
hold the current version cached exchanges only a few bytes.

Every rank of the group must call ``read_metadata`` at the same point, as ``dcp.load``
does on the group it runs on; the ranks first agree that they open one checkpoint, and
a failure on the reading rank is raised on every rank, so no rank waits for a broadcast
that never comes. Only DCP checkpoints (ours, stock, Megatron torch_dist) are shared:
other formats raise.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from dcp_ext.errors import CheckpointError, InvalidRequestError
from dcp_ext.storage.catalog import (
    METADATA_CACHE,
    Catalog,
    catalog_from_inputs,
    catalog_signature,
    read_catalog_inputs,
)
from dcp_ext.storage.catalog_formats import catalog_format, with_views
from dcp_ext.storage.location import Location

DCP = ("dcp",)  # the metadata cache variant of DCP checkpoints (no format options)


def open_shared_catalog(
    location: Location, group: dist.ProcessGroup | None, cached: bool, options: Any = None
) -> tuple[Catalog, bool]:
    """(catalog, whether this rank read metadata from storage); a collective over ``group``."""
    held = METADATA_CACHE.peek(location, DCP) if cached else None
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (location.cache_key(), None if held is None else held.signature), group=group)
    opened = sorted({key for key, _ in everyone})
    if len(opened) > 1:
        raise InvalidRequestError(
            f"ShardReader(share_metadata=True): the ranks of the metadata group open different checkpoints "
            f"({', '.join(opened[:3])}); pass group= the process group given to dcp.load, or a group inside it "
            "whose ranks load one checkpoint"
        )
    leader = 0 if group is None else dist.get_global_rank(group, 0)
    message: list[Any] = [None]
    if dist.get_rank() == leader:
        message[0] = _leader_message(location, [signature for _, signature in everyone], cached)
    dist.broadcast_object_list(message, src=leader, group=group)
    kind, payload = message[0]
    if kind == "error":
        raise payload
    if kind == "cached":
        assert held is not None and held.signature == payload  # every rank reported holding it
        catalog, was_read = held, False
    else:
        build = lambda loc: catalog_from_inputs(loc, payload)  # noqa: E731
        if cached:
            catalog, _ = METADATA_CACHE.open(location, build, lambda loc: payload.signature, DCP)
        else:
            catalog = build(location)
        was_read = dist.get_rank() == leader
    return with_views(location, catalog, options, shared=cached), was_read


def _leader_message(location: Location, held: list[tuple[Any, ...] | None], cached: bool) -> tuple[str, Any]:
    """What the reading rank sends: the current signature when every rank holds that
    version, else the files' contents; a failure as itself, for every rank to raise."""
    try:
        fmt = catalog_format(location)
        if fmt.name != "dcp":
            raise InvalidRequestError(
                f"{location.url}: ShardReader(share_metadata=True) shares DCP metadata (ours, stock, Megatron "
                f"torch_dist); this is a {fmt.name} checkpoint, load it with share_metadata=False"
            )
        current = catalog_signature(location)
        if cached and all(signature == current for signature in held):
            return "cached", current
        return "inputs", read_catalog_inputs(location).complete()
    except CheckpointError as exc:
        return "error", exc
    except Exception as exc:  # sent to every rank: a plain error of ours always pickles
        return "error", CheckpointError(f"{location.url}: reading the metadata failed ({type(exc).__name__}: {exc})")
