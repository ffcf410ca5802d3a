"""A checkpoint directory on local disk or on any fsspec filesystem.

Local paths get a fast path (``os.preadv`` scatter reads, ``fsync`` of files and of the
directory, atomic ``os.replace``); everything else goes through fsspec. All names are
validated so that nothing outside the checkpoint directory is ever read or written.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import shutil
from collections.abc import Iterator, Sequence
from typing import IO, Any

import fsspec

from dcp_ext.errors import CheckpointError, StorageFullError, UnsafeCheckpointError
from dcp_ext.formats.data_files import check_relative_name

IOV_MAX = 1024  # scatter buffers per preadv call (the Linux limit)
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class Location:
    """One checkpoint directory, addressed by a local path or a URL."""

    def __init__(self, path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None):
        text = os.fspath(path)
        if "://" in text and not text.startswith("file://"):
            fs, root = fsspec.core.url_to_fs(text, **(storage_options or {}))
            self.fs: fsspec.AbstractFileSystem | None = fs
            self.root = root.rstrip("/") or root
            self.url = fs.unstrip_protocol(self.root)
        else:
            if text.startswith("file://"):
                text = text[len("file://") :]
            self.fs = None
            self.root = os.path.abspath(text)
            self.url = self.root

    @property
    def is_local(self) -> bool:
        return self.fs is None

    def cache_key(self) -> str:
        """Canonical identity of the directory, used to share parsed metadata."""
        return os.path.realpath(self.root) if self.is_local else self.url

    def path(self, name: str, key: str = "") -> str:
        check_relative_name(self.url, name, key)
        if self.is_local:
            full = os.path.join(self.root, name)
            real_root = os.path.realpath(self.root)
            real = os.path.realpath(full)
            if os.path.commonpath([real_root, real]) != real_root:
                raise UnsafeCheckpointError(
                    f"{self.url}: {name!r}{f' (key {key!r})' if key else ''} resolves to "
                    f"{real}, outside the checkpoint directory"
                )
            return full
        return posixpath.join(self.root, name)

    # -- queries -----------------------------------------------------------------------
    def exists(self, name: str) -> bool:
        full = self.path(name)
        return os.path.exists(full) if self.fs is None else self.fs.exists(full)

    def size(self, name: str) -> int | None:
        """Size in bytes, or None when the file is missing."""
        full = self.path(name)
        try:
            if self.fs is None:
                return os.stat(full).st_size
            return int(self.fs.size(full))
        except (FileNotFoundError, OSError):
            return None

    def signature(self, name: str) -> tuple[Any, ...] | None:
        """A cheap fingerprint that changes when the file is rewritten (None: missing).

        Locally the ctime is part of it: every write or rename sets it to now, and unlike
        mtime no tool (tar, rsync, ``os.utime``) can set it back, so an in-place rewrite
        that keeps size, mtime and inode still changes it.
        """
        full = self.path(name)
        try:
            if self.fs is None:
                st = os.stat(full)
                return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
            self.fs.invalidate_cache(full)
            info = self.fs.info(full)
        except (FileNotFoundError, OSError):
            return None
        tag = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified")
        return (info.get("size"), str(tag), info.get("created"))

    def listdir(self) -> list[str]:
        if self.fs is None:
            return os.listdir(self.root) if os.path.isdir(self.root) else []
        self.fs.invalidate_cache(self.root)  # other processes write here too
        try:
            return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []

    # -- reading -----------------------------------------------------------------------
    def read_bytes(self, name: str) -> bytes:
        """The whole file; FileNotFoundError when it is missing, CheckpointError when it
        cannot be a checkpoint file (the root is a file, the name a directory, no access)."""
        full = self.path(name)
        try:
            if self.fs is None:
                with open(full, "rb") as f:
                    return f.read()
            return bytes(self.fs.cat_file(full))
        except NotADirectoryError:
            raise CheckpointError(f"{self.url}: is a file, not a checkpoint directory") from None
        except IsADirectoryError:
            raise CheckpointError(f"{self.url}: {name} is a directory, expected a file") from None
        except PermissionError as exc:
            raise CheckpointError(f"{self.url}: cannot read {name} ({exc.strerror})") from None

    def open_file(self, name: str) -> IO[bytes]:
        """A seekable binary file object, for parsers that read a file's structure
        (zip directories, pickles) with seeks; data reads go through ``open_reader``."""
        full = self.path(name)
        return open(full, "rb") if self.fs is None else self.fs.open(full, "rb")  # noqa: SIM115

    @contextlib.contextmanager
    def open_reader(self, name: str, key: str = "") -> Iterator[RangeReader]:
        full = self.path(name, key)
        reader = LocalRangeReader(full) if self.fs is None else FsspecRangeReader(self.fs.open(full, "rb"))
        try:
            yield reader
        finally:
            reader.close()

    # -- writing -----------------------------------------------------------------------
    def makedirs(self) -> bool:
        """Create the directory and its parents; True when this call created it (a failed
        save removes a directory it created, see ``remove_dir_if_empty``)."""
        if self.fs is not None:
            existed = self.fs.isdir(self.root)
            self.fs.makedirs(self.root, exist_ok=True)
            return not existed
        try:
            os.makedirs(self.root)
            return True
        except FileExistsError:
            if not os.path.isdir(self.root):
                raise
            return False

    def remove_dir_if_empty(self) -> None:
        """Best effort: a directory that still holds anything stays."""
        with contextlib.suppress(OSError):
            if self.fs is None:
                os.rmdir(self.root)
            elif not self.fs.ls(self.root, detail=False):
                self.fs.rmdir(self.root)

    @contextlib.contextmanager
    def create(self, name: str, sync: bool, needed: int | None = None) -> Iterator[IO[bytes]]:
        """Open ``name`` for writing; on success flush it and, if ``sync``, fsync it.

        Running out of space raises ``StorageFullError`` naming the file and ``needed``
        (the bytes the caller meant to write), instead of a bare ENOSPC ``OSError``.
        """
        full = self.path(name)
        with self._loud_when_full(name, needed):
            if self.fs is None:
                with open(full, "wb", buffering=1 << 20) as f:
                    yield f
                    f.flush()
                    if sync:
                        os.fsync(f.fileno())
            else:
                with self.fs.open(full, "wb") as f:
                    yield f

    def write_bytes(self, name: str, data: bytes, sync: bool) -> None:
        with self.create(name, sync, needed=len(data)) as f:
            f.write(data)

    @contextlib.contextmanager
    def _loud_when_full(self, name: str, needed: int | None) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise
            raise StorageFullError(self._full_message(name, needed, exc)) from exc

    def _full_message(self, name: str, needed: int | None, exc: OSError) -> str:
        what = "no space left on device" if exc.errno == errno.ENOSPC else "disk quota exceeded"
        facts = [f"needed {needed} bytes" if needed is not None else "needed more bytes than were free"]
        if self.fs is None:
            with contextlib.suppress(OSError):
                facts.append(f"{shutil.disk_usage(self.root).free} bytes free")
        return f"{self.url}: {what} writing {name} ({', '.join(facts)})"

    def replace(self, src: str, dst: str) -> None:
        """Move ``src`` over ``dst``: atomic on local disks (rename(2))."""
        if self.fs is None:
            os.replace(self.path(src), self.path(dst))
        else:
            self.fs.mv(self.path(src), self.path(dst))

    def remove(self, name: str) -> None:
        full = self.path(name)
        with contextlib.suppress(FileNotFoundError):
            if self.fs is None:
                os.unlink(full)
            else:
                self.fs.rm_file(full)

    def sync_directory(self) -> None:
        """Make renames in the directory durable (local disks only)."""
        if self.fs is None:
            fd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class RangeReader:
    """Reads byte ranges of one open file into caller-provided buffers."""

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> int:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class LocalRangeReader(RangeReader):
    """``preadv`` scatter reads: one syscall fills many buffers, the GIL is released."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> int:
        total = 0
        pending = [b for b in buffers if b.nbytes]
        while pending:
            batch = pending[:IOV_MAX]
            n = os.preadv(self.fd, batch, offset)
            if n == 0:
                raise CheckpointError(f"{self.path}: unexpected end of file at byte {offset}")
            total += n
            offset += n
            pending = _advance(pending, n)
        return total

    def close(self) -> None:
        os.close(self.fd)


class FsspecRangeReader(RangeReader):
    def __init__(self, handle: Any):
        self.handle = handle

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> int:
        self.handle.seek(offset)
        total = 0
        for buf in buffers:
            view = buf
            while view.nbytes:
                n = self.handle.readinto(view)
                if not n:
                    raise CheckpointError(f"{self.handle}: unexpected end of file at byte {offset + total}")
                total += n
                view = view[n:]
        return total

    def close(self) -> None:
        self.handle.close()


def _advance(buffers: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first ``n`` bytes from a list of buffers (after a short read)."""
    while n and buffers:
        first = buffers[0]
        if first.nbytes <= n:
            n -= first.nbytes
            buffers = buffers[1:]
        else:
            buffers = [first[n:], *buffers[1:]]
            n = 0
    return buffers
