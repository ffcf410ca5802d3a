"""Start a cold load's first disk reads while the reader is still planning them.

``ShardReader.read_data`` checks its plan against the checkpoint and turns it into
byte-range requests before its first data read: 7-12 ms at 2 processes, 3-4 ms in one,
in which a cold load's disk idles. As ``read_data`` starts, the reader names the ranges
its first files will be read from (``first_ranges``) and a helper thread asks the kernel
for them (``POSIX_FADV_WILLNEED``). A file whose first page the page cache holds (a warm
load) is left alone: a warm load pays one probe a file. Only the first
``READ_AHEAD_BYTES`` of a load: asking for all of its ranges made cold loads slower (the
kernel's reads of whole ranges compete with the readers' own).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable

from dcp_ext.errors import CheckpointError
from dcp_ext.formats.index import StoredItem
from dcp_ext.storage.location import Location

READ_AHEAD_BYTES = 16 << 20  # about what the disk gives one process in the gap (0.8-1.2 GB/s)
SHARE_FRACTION = 16  # a file's head is at most this fraction of a reader thread's share of the load

FileRanges = list[tuple[str, list[tuple[int, int]]]]  # (file, its (offset, length) ranges in order)


def first_ranges(records: Iterable[StoredItem], threads: int, budget: int = READ_AHEAD_BYTES) -> FileRanges:
    """The ranges a load reads first: of the first ``threads`` of its files in the order
    the reader reads them (by name), the records' bytes within a head of each file, from
    its first record: an even share of ``budget``, and at most 1/``SHARE_FRACTION`` of a
    thread's share of the load. A longer head slowed short loads (0.12 GB, one process,
    four 30 MB stretches: 105 -> 122 ms with 8 MiB heads, unchanged with 2 MiB) while
    long ones gained (1.07 GB: 870 -> 811 ms with 8 MiB heads, unchanged with 2 MiB).
    Records whose payload the index places (ours) only: a stock record's ends are read
    and parsed first, and reading ahead beside those small reads slowed a cold 2-process
    load of a stock checkpoint (498 -> 549 ms)."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    total = 0
    for record in records:
        total += record.length
        if record.length and record.payload_offset >= 0:
            by_file.setdefault(record.relative_path, []).append((record.offset, record.length))
    names = sorted(by_file)[:threads]
    head = min(budget // max(1, len(names)), total // max(1, threads) // SHARE_FRACTION)
    heads: FileRanges = []
    for name in names:
        ranges = sorted(by_file[name])
        end = ranges[0][0] + head
        heads.append((name, [(offset, min(length, end - offset))
                             for offset, length in itertools.takewhile(lambda r: r[0] < end, ranges)]))
    return [(name, ranges) for name, ranges in heads if ranges]


def start_read_ahead(location: Location, heads: FileRanges) -> threading.Thread | None:
    """Ask for the ranges of ``heads`` whose file's first page is not cached, on a helper
    thread (the kernel's advice blocks ~1 ms per 8 MiB while it queues the reads); local
    files only: a remote store has no page cache to fill."""
    if not location.is_local:
        return None
    cold = [(name, ranges) for name, ranges in heads if not _cached(location, name, ranges[0][0])]
    if not cold:
        return None
    thread = threading.Thread(target=_read_ahead, args=(location, cold), name="dcp_ext-willneed", daemon=True)
    thread.start()
    return thread


def _cached(location: Location, name: str, offset: int) -> bool:
    """Whether the page at ``offset`` of ``name`` is cached; True where that cannot be told."""
    try:
        with location.open_reader(name) as reader:
            return reader.holds([offset])
    except (OSError, CheckpointError):  # advice only: the load's own read of the file reports it
        return True


def _read_ahead(location: Location, heads: FileRanges) -> None:
    for name, ranges in heads:
        try:
            with location.open_reader(name) as reader:
                reader.prefetch(ranges)
        except (OSError, CheckpointError):  # (as in _cached)
            continue
