"""Megatron's TP-replica keys (``{key}.__tp_replica_{r}``) served as the plain ``key``.

Megatron's locality saves (seed 000) write a TP-replicated tensor once per TP rank under
a postfixed key, so each rank writes into its own file, and stock readers no longer find
the plain key. We present ``key`` again: its canonical location is the lowest replica, and
the other replicas become copies, so ShardReader serves each rank from the replica in its
own file (the same TP layout) and from any replica when the TP degree changed.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import defaultdict

from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from dcp_ext.formats.index import StoredItem
from dcp_ext.storage.catalog import Catalog

log = logging.getLogger("dcp_ext")
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
        if any(not _same_tensor(canonical, state[fqn]) for _, fqn in replicas[1:]):
            shown = ", ".join(f"{fqn}: {state[fqn].properties.dtype} {list(state[fqn].size)}" for _, fqn in replicas)
            log.warning("%s: TP-replica keys of %r disagree (%s); only the postfixed keys load", catalog.url, key, shown)
            continue
        entries[key] = canonical
        others = [(fqn, _chunk_sizes(state[fqn])) for _, fqn in replicas[1:]]
        for chunk in canonical.chunks:
            index = MetadataIndex(key, chunk.offsets)
            items[index] = catalog.items[MetadataIndex(replicas[0][1], chunk.offsets)]
            copies[index] = [  # a replica chunked otherwise keeps its own key only
                catalog.items[MetadataIndex(fqn, chunk.offsets)]
                for fqn, sizes in others
                if sizes.get(tuple(chunk.offsets)) == tuple(chunk.sizes)
            ]
    metadata = dataclasses.replace(catalog.metadata, state_dict_metadata=entries)
    return catalog.derived(metadata=metadata, items=items, copies=copies)


def _same_tensor(canonical: TensorStorageMetadata, md: TensorStorageMetadata) -> bool:
    """Copies of one tensor have its dtype and shape: a copy that differs would be read
    with the canonical replica's layout (another dtype's bytes taken as its values)."""
    return md.properties.dtype == canonical.properties.dtype and tuple(md.size) == tuple(canonical.size)


def _chunk_sizes(md: TensorStorageMetadata) -> dict[tuple[int, ...], tuple[int, ...]]:
    return {tuple(chunk.offsets): tuple(chunk.sizes) for chunk in md.chunks}
