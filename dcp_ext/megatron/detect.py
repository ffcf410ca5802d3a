"""Tell a Megatron checkpoint directory's format, and register the Megatron formats with storage.

DCP directories (stock, ShardWriter, Megatron torch_dist) have ``.metadata`` and are read
as DCP, with the torch_dist view applied; zarr and legacy directories become catalogs of
their own (``zarr_format``, ``legacy``). Registering here, when ``dcp_ext.megatron`` is
imported (``import dcp_ext`` does), keeps storage free of imports from this package.
"""

from __future__ import annotations

from typing import Any

from dcp_ext.errors import CorruptCheckpointError
from dcp_ext.megatron.base import IncompleteSaveError, MegatronOptions
from dcp_ext.megatron.legacy import legacy_signature, read_legacy_catalog
from dcp_ext.megatron.legacy_layout import is_legacy
from dcp_ext.megatron.torch_dist import METADATA_JSON, SAVE_OPTIONS, read_metadata_json, torch_dist_options, torch_dist_view
from dcp_ext.megatron.zarr_format import has_zarr_arrays, read_zarr_catalog, zarr_signature
from dcp_ext.storage.catalog_formats import CatalogFormat, register_format, register_view
from dcp_ext.storage.location import Location

DCP_METADATA = ".metadata"


def detect_format(location: Location, arrays: bool = True) -> str | None:
    """"dcp" (torch_dist included), "zarr", "legacy", or None when nothing is recognized.

    ``arrays=False`` skips the last look, for zarr arrays without ``metadata.json`` (one
    ``exists`` per entry): what the legacy detector needs, after the zarr one looked."""
    if location.exists(DCP_METADATA):
        return "dcp"
    names = location.listdir()
    if METADATA_JSON in names:
        try:
            backend = read_metadata_json(location).get("sharded_backend")
        except CorruptCheckpointError:  # no Megatron's: the legacy files, or the zarr reader, say what is there
            backend = None
        if backend == "zarr":
            return "zarr"
        if backend == "torch_dist":
            raise IncompleteSaveError(f"{location.url}: metadata.json says torch_dist but {DCP_METADATA} is missing")
    if is_legacy(names):
        return "legacy"
    if arrays and has_zarr_arrays(location):
        return "zarr"  # without metadata.json: the zarr reader reports the incomplete save
    return None


def _options_key(options: Any) -> tuple[Any, ...]:
    return (options or MegatronOptions()).cache_key()


register_format(CatalogFormat(
    "zarr", lambda location: detect_format(location) == "zarr", read_zarr_catalog, zarr_signature,
    checksums=False, options_key=_options_key, option_names=SAVE_OPTIONS, records_fill_files=True,
))
register_format(CatalogFormat(
    "legacy", lambda location: detect_format(location, arrays=False) == "legacy", read_legacy_catalog, legacy_signature,
    checksums=False, options_key=_options_key, option_names=frozenset({"iteration", "partition_dims"}),
))
register_view(torch_dist_view, torch_dist_options)
