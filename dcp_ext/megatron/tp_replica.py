"""Megatron's TP-replica keys (``{key}.__tp_replica_{r}``) served as the plain ``key``.

Megatron's locality saves (seed 000) write a TP-replicated tensor once per TP rank under
a postfixed key, so each rank writes into its own file, and stock readers no longer find
the plain key. We present ``key`` again: its canonical location is the lowest replica, and
the other replicas become copies, so ShardReader serves each rank from the replica in its
own file (the same TP layout) and from any replica when the TP degree changed.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from dcp_ext.errors import CorruptCheckpointError
from dcp_ext.formats.index import StoredItem
from dcp_ext.storage.catalog import Catalog

TP_REPLICA_KEY = re.compile(r"^(?P<key>.+)\.__tp_replica_(?P<rank>\d+)$")


def merge_tp_replica_keys(catalog: Catalog) -> Catalog:
    """``catalog`` plus a plain key for every postfixed tensor group (unchanged if none)."""
    state = catalog.metadata.state_dict_metadata
    groups: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for fqn, md in state.items():
        match = TP_REPLICA_KEY.match(fqn)
        if match and match["key"] not in state and isinstance(md, TensorStorageMetadata):
            groups[match["key"]].append((int(match["rank"]), fqn))
    if not groups:
        return catalog
    entries = dict(state)
    items = dict(catalog.items)
    copies: dict[MetadataIndex, list[StoredItem]] = {k: list(v) for k, v in catalog.copies.items()}
    for key, replicas in groups.items():
        replicas.sort()
        canonical = state[replicas[0][1]]
        for _, fqn in replicas[1:]:
            _check_same_tensor(catalog.url, replicas[0][1], canonical, fqn, state[fqn])
        entries[key] = canonical
        for chunk in canonical.chunks:
            index = MetadataIndex(key, chunk.offsets)
            items[index] = catalog.items[MetadataIndex(replicas[0][1], chunk.offsets)]
            copies[index] = [
                catalog.items[MetadataIndex(fqn, chunk.offsets)]
                for _, fqn in replicas[1:]
                if MetadataIndex(fqn, chunk.offsets) in catalog.items
            ]
    metadata = dataclasses.replace(catalog.metadata, state_dict_metadata=entries)
    return catalog.derived(metadata=metadata, items=items, copies=copies)


def _check_same_tensor(url: str, canonical_fqn: str, canonical: TensorStorageMetadata, fqn: str, md: TensorStorageMetadata) -> None:
    """Copies of one tensor have its dtype, shape and chunks: a copy that differs would be
    read with the canonical replica's layout (another dtype's bytes taken as its values)."""
    def facts(entry: TensorStorageMetadata) -> tuple:
        return entry.properties.dtype, tuple(entry.size), sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)

    if facts(md) != facts(canonical):
        raise CorruptCheckpointError(
            f"{url}: TP-replica keys disagree: {fqn!r} is {md.properties.dtype} {list(md.size)} in "
            f"{len(md.chunks)} chunk(s), {canonical_fqn!r} is {canonical.properties.dtype} {list(canonical.size)} in "
            f"{len(canonical.chunks)} chunk(s); copies of one tensor must match"
        )
