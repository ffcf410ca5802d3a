"""The ``torch.save`` tensor record, both directions: written checksummed, parsed without torch.load.

A DCP data file is a sequence of records, one per item, each exactly what stock DCP
writes: a ``torch.save`` of the tensor (an uncompressed zip archive whose ``data/0``
entry holds the tensor bytes) or the item's raw bytes, either maybe passed through a DCP
stream transform. Keeping both directions here keeps the writer and the parser agreeing
on one format.

Writing (``RecordSink``, ``write_tensor``, ``write_bytes``): because the bytes are
``torch.save``'s, stock ``FileSystemReader`` reads our files. We compute a CRC32C of every
record and note where the tensor bytes start (``torch.save`` hands the storage over as
one zero-copy write at the tensor's own address), so the index can send later reads
straight there. A record with our CRC32C is written without the zip CRC-32s (as
``torch.serialization.set_crc32_options(False)`` would; ``torch.load`` does not check
them), so its bytes around the storage are the same for every tensor of one dtype and
shape: they are made once per kind and file (``RecordFrames``). (Empty tensors have no
storage write; for them the record goes through the parser.)

Reading (``parse_tensor_record``): knowing the entry's offset, dtype, shape and strides
lets a reader copy exactly the bytes it needs straight into the destination tensor. The
record's pickle is decoded by a tiny allowlist unpickler that only records the arguments
of ``_rebuild_tensor_v2`` / ``_v3``: it never imports or calls anything.

Besides the storage, offset, size and stride, a record may carry the conj and neg bits of
a view (``torch.save`` writes the unresolved storage plus the bits); they are kept in the
layout so reads apply them. Anything else a record can hold (quantized, sparse, nested,
subclass or parameter rebuilds, unknown metadata, big-endian bytes) is refused by name,
never read as wrong values.
"""

from __future__ import annotations

import ctypes
import functools
import io
import math
import pickle
import struct
import threading
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Protocol, cast

import crc32c
import numpy as np
import torch
from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from dcp_ext.errors import CheckpointError, CorruptCheckpointError, InvalidRequestError, UnsafeCheckpointError
from dcp_ext.formats.index import StoredItem
from dcp_ext.formats.safe_pickle import largest_memo_slot
from dcp_ext.runtime.frozen import replaced

PROBE_BYTES = 4096  # head and tail of a record: enough for its zip headers and pickle
SMALL_WRITE = 64 << 10  # below this a write is gathered with its neighbours, not passed on
# A larger write is checksummed and passed on in pieces of at most this: the file sees a
# 64 MiB storage's first bytes (and its writer may start them to disk, storage.writeback)
# before the rest is checksummed. 2 processes, 0.54 GB, one thread each, four A/B runs:
# 257-284 -> 225-237 ms a save (4 and 16 MiB alike; checksumming whole, then passing in
# pieces: 240 ms).
WRITE_PIECE = 8 << 20
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_HEADER_MAGIC = 0x04034B50
_U32 = struct.Struct("<I")
_ZEROS = bytes(PROBE_BYTES)
_MEMO_SLOTS = 1024

_STORAGE_DTYPES: dict[str, torch.dtype] = {
    name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()
}
_DTYPES: dict[str, torch.dtype] = {n: d for n, d in vars(torch).items() if isinstance(d, torch.dtype)}  # v3's dtype
_UNTYPED = ("torch.storage", "UntypedStorage")  # the storage class of ``_rebuild_tensor_v3`` records
_TENSOR_FLAGS = ("conj", "neg")  # what ``torch._utils.get_tensor_metadata`` writes (torch 2.13)

