"""Where the raw tensor bytes sit inside a ``torch.save`` record, found without torch.load.

A DCP data file is a sequence of ``torch.save`` records, each an uncompressed zip archive
whose ``data/0`` entry holds the tensor bytes. Knowing the entry's offset, dtype, shape
and strides lets a reader copy exactly the bytes it needs straight into the destination
tensor. The record's pickle is decoded by a tiny allowlist unpickler that only records
the arguments of ``_rebuild_tensor_v2``: it never imports or calls anything.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dcp_ext.errors import CorruptCheckpointError, UnsafeCheckpointError

PROBE_BYTES = 4096  # head and tail of a record: enough for its zip headers and pickle
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_HEADER_MAGIC = 0x04034B50

_STORAGE_DTYPES: dict[str, torch.dtype] = {
    name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()
}


@dataclass(frozen=True)
class TensorLayout:
    """How one stored tensor is laid out, relative to the start of its record."""

    payload_offset: int  # bytes from record start to the first byte of the storage
    payload_nbytes: int  # bytes of the storage
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements
    payload_crc32: int | None  # the zip entry's CRC-32 (covers the whole storage)

    def is_dense(self) -> bool:
        """True when the tensor is the whole storage in row-major order."""
        return self.storage_offset == 0 and self.stride == contiguous_strides(self.shape) and (
            self.payload_nbytes == numel(self.shape) * self.dtype.itemsize
        )


def numel(shape: tuple[int, ...] | torch.Size) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class _StorageRef:
    dtype: torch.dtype
    key: str
    numel: int


def _rebuild_tensor_record(storage, storage_offset, size, stride, *_ignored):  # noqa: ANN001
    return ("tensor", storage, int(storage_offset), tuple(size), tuple(stride))


class _TensorPickleReader(pickle.Unpickler):
    """Decodes the pickle of a single plain tensor; anything else is refused."""

    def find_class(self, module: str, name: str):  # noqa: ANN201
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_record
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise UnsafeCheckpointError(f"tensor record refers to {module}.{name}, which is not a plain tensor")

    def persistent_load(self, pid):  # noqa: ANN001, ANN201
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafeCheckpointError(f"tensor record has an unexpected storage reference {pid!r}")
        _, dtype, key, _location, count = pid
        if not isinstance(dtype, torch.dtype) or not isinstance(key, str) or not isinstance(count, int):
            raise UnsafeCheckpointError(f"tensor record has a malformed storage reference {pid!r}")
        return _StorageRef(dtype, key, count)


class _ProbedRecord(io.RawIOBase):
    """A seekable view of one record served from its probed head and tail bytes."""

    def __init__(self, length: int, read_at: Callable[[int, int], bytes]):
        self.length = length
        self.read_at = read_at
        self.head = read_at(0, min(length, PROBE_BYTES))
        self.tail_start = max(0, length - PROBE_BYTES)
        overlap = self.head[self.tail_start :]  # a record under 2 * PROBE_BYTES: the ends overlap
        rest = self.tail_start + len(overlap)
        self.tail = overlap + (read_at(rest, length - rest) if rest < length else b"")
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.length if n is None or n < 0 else min(self.length, self.pos + n)
        start, self.pos = self.pos, end
        if end <= len(self.head):
            return self.head[start:end]
        if start >= self.tail_start:
            return self.tail[start - self.tail_start : end - self.tail_start]
        return self.read_at(start, end - start)

    def readinto(self, buffer) -> int:  # noqa: ANN001
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def parse_tensor_record(length: int, read_at: Callable[[int, int], bytes], where: str) -> TensorLayout:
    """Locate the tensor bytes of a ``torch.save`` record of ``length`` bytes.

    ``read_at(offset, n)`` returns bytes of the record; usually only its first and last
    ``PROBE_BYTES`` are touched. ``where`` names the file and key for error messages.
    """
    try:
        probe = _ProbedRecord(length, read_at)
        with zipfile.ZipFile(probe) as archive:
            entries = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
            pickled = archive.read(entries["data.pkl"])
            decoded = _TensorPickleReader(io.BytesIO(pickled)).load()
            if not (isinstance(decoded, tuple) and decoded and decoded[0] == "tensor"):
                raise UnsafeCheckpointError(f"{where}: record does not hold a plain tensor")
            _, storage, storage_offset, shape, stride = decoded
            data_entry = entries[f"data/{storage.key}"]
    except (UnsafeCheckpointError, CorruptCheckpointError) as exc:
        raise type(exc)(f"{where}: {exc}") from None
    except (KeyError, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, struct.error) as exc:
        raise CorruptCheckpointError(f"{where}: not a readable torch.save tensor record ({exc})") from None
    probe.seek(data_entry.header_offset)
    header = probe.read(_LOCAL_HEADER.size)
    fields = _LOCAL_HEADER.unpack(header) if len(header) == _LOCAL_HEADER.size else (0,) * 11
    if fields[0] != _LOCAL_HEADER_MAGIC:
        raise CorruptCheckpointError(f"{where}: bad zip local header for the tensor data")
    payload_offset = data_entry.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
    nbytes = data_entry.file_size
    if data_entry.compress_type != zipfile.ZIP_STORED or payload_offset + nbytes > length:
        raise CorruptCheckpointError(f"{where}: tensor data lies outside its record or is compressed")
    if nbytes != storage.numel * storage.dtype.itemsize:
        raise CorruptCheckpointError(
            f"{where}: storage claims {storage.numel} elements of {storage.dtype} but holds {nbytes} bytes"
        )
    layout = TensorLayout(payload_offset, nbytes, storage.dtype, shape, stride, storage_offset, data_entry.CRC)
    _check_within_storage(layout, storage.numel, where)
    return layout


def _check_within_storage(layout: TensorLayout, storage_numel: int, where: str) -> None:
    if any(s < 0 for s in layout.shape) or any(s < 0 for s in layout.stride) or layout.storage_offset < 0:
        raise CorruptCheckpointError(f"{where}: negative shape, stride or offset in tensor record")
    if numel(layout.shape) == 0:
        return
    last = layout.storage_offset + sum((s - 1) * st for s, st in zip(layout.shape, layout.stride))
    if last >= storage_numel:
        raise CorruptCheckpointError(f"{where}: tensor view reaches past the end of its storage")
