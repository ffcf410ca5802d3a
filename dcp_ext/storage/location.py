"""A checkpoint directory on local disk or on any fsspec filesystem.

``Location(path_or_url)`` gives a ``LocalLocation`` (``os.preadv`` scatter reads,
``fsync`` of files and of the directory, atomic ``os.replace``) or an ``FsspecLocation``
(range reads batched through ``cat_ranges``: concurrent on object stores and free of the
block cache's read-ahead), the way ``pathlib.Path`` gives a platform's path class. Callers
see one interface; the few policy questions that depend on the storage (is a rename
atomic, is a commit marker needed) ask ``is_local``. All names are validated so that
nothing outside the checkpoint directory is ever read or written.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import functools
import itertools
import os
import posixpath
import shutil
import stat
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any, Callable, TypeVar

import fsspec

from dcp_ext.errors import CheckpointError, InvalidRequestError, StorageFullError, UnsafeCheckpointError
from dcp_ext.formats.data_files import check_relative_name
from dcp_ext.storage import page_cache

IOV_MAX = 1024  # scatter buffers per preadv call (the Linux limit)
# Bytes per preadv where the page cache does not hold a range: a large read waits for the
# disk one readahead window at a time, while the kernel reads ahead of a stream of small
# ones. Cold 0.12 GB loads took 0.7-0.8x the time (2-core box, 4 threads; README, stop 36),
# 1.07 GB ones 0.7x to 1.0x (it varies with the host's cache); warm loads are unchanged.
# 256 KiB steps were as fast at 0.12 GB and slower than one call at 1.07 GB.
COLD_READ_BYTES = 1 << 20
PROBE_BYTES = 4096  # read with RWF_NOWAIT to tell whether the page cache holds a range (twice)
PART_BYTES = 8 << 20  # largest ranged request to a remote store
BATCH_BYTES = 64 << 20  # bytes one cat_ranges call fetches (held in memory at once)
PREFETCH_BYTES = 64 << 20  # most bytes a remote reader fetches ahead and holds (``FsspecRangeReader.prefetch``)
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)  # Linux 4.14+
Run = tuple[int, Sequence[memoryview]]  # (file offset, buffers filled back to back from there)
# fsspec backends' HTTP clients, whose errors are not OSError (botocore's EndpointConnectionError
# for an endpoint that does not answer, NoCredentialsError, aiohttp's timeouts)
STORE_CLIENTS = frozenset({"botocore", "aiobotocore", "aiohttp", "requests", "urllib3", "google", "azure"})
# fsspec backends that build their client on the first request, from storage_options
CLIENT_BUILDERS = frozenset({"s3fs", "gcsfs", "adlfs"})
F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def store_failures(where: str) -> Iterator[None]:
    """A store client's own error becomes a CheckpointError naming ``where``: left as it
    was, it named an internal request (a listing URL) and passed every ``except OSError``
    handler of the callers. The client's OSErrors too (aiohttp's failed connections named
    only the host)."""
    try:
        yield
    except Exception as exc:
        if type(exc).__module__.partition(".")[0] in STORE_CLIENTS:
            raise CheckpointError(f"{where}: the object store failed ({type(exc).__name__}: {exc})") from exc
        if isinstance(exc, TypeError) and _raised_in(exc, STORE_CLIENTS | CLIENT_BUILDERS):
            # s3fs passes storage_options to its client only on the first request: a misspelled one
            raise CheckpointError(
                f"{where}: the object store client refused its settings; check storage_options ({exc})"
            ) from exc
        raise


def _raised_in(exc: BaseException, packages: frozenset[str]) -> bool:
    """Whether a frame of the exception's traceback runs code of one of ``packages``."""
    frame = exc.__traceback__
    while frame is not None:
        if str(frame.tb_frame.f_globals.get("__name__", "")).partition(".")[0] in packages:
            return True
        frame = frame.tb_next
    return False


