"""Offline verification of a checkpoint: completeness, files and every checksum.

Used by ``dcp-ext verify``. It reads each referenced file once, sequentially, in
bounded blocks, and reports every fault it finds instead of stopping at the first.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import crc32c
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from dcp_ext.errors import CheckpointError
from dcp_ext.runtime.options import callback
from dcp_ext.formats.index import StoredItem
from dcp_ext.formats.torch_record import TensorLayout, archive_crc_fault
from dcp_ext.formats.transforms import decode, record_limit
from dcp_ext.formats.validate import chunk_faults
from dcp_ext.storage.catalog import Catalog, stored_metadata_facts
from dcp_ext.storage.catalog_formats import FORMATS, open_catalog, replaced_since_read
from dcp_ext.formats.data_files import is_data_file
from dcp_ext.storage.location import Location

BLOCK_BYTES = 16 << 20


@dataclass
class VerifyReport:
    path: str
    faults: list[str] = field(default_factory=list)
    items_checked: int = 0
    items_without_checksum: int = 0
    bytes_checked: int = 0
    files: int = 0
    unreferenced_files: list[str] = field(default_factory=list)
    indexed: bool = False
    committed: bool = False  # see Catalog.committed; a fault only where the marker is the commit point
    save_id: str | None = None  # which save this checkpoint is (from its storage meta)
    changed: bool = False  # a newer save was committed while the check ran: its one fault says so

    @property
    def ok(self) -> bool:
        return not self.faults


def verify_checkpoint(
    path: str,
    storage_options: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check ``path``; ``progress(done_bytes, total_bytes)`` is called as data is read."""
    callback("verify_checkpoint", "progress", progress)
    location = Location(path, storage_options)
    report = VerifyReport(location.url)
    try:
        catalog, _ = open_catalog(location, cached=False)
    except CheckpointError as exc:
        report.faults.append(str(exc))
        return report
    _check_catalog(catalog, location, report, progress)
    if report.faults and replaced_since_read(location, catalog):
        # the files looked at were partly the old checkpoint's, partly the new one's (or retired)
        report.changed = True
        report.faults = [
            f"{location.url}: a newer save was committed into this directory while verify ran (the "
            f"{len(report.faults)} fault(s) seen were in files it replaced or retired); run verify again"
        ]
    return report


def _check_catalog(
    catalog: Catalog, location: Location, report: VerifyReport, progress: Callable[[int, int], None] | None
) -> None:
    """Every check of one opened catalog, its faults into ``report``."""
    report.indexed = catalog.indexed
    if catalog.format == "dcp" and catalog.indexed and stored_metadata_facts(location)[1] != catalog.fingerprint:  # a load trusts the marker's stamp
        report.faults.append(f"{location.url}/.metadata: CRC32C differs from what the index and commit marker recorded (stock DCP readers read this file)")
    report.committed = catalog.committed
    report.save_id = getattr(catalog.metadata.storage_meta, "save_id", None)
    if not catalog.committed and not location.is_local:
        report.faults.append(
            f"{location.url}: not committed (no commit marker matches .metadata: a save was interrupted or is running)"
        )
    for fqn, md in catalog.metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            report.faults.extend(chunk_faults(fqn, md))
    by_file = _records_by_file(catalog)
    report.files = len(by_file)
    shards = catalog.format == "safetensors"  # files the index leaves out: stock's HF reader reads every one
    report.unreferenced_files = sorted(
        n for n in location.listdir() if (is_data_file(n) or (shards and n.endswith(".safetensors"))) and n not in by_file
    )
    total = sum(item.length for entries in by_file.values() for _, item in entries)
    done = 0
    for name, entries in sorted(by_file.items()):
        entries.sort(key=lambda entry: entry[1].offset)
        holds = ", ".join(sorted({i.fqn for i, _ in entries}))
        file_end = done + sum(item.length for _, item in entries)
        try:
            size = location.size(name)
            if size is None:
                report.faults.append(f"{name}: missing (holds {holds})")
                continue
            for nbytes in _check_file(catalog, location, report, name, entries, size):
                done += nbytes
                if progress:
                    progress(done, total)
        except CheckpointError as exc:  # a file that cannot be read (a directory, no access)
            report.faults.append(f"{exc} (holds {holds})")
        except FileNotFoundError:  # removed after its size was read
            report.faults.append(f"{name}: missing (holds {holds})")
        finally:
            done = file_end