# torch's own rebuilds of tensors that are not one plain strided storage: legitimate, not readable here
_OTHER_REBUILDS = {
    "_rebuild_qtensor": "a quantized tensor",
    "_rebuild_sparse_tensor": "a sparse tensor",
    "_rebuild_nested_tensor": "a nested tensor",
    "_rebuild_wrapper_subclass": "a tensor subclass",
    "_rebuild_from_type_v2": "a tensor subclass",
    "_rebuild_parameter": "an nn.Parameter",
    "_rebuild_parameter_with_state": "an nn.Parameter",
    "_rebuild_meta_tensor_no_storage": "a meta tensor without data",
    "_rebuild_device_tensor_from_cpu_tensor": "a device tensor",
    "_rebuild_device_tensor_from_numpy": "a device tensor",
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
    payload_crc32: int | None  # the zip entry's CRC-32 (covers the whole storage); None: not recorded
    conj: bool = False  # the record's conj bit: stored values are the conjugate of the bytes
    neg: bool = False  # the record's neg bit: stored values are the negation of the bytes

    def is_dense(self) -> bool:
        """True when the tensor is the whole storage in row-major order."""
        return self.storage_offset == 0 and self.is_row_major() and (
            self.payload_nbytes == numel(self.shape) * self.dtype.itemsize
        )

    def is_row_major(self) -> bool:
        """True when the tensor's elements are one row-major run of its storage (maybe not
        all of it: a view of a larger buffer, as Megatron's parameters are)."""
        return self.stride == contiguous_strides(self.shape)

    def values(self, raw: torch.Tensor) -> torch.Tensor:
        """``raw`` (a view of stored bytes) as the values it stands for: the record's bits
        set as lazy views, resolved by whatever copies out of it."""
        if self.conj:
            raw = raw.conj()
        return torch._neg_view(raw) if self.neg else raw

    def copy_values(self, dest: torch.Tensor, raw: torch.Tensor) -> None:
        """``dest.copy_(self.values(raw))``; a copy that casts gets the neg bit resolved
        first: torch's float16-to-float32 copy drops it (the values' signs with it)."""
        values = self.values(raw)
        if self.neg and dest.dtype != raw.dtype:
            values = values.resolve_neg()
        dest.copy_(values)

    def resolve_in_place(self, dest: torch.Tensor) -> None:
        """Apply the record's bits to stored bytes already read into ``dest``."""
        if self.conj:
            torch.conj_physical_(dest)
        if self.neg:
            dest.neg_()


def host_bytes(memory: torch.Tensor | torch.UntypedStorage) -> memoryview:
    """Writable bytes of a contiguous CPU tensor, or of a whole storage, that keep it alive.

    Built from its address, not through ``tensor.view(torch.uint8).numpy()``: torch's
    operators release the GIL, and a thread that gives it up while another runs Python
    waits for that one's switch interval to get it back (a view plus ``numpy()`` took
    ~2.8 ms instead of 2.7 us beside a busy thread): reader threads and the thread planning
    the next file's requests made each other wait that way, item after item."""
    tensor = isinstance(memory, torch.Tensor)
    if not (memory.is_cpu if tensor else memory.device.type == "cpu"):  # an address Python must not write through
        raise ValueError(f"host_bytes takes CPU memory, got {memory.device} memory")
    if tensor and not memory.is_contiguous():  # its bytes are not the nbytes from its address
        raise ValueError(f"host_bytes takes a contiguous tensor, got strides {memory.stride()} for shape {list(memory.shape)}")
    nbytes = memory.nbytes if tensor else memory.nbytes()
    array = (ctypes.c_ubyte * nbytes).from_address(memory.data_ptr())
    array.owner = memory  # type: ignore[attr-defined]  # the memoryview holds the array, the array the memory
    return memoryview(array).cast("B")


_CONJ_KEY, _NEG_KEY = torch._C.DispatchKey.Conjugate, torch._C.DispatchKey.Negative


def math_bits(tensor: torch.Tensor) -> tuple[bool, bool]:
    """``(tensor.is_conj(), tensor.is_neg())`` of a plain tensor, read from its dispatch
    keys while holding the GIL: both methods are dispatched operators that give it up, and
    beside a thread running Python each took 100-200 us instead of 0.5 (``host_bytes``).
    A subclass answers through its own dispatch: its methods are asked."""
    if type(tensor) is not torch.Tensor:
        return tensor.is_conj(), tensor.is_neg()
    keys = torch._C._dispatch_keys(tensor)
    return keys.has(_CONJ_KEY), keys.has(_NEG_KEY)


def numel(shape: tuple[int, ...] | torch.Size) -> int:
    return math.prod(shape)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    return _contiguous_strides(tuple(shape))


@functools.lru_cache(maxsize=4096)  # once per item a load reads from an index; a model has few distinct kinds
def dense_layout(payload_offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorLayout:
    """The layout of a record holding one row-major tensor that is its whole storage
    (every record of ours): one object per kind, not a frozen dataclass built per item."""
    return TensorLayout(payload_offset, numel(shape) * dtype.itemsize, dtype, shape, contiguous_strides(shape), 0, None)


@functools.lru_cache(maxsize=4096)  # twice per item a load reads; a model has few distinct shapes
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class _StorageRef:
    dtype: torch.dtype | None  # None: an untyped storage (``_rebuild_tensor_v3``)
    key: str
    numel: int  # elements of ``dtype``, bytes when untyped


@dataclass(frozen=True)
class _Rebuild:
    """The arguments of the record's tensor rebuild call that decide its values."""

    storage: _StorageRef
    dtype: torch.dtype
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    flags: dict[str, bool]

    @property
    def storage_numel(self) -> int:
        """The storage's length in elements of the tensor's dtype."""
        return self.storage.numel if self.storage.dtype is not None else self.storage.numel // self.dtype.itemsize


def _rebuild_v2(storage, storage_offset, size, stride, _requires_grad=False, _hooks=None, metadata=None):  # noqa: ANN001, ANN202
    if not isinstance(storage, _StorageRef) or storage.dtype is None:
        raise CorruptCheckpointError(f"tensor record rebuilds from {storage!r}, not a typed storage")
    return _Rebuild(storage, storage.dtype, int(storage_offset), tuple(size), tuple(stride), _flags(metadata))


def _rebuild_v3(storage, storage_offset, size, stride, _requires_grad, _hooks, dtype, metadata=None):  # noqa: ANN001, ANN202
    if not isinstance(storage, _StorageRef) or storage.dtype is not None or not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"tensor record rebuilds {dtype!r} from {storage!r}, not an untyped storage")
    return _Rebuild(storage, dtype, int(storage_offset), tuple(size), tuple(stride), _flags(metadata))


def _flags(metadata: object) -> dict[str, bool]:
    """The record's tensor metadata: only the conj/neg bits torch writes are understood."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise CorruptCheckpointError(f"tensor record carries metadata {metadata!r}, not a dict")
    unknown = sorted(str(k) for k in metadata if k not in _TENSOR_FLAGS)
    if unknown:
        raise CheckpointError(
            f"tensor record carries tensor metadata {unknown} that ShardReader cannot apply "
            f"(it understands {list(_TENSOR_FLAGS)})"
        )
    if not all(isinstance(v, bool) for v in metadata.values()):
        raise CorruptCheckpointError(f"tensor record carries non-boolean metadata {metadata!r}")
    return dict(metadata)


class _TensorPickleReader(pickle.Unpickler):
    """Decodes the pickle of a single plain tensor; anything else is refused."""

    def find_class(self, module: str, name: str):  # noqa: ANN201
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_v2
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
            return _rebuild_v3
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if (module, name) == _UNTYPED:
            return _UNTYPED
        if module == "torch" and (name in _STORAGE_DTYPES or name in _DTYPES):
            return _STORAGE_DTYPES.get(name) or _DTYPES[name]
        if module in ("torch._utils", "torch._tensor") and name in _OTHER_REBUILDS:
            raise CheckpointError(
                f"tensor record holds {_OTHER_REBUILDS[name]} ({module}.{name}); ShardReader reads "
                "plain strided tensors only"
            )
        raise UnsafeCheckpointError(f"tensor record refers to {module}.{name}, which is not a plain tensor")

    def persistent_load(self, pid):  # noqa: ANN001, ANN201
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafeCheckpointError(f"tensor record has an unexpected storage reference {pid!r}")
        _, dtype, key, _location, count = pid
        if not (isinstance(dtype, torch.dtype) or dtype is _UNTYPED) or not isinstance(key, str) or not isinstance(count, int):
            raise UnsafeCheckpointError(f"tensor record has a malformed storage reference {pid!r}")
        return _StorageRef(dtype if dtype is not _UNTYPED else None, key, count)


def probed_ranges(length: int) -> list[tuple[int, int]]:
    """The (start, length) ranges of a record of ``length`` bytes that parsing its layout
    reads first (``_ProbedRecord``): its head and the rest of its tail."""
    head = min(length, PROBE_BYTES)
    tail = max(head, length - PROBE_BYTES)
    return [(0, head)] + ([(tail, length - tail)] if tail < length else [])


_RecordEnds = tuple[bytes, bytes, int]  # a record's head, its tail, where the tail starts


def _record_ends(length: int, read_at: Callable[[int, int], bytes]) -> _RecordEnds:
    """The first and last ``PROBE_BYTES`` of a record of ``length`` bytes (the bytes
    ``probed_ranges`` names), read through ``read_at``."""
    head = read_at(0, min(length, PROBE_BYTES))
    tail_start = max(0, length - PROBE_BYTES)
    overlap = head[tail_start:]  # a record under 2 * PROBE_BYTES: the ends overlap
    rest = tail_start + len(overlap)
    return head, overlap + (read_at(rest, length - rest) if rest < length else b""), tail_start


class _ProbedRecord(io.RawIOBase):
    """A seekable view of one record served from its probed head and tail bytes (``ends``:
    read already)."""

    def __init__(self, length: int, read_at: Callable[[int, int], bytes], ends: _RecordEnds | None = None):
        self.length = length
        self.read_at = read_at
        self.head, self.tail, self.tail_start = ends or _record_ends(length, read_at)
        self.pos = 0
        self.reads: list[tuple[int, int]] = []  # (start, end) of every read the parse made

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        if not 0 <= base + offset <= self.length:  # a zip offset pointing outside the record
            raise ValueError(f"zip directory points at byte {base + offset}, outside the record's {self.length}")
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.length if n is None or n < 0 else min(self.length, self.pos + n)
        start, self.pos = self.pos, end
        self.reads.append((start, end))
        return self.peek(start, end - start) or self.read_at(start, end - start)

    def peek(self, start: int, n: int) -> bytes | None:
        """Bytes ``[start, start + n)`` when one end holds them whole (not counted as read)."""
        if start + n <= len(self.head):
            return self.head[start : start + n]
        if start >= self.tail_start and start + n <= self.length:
            return self.tail[start - self.tail_start : start + n - self.tail_start]
        return None

    def holds(self, start: int, end: int) -> bool:
        """True when the head and tail (what ``ends`` holds) cover bytes ``[start, end)``."""
        return end <= len(self.head) or start >= self.tail_start or self.tail_start <= len(self.head)

    def end_ranges(self, spans: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
        """Where each (record position, length) span lies in ``ends()`` (same for every
        record of this length): its parts in the head and in the tail."""
        ranges = []
        for start, n in spans:
            if start < len(self.head):
                ranges.append((start, min(start + n, len(self.head))))
            lo, hi = max(start, self.tail_start), min(start + n, self.length)
            if lo < hi:
                ranges.append((len(self.head) + lo - self.tail_start, len(self.head) + hi - self.tail_start))
        return tuple(ranges)

    def ends_position(self, start: int, n: int) -> int:
        """Where the record's bytes ``[start, start + n)`` lie in ``ends()``, taken from the
        end ``peek`` takes them from (one must hold them whole)."""
        return start if start + n <= len(self.head) else len(self.head) + start - self.tail_start

    def ends(self, zeroed: Sequence[tuple[int, int]] = ()) -> bytearray:
        """The head and the tail back to back, with the ``zeroed`` ranges of that zeroed."""
        out = bytearray(self.head)
        out += self.tail
        for lo, hi in zeroed:
            out[lo:hi] = _ZEROS[: hi - lo]
        return out

    def readinto(self, buffer) -> int:  # noqa: ANN001
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def parse_tensor_record(length: int, read_at: Callable[[int, int], bytes], where: str) -> TensorLayout:
    """Locate the tensor bytes of a ``torch.save`` record of ``length`` bytes.

    ``read_at(offset, n)`` returns bytes of the record; usually only its first and last
    ``PROBE_BYTES`` are touched. ``where`` names the file and key for error messages.
    """
    with _record_errors(where):
        probe = _ProbedRecord(length, read_at)
    return _parse(probe, where).layout


# what parsing untrusted record bytes can raise
_RECORD_FAULTS = (
    CheckpointError, KeyError, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, TypeError, struct.error,
    NotImplementedError,  # zipfile: an entry claims a zip version or feature it does not read
    OverflowError,  # an offset beyond what a seek takes
)


def _record_fault(where: str, exc: BaseException) -> CheckpointError:
    """One of ``_RECORD_FAULTS`` as the error that names the record."""
    if isinstance(exc, CheckpointError):
        return type(exc)(f"{where}: {exc}")
    return CorruptCheckpointError(f"{where}: not a readable torch.save tensor record ({exc})")


@contextmanager
def _record_errors(where: str) -> Iterator[None]:
    """What parsing untrusted record bytes can raise, as errors that name the record."""
    try:
        yield
    except _RECORD_FAULTS as exc:
        raise _record_fault(where, exc) from None


@dataclass(frozen=True)
class _Parsed:
    layout: TensorLayout
    infos: list[zipfile.ZipInfo]  # the central directory's entries, in its order
    start_dir: int  # where the central directory starts
    data_entry: zipfile.ZipInfo  # the storage's entry
    crcs: bool  # the record carries zip CRC-32s (one entry's is not 0)


def _parse(probe: _ProbedRecord, where: str) -> _Parsed:
    with _record_errors(where):  # names the record in every error raised inside
        with zipfile.ZipFile(probe) as archive:
            infos, start_dir = archive.infolist(), archive.start_dir
            entries = {info.filename.split("/", 1)[-1]: info for info in infos}
        if min((info.header_offset for info in infos), default=0) != 0:
            # zipfile reads an archive with bytes before it (another record, where a length
            # in the metadata spans two): the tensor would be the later record's
            raise CorruptCheckpointError("record does not begin with its zip archive (its stored length is wrong?)")
        # every CRC-32 is 0 where torch.save was told not to compute them (ours, whose CRC32C
        # the index holds: ``_save_record``); a computed one is 0 once in 2**32
        crcs = any(info.CRC for info in entries.values())
        pickled = _entry_bytes(probe, entries["data.pkl"], crcs)
        _check_memo(pickled)
        decoded = _TensorPickleReader(io.BytesIO(pickled)).load()
        if not isinstance(decoded, _Rebuild):
            raise UnsafeCheckpointError("record does not hold a plain tensor")
        order = _entry_bytes(probe, entries["byteorder"], crcs) if "byteorder" in entries else b"little"
        _check_byteorder(order, decoded.dtype)
        data_entry = entries[f"data/{decoded.storage.key}"]
        payload_offset = _entry_start(probe, data_entry)
        nbytes = data_entry.file_size
        if nbytes != decoded.storage_numel * decoded.dtype.itemsize:
            raise CorruptCheckpointError(
                f"storage claims {decoded.storage.numel} {decoded.storage.dtype or 'bytes'} elements "
                f"of {decoded.dtype} but holds {nbytes} bytes"
            )
        if decoded.flags.get("conj") and not decoded.dtype.is_complex:
            raise CorruptCheckpointError(f"record sets the conj bit on a {decoded.dtype} tensor")
    layout = TensorLayout(
        payload_offset, nbytes, decoded.dtype, decoded.shape, decoded.stride, decoded.storage_offset,
        data_entry.CRC if crcs else None, conj=decoded.flags.get("conj", False), neg=decoded.flags.get("neg", False),
    )
    check_within_storage(layout, decoded.storage_numel, where)
    return _Parsed(layout, infos, start_dir, data_entry, crcs)


def _check_memo(pickled: bytes) -> None:
    """Refuse a pickle that names a memo slot beyond ``_MEMO_SLOTS``: the unpickler grows
    its memo to the slot number before anything else, so a corrupt or crafted number
    would allocate gigabytes (a tensor record's pickle uses about ten)."""
    try:
        slot = largest_memo_slot(pickled)
    except ValueError as exc:
        raise CorruptCheckpointError(f"record pickle is unreadable ({exc})") from None
    if slot >= _MEMO_SLOTS:
        raise CorruptCheckpointError(f"record pickle uses memo slot {slot} (at most {_MEMO_SLOTS - 1} expected)")


class RecordLayouts:
    """Layouts of ``torch.save`` records, each parsed from its head and tail.

    ``torch.save`` frames every tensor of one dtype, shape and strides in the same bytes
    but for the entries no parse reads (the storage, the serialization id) and their
    CRC-32s. So once a record has been parsed, a record of the same length whose head and
    tail equal its own everywhere but there has its layout, with its own storage CRC: two
    small reads and a byte comparison instead of a zip and pickle parse (~10 us instead
    of ~60 per record; a stock checkpoint has one record per tensor). The comparison
    leaves out only bytes the first parse did not read (``_Frame.of`` checks), so the
    result is the one a full parse would give; anything else is parsed in full.
    """

    KINDS = 8  # frames kept per record length (kinds of one byte size: bf16 and fp32 shapes)

    def __init__(self) -> None:
        # (record length, its first FRAME_KEY_BYTES or None) -> frames of records parsed in full
        self._frames: dict[tuple[int, bytes | None], tuple[_Frame, ...]] = {}
        self._kinds: dict[int, int] = {}  # record length -> frames kept
        self._lock = threading.Lock()  # threads probing records of one load share the frames
        self.parsed_in_full = 0  # records that matched no frame

    def parse(self, length: int, read_at: Callable[[int, int], bytes], where: str) -> TensorLayout:
        """A record framed like one parsed before is compared with the frames of its length
        that begin with its bytes (``_Frame.key``), its ends not made a seekable probe: a
        stock file's 590 records, two kinds of each length (``Catalog.parse_layouts``,
        warm), 16.5-17.0 -> 13.7-14.3 us a record."""
        try:
            ends = _record_ends(length, read_at)
        except _RECORD_FAULTS as exc:
            raise _record_fault(where, exc) from None
        with self._lock:
            frames = self._frames.get((length, ends[0][:FRAME_KEY_BYTES]), ()) + self._frames.get((length, None), ())
        if frames:
            joined = ends[0] + ends[1]
            for frame in frames:
                layout = frame.match(joined)
                if layout is not None:
                    return layout
        probe = _ProbedRecord(length, read_at, ends)
        parsed = _parse(probe, where)
        with self._lock:
            self.parsed_in_full += 1
            frame = _Frame.of(probe, parsed) if self._kinds.get(length, 0) < self.KINDS else None
            if frame is not None:
                self._kinds[length] = self._kinds.get(length, 0) + 1
                key = (length, frame.key())
                self._frames[key] = self._frames.get(key, ()) + (frame,)
        return parsed.layout


_READ_ENTRIES = ("data.pkl", "byteorder")  # the entries whose bytes a parse reads
# a record's first bytes: its first entry's zip header (torch.save puts no CRC-32 or sizes
# there) and the start of its pickle (storage type, numel, shape), where records of one
# length but of two kinds (fp32 [16, 1024] and bf16 [32, 1024]) differ; a frame compares
# the first ~240 bytes of a stock record whole
FRAME_KEY_BYTES = 192


@dataclass(frozen=True)
class _Frame:
    """A parsed record's probed ends with the bytes no parse reads zeroed."""

    ends: bytes
    crc_fields: tuple[int, ...]  # central directory CRC-32s that are zeroed (of unread entries)
    parsed: _Parsed
    fixed_crcs: bool  # an entry the parse reads has a CRC-32 (so the record has them)
    data_crc_field: int  # the storage entry's CRC-32 field, one of ``crc_fields``
    kept: tuple[tuple[int, bytes], ...] = ()  # the bytes compared, where they lie in ``ends``: all but the zeroed ones
    crc_at: tuple[int, ...] = ()  # where each of ``crc_fields`` lies in ``ends``

    @classmethod
    def of(cls, probe: _ProbedRecord, parsed: _Parsed) -> _Frame | None:
        """None unless every read the parse made lies in the ends (a read from the middle,
        such as a pickle longer than the head, is a byte the comparison cannot see) and
        every byte left out of the comparison lies in the ends, outside every read the
        parse made, but for CRC-32 fields whose values it does not use or takes from the
        match (such records are then always parsed in full)."""
        central = _central_headers(probe, parsed)
        starts = sorted({info.header_offset for info in parsed.infos} | {parsed.start_dir})
        if central is None or not all(probe.holds(begin, end) for begin, end in probe.reads):
            return None
        spans: list[tuple[int, int]] = []
        unused: set[int] = set()  # CRC fields read as part of a header, their values not used
        crc_fields: list[int] = []
        fixed_crcs, data_crc_field = False, None
        for info, header in zip(parsed.infos, central):
            if info.filename.split("/", 1)[-1] in _READ_ENTRIES:
                fixed_crcs = fixed_crcs or bool(info.CRC)
                continue
            crc_fields.append(header + 16)
            unused.add(header + 16)
            end = next((start for start in starts if start > info.header_offset), 0)  # the next entry's header
            if info is parsed.data_entry:  # its local header is read: there only its CRC is left out
                data_crc_field = header + 16
                unused.add(info.header_offset + 14)
                spans += [(info.header_offset + 14, 4), (parsed.layout.payload_offset, end - parsed.layout.payload_offset)]
            else:  # header, bytes and data descriptor
                spans.append((info.header_offset, end - info.header_offset))
        spans += [(field, 4) for field in crc_fields]
        for start, n in spans:
            if n < 0 or (start not in unused and any(start < end and begin < start + n for begin, end in probe.reads)):
                return None
        if data_crc_field is None or any(probe.peek(field, 4) is None for field in crc_fields):
            return None
        zeroed = probe.end_ranges(spans)
        ends = bytes(probe.ends(zeroed))
        kept, at = [], 0
        for lo, hi in sorted(zeroed):
            if lo > at:
                kept.append((at, ends[at:lo]))
            at = max(at, hi)
        kept += [(at, ends[at:])] if at < len(ends) else []
        crc_at = tuple(probe.ends_position(field, 4) for field in crc_fields)
        return cls(ends, tuple(crc_fields), parsed, fixed_crcs, data_crc_field, tuple(kept), crc_at)

    def key(self) -> bytes | None:
        """The first ``FRAME_KEY_BYTES`` of the ends, which every record it matches begins
        with: None where the comparison leaves some of them out (or the ends are shorter)."""
        whole = any(lo == 0 and len(piece) >= FRAME_KEY_BYTES for lo, piece in self.kept)
        return self.ends[:FRAME_KEY_BYTES] if whole else None

    def match(self, ends: bytes) -> TensorLayout | None:
        """The layout of the record whose head and tail are ``ends`` (of the same length, so
        its ends lie where this one's do) if it is framed like this one; None when it is
        not, or when its CRC-32s would make a full parse differ. Compares the ranges the
        frame keeps where they lie (``startswith``: no slice is copied), not a zeroed copy
        of the record's ends (~9 against ~24 us a record)."""
        if len(ends) != len(self.ends) or not all(ends.startswith(piece, lo) for lo, piece in self.kept):
            return None
        crcs = [_U32.unpack_from(ends, at)[0] for at in self.crc_at]
        if (self.fixed_crcs or any(crcs)) != self.parsed.crcs:
            return None
        data_crc = crcs[self.crc_fields.index(self.data_crc_field)] if self.parsed.crcs else None
        # the parse's layout with this record's CRC-32 (dataclasses.replace runs the frozen __init__: ~10 us)
        return replaced(self.parsed.layout, payload_crc32=data_crc)


def _central_headers(probe: _ProbedRecord, parsed: _Parsed) -> list[int] | None:
    """Record positions of the central directory's headers, walked as ``zipfile`` walks
    them (46 bytes, then name, extra and comment); None unless the tail holds them."""
    positions, at = [], parsed.start_dir
    for info in parsed.infos:
        header = probe.peek(at, 46)
        if header is None or header[:4] != b"PK\x01\x02":
            return None
        name_length, extra_length, comment_length = struct.unpack("<HHH", header[28:34])
        positions.append(at)
        at += 46 + name_length + extra_length + comment_length
    return positions


def _check_byteorder(order: bytes, dtype: torch.dtype) -> None:
    """Refuse bytes in the other byte order (no record means little-endian, as torch.load assumes here)."""
    text = order.decode("ascii", "replace")
    if text not in ("little", "big"):
        raise CorruptCheckpointError(f"record has an unknown byte order {text!r}")
    if text == "big" and dtype.itemsize > 1:
        raise CheckpointError(f"record holds big-endian {dtype} bytes; ShardReader reads little-endian records only")


def _entry_start(probe: _ProbedRecord, entry: zipfile.ZipInfo) -> int:
    """Where a stored (uncompressed) zip entry's bytes start in the record, from its local header."""
    probe.seek(entry.header_offset)
    header = probe.read(_LOCAL_HEADER.size)
    fields = _LOCAL_HEADER.unpack(header) if len(header) == _LOCAL_HEADER.size else (0,) * 11
    if fields[0] != _LOCAL_HEADER_MAGIC:
        raise CorruptCheckpointError(f"bad zip local header for entry {entry.filename!r}")
    start = entry.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
    if entry.compress_type != zipfile.ZIP_STORED or start + entry.file_size > probe.length:
        raise CorruptCheckpointError(f"zip entry {entry.filename!r} lies outside its record or is compressed")
    return start


def _entry_bytes(probe: _ProbedRecord, entry: zipfile.ZipInfo, crcs: bool) -> bytes:
    """A small entry's bytes (the pickle, the byte order), checked against its CRC-32
    where the record has CRCs (zipfile's own read refuses a record written without)."""
    probe.seek(_entry_start(probe, entry))
    data = probe.read(entry.file_size)
    if crcs and zlib.crc32(data) != entry.CRC:
        raise CorruptCheckpointError(f"zip entry {entry.filename!r} fails its CRC-32")
    return data


def archive_crc_fault(record: bytes | bytearray) -> tuple[bool, str | None]:
    """Whether ``record`` carries zip CRC-32s (a ``torch.save`` archive: stock DCP's records,
    tensors and other objects alike), and why its bytes fail them (the first failing
    entry, or an archive that cannot be read), or None."""
    data = io.BytesIO(record)
    try:
        if not zipfile.is_zipfile(data):  # it raises on some damaged end records
            return False, None
        bad = zipfile.ZipFile(data).testzip()
    except Exception as exc:  # untrusted bytes: whatever zipfile trips over (names, versions, offsets)
        return True, f"unreadable torch.save archive ({type(exc).__name__}: {exc})"
    return True, None if bad is None else f"crc32 mismatch in record entry {bad!r}"


def check_holds(layout: TensorLayout, dtype: torch.dtype, sizes: tuple[int, ...], where: str) -> None:
    """The record's tensor is the chunk the metadata says it is (dtype and shape)."""
    if layout.dtype != dtype or layout.shape != tuple(sizes):
        raise CorruptCheckpointError(
            f"{where}: record holds {layout.dtype} {list(layout.shape)} but metadata says {dtype} {list(sizes)}"
        )


def check_within_storage(layout: TensorLayout, storage_numel: int, where: str) -> None:
    if any(s < 0 for s in layout.shape) or any(s < 0 for s in layout.stride) or layout.storage_offset < 0:
        raise CorruptCheckpointError(f"{where}: negative shape, stride or offset in tensor record")
    if numel(layout.shape) == 0:
        return
    last = layout.storage_offset + sum((s - 1) * st for s, st in zip(layout.shape, layout.stride))
    if last >= storage_numel:
        raise CorruptCheckpointError(f"{where}: tensor view reaches past the end of its storage")


class BytesOut(Protocol):
    """Where a ``RecordSink`` passes its bytes: a binary file, or a wrapper of one."""

    def write(self, data: bytes | bytearray | memoryview, /) -> int: ...


class RecordSink:
    """File wrapper records are written through: tracks position and each record's checksum.

    Small writes (zip headers, pickles, small records) are checksummed as they come and
    gathered, across records, into writes of at least ``SMALL_WRITE`` bytes; ``drain``
    passes on the rest. Larger ones are checksummed and passed on ``WRITE_PIECE`` bytes at
    a time. ``frames`` keeps the bytes ``torch.save`` writes around a tensor's storage, per
    kind of tensor, for the records of this file.
    """

    def __init__(self, out: BytesOut, checksums: bool) -> None:
        self.out = out
        self.checksums = checksums
        self.frames = RecordFrames(zip_crc=not checksums)  # one checksum per record: ours, or else the zip's
        self.position = 0
        self._start = 0
        self._crc = 0
        self._pending = bytearray()  # small writes not yet passed on

    def begin(self) -> None:
        """Start a record."""
        self._start, self._crc = self.position, 0

    def write(self, data: bytes | memoryview) -> int:
        """Take one write of the record: checksum it, and gather it or pass it on."""
        view = memoryview(data).cast("B")
        if view.nbytes < SMALL_WRITE:
            self._checksum(view)
            self._pending += view
            if len(self._pending) >= SMALL_WRITE:
                self.drain()
        else:
            self.drain()
            for start in range(0, view.nbytes, WRITE_PIECE):
                piece = view[start:start + WRITE_PIECE]
                self._checksum(piece)
                self.out.write(piece)
        self.position += view.nbytes
        return view.nbytes

    def _checksum(self, view: memoryview) -> None:
        if self.checksums:
            self._crc = crc32c.crc32c(view, self._crc)

    @property
    def record_start(self) -> int:
        """Where the current record starts in the file."""
        return self._start

    def drain(self) -> None:
        """Pass the gathered small writes on (the file copies them: the buffer is reused);
        call before the file is closed."""
        if self._pending:
            self.out.write(self._pending)
            self._pending.clear()

    def flush(self) -> None:
        """Nothing: a stream transform may flush after every record, which would cost a
        write syscall each; the file is flushed once, where it is closed."""

    def finish(self, relative_path: str, payload_offset: int, transforms: tuple[str, ...] = ()) -> StoredItem:
        """The record is complete: describe it."""
        return StoredItem(
            relative_path,
            self._start,
            self.position - self._start,
            payload_offset,
            self._crc if self.checksums else None,
            transforms,
        )


@dataclass(frozen=True)
class Frames:
    """A ``torch.save`` record of one tensor without its storage bytes: ``before`` + the
    storage + ``after`` is the record (``apart=False``: the storage was not handed over as
    a write of its own, or is empty, and ``before`` is the whole record)."""

    before: bytes
    after: bytes
    payload_offset: int  # where the storage starts in the record
    apart: bool


class RecordFrames:
    """The frames of ``torch.save`` records, reused for tensors of one dtype, shape and
    class. Without zip CRC-32s, a record's bytes around the storage depend on nothing
    else (the pickle names the dtype, shape and storage; the zip headers the sizes; the
    serialization id the entry names), so the first tensor of a kind is saved through
    ``torch.save`` and later ones cost three writes: a model's layers repeat a few shapes.
    With CRCs every record is saved afresh (its headers hold its storage's CRC-32)."""

    LIMIT = 4096  # kinds remembered per file (each ~2 KB)

    def __init__(self, zip_crc: bool) -> None:
        self.zip_crc = zip_crc
        self._known: dict[tuple[type, torch.dtype, torch.Size], Frames] = {}

    def of(self, tensor: torch.Tensor, where: str) -> Frames:
        """The frames of ``tensor`` (as ``dense_cpu`` returns it)."""
        return self._frames((type(tensor), tensor.dtype, tensor.shape), lambda: tensor, where)

    def of_kind(self, dtype: torch.dtype, shape: torch.Size, where: str) -> Frames:
        """The frames of a plain CPU tensor of ``dtype`` and ``shape`` whose data is elsewhere:
        a stand-in (never read) is made only when the kind is not known yet."""
        return self._frames((torch.Tensor, dtype, shape), lambda: torch.empty(shape, dtype=dtype), where)

    def _frames(self, kind: tuple[type, torch.dtype, torch.Size], tensor: Callable[[], torch.Tensor], where: str) -> Frames:
        frames = self._known.get(kind)
        if frames is None:
            frames = _capture(tensor(), self.zip_crc, where)
            if frames.apart and not self.zip_crc and len(self._known) < self.LIMIT:
                self._known[kind] = frames
        return frames


class _Capture(io.RawIOBase):
    """What ``torch.save`` writes, kept in memory, except the tensor's storage itself: it
    comes as one write at the storage's own address, noted and not copied."""

    def __init__(self, storage: tuple[int, int]) -> None:
        self.storage = storage  # (address, nbytes)
        self.parts = [bytearray()]

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        if len(self.parts) == 1 and view.nbytes == self.storage[1] > 0 and _address(view) == self.storage[0]:
            self.parts.append(bytearray())
        else:
            self.parts[-1] += view
        return view.nbytes


def _capture(tensor: torch.Tensor, zip_crc: bool, where: str) -> Frames:
    capture = _Capture((tensor.data_ptr(), tensor.nbytes))
    _save_record(tensor, capture, zip_crc)
    before = bytes(capture.parts[0])
    if len(capture.parts) == 2:
        return Frames(before, bytes(capture.parts[1]), len(before), True)
    payload_offset = parse_tensor_record(len(before), lambda offset, n: before[offset : offset + n], where).payload_offset
    return Frames(before, b"", payload_offset, False)


def _address(view: memoryview) -> int:
    """The address of a write's first byte, to tell the tensor's own storage when it passes."""
    return np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]


def dense_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns exactly its values in row-major order (what we store).

    Conj/neg views are resolved: ``torch.save`` would write the unresolved storage plus a
    bit that the index (which records only where the bytes are) does not carry. A tensor
    subclass holding its own storage is stored as a plain tensor: its rebuild names its
    class, which weights-only loaders (stock ``FileSystemReader``'s) refuse, and a load
    copies values into the destination anyway.
    """
    if type(tensor) is not torch.Tensor and not is_traceable_wrapper_subclass(tensor):
        tensor = tensor.as_subclass(torch.Tensor)
    # always detached: a fresh tensor without the Python attributes torch.save would pickle
    # into the record; the bits resolved only where set (an operator gives up the GIL: ``math_bits``)
    tensor = tensor.detach()
    conj, neg = math_bits(tensor)
    if conj:
        tensor = tensor.resolve_conj()
    if neg:
        tensor = tensor.resolve_neg()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    ):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


PayloadCopy = Callable[[torch.Tensor, Callable[[memoryview], int]], None]  # (device tensor, write) -> None


def write_tensor(
    sink: RecordSink,
    relative_path: str,
    tensor: torch.Tensor,
    where: str,
    transform: StreamTransformExtension | None = None,
    copy_out: PayloadCopy | None = None,
) -> StoredItem:
    """Write ``tensor`` as a ``torch.save`` record, noting where its bytes start so reads can go straight there.

    ``copy_out(tensor, write)`` hands a device tensor's bytes to ``write`` piece by piece
    through host buffers (the writer's staging): without it, or where the record's frames
    need the data (zip CRC-32s, a stream transform), the tensor is copied to the CPU whole."""
    if tensor.is_meta:  # torch's own message ("Cannot copy out of meta tensor") names no key
        raise InvalidRequestError(
            f"{where}: is a meta tensor, which holds no values to save; materialize it first "
            "(module.to_empty(device=...), then initialize or load its weights)"
        )
    if copy_out is not None and tensor.device.type != "cpu" and transform is None and not sink.frames.zip_crc:
        return write_device_tensor(sink, relative_path, tensor, where, copy_out)
    tensor = dense_cpu(tensor)
    if transform is not None:
        return _write_transformed(sink, relative_path, transform, lambda stream: torch.save(tensor, stream))
    frames = sink.frames.of(tensor, where)
    sink.begin()
    sink.write(frames.before)
    if frames.apart:
        sink.write(host_bytes(tensor))
    sink.write(frames.after)
    return sink.finish(relative_path, sink.record_start + frames.payload_offset)


def write_device_tensor(
    sink: RecordSink, relative_path: str, tensor: torch.Tensor, where: str, copy_out: PayloadCopy
) -> StoredItem:
    """``write_tensor`` of a tensor whose bytes ``copy_out`` passes on (on a device): the
    same record bytes, framed by a CPU stand-in of its dtype and shape (the frames do not
    depend on the data without zip CRC-32s, and the stand-in's storage is never read)."""
    tensor = tensor.detach().resolve_conj().resolve_neg().contiguous()
    frames = sink.frames.of_kind(tensor.dtype, tensor.shape, where)
    if not frames.apart:  # an empty tensor, or a record torch.save writes otherwise: from a host copy
        return write_tensor(sink, relative_path, tensor.cpu(), where)
    sink.begin()
    sink.write(frames.before)
    copy_out(tensor, sink.write)
    sink.write(frames.after)
    return sink.finish(relative_path, sink.record_start + frames.payload_offset)


def _save_record(tensor: torch.Tensor, out: IO[bytes], zip_crc: bool) -> None:
    """``torch.save(tensor, out)``; ``zip_crc=False`` writes the bytes ``torch.save``
    writes with ``torch.serialization.set_crc32_options(False)``: every zip entry's CRC-32
    is 0 (``torch.load`` does not check it). The zip CRC-32 costs 0.25 CPU-seconds per GB
    and a record that has our CRC32C needs no second checksum; the process-wide option is
    not touched, so a ``torch.save`` on another thread keeps its CRCs."""
    if zip_crc:
        torch.save(tensor, out)
        return
    writer = torch._C.PyTorchFileWriter(out, False, torch.serialization._get_storage_alignment())
    torch.serialization._save(tensor, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()


def write_bytes(
    sink: RecordSink, relative_path: str, data: io.BytesIO, transform: StreamTransformExtension | None = None
) -> StoredItem:
    """Write a bytes item as stock DCP does: its raw bytes, with no addressable payload."""
    if transform is not None:
        return _write_transformed(sink, relative_path, transform, lambda stream: stream.write(data.getbuffer()))
    sink.begin()
    sink.write(data.getbuffer())
    return sink.finish(relative_path, -1)


def _write_transformed(
    sink: RecordSink, relative_path: str, transform: StreamTransformExtension, write: Callable[[IO[bytes]], object]
) -> StoredItem:
    """A record passed through a DCP stream transform (as stock ``_extensions`` do): the
    checksum covers the stored (transformed) bytes; there is no addressable payload."""
    sink.begin()
    stream = transform.transform_to(cast(IO[bytes], sink))
    write(stream)
    stream.close()  # ends the compressed frame; the sink itself stays open
    return sink.finish(relative_path, -1, (transform.get_descriptor(),))
