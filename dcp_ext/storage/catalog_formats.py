"""Which format a checkpoint directory is read as; formats register themselves here.

Every on-disk format ends as a ``Catalog``: DCP metadata plus, for each stored item, the
file and byte range that hold it and its tensor layout. That is the *source* side of a
load; executors (local scatter reads, the two-stage exchange) run the byte-range requests
a catalog yields, so every format gets the same reads, stats, reports, fsspec URLs,
two-stage exchange and checksum checks. DCP (ours and stock) and safetensors register in
this module; ``dcp_ext.megatron`` registers Megatron zarr and legacy ``mp_rank_*`` and the
torch_dist view, so storage never imports a format package above it.

To add a format: write ``read(location, options) -> Catalog`` and a cheap ``signature``,
and ``register_format`` it with a ``detect`` test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dcp_ext.errors import IgnoredOptionsError
from dcp_ext.storage.catalog import METADATA_CACHE, METADATA_NAME, Catalog, catalog_signature, read_catalog
from dcp_ext.storage.location import Location
from dcp_ext.storage.safetensors_catalog import read_safetensors_catalog, safetensors_files, safetensors_signature


@dataclass(frozen=True)
class CatalogFormat:
    """One on-disk format.

    ``options`` is what the reader was given for formats that need choices (today
    ``ShardReader(megatron=MegatronOptions(...))``); ``options_key`` makes it part of the
    metadata cache key, so two option sets never share a parsed catalog. ``option_names``
    are the options the format reads: one given for a checkpoint that reads none of them
    is refused (``with_views``), not ignored.
    """

    name: str
    detect: Callable[[Location], bool]
    read: Callable[[Location, Any], Catalog]
    signature: Callable[[Location, Any], tuple[Any, ...]]
    checksums: bool  # whether the format records checksums a verified read can check
    records_fill_files: bool = False  # each stored record is a whole file (zarr chunks): any other size is corrupt
    options_key: Callable[[Any], tuple[Any, ...]] = lambda options: ()
    option_names: frozenset[str] = frozenset()


# adjusts a catalog after it is read (torch_dist); the flag: the catalog is shared (the
# metadata cache holds it), so the view may be kept for the next load of it too
View = Callable[[Location, Catalog, Any, bool], Catalog]
ViewOptions = Callable[[Location, Catalog], frozenset[str]]  # the options a view reads for this catalog

FORMATS: dict[str, CatalogFormat] = {}
_VIEWS: list[tuple[View, ViewOptions]] = []


def register_format(fmt: CatalogFormat) -> None:
    """Add a format; formats are detected in registration order, DCP first."""
    FORMATS[fmt.name] = fmt


def register_view(view: View, option_names: ViewOptions) -> None:
    _VIEWS.append((view, option_names))


register_format(CatalogFormat(
    "dcp", lambda location: location.exists(METADATA_NAME), lambda location, _: read_catalog(location),
    lambda location, _: catalog_signature(location), checksums=True,
))
register_format(CatalogFormat(
    "safetensors", lambda location: bool(safetensors_files(location)),
    lambda location, _: read_safetensors_catalog(location), lambda location, _: safetensors_signature(location),
    checksums=False,
))


def held_format(location: Location) -> str | None:
    """The name of the first registered format that recognises the directory (the
    checkpoint it holds), or None."""
    return next((fmt.name for fmt in FORMATS.values() if fmt.detect(location)), None)


def catalog_format(location: Location) -> CatalogFormat:
    """The format of the directory's checkpoint; DCP when none is recognised (its reader
    then reports the missing ``.metadata``)."""
    return FORMATS[held_format(location) or "dcp"]


def replaced_since_read(location: Location, catalog: Catalog, options: Any = None) -> bool:
    """Whether the directory's checkpoint is no longer the one ``catalog`` was read from: a
    newer save was committed into it since (the files its records name may be retired)."""
    return FORMATS[catalog.format].signature(location, options) != catalog.signature


def open_catalog(location: Location, cached: bool = True, options: Any = None, check_options: bool = True) -> tuple[Catalog, bool]:
    """(catalog with every registered view applied, whether metadata was read from storage);
    ``check_options=False`` takes options that do not apply as unset (``dcp-ext inspect``
    reads any checkpoint with ``allow_incomplete``)."""
    fmt = catalog_format(location)
    read = lambda loc: fmt.read(loc, options)  # noqa: E731
    signature = lambda loc: fmt.signature(loc, options)  # noqa: E731
    if cached:
        catalog, was_read = METADATA_CACHE.open(location, read, signature, (fmt.name, *fmt.options_key(options)))
    else:
        catalog, was_read = read(location), True
    return with_views(location, catalog, options, check_options, shared=cached), was_read


def check_options_apply(location: Location, options: Any, used: frozenset[str], kind: str) -> None:
    """Refuse the options given (``options.given()``) that a ``kind`` checkpoint, which
    reads ``used``, would ignore."""
    unused = sorted(options.given() - used)
    if unused:
        given = ", ".join(f"{name}=..." for name in unused)
        raise IgnoredOptionsError(
            f"{location.url}: megatron=MegatronOptions({given}) would be ignored: {ignored_because(kind, sorted(used))}",
            tuple(unused),
            tuple(sorted(used)),
            kind,
        )


def ignored_because(kind: str, used: list[str]) -> str:
    """Why options would be ignored, with ``used`` (the ones a ``kind`` checkpoint reads)
    spelled as the caller names them."""
    return f"this {kind} checkpoint reads only {', '.join(used)}" if used else f"this {kind} checkpoint reads none"


def with_views(location: Location, catalog: Catalog, options: Any = None, check_options: bool = True, shared: bool = False) -> Catalog:
    """``catalog`` as a load should see it: every registered view applied, after checking
    that every option given applies to it (``options.given()``: the ones set). ``shared``:
    the metadata cache holds ``catalog``; a view of any other is made for this load alone."""
    if options is not None and check_options:
        used = FORMATS[catalog.format].option_names.union(*(names(location, catalog) for _, names in _VIEWS))
        check_options_apply(location, options, used, "Megatron torch_dist" if catalog.format == "dcp" and used else catalog.format)
    for view, _ in _VIEWS:
        catalog = view(location, catalog, options, shared)
    return catalog