def store_errors(method: F) -> F:
    """``store_failures`` around a method of an object with a ``url``."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with store_failures(self.url):
            return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


def _is_url(text: str) -> bool:
    return "://" in text and not text.startswith("file://")


class Location(ABC):
    """One checkpoint directory, addressed by a local path or a URL."""

    url: str  # how messages name the directory
    root: str  # the directory as the implementation addresses it
    is_local: bool  # atomic rename and durable fsync are available
    # each read is a request over a network (an async fsspec filesystem: s3fs, gcsfs, adlfs):
    # for a small record, one request fewer is worth more than a few bytes fewer
    networked = False

    def __new__(cls, path: str | os.PathLike[str] | None = None, storage_options: dict[str, Any] | None = None) -> Location:
        if cls is Location:  # (unpickling calls a subclass's __new__ without arguments)
            if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
                raise InvalidRequestError(f"a checkpoint is a directory path or URL, got {path!r}")
            cls = FsspecLocation if _is_url(os.fspath(path)) else LocalLocation
        return super().__new__(cls)

    def cache_key(self) -> str:
        """Canonical identity of the directory, used to share parsed metadata."""
        return self.url

    def within(self, other: Location) -> bool:
        """Whether this directory is ``other`` or lies inside it (their canonical identities)."""
        mine, theirs = self.cache_key().rstrip("/"), other.cache_key().rstrip("/")
        return mine == theirs or mine.startswith(theirs + "/")

    def path(self, name: str, key: str = "") -> str:
        """The full path of ``name``, refused when it would leave the directory."""
        check_relative_name(self.url, name, key)
        return posixpath.join(self.root, name)

    # -- queries -----------------------------------------------------------------------
    @abstractmethod
    def exists(self, name: str) -> bool: ...

    @abstractmethod
    def size(self, name: str) -> int | None:
        """Size in bytes, or None when the file is missing (a directory: CheckpointError)."""

    @abstractmethod
    def signature(self, name: str) -> tuple[Any, ...] | None:
        """A cheap fingerprint that changes when the file is rewritten (None: missing)."""

    def stamp(self, name: str) -> list[Any] | None:
        """What stays the same while ``name`` is the file it was, through renames (None:
        missing, or the store reports nothing that changes with the file). A commit
        records ``.metadata``'s, so a reader can tell the file is the committed one
        without reading it (169 MB at a million chunks, on every rank)."""
        return self.stamp_of(self.signature(name))

    @abstractmethod
    def stamp_of(self, signature: tuple[Any, ...] | None) -> list[Any] | None:
        """The stamp within a ``signature`` of this location's (a reader has one already:
        no second stat, or request to an object store)."""

    @abstractmethod
    def listdir(self, name: str = "") -> list[str]:
        """Entry names of the directory or of its subdirectory ``name`` ([] if missing)."""

    @abstractmethod
    def is_file(self) -> bool:
        """Whether the checkpoint's path is a file (an object, on a store) and so no directory."""

    @abstractmethod
    def walk(self) -> list[str]:
        """Every file below the directory, as names relative to it ('/'-separated)."""

    # -- reading -----------------------------------------------------------------------
    @contextlib.contextmanager
    def _file_errors(self, name: str) -> Iterator[None]:
        """Opening ``name`` where it cannot be a checkpoint file (the root is a file, the name a
        directory, no access) raises CheckpointError naming it; a missing file stays
        FileNotFoundError, which callers turn into their own message."""
        try:
            yield
        except NotADirectoryError:
            raise CheckpointError(f"{self.url}: is a file, not a checkpoint directory") from None
        except IsADirectoryError:
            raise CheckpointError(f"{self.url}: {name} is a directory, expected a file") from None
        except SpecialFileError:
            raise CheckpointError(f"{self.url}: {name} is not a regular file (a FIFO, socket or device), expected a file") from None
        except PermissionError as exc:  # an object store answering 403 (credentials) too
            raise CheckpointError(f"{self.url}: cannot read {name} ({exc.strerror or exc})") from None
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise CheckpointError(f"{self.url}: {name} is a symbolic link that loops, expected a file") from None

    @contextlib.contextmanager
    def _directory_errors(self) -> Iterator[None]:
        """Creating the checkpoint directory where a file is, or without access, raises
        CheckpointError naming it."""
        try:
            yield
        except (FileExistsError, NotADirectoryError):
            raise CheckpointError(f"{self.url}: is a file (or under one), not a checkpoint directory") from None
        except (PermissionError, FileNotFoundError) as exc:  # no access; a parent that cannot hold directories
            raise CheckpointError(f"{self.url}: cannot create the checkpoint directory ({exc.strerror or exc})") from None

    def read_bytes(self, name: str) -> bytes:
        """The whole file (errors: ``_file_errors``)."""
        full = self.path(name)
        with self._file_errors(name):
            return self._read_all(full)

    @abstractmethod
    def _read_all(self, full: str) -> bytes: ...

    def open_file(self, name: str) -> IO[bytes]:
        """A seekable binary file object, for parsers that read a file's structure
        (zip directories, pickles) with seeks; data reads go through ``open_reader``."""
        full = self.path(name)
        with self._file_errors(name):
            return self._open_file(full)

    @abstractmethod
    def _open_file(self, full: str) -> IO[bytes]: ...

    def local_file(self, name: str) -> str | None:
        """A path the OS opens directly (for memory-mapped loads), None off local disk."""
        return None

    @contextlib.contextmanager
    def open_reader(self, name: str, key: str = "") -> Iterator[RangeReader]:
        full = self.path(name, key)
        with self._file_errors(name):
            reader = self._range_reader(full)
        reader.key = key
        try:
            yield reader
        finally:
            reader.close()

    @abstractmethod
    def _range_reader(self, full: str) -> RangeReader: ...

    # -- writing -----------------------------------------------------------------------
    @abstractmethod
    def makedirs(self) -> bool:
        """Create the directory and its parents; True when this call created it (a failed
        save removes a directory it created, see ``remove_dir_if_empty``)."""

    @abstractmethod
    def remove_dir_if_empty(self) -> None:
        """Best effort: a directory that still holds anything stays."""

    @contextlib.contextmanager
    def create(self, name: str, sync: bool, needed: int | None = None) -> Iterator[IO[bytes]]:
        """Open ``name`` for writing; on success flush it and, if ``sync``, make it durable.

        Running out of space raises ``StorageFullError`` naming the file and ``needed``
        (the bytes the caller meant to write), instead of a bare ENOSPC ``OSError``.
        """
        with self._write_errors(name, needed), self._open_for_write(self.path(name), sync) as f:
            yield f

    @contextlib.contextmanager
    def _write_errors(self, name: str, needed: int | None) -> Iterator[None]:
        """A write or sync of ``name`` the caller may not make, or that the disk has no
        room for, as CheckpointError / StorageFullError naming it."""
        try:
            yield
        except PermissionError as exc:
            raise CheckpointError(f"{self.url}: cannot write {name} ({exc.strerror or exc})") from None
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise
            raise StorageFullError(self._full_message(name, needed, exc)) from exc

    @abstractmethod
    def _open_for_write(self, full: str, sync: bool) -> contextlib.AbstractContextManager[IO[bytes]]: ...

    def sync_file(self, name: str) -> None:
        """Make ``name``, written with ``create(name, sync=False)``, durable; its errors as
        ``create``'s (a full disk can surface only here). Stores: durable once written. A
        file that is gone is no error here: a commit's listing (``require_files``) names it
        with what removed it (another save into the directory)."""
        if not self.is_local:
            return
        with self._write_errors(name, None):
            try:
                fd = os.open(self.path(name), os.O_RDONLY)
            except FileNotFoundError:
                return
            try:
                os.fsync(fd)  # the file's dirty pages, whichever descriptor wrote them
            finally:
                os.close(fd)

    def write_bytes(self, name: str, data: bytes, sync: bool) -> None:
        with self.create(name, sync, needed=len(data)) as f:
            f.write(data)

    def _full_message(self, name: str, needed: int | None, exc: OSError) -> str:
        what = "no space left on device" if exc.errno == errno.ENOSPC else "disk quota exceeded"
        facts = [f"needed {needed} bytes" if needed is not None else "needed more bytes than were free"]
        free = self._free_bytes()
        if free is not None:
            facts.append(f"{free} bytes free")
        return f"{self.url}: {what} writing {name} ({', '.join(facts)})"

    def _free_bytes(self) -> int | None:
        return None

    @abstractmethod
    def replace(self, src: str, dst: str) -> None:
        """Move ``src`` over ``dst`` (atomic where ``is_local``)."""

    @abstractmethod
    def remove(self, name: str) -> None:
        """Delete ``name``; a missing file is not an error."""

    def remove_all(self, names: list[str]) -> None:
        """``remove`` each of ``names``, in as few requests as the storage takes."""
        for name in names:
            self.remove(name)

    def sync_directory(self) -> None:
        """Make renames in the directory durable (only local disks have a directory to sync)."""