def _records_by_file(catalog: Catalog) -> dict[str, list[tuple[MetadataIndex, StoredItem]]]:
    """Each stored record once, by file: canonical items and TP-replica copies alike. Items
    sharing a record (the boxes a Megatron flattened range is split into) are checked once."""
    by_file: dict[str, list[tuple[MetadataIndex, StoredItem]]] = {}
    seen: set[tuple[str, int, int]] = set()
    for index, item in catalog.items.items():
        for stored in (item, *catalog.copies.get(index, ())):
            record = (stored.relative_path, stored.offset, stored.length)
            if record not in seen:
                seen.add(record)
                by_file.setdefault(stored.relative_path, []).append((index, stored))
    return by_file


def _check_file(
    catalog: Catalog, location: Location, report: VerifyReport, name: str, entries: list[tuple[MetadataIndex, StoredItem]], size: int
) -> Iterator[int]:
    """Check the items of data file ``name`` (``size`` bytes) into ``report``; yields each
    item's bytes once it is checked (progress)."""
    whole_files = FORMATS[catalog.format].records_fill_files
    with location.open_reader(name) as reader:
        for index, item in entries:
            if item.offset + item.length > size:
                report.faults.append(f"{name}: key {index.fqn!r} needs bytes up to {item.offset + item.length}, file has {size}")
            elif whole_files and item.offset + item.length != size:
                report.faults.append(f"{name}: key {index.fqn!r}: the file holds {size} bytes, but its record is "
                                     f"{item.length} bytes; a chunk file holds exactly one chunk")
            else:
                fault, recorded = _check_item(catalog, location, reader, index, item)
                if fault:
                    report.faults.append(f"{name}: key {index.fqn!r}: {fault}")
                report.items_checked += 1
                report.items_without_checksum += not recorded
                report.bytes_checked += item.length
            yield item.length


def _check_item(  # noqa: ANN001
    catalog: Catalog, location: Location, reader, index: MetadataIndex, item: StoredItem
) -> tuple[str | None, bool]:
    """(a fault description or None, whether the item records a checksum to check)."""
    if not FORMATS[catalog.format].checksums:
        return None, False  # safetensors records none: the structure and file sizes were checked
    if item.checksum is not None:
        value = _stream_crc(reader, item.offset, item.length, crc32c.crc32c)
        expected, algorithm = item.checksum, "crc32c"
    elif item.transforms:  # a stock compressed record: the zip CRC-32s inside the decoded record
        where = f"{location.url}: file {item.relative_path!r} key {index.fqn!r}"
        return _transformed_fault(reader, item, where, record_limit(catalog.chunk_nbytes(index))), True
    elif index.offset is not None:  # stock tensor record: the zip entry CRC-32
        try:
            layout = _record_layout(catalog, location, index)
        except (CheckpointError, OSError) as exc:
            return str(exc), True
        if layout.payload_crc32 is None:  # what a verified load refuses too: nothing vouches for these bytes
            return (
                "record carries no checksum: written by dcp_ext without zip CRC-32s, its CRC32C is in the "
                "checkpoint's index, missing or stale here (restore the index or save again)"
            ), False
        value = _stream_crc(reader, item.offset + layout.payload_offset, layout.payload_nbytes, zlib.crc32)
        expected, algorithm = layout.payload_crc32, "crc32"
    else:  # a stock bytes item: a torch.save archive, with the zip CRC-32 of each entry
        record = bytearray(item.length)
        reader.read_into(item.offset, [memoryview(record)])
        carries, fault = archive_crc_fault(record)
        return fault, carries
    if value != expected:
        return f"{algorithm} mismatch (recorded {expected:#010x}, read {value:#010x})", True
    return None, True


def _record_layout(catalog: Catalog, location: Location, index: MetadataIndex) -> TensorLayout:
    """The layout of a stock record with its zip CRC-32: the one the catalog knows when it
    has that CRC (a view's box of a Megatron flattened range, which parsing the box could
    not give), else parsed from the record (our index does not keep the zip CRC)."""
    known = catalog.known_layout(index)
    if known is not None and known.payload_crc32 is not None:
        return known
    return catalog.parse_layout(location, index)


def _transformed_fault(reader, item: StoredItem, where: str, limit: int) -> str | None:  # noqa: ANN001
    stored = bytearray(item.length)
    reader.read_into(item.offset, [memoryview(stored)])
    try:
        record = decode(item.transforms, stored, where, limit)
    except CheckpointError as exc:
        return str(exc)
    fault = archive_crc_fault(record)[1]
    return None if fault is None else f"{fault} after undoing {list(item.transforms)}"


def _stream_crc(reader, offset: int, length: int, update: Callable[..., int]) -> int:  # noqa: ANN001
    buf = bytearray(min(length, BLOCK_BYTES))
    value, pos = 0, 0
    while pos < length:
        n = min(len(buf), length - pos)
        view = memoryview(buf)[:n]
        reader.read_into(offset + pos, [view])
        value = update(view, value)
        pos += n
    return value
