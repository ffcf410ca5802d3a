"""Tell a checkpoint directory's format and open the matching Megatron source, once per process.

DCP directories (stock, ShardWriter, Megatron torch_dist) have ``.metadata`` and take
the ordinary catalog path: ``open_source`` returns None for them. zarr and legacy
directories become sources; building one parses every ``.zarray`` or loads every rank
file's pickle, so sources are cached per process and revalidated by file signatures.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from dcp_ext.megatron.base import IncompleteSaveError, MegatronOptions, MegatronSource
from dcp_ext.megatron.legacy import LegacySource
from dcp_ext.megatron.legacy_layout import is_legacy, list_dir
from dcp_ext.megatron.torch_dist import METADATA_JSON, read_metadata_json
from dcp_ext.megatron.zarr_format import ZarrSource, has_zarr_arrays
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


class SourceCache:
    """Small LRU of built sources keyed by directory and options, checked by signature."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[Any, ...], MegatronSource] = OrderedDict()
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def get(self, key: tuple[Any, ...]) -> MegatronSource | None:
        with self._lock:
            source = self._entries.get(key)
        if source is None or source.signature() != getattr(source, "_signature", None):
            return None
        with self._lock:
            self._entries.move_to_end(key)
        return source

    def put(self, key: tuple[Any, ...], source: MegatronSource) -> None:
        source._signature = source.signature()  # type: ignore[attr-defined]
        with self._lock:
            self._entries[key] = source
            while len(self._entries) > _MAX_SOURCES:
                self._entries.popitem(last=False)


SOURCES = SourceCache()


def open_source(location: Location, options: MegatronOptions, cached: bool = True) -> MegatronSource | None:
    """The zarr/legacy source for ``location``, or None for a DCP (or unknown) directory."""
    kind = detect_format(location)
    if kind not in ("zarr", "legacy"):
        return None
    key = (location.cache_key(), kind, options.cache_key())
    source = SOURCES.get(key) if cached else None
    if source is None:
        source = ZarrSource(location, options) if kind == "zarr" else LegacySource(location, options)
        if cached:
            SOURCES.put(key, source)
    return source