class SpecialFileError(OSError):
    """A checkpoint file name that is a FIFO, socket or device."""


def check_regular(mode: int, path: str) -> None:
    """Refuse what is not a regular file: a directory opens but every read fails, and a
    FIFO's open or read waits for a writer forever (stock DCP hangs on one)."""
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
    if not stat.S_ISREG(mode):
        raise SpecialFileError(errno.EINVAL, "Not a regular file", path)


def open_regular_file(path: str) -> int:
    """A read-only descriptor of ``path``, a regular file (``check_regular``; the open
    does not wait: ``O_NONBLOCK``, which regular files ignore)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        check_regular(os.fstat(fd).st_mode, path)
    except OSError:
        os.close(fd)
        raise
    os.set_blocking(fd, True)
    return fd


def _options_dict(path: str | os.PathLike[str], storage_options: Any) -> dict[str, Any]:
    """``storage_options`` as keyword arguments (None: none); anything but a mapping is
    refused, whatever the location (an empty list or 0 must not pass as "no options")."""
    if storage_options is None:
        return {}
    if not isinstance(storage_options, Mapping):
        raise InvalidRequestError(
            f"{os.fspath(path)}: storage_options must be a dict of the filesystem's options, got {storage_options!r}"
        )
    return dict(storage_options)


def _is_symlink(path: str) -> bool:
    """Whether ``path`` is a symbolic link (one ``lstat``; a missing entry is none)."""
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def _readable_roots(real_root: str) -> list[str]:
    """Where a checkpoint's names may resolve: inside it, and for a huggingface_hub cache
    snapshot (``models--org--name/snapshots/<revision>``, whose files are symlinks to
    ``../../blobs/<hash>``, as ``from_pretrained`` downloads them) its repository's blobs."""
    snapshots = os.path.dirname(real_root)
    if os.path.basename(snapshots) != "snapshots":
        return [real_root]
    return [real_root, os.path.join(os.path.dirname(snapshots), "blobs")]


