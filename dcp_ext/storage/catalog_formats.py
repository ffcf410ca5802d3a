"""Which catalog a checkpoint directory is read as: DCP (``.metadata``) or safetensors.

Both end as a ``Catalog`` (metadata + byte locations), so every load, the metadata
cache, ``dcp-ext inspect`` and ``verify`` take one path whatever wrote the files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dcp_ext.storage.catalog import METADATA_CACHE, Catalog, catalog_signature, read_catalog
from dcp_ext.storage.location import Location
from dcp_ext.storage.safetensors_catalog import read_safetensors_catalog, safetensors_files, safetensors_signature


@dataclass(frozen=True)
class CatalogFormat:
    name: str
    read: Callable[[Location], Catalog]
    signature: Callable[[Location], tuple[Any, ...]]
    checksums: bool  # whether the format records checksums a verified read can check


DCP = CatalogFormat("dcp", read_catalog, catalog_signature, checksums=True)
SAFETENSORS = CatalogFormat("safetensors", read_safetensors_catalog, safetensors_signature, checksums=False)
FORMATS = {f.name: f for f in (DCP, SAFETENSORS)}


def catalog_format(location: Location) -> CatalogFormat:
    """Safetensors for a directory of ``*.safetensors`` files without ``.metadata``; else DCP."""
    return SAFETENSORS if safetensors_files(location) else DCP


def open_catalog(location: Location, cached: bool = True) -> tuple[Catalog, bool]:
    """(catalog, whether metadata was read from storage), through the process cache."""
    fmt = catalog_format(location)
    if cached:
        return METADATA_CACHE.open(location, fmt.read, fmt.signature)
    return fmt.read(location), True
