"""Start writing a local file to disk while it is still being filled.

A save that fsyncs its data files otherwise works in two serial steps: fill the page
cache (serializing, checksumming: CPU) and then, at the ``fsync``, wait for the disk to
take every byte. Handing each finished stretch of the file to the kernel's writeback at
once lets the disk work while the next records are serialized, so the final ``fsync``
waits only for the last stretch. Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``
starts the writeback of a range and returns; the pages stay cached, so a load right
after the save reads memory, from the large folios the writes made. (Until stop 54
``posix_fadvise(POSIX_FADV_DONTNEED)`` started it, and then dropped every page whose
write had already ended: 25-60% of a file's pages on this machine's disk. Read again,
they come back in small folios: a 2-process checkpoint's four files took 35-36 ms to
read from the page cache after that, 31-32 ms as the writes left them.) Elsewhere the
``fsync`` writes everything.

The coordinator goes further: its ``fsync``s run on threads (``PendingSyncs``) while DCP
gathers the ranks' results and it encodes the metadata, which it used to do only after
them, its main thread idle meanwhile; it waits for them before the commit names the files.
Every other rank's files are durable when its ``write_data`` returns: nothing later tells
the coordinator that they are. Only on file systems whose ``fsync`` takes a file's data
through any descriptor of it (``syncs_later``): a FUSE daemon gets the handle the call
came through, and may hold data per handle, so there each file is synced as written.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import IO

from dcp_ext.runtime.libc import loaded_function
from dcp_ext.runtime.threads import StartedPool
from dcp_ext.storage.cleanup import DEFERS_FREEING, file_system_type
from dcp_ext.storage.location import Location

# Stretch handed to the disk at a time. The disk idles until the first one is handed over:
# at 32 MiB a 60 MB file (0.12 GB saved by two threads) was half written before it started,
# and its fsync waited ~22 ms for the other half (saves 62.1 -> 55.2 ms at 8 MiB; 2 processes
# of 0.54 GB, one thread each, 253.9 -> 230.4 ms; 1.07 GB unchanged). 4 MiB was no faster.
WRITEBACK_BYTES = 8 << 20


_SYNC_FILE_RANGE = loaded_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
_WRITE = 2  # SYNC_FILE_RANGE_WRITE: start writing the range's dirty pages, wait for none


class EarlyWriteback:
    """A file's writes passed through: once ``stretch`` bytes are passed since the last
    stretch was queued, their writeback starts."""

    def __init__(self, out: IO[bytes], stretch: int = WRITEBACK_BYTES):
        self.out = out
        self.fd = out.fileno()
        self.stretch: float = stretch
        self.position = 0  # bytes passed to the file
        self.started = 0  # bytes before this offset are queued for writeback

    def write(self, data: bytes | bytearray | memoryview, /) -> int:
        written = self.out.write(data)
        self.position += written
        if self.position - self.started >= self.stretch:
            self.out.flush()  # the bytes still in the Python buffer must reach the page cache first
            if _SYNC_FILE_RANGE(self.fd, self.started, self.position - self.started, _WRITE) != 0:
                self.stretch = float("inf")  # a file system that refuses it is written back at the fsync
            self.started = self.position
        return written


def early_writeback(out: IO[bytes]) -> EarlyWriteback | None:
    """An ``EarlyWriteback`` for ``out``; None where the platform or the file has no way to it."""
    if _SYNC_FILE_RANGE is None:
        return None
    try:
        out.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return None
    return EarlyWriteback(out)


SYNCED_BY_INODE = DEFERS_FREEING | {"nfs", "nfs4"}  # the kernel's own file systems, whose fsync is per inode


def syncs_later(location: Location) -> bool:
    """Whether files written to ``location`` may be closed first and synced later, through
    a descriptor of their own (``Location.sync_file``)."""
    return location.is_local and file_system_type(location.root) in SYNCED_BY_INODE


class PendingSyncs:
    """``fsync``s of written files, one thread each, started at once and awaited later."""

    def __init__(self, location: Location, names: Sequence[str]):
        self._pool = StartedPool(max(1, len(names)), "dcp_ext-sync")
        self._futures = [self._pool.submit(location.sync_file, name) for name in names]

    def wait(self) -> None:
        """Until every file is durable; the first failure raises (after all have ended)."""
        try:
            for future in self._futures:
                future.exception()
            for future in self._futures:
                future.result()
        finally:
            self._pool.shutdown()

    def __reduce__(self) -> tuple[object, tuple[()]]:
        """A writer pickled into DCP's checkpoint process carries no syncs of this one."""
        return _none, ()


def _none() -> None:
    return None