class LocalLocation(Location):
    is_local = True

    def __init__(self, path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None):
        if _options_dict(path, storage_options):
            raise InvalidRequestError(f"{os.fspath(path)}: storage_options apply to fsspec URLs, not to a local path")
        text = os.fspath(path)
        self.root = os.path.abspath(text[len("file://") :] if text.startswith("file://") else text)
        self.url = self.root

    def cache_key(self) -> str:
        return os.path.realpath(self.root)

    def path(self, name: str, key: str = "") -> str:
        check_relative_name(self.url, name, key)
        full = os.path.join(self.root, name)
        if "/" not in name and os.sep not in name and not _is_symlink(full):
            return full  # an entry of the directory itself, not a link: inside it wherever the root resolves
        try:
            real_root = os.path.realpath(self.root)
            real = os.path.realpath(full)
        except OSError as exc:  # a link on the way that cannot be followed (no access to its directory)
            raise CheckpointError(f"{self.url}: cannot resolve {name!r} ({exc.strerror or exc})") from None
        if not any(os.path.commonpath([inside, real]) == inside for inside in _readable_roots(real_root)):
            raise UnsafeCheckpointError(
                f"{self.url}: {name!r}{f' (key {key!r})' if key else ''} resolves to {real}, outside the checkpoint directory"
            )
        return full

    def exists(self, name: str) -> bool:
        return os.path.exists(self.path(name))

    def size(self, name: str) -> int | None:
        try:
            st = os.stat(self.path(name))
        except OSError:
            return None
        with self._file_errors(name):
            check_regular(st.st_mode, name)
        return st.st_size

    def signature(self, name: str) -> tuple[Any, ...] | None:
        """Size, mtime, inode and ctime: every write or rename sets ctime to now, and unlike
        mtime no tool (tar, rsync, ``os.utime``) can set it back, so an in-place rewrite that
        keeps size, mtime and inode still changes it."""
        try:
            st = os.stat(self.path(name))
        except OSError:
            return None
        return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)

    def stamp_of(self, signature: tuple[Any, ...] | None) -> list[Any] | None:
        return None if signature is None else list(signature[:3])  # a rename sets the ctime: size, mtime, inode

    def listdir(self, name: str = "") -> list[str]:
        full = self.path(name) if name else self.root
        with self._file_errors(name or "the directory's listing"):
            return os.listdir(full) if os.path.isdir(full) else []

    def walk(self) -> list[str]:
        return [
            os.path.relpath(os.path.join(parent, f), self.root).replace(os.sep, "/")
            for parent, _, files in os.walk(self.root)
            for f in files
        ]

    def _read_all(self, full: str) -> bytes:
        with os.fdopen(open_regular_file(full), "rb") as f:
            return f.read()

    def _open_file(self, full: str) -> IO[bytes]:
        return os.fdopen(open_regular_file(full), "rb")

    def local_file(self, name: str) -> str | None:
        full = self.path(name)
        with self._file_errors(name):
            try:
                check_regular(os.stat(full).st_mode, full)  # torch.load would wait on a FIFO
            except FileNotFoundError:
                pass  # the opener reports it
        return full

    def _range_reader(self, full: str) -> RangeReader:
        return LocalRangeReader(full)

    def makedirs(self) -> bool:
        with self._directory_errors():
            try:
                os.makedirs(self.root)
                return True
            except FileExistsError:
                if os.path.isdir(self.root):
                    return False
                if _is_symlink(self.root) and not os.path.exists(self.root):
                    raise CheckpointError(
                        f"{self.url}: is a symbolic link to {os.readlink(self.root)!r}, which does not exist; "
                        "create the directory it names, or remove the link"
                    ) from None
                raise

    def is_file(self) -> bool:
        return os.path.isfile(self.root)

    def remove_dir_if_empty(self) -> None:
        with contextlib.suppress(OSError):
            os.rmdir(self.root)

    @contextlib.contextmanager
    def _open_for_write(self, full: str, sync: bool) -> Iterator[IO[bytes]]:
        with open(full, "wb", buffering=1 << 20) as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())

    def _free_bytes(self) -> int | None:
        try:
            return shutil.disk_usage(self.root).free
        except OSError:
            return None

    def replace(self, src: str, dst: str) -> None:
        os.replace(self.path(src), self.path(dst))

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(name))

    def sync_directory(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _change_tag(info: dict[str, Any]) -> Any:
    """What an fsspec store reports that changes with a file's contents: the object's
    ETag, else its modification time (None: neither)."""
    return info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified")


BUCKET_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss"})  # paths start with a bucket


class FsspecLocation(Location):
    is_local = False

    def __init__(self, path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None):
        options = _options_dict(path, storage_options)
        try:
            fs, root = fsspec.core.url_to_fs(os.fspath(path), **options)
        except (ValueError, ImportError, OSError) as exc:  # an unknown scheme, its backend not installed or not loadable
            first_line = next(iter(str(exc).splitlines()), "") or type(exc).__name__  # libjvm's runs on for lines
            raise InvalidRequestError(f"{os.fspath(path)}: cannot open this URL ({first_line})") from None
        except TypeError as exc:  # storage_options its filesystem does not take
            raise InvalidRequestError(f"{os.fspath(path)}: storage_options {storage_options!r} ({exc})") from None
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        if protocols & BUCKET_STORES and not root.split("/", 1)[0]:  # the first segment is the bucket
            raise InvalidRequestError(
                f"{os.fspath(path)}: the URL names no bucket; expected {os.fspath(path).split(':', 1)[0]}://BUCKET/PREFIX"
            )
        if "//" in root.split("://", 1)[-1].split("?", 1)[0].strip("/"):  # the innermost path (an http root is the URL)
            raise InvalidRequestError(
                f"{os.fspath(path)}: the path has an empty segment ('//'), which object stores keep in their keys "
                "(s3fs cannot list a checkpoint under 'bucket//prefix': every save there failed, taking its own "
                "files for another job's removals); remove the extra '/'"
            )
        self.fs: fsspec.AbstractFileSystem = fs
        self.networked = bool(getattr(fs, "async_impl", False))
        self.root = root.rstrip("/") or root
        self.url = fs.unstrip_protocol(self.root)

    @store_errors
    def exists(self, name: str) -> bool:
        full = self.path(name)
        with self._file_errors(name):
            return bool(self.fs.exists(full))

    @store_errors
    def size(self, name: str) -> int | None:
        try:
            return int(self.fs.size(self.path(name)))
        except OSError:
            return None

    def signature(self, name: str) -> tuple[Any, ...] | None:
        info = self._info(name)
        if info is None:
            return None
        tag = _change_tag(info)
        return (info.get("size"), None if tag is None else str(tag), info.get("created"))

    def stamp_of(self, signature: tuple[Any, ...] | None) -> list[Any] | None:
        return None if signature is None or signature[1] is None else list(signature[:2])  # size, ETag or mtime

    @store_errors
    def _info(self, name: str) -> dict[str, Any] | None:
        full = self.path(name)
        try:
            self.fs.invalidate_cache(full)
            return self.fs.info(full)
        except OSError:
            return None

    @store_errors
    def listdir(self, name: str = "") -> list[str]:
        full = self.path(name) if name else self.root
        self.fs.invalidate_cache(full)  # other processes write here too
        try:
            return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(full, detail=False)]
        except FileNotFoundError:
            return []

    @store_errors
    def walk(self) -> list[str]:
        self.fs.invalidate_cache(self.root)
        return [posixpath.relpath(p, self.root) for p in self.fs.find(self.root)]

    @store_errors
    def _read_all(self, full: str) -> bytes:
        return bytes(self.fs.cat_file(full))

    @store_errors
    def _open_file(self, full: str) -> IO[bytes]:
        return self.fs.open(full, "rb")  # type: ignore[no-any-return]

    def _range_reader(self, full: str) -> RangeReader:
        return FsspecRangeReader(self.fs, full, self.networked)

    @store_errors
    def makedirs(self) -> bool:
        with self._directory_errors():
            existed = self.fs.isdir(self.root)
            if not existed and self.fs.isfile(self.root):  # some stores would make the directory beside it
                raise FileExistsError(self.root)
            self.fs.makedirs(self.root, exist_ok=True)
        return not existed

    @store_errors
    def is_file(self) -> bool:
        return bool(self.fs.isfile(self.root))

    def remove_dir_if_empty(self) -> None:
        with contextlib.suppress(OSError):
            if not self.fs.ls(self.root, detail=False):
                self.fs.rmdir(self.root)

    @contextlib.contextmanager
    def _open_for_write(self, full: str, sync: bool) -> Iterator[IO[bytes]]:
        with store_failures(self.url), self.fs.open(full, "wb") as f:  # durable once closed: stores have no fsync
            yield f

    @store_errors
    def replace(self, src: str, dst: str) -> None:
        self.fs.mv(self.path(src), self.path(dst))

    @store_errors
    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(name))

    @store_errors
    def remove_all(self, names: list[str]) -> None:
        """An async store's ``rm`` of a list deletes in batches (s3fs: a thousand keys a
        request): 16 retired files on the loopback S3 server, 109 -> 65 ms of a commit. A
        synchronous file system's stops at the first missing file: each in turn there."""
        if not (self.networked and names):
            super().remove_all(names)
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm([self.path(name) for name in names])


