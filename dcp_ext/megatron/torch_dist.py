"""Megatron ``torch_dist`` checkpoints: a DCP directory plus Megatron's own extras.

They load through the ordinary catalog path; this module only adjusts what it finds:
- a Megatron save is complete only once rank 0 wrote ``metadata.json`` (last);
- distributed-optimizer tensors saved with a flattened range (megatron-core <= 0.15)
  were stored under a reformulated shape ``[X/x, Y/y, Z/z, x*y*z]``; they are presented
  with their original global shape, each stored range split into the boxes it covers.
  A box keeps its whole record as the stored item and is a view into the record's
  storage (its layout's storage offset), so a verified read or ``dcp-ext verify``
  checks the record's zip CRC-32 over the bytes it covers.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from dcp_ext.errors import CheckpointError, CorruptCheckpointError
from dcp_ext.formats.faults import shown
from dcp_ext.formats.index import StoredItem
from dcp_ext.formats.torch_record import TensorLayout, contiguous_strides, numel
from dcp_ext.formats.validate import is_dims
from dcp_ext.megatron.base import Box, IncompleteSaveError, MegatronOptions, tensor_metadata
from dcp_ext.megatron.flat_range import flat_index, flat_range_boxes
from dcp_ext.megatron.tp_replica import merge_tp_replica_keys
from dcp_ext.runtime.lru import Lru
from dcp_ext.storage.catalog import CACHED_ROWS, METADATA_NAME
from dcp_ext.storage.location import Location

if TYPE_CHECKING:
    from dcp_ext.storage.catalog import Catalog

METADATA_JSON = "metadata.json"
COMMON_PT = "common.pt"
COMMON_STATE_PREFIX = "common_state/shard_"
REFORMULATED = "nd_reformulated_orig_global_shape"
_PROBE_THREADS = 8

# id(raw catalog) -> (raw, view); raw kept alive, so bounded like the metadata cache
_VIEWS: Lru[tuple[Catalog, Catalog]] = Lru(16, lambda entry: entry[0].rows() + entry[1].rows(), CACHED_ROWS)


SAVE_OPTIONS = frozenset({"allow_incomplete"})  # what a torch_dist or zarr save reads of MegatronOptions


def is_megatron_catalog(location: Location, catalog: Catalog) -> bool:
    """Megatron marks: ``mcore_data`` on the metadata, the common-state object, or ``common.pt``.

    Only in data Megatron wrote (no index of ours): ``dcp-ext convert`` copies the
    common-state object into a ShardWriter checkpoint, and its note sends users to the
    source's ``common.pt``, which they may put beside the copy; that copy is complete
    without Megatron's ``metadata.json``.
    """
    metadata = catalog.metadata
    if getattr(metadata, "mcore_data", None) is not None:
        return True
    if catalog.indexed:  # ours (a convert's copy), also with Megatron's common.pt put beside it
        return False
    return any(key.startswith(COMMON_STATE_PREFIX) for key in metadata.state_dict_metadata) or location.exists(COMMON_PT)


def check_complete(location: Location, backend: str, options: MegatronOptions) -> None:
    """Raise IncompleteSaveError unless ``metadata.json`` exists and names ``backend``."""
    if not location.exists(METADATA_JSON):
        if options.allow_incomplete:
            return
        raise IncompleteSaveError(
            f"{location.url}: incomplete Megatron save: {METADATA_JSON} is missing (rank 0 writes it last, "
            "after every shard); pass megatron=MegatronOptions(allow_incomplete=True) (dcp-ext convert "
            "--allow-incomplete) to load it anyway"
        )
    config = read_metadata_json(location)
    if config.get("sharded_backend") != backend:
        raise CorruptCheckpointError(
            f"{location.url}/{METADATA_JSON}: sharded_backend is {config.get('sharded_backend')!r}, "
            f"but the directory holds a {backend} checkpoint"
        )


def read_metadata_json(location: Location) -> dict[str, Any]:
    try:
        config = json.loads(location.read_bytes(METADATA_JSON))
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested thousands deep
        raise CorruptCheckpointError(f"{location.url}/{METADATA_JSON}: not valid JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(config, dict):
        raise CorruptCheckpointError(f"{location.url}/{METADATA_JSON}: expected a JSON object")
    return config


def torch_dist_options(location: Location, catalog: Catalog) -> frozenset[str]:
    """The MegatronOptions a torch_dist checkpoint reads (none for other DCP checkpoints)."""
    return SAVE_OPTIONS if catalog.format == "dcp" and is_megatron_catalog(location, catalog) else frozenset()


def torch_dist_view(location: Location, catalog: Catalog, options: MegatronOptions | None, shared: bool) -> Catalog:
    """The catalog a load should see: checked for completeness, flattened tensors restored,
    TP-replica keys (``{key}.__tp_replica_{r}``) answered as ``key``.

    Plain DCP checkpoints come back unchanged. The view is computed once per parsed
    catalog (it may probe record headers) and, for a ``shared`` one, kept like the catalog
    itself (``cache_metadata=False``: neither is kept).
    """
    if catalog.format != "dcp" or not is_megatron_catalog(location, catalog):
        return catalog
    check_complete(location, "torch_dist", options or MegatronOptions())
    cached = _VIEWS.get(id(catalog), lambda entry: entry[0] is catalog)
    if cached is not None:
        return cached[1]
    shapes = _reformulated_shapes(catalog)
    view = merge_tp_replica_keys(catalog)  # first: its view starts without parsed layouts
    view = _restore_flattened(location, view, shapes) if shapes else view
    if shared:
        _VIEWS.put(id(catalog), (catalog, view))
    return view


def _reformulated_shapes(catalog: Catalog) -> dict[str, tuple[int, ...]]:
    """Key -> original global shape of each tensor saved with a flattened range, from the
    ``mcore_data`` Megatron adds to ``.metadata`` (checked: it comes from the file)."""
    where = f"{catalog.url}/{METADATA_NAME}"
    mcore_data = getattr(catalog.metadata, "mcore_data", None)
    if mcore_data is None:
        return {}
    if not isinstance(mcore_data, dict):
        raise CorruptCheckpointError(f"{where}: mcore_data is a {type(mcore_data).__name__}, expected a dict by key")
    shapes = {}
    for key, data in mcore_data.items():
        shape = data.get(REFORMULATED) if isinstance(data, dict) else None
        if shape is None:
            continue
        if not is_dims(shape):
            raise CorruptCheckpointError(
                f"{where}: mcore_data[{shown(key)}][{REFORMULATED!r}] is {shown(shape)}, "
                "expected a list of sizes (integers 0 to 2**63-1)"
            )
        shapes[key] = tuple(shape)
    return shapes


def _restore_flattened(location: Location, catalog: Catalog, shapes: dict[str, tuple[int, ...]]) -> Catalog:
    metadata = catalog.metadata
    indices = [
        MetadataIndex(key, chunk.offsets)
        for key in shapes
        for chunk in _reformulated_md(catalog, key).chunks
    ]
    unknown = [index for index in indices if catalog.known_layout(index) is None]
    try:
        parsed = dict(zip(unknown, catalog.parse_layouts(location, unknown, _PROBE_THREADS)))
    except FileNotFoundError as exc:  # a bare OSError naming no key, from inside the metadata read
        raise CheckpointError(
            f"{catalog.url}: data file {os.path.basename(exc.filename or '?')!r} is missing; it holds records of "
            "flattened (distributed-optimizer) tensors, whose places are read with the metadata, so no key loads "
            "without it"
        ) from None
    layouts = {index: catalog.known_layout(index) or parsed[index] for index in indices}
    entries = dict(metadata.state_dict_metadata)
    items = {index: item for index, item in catalog.items.items() if index.fqn not in shapes}
    box_layouts: dict[MetadataIndex, TensorLayout] = {}
    for key, shape in shapes.items():
        md = _reformulated_md(catalog, key)
        local = _local_shape(catalog.url, key, shape, tuple(md.size))
        chunks: list[Box] = []
        for chunk in md.chunks:
            index = MetadataIndex(key, chunk.offsets)
            for offsets, sizes, layout in _chunk_boxes(catalog.url, index, tuple(chunk.sizes), local, layouts[index]):
                chunks.append((offsets, sizes))
                box = MetadataIndex(key, torch.Size(offsets))
                items[box], box_layouts[box] = _record_item(catalog.item(index)), layout
        entries[key] = tensor_metadata(md.properties, shape, chunks)
    restored = Metadata(entries, metadata.planner_data, None, metadata.storage_meta, metadata.version)
    # _layouts: what known_layout answers for a box, a view into its record
    return catalog.derived(metadata=restored, items=items, _layouts=box_layouts)


def _record_item(item: StoredItem) -> StoredItem:
    """A box's stored item: its whole record, so the record's checksum still covers what
    is read. Without a payload offset, a layout comes from the view's parsed layouts
    (``Catalog.known_layout``), never from the box's own shape."""
    return item._replace(payload_offset=-1)


