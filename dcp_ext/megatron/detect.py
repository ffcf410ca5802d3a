"""Tell a checkpoint directory's format and open the matching Megatron source, once per process.

DCP directories (stock, ShardWriter, Megatron torch_dist) have ``.metadata`` and take
the ordinary catalog path: ``open_source`` returns None for them. zarr and legacy
directories become sources; building one parses every ``.zarray`` or loads every rank
file's pickle, so sources are cached per process and revalidated by file signatures.
"""

from __future__ import annotations

from typing import Any

from dcp_ext.megatron.base import IncompleteSaveError, MegatronOptions, MegatronSource
from dcp_ext.megatron.legacy import LegacySource
from dcp_ext.megatron.legacy_layout import is_legacy, list_dir
from dcp_ext.megatron.torch_dist import METADATA_JSON, read_metadata_json
from dcp_ext.megatron.zarr_format import ZarrSource, has_zarr_arrays
from dcp_ext.runtime.lru import Lru
from dcp_ext.storage.location import Location

DCP_METADATA = ".metadata"
_MAX_SOURCES = 4


def detect_format(location: Location) -> str | None:
    """"dcp" (torch_dist included), "zarr", "legacy", or None when nothing is recognized."""
    if location.exists(DCP_METADATA):
        return "dcp"
    names = list_dir(location)
    if METADATA_JSON in names:
        backend = read_metadata_json(location).get("sharded_backend")
        if backend == "zarr":
            return "zarr"
        if backend == "torch_dist":
            raise IncompleteSaveError(f"{location.url}: metadata.json says torch_dist but {DCP_METADATA} is missing")
    if is_legacy(names):
        return "legacy"
    if has_zarr_arrays(location):
        return "zarr"  # without metadata.json: ZarrSource reports the incomplete save
    return None


SOURCES: Lru[tuple[tuple[Any, ...], MegatronSource]] = Lru(_MAX_SOURCES)  # (files' signature when built, source)


def open_source(location: Location, options: MegatronOptions, cached: bool = True) -> MegatronSource | None:
    """The zarr/legacy source for ``location``, or None for a DCP (or unknown) directory."""
    kind = detect_format(location)
    if kind not in ("zarr", "legacy"):
        return None
    key = (location.cache_key(), kind, options.cache_key())
    entry = SOURCES.get(key, lambda built: built[1].signature() == built[0]) if cached else None
    if entry is not None:
        return entry[1]
    source = ZarrSource(location, options) if kind == "zarr" else LegacySource(location, options)
    if cached:
        SOURCES.put(key, (source.signature(), source))
    return source