class RangeReader(ABC):
    """Reads byte ranges of one file into caller-provided buffers."""

    path: str
    key = ""  # the first key its reads serve, for errors (set by Location.open_reader)

    @abstractmethod
    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> int:
        """Fill ``buffers`` back to back from ``offset``; returns the bytes read."""

    def read_runs(self, runs: Sequence[Run]) -> int:
        """Fill several runs of the file; one call so a remote reader can batch them."""
        return sum(self.read_into(offset, buffers) for offset, buffers in runs)

    def holds(self, offsets: Sequence[int]) -> bool:
        """Whether reads at ``offsets`` would be answered from memory (a page cache), not
        wait for storage; False where that cannot be asked (a remote store)."""
        return False

    def prefetch(self, ranges: Sequence[tuple[int, int]]) -> bool:
        """Say that ``(offset, length)`` ranges will be read soon, so that storage fetches
        them all at once while the caller goes on; False where that cannot be said."""
        return False

    def release(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Say that ``(offset, length)`` ranges a ``prefetch`` brought in are done with."""

    def in_memory(self, start: int, end: int) -> bool:
        """Whether memory (a page cache) holds bytes ``[start, end)``, asked without reading
        them (of windows through a long range: ``page_cache.held``); False where that cannot
        be asked (a remote store, an old kernel)."""
        return False

    def fetch(self, ranges: Sequence[tuple[int, int]]) -> FetchedSpans:
        """The bytes of ``(offset, length)`` ranges, touching ones read as one span, in one
        ``read_runs`` call (a remote store batches it)."""
        spans = [(start, bytearray(end - start)) for start, end in merged_ranges(ranges)]
        self.read_runs([(start, [memoryview(data)]) for start, data in spans])
        return FetchedSpans(spans)

    def close(self) -> None:
        """Release what the reader holds."""

    def _ended_early(self, offset: int) -> CheckpointError:
        """The file ended before a byte the load planned to read (the planning checked its
        size: it shrank since)."""
        reading = f", reading key {self.key!r} or one after it in the file" if self.key else ""
        return CheckpointError(
            f"{self.path}: unexpected end of file at byte {offset}{reading} (the file is shorter than when the "
            "load was planned)"
        )


class FetchedSpans:
    """Spans of a file held in memory (``RangeReader.fetch``), answering reads inside one."""

    def __init__(self, spans: Sequence[tuple[int, bytes | bytearray]]):
        self.starts = [start for start, _ in spans]
        self.data = [data for _, data in spans]

    def view(self, offset: int, n: int) -> memoryview | None:
        """Bytes ``[offset, offset + n)`` when one span holds them whole."""
        at = bisect.bisect_right(self.starts, offset) - 1
        if at < 0 or offset + n > self.starts[at] + len(self.data[at]):
            return None
        pos = offset - self.starts[at]
        return memoryview(self.data[at])[pos : pos + n]

    def covers(self, ranges: Sequence[tuple[int, int]]) -> bool:
        return all(self.view(offset, n) is not None for offset, n in ranges)


def merged_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` ranges as ``(start, end)`` spans in order, overlapping and
    touching ones merged."""
    spans: list[list[int]] = []
    for offset, length in sorted(ranges):
        if spans and offset <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], offset + length)
        else:
            spans.append([offset, offset + length])
    return [(start, end) for start, end in spans]