def _reformulated_md(catalog: Catalog, key: str) -> TensorStorageMetadata:
    md = catalog.metadata.state_dict_metadata.get(key)
    if not isinstance(md, TensorStorageMetadata):
        raise CorruptCheckpointError(f"{catalog.url}: mcore_data names {key!r}, which is not a stored tensor")
    return md


def _local_shape(url: str, key: str, shape: tuple[int, ...], stored: tuple[int, ...]) -> tuple[int, ...]:
    """The per-rank block shape: global / fragmentation on every axis."""
    grid = stored[:-1]
    if not stored or len(grid) != len(shape) or any(g <= 0 or s % g for s, g in zip(shape, grid)):
        raise CorruptCheckpointError(
            f"{url}: key {key!r} is stored as {list(stored)}, which is no reformulation of {list(shape)}"
        )
    local = tuple(s // g for s, g in zip(shape, grid))
    if numel(local) != stored[-1]:
        raise CorruptCheckpointError(
            f"{url}: key {key!r}: blocks of {list(local)} hold {numel(local)} elements, stored rows hold {stored[-1]}"
        )
    return local


def _chunk_boxes(
    url: str, index: MetadataIndex, sizes: tuple[int, ...], local: tuple[int, ...], layout: TensorLayout
) -> list[tuple[tuple[int, ...], tuple[int, ...], TensorLayout]]:
    """Boxes (in the original shape) of one stored flattened range, each with its layout:
    the record's, narrowed to the box by shape and storage offset (the payload and its
    CRC-32 stay the record's)."""
    if any(s != 1 for s in sizes[:-1]) or (sizes[-1] > 1 and layout.stride[-1] != 1):
        where = f"{url}: key {index.fqn!r} chunk at {list(index.offset)}"
        raise CorruptCheckpointError(f"{where}: a flattened range must be one contiguous row, found {list(sizes)}")
    grid, start = tuple(index.offset[:-1]), index.offset[-1]
    origin = tuple(g * n for g, n in zip(grid, local))
    out = []
    for offsets, box in flat_range_boxes(local, start, start + sizes[-1]):
        storage_offset = layout.storage_offset + flat_index(local, offsets) - start
        view = dataclasses.replace(layout, shape=box, stride=contiguous_strides(box), storage_offset=storage_offset)
        out.append((tuple(o + p for o, p in zip(origin, offsets)), box, view))
    return out


def common_state_key(metadata: Metadata) -> str | None:
    """The bytes item holding the common state (newer megatron-core), if any."""
    keys = sorted(k for k in metadata.state_dict_metadata if k.startswith(COMMON_STATE_PREFIX))
    return keys[0] if keys else None