class LocalRangeReader(RangeReader):
    """``preadv`` scatter reads: one syscall fills many buffers, the GIL is released."""

    def __init__(self, path: str):
        self.path = path
        self.fd = open_regular_file(path)
        self._nowait = _NOWAIT  # None once the file system refused it (overlayfs, FUSE, NFS)
        self._probe = bytearray(PROBE_BYTES)

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> int:
        views = _byte_views(buffers)
        # read in steps: a range of more than one step whose start or first step's end the
        # page cache lacks (the start of a stock-written record is cached once its layout
        # was parsed from its head; probing further in alone made cold loads slower: that
        # probe's readahead starts away from where the reads begin)
        nbytes = sum(v.nbytes for v in views)
        step = COLD_READ_BYTES if nbytes > COLD_READ_BYTES and not self.holds((offset, offset + COLD_READ_BYTES - PROBE_BYTES)) else 0
        total = first = 0  # views[first:] are still to fill
        while first < len(views):
            if not step:  # the page cache holds the start: IOV_MAX buffers a call, none looked at
                batch = views[first : first + IOV_MAX]
            else:
                batch, size = [], 0
                for view in itertools.islice(views, first, first + IOV_MAX):
                    if size + view.nbytes > step:  # a cold read: COLD_READ_BYTES at a time
                        if size < step:
                            batch.append(view[: step - size])
                        break
                    batch.append(view)
                    size += view.nbytes
            n = os.preadv(self.fd, batch, offset)
            if n == 0:
                raise self._ended_early(offset)
            total += n
            offset += n
            if total == nbytes:
                return total
            if not step and n == sum(v.nbytes for v in batch):  # every view of the call filled
                first += len(batch)
                continue
            while n:  # the views the call filled, the last one maybe in part
                if views[first].nbytes <= n:
                    n -= views[first].nbytes
                    first += 1
                else:
                    views[first] = views[first][n:]
                    n = 0
        return total

    def holds(self, offsets: Sequence[int]) -> bool:
        """By a read at each offset that must not wait (``RWF_NOWAIT``); True where the
        kernel or the file system cannot tell: reads then go on as they always did."""
        if self._nowait is None:
            return True
        try:
            for at in offsets:
                os.preadv(self.fd, [self._probe], at, self._nowait)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            self._nowait = None
        return True

    def in_memory(self, start: int, end: int) -> bool:
        return page_cache.held(self.fd, start, end) is True

    def prefetch(self, ranges: Sequence[tuple[int, int]]) -> bool:
        """``POSIX_FADV_WILLNEED`` for each range, neighbours merged: the kernel queues the
        reads of them all (exactly their pages, no readahead) and returns."""
        try:
            for start, end in merged_ranges(ranges):
                os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_WILLNEED)
        except OSError:  # a file system that takes no advice: read as before
            return False
        return True

    def release(self, ranges: Sequence[tuple[int, int]]) -> None:
        """``POSIX_FADV_DONTNEED`` over the pages of each range (whole pages: those
        ``prefetch`` brought in). A cold stock file's record ends, left cached after their
        layouts are parsed, break the kernel's readahead of the data reads that follow: one
        cached page in eight (each 64 KiB record's first and last 4 KiB) made a 0.12 GB
        cold stock-written load 64.8 ms against 50.5 with them dropped (1.07 GB: 442.8
        against 376.1; 2 processes: 258.9 against 215.9)."""
        page = page_cache.PAGE_BYTES
        try:
            for start, end in merged_ranges(ranges):
                first = start // page * page
                os.posix_fadvise(self.fd, first, -(-end // page) * page - first, os.POSIX_FADV_DONTNEED)
        except OSError:  # a file system that takes no advice: nothing to drop
            pass

    def fetch(self, ranges: Sequence[tuple[int, int]]) -> FetchedSpans:
        """``pread`` per span: one syscall and one bytes object each, no buffer to fill."""
        spans = []
        for start, end in merged_ranges(ranges):
            data = os.pread(self.fd, end - start, start)
            while len(data) < end - start:  # a regular file comes short only at its end, or at a signal
                more = os.pread(self.fd, end - start - len(data), start + len(data))
                if not more:
                    raise self._ended_early(start + len(data))
                data += more
            spans.append((start, data))
        return FetchedSpans(spans)

    def close(self) -> None:
        os.close(self.fd)


class FsspecRangeReader(RangeReader):
    """Range reads through ``cat_ranges``: exactly the bytes asked for (no block cache
    read-ahead), all runs of a call in one batch that async filesystems (s3fs, gcsfs)
    fetch concurrently."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, concurrent: bool = False):
        self.fs, self.path = fs, path
        self.url = fs.unstrip_protocol(path)
        self.concurrent = concurrent  # the filesystem sends a batch's requests at once (``Location.networked``)
        self._fetched = FetchedSpans(())  # what ``prefetch`` fetched

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> int:
        nbytes = sum(memoryview(b).nbytes for b in buffers)
        data = self._fetched.view(offset, nbytes)
        if data is None:
            return self.read_runs([(offset, buffers)])
        pos = 0
        for buf in buffers:
            view = memoryview(buf).cast("B")
            view[:] = data[pos : pos + view.nbytes]
            pos += view.nbytes
        return nbytes

    def fetch(self, ranges: Sequence[tuple[int, int]]) -> FetchedSpans:
        """From what ``prefetch`` holds when it holds them all."""
        return self._fetched if self._fetched.covers(ranges) else super().fetch(ranges)

    def prefetch(self, ranges: Sequence[tuple[int, int]]) -> bool:
        """Fetch the ranges now, in batches an async filesystem (s3fs, gcsfs) sends
        concurrently, and answer this reader's reads inside them from memory: a stock
        record's two ends are two round trips each otherwise (a synchronous filesystem,
        or more than PREFETCH_BYTES, is not prefetched)."""
        spans = merged_ranges(ranges)
        if not self.concurrent or sum(end - start for start, end in spans) > PREFETCH_BYTES:
            return False
        self._fetched = super().fetch(ranges)
        return True

    @store_errors
    def read_runs(self, runs: Sequence[Run]) -> int:
        total = 0
        for batch in _batches(_parts(runs, PART_BYTES), BATCH_BYTES):
            starts = [offset for offset, _, _ in batch]
            ends = [offset + nbytes for offset, _, nbytes in batch]
            blobs = self.fs.cat_ranges([self.path] * len(batch), starts, ends, on_error="return")
            for (offset, buffers, nbytes), blob in zip(batch, blobs):
                if isinstance(blob, BaseException):
                    raise blob
                if len(blob) > nbytes:
                    raise CheckpointError(
                        f"{self.url}: asked for {nbytes} bytes at byte {offset}, the server sent {len(blob)}: it ignores "
                        "range requests, which loads need (stock FsspecReader reads whole files)"
                    )
                if len(blob) < nbytes:
                    raise self._ended_early(offset + len(blob))
                pos = 0
                for buf in buffers:
                    buf[:] = blob[pos : pos + buf.nbytes]
                    pos += buf.nbytes
                total += nbytes
        return total


def _parts(runs: Sequence[Run], limit: int) -> Iterator[tuple[int, list[memoryview], int]]:
    """(offset, buffers, bytes) pieces of the runs, none over ``limit`` bytes."""
    for offset, buffers in runs:
        pending = _byte_views(buffers)
        while pending:
            head, pending = _take(pending, limit)
            nbytes = sum(b.nbytes for b in head)
            yield offset, head, nbytes
            offset += nbytes


def _batches(parts: Iterator[tuple[int, list[memoryview], int]], limit: int) -> Iterator[list[tuple[int, list[memoryview], int]]]:
    batch: list[tuple[int, list[memoryview], int]] = []
    held = 0
    for part in parts:
        if batch and held + part[2] > limit:
            yield batch
            batch, held = [], 0
        batch.append(part)
        held += part[2]
    if batch:
        yield batch


def _byte_views(buffers: Sequence[memoryview]) -> list[memoryview]:
    """Non-empty buffers as flat byte views (slicing and copying work bytewise)."""
    return [b if b.format == "B" and b.ndim == 1 else b.cast("B") for b in buffers if b.nbytes]


def _take(buffers: list[memoryview], n: int) -> tuple[list[memoryview], list[memoryview]]:
    """Split buffers after their first ``n`` bytes: (head, rest)."""
    head: list[memoryview] = []
    i = 0
    while i < len(buffers) and n:
        first = buffers[i]
        if first.nbytes <= n:
            head.append(first)
            n -= first.nbytes
            i += 1
        else:
            head.append(first[:n])
            return head, [first[n:], *buffers[i + 1 :]]
    return head, buffers[i:]
