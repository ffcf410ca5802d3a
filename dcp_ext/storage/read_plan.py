"""Turn DCP read items into byte-range requests that land in the destination tensor.

A stored chunk is a dense row-major block inside a file. The box a load needs from it
decomposes into runs of contiguous bytes; when the destination holds those runs
contiguously too (the usual case: a whole chunk, or rows of it) the file bytes are read
straight into the destination's memory. Otherwise they go into a temporary buffer no
larger than the box (never the whole record) and are copied over. Boxes above
``SLAB_BYTES`` are split so temporary memory per request stays bounded. A record's conj
and neg bits (``TensorLayout.conj`` / ``.neg``) are applied once the bytes have landed.
A destination off the CPU gets the same requests with ``device`` set: their targets are
``DeviceSpan``s of device memory (temporaries live on that device too), which the executor
fills through host staging buffers (``device_staging``).
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import crc32c
import numpy as np
import torch

from dcp_ext.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    InvalidRequestError,
)
from dcp_ext.formats.index import INDEX_NAME, StoredItem
from dcp_ext.formats.torch_record import (
    RecordLayouts,
    TensorLayout,
    archive_crc_fault,
    check_holds,
    check_within_storage,
    host_bytes,
    math_bits,
    numel,
    parse_tensor_record,
)
from dcp_ext.formats.transforms import decode
from dcp_ext.storage.device_staging import DeviceSpan, Target

SLAB_BYTES = 32 << 20  # largest temporary buffer one request may allocate
SMALL_RUN_BYTES = 4096  # runs below this are read as one span and copied with strides


def _nothing() -> None:
    pass


@dataclass
class Request:
    """Bytes to read from one file and what to do once they have landed."""

    path: str
    key: str
    ranges: list[tuple[int, int]]  # (file offset, length), ascending and disjoint
    targets: Callable[[], list[Target]]  # allocated when the request runs
    complete: Callable[[], None] = _nothing  # verify / copy into the destination
    device: torch.device | None = None  # set: targets are DeviceSpans, filled through host staging
    scratch_bytes: int = 0  # temporary memory its targets allocate (0: they are the destination's)

    @property
    def start(self) -> int:
        return self.ranges[0][0]

    @property
    def nbytes(self) -> int:
        return sum(length for _, length in self.ranges)


def storage_bytes(tensor: torch.Tensor, staged: bool = False) -> Target:
    """Writable bytes of a tensor's whole storage (index with byte offsets): a memoryview
    of host memory, or a DeviceSpan when the bytes go through host staging."""
    storage = tensor.untyped_storage()
    if not staged:
        return host_bytes(storage)
    nbytes = storage.nbytes()
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    flat.set_(storage, 0, (nbytes,), (1,))
    return DeviceSpan(flat, extent=nbytes)


def tensor_bytes(tensor: torch.Tensor, staged: bool = False) -> Target:
    """Writable bytes of a contiguous tensor: its own memory on the CPU (``host_bytes``),
    else a span of its storage."""
    if not staged and tensor.is_cpu and tensor.is_contiguous():
        return host_bytes(tensor)
    start = tensor.storage_offset() * tensor.element_size()
    return storage_bytes(tensor, staged)[start : start + tensor.numel() * tensor.element_size()]


class Scratch:
    """A temporary tensor allocated when its request runs and dropped once copied out,
    so a load holds temporary memory only for the requests in flight."""

    def __init__(self, shape: tuple[int, ...] | int, dtype: torch.dtype, device: torch.device | None = None):
        self.shape, self.dtype, self.device = shape, dtype, device
        self._tensor: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self._tensor

    def release(self) -> torch.Tensor:
        tensor, self._tensor = self.get(), None
        return tensor


def _direct_capable(dest: torch.Tensor, dtype: torch.dtype) -> bool:
    return dest.dtype == dtype and not any(math_bits(dest))


@dataclass(frozen=True)
class Verification:
    """A checksum to check over the bytes a request reads, in file order."""

    algorithm: str  # "crc32c" (our index, whole record) or "crc32" (zip entry, payload)
    expected: int
    where: str

    def update(self, value: int, piece: memoryview) -> int:
        return crc32c.crc32c(piece, value) if self.algorithm == "crc32c" else zlib.crc32(piece, value)

    def check(self, pieces: list[memoryview]) -> None:
        value = 0
        for piece in pieces:
            value = self.update(value, piece)
        self.confirm(value)

    def confirm(self, value: int) -> None:
        if value != self.expected:
            raise ChecksumMismatchError(
                f"{self.where}: {self.algorithm} mismatch (recorded {self.expected:#010x}, read {value:#010x}); "
                "the stored bytes are corrupt"
            )


def whole_record_request(
    item: StoredItem, key: str, where: str, verify: bool, deliver: Callable[[bytes | bytearray], None], limit: int = 0
) -> Request:
    """Read a whole record: a bytes item, or a record stored through stream transforms
    (compression), decoded to at most ``limit`` bytes. Checked against its stored-bytes
    checksum when asked, then handed to ``deliver`` on the reading thread. Its buffer is
    allocated when the request runs and dropped once delivered, so a load of compressed
    records holds those in flight, not every one it has read."""
    held: list[bytearray] = []
    check = Verification("crc32c", item.checksum, where) if verify and item.checksum is not None else None

    def targets() -> list[Target]:
        held.append(bytearray(item.length))
        return [memoryview(held[-1])]

    def complete() -> None:
        buf = held.pop()
        if check is not None:
            check.check([memoryview(buf)])
        deliver(decode(item.transforms, buf, where, limit) if item.transforms else buf)

    return Request(item.relative_path, key, [(item.offset, item.length)], targets, complete, scratch_bytes=item.length)


@dataclass(frozen=True)
class GuessedLayout:
    """The layout a stock record is taken to have before any byte of it is read: that of a
    record of the same length, dtype and shape this load parsed (``torch.save`` frames all
    such records alike), its CRC-32 unknown. ``records`` holds the frames of the records
    parsed, which the read checks the guess against (``guessed_record_request``)."""

    layout: TensorLayout
    records: RecordLayouts


def guessed_record_request(
    item: StoredItem,
    guess: GuessedLayout,
    chunk: tuple[torch.dtype, tuple[int, ...]],
    dest: torch.Tensor,
    key: str,
    where: str,
    learned: Callable[[TensorLayout], None],
) -> Request:
    """A whole stock record read as one range, its payload straight into ``dest`` (the
    caller checked that it lands there: ``straight_start``) where ``guess`` puts it, the
    bytes before and after into buffers of their own. Once it has landed, the record's
    layout is parsed from those bytes as from its ends anywhere else (``RecordLayouts.parse``:
    compared with a frame, or parsed in full) and handed to ``learned``. Where it is not
    the guess, the record, whole across the three buffers, is first put together and its
    tensor copied into ``dest`` through its true layout (``copy_record_box``): a wrong
    guess costs a copy, never a wrong value. No read of the ends comes first: a cold
    load streams the file once instead of reading every record's ends before its data."""
    head = guess.layout.payload_offset + guess.layout.storage_offset * guess.layout.dtype.itemsize
    end = head + dest.nbytes
    held: list[bytearray] = []

    def targets() -> list[Target]:
        held[:] = [bytearray(head), bytearray(item.length - end)]
        return [memoryview(held[0]), host_bytes(dest), memoryview(held[1])]

    def complete() -> None:
        before, after = held
        held.clear()
        payload = host_bytes(dest)
        parts = ((0, memoryview(before)), (head, payload), (end, memoryview(after)))

        def read_at(offset: int, n: int) -> bytes:
            out = bytearray()
            for base, part in parts:
                lo, hi = max(offset, base), min(offset + n, base + part.nbytes)
                if lo < hi:
                    out += part[lo - base : hi - base]
            return bytes(out)

        layout = guess.records.parse(item.length, read_at, where)
        if replace(layout, payload_crc32=None) != guess.layout:
            record = b"".join(bytes(part) for _, part in parts)
            copy_record_box(record, chunk, (0,) * dest.dim(), tuple(dest.shape), dest, where, False, decoded=False)
        learned(layout)

    return Request(item.relative_path, key, [(item.offset, item.length)], targets, complete, scratch_bytes=item.length - dest.nbytes)


def copy_record_box(
    record: bytes | bytearray,
    chunk: tuple[torch.dtype, tuple[int, ...]],
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    dest: torch.Tensor,
    where: str,
    verify: bool,
    decoded: bool = True,
) -> None:
    """Copy a box of the tensor in a ``torch.save`` record (``decoded`` from its stored
    transforms, or read as stored) into ``dest``, straight out of the record's bytes
    (``torch.load`` would copy the whole tensor out first: a load of compressed records
    held each one twice).

    ``chunk``: the (dtype, shape) the metadata gives the stored chunk, which the record must
    hold (a record of another key would be cast or copied in part). ``verify`` checks the
    CRC-32 of every zip entry of the record (what stock records carry).
    """
    what = f"{where}: decoded record" if decoded else where
    if verify:
        carries, fault = archive_crc_fault(record)
        if not carries:
            raise CorruptCheckpointError(f"{what} is no torch.save archive (no zip directory in its {len(record)} bytes)")
        raise_if_corrupt(where, fault)
    data = memoryview(record)
    layout = parse_tensor_record(len(data), lambda at, n: bytes(data[at : at + n]), what)
    check_holds(layout, *chunk, where)
    end = layout.payload_offset + layout.payload_nbytes
    if end > len(data) or layout.payload_nbytes % layout.dtype.itemsize:
        raise CorruptCheckpointError(f"{what} holds no tensor within its bytes")
    count = layout.payload_nbytes // layout.dtype.itemsize
    check_within_storage(layout, count, where)
    with warnings.catch_warnings():  # the record is read-only bytes, and only read here
        warnings.simplefilter("ignore", UserWarning)
        storage = torch.frombuffer(data, dtype=layout.dtype, count=count, offset=layout.payload_offset) if count else (
            torch.empty(0, dtype=layout.dtype))
    tensor = storage.as_strided(layout.shape, layout.stride, layout.storage_offset)
    layout.copy_values(dest, tensor[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))])


def raise_if_corrupt(where: str, fault: str | None) -> None:
    """A checksum fault found in a record's bytes, as the error a load raises."""
    if fault is not None:
        raise ChecksumMismatchError(f"{where}: {fault}; the stored bytes are corrupt")


@dataclass(frozen=True)
class BoxRead:
    """A box of one stored chunk and the destination tensor it fills."""

    path: str
    key: str
    layout: TensorLayout
    base: int  # absolute file offset of the chunk's first storage byte
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    dest: torch.Tensor
    device: torch.device | None = None  # set: the box lands through host staging (``Request.device``)

    def narrowed(self, dim: int, start: int, n: int) -> BoxRead:
        offsets = self.offsets[:dim] + (self.offsets[dim] + start,) + self.offsets[dim + 1 :]
        lengths = self.lengths[:dim] + (n,) + self.lengths[dim + 1 :]
        return replace(self, offsets=offsets, lengths=lengths, dest=self.dest.narrow(dim, start, n))

    def copy_from(self, storage: torch.Tensor, storage_offset: int = 0) -> None:
        """Copy the box out of a buffer laid out like the stored chunk's storage."""
        start = storage_offset + sum(o * s for o, s in zip(self.offsets, self.layout.stride))
        self.layout.copy_values(self.dest, storage.as_strided(self.lengths, self.layout.stride, start))

    def resolve_in_place(self) -> None:
        """Bytes read straight into the destination become values (the record's bits)."""
        self.layout.resolve_in_place(self.dest)


def tensor_requests(
    item: StoredItem,
    layout: TensorLayout,
    box_offsets: tuple[int, ...],
    box_lengths: tuple[int, ...],
    dest: torch.Tensor,
    key: str,
    where: str,
    verify: bool,
    staged: bool = False,
) -> list[Request]:
    """Requests that fill ``dest`` with the box of the stored chunk ``item``; through host
    staging when ``dest`` is off the CPU (``staged`` forces it for a CPU ``dest``: tests)."""
    if numel(box_lengths) == 0:
        return []
    start = None if staged else straight_start(item, layout, box_lengths, dest, verify)
    if start is not None:  # the common case, kept cheap
        if layout.conj or layout.neg:  # resolved once every byte has landed: one request
            resolve = lambda: layout.resolve_in_place(dest)  # noqa: E731
            return [Request(item.relative_path, key, [(start, dest.nbytes)], lambda: [tensor_bytes(dest)], resolve)]
        return straight_requests(item.relative_path, key, start, dest)
    device = dest.device if staged or not dest.is_cpu else None
    box = BoxRead(item.relative_path, key, layout, item.offset + layout.payload_offset, box_offsets, box_lengths, dest, device)
    if verify:
        if item.checksum is None and layout.payload_crc32 is None:
            raise InvalidRequestError(
                f"{where}: verify_checksums=True (dcp-ext convert always checks), but the record carries no checksum: "
                "torch.save wrote it without zip CRC-32s, and a dcp_ext record's CRC32C is in the checkpoint's index "
                f"({INDEX_NAME}), missing or stale here; restore the index or save again"
            )
        return [_verified_request(item, box, where)]
    if not layout.is_row_major():
        return [_strided_request(box)]
    view = replace(box, base=box.base + layout.storage_offset * layout.dtype.itemsize)  # the view's first byte
    return [_dense_request(slab) for slab in _slabs(view)]


def straight_start(item: StoredItem, layout: TensorLayout, box_lengths: tuple[int, ...], dest: torch.Tensor, verify: bool) -> int | None:
    """Where in its file the stored chunk ``item`` begins when the box ``box_lengths`` is
    all of it and its bytes land in ``dest`` as they are (one row-major run, no checksum
    to take on the way, ``lands_straight``): the place to read it straight from. None
    otherwise. A record's math bits (``layout.conj``, ``neg``) are the caller's to resolve."""
    if verify or box_lengths != layout.shape or not layout.is_row_major() or not lands_straight(dest, layout.dtype):
        return None
    return item.offset + layout.payload_offset + layout.storage_offset * layout.dtype.itemsize


def lands_straight(dest: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether stored ``dtype`` elements can be read straight into ``dest``'s own memory
    (``straight_requests``): host memory, one run of it, the same dtype, no math bits."""
    return dest.is_cpu and dest.is_contiguous() and _direct_capable(dest, dtype)


def straight_requests(path: str, key: str, start: int, dest: torch.Tensor) -> list[Request]:
    """A whole record read straight into ``dest``, in pieces of at most SLAB_BYTES: no
    temporary is involved, but a large tensor read as one request is one thread's work
    while the others may have finished (a 64 MiB tensor in a 120 MB load)."""
    nbytes = dest.nbytes
    if nbytes <= SLAB_BYTES:
        return [Request(path, key, [(start, nbytes)], lambda: [tensor_bytes(dest)])] if nbytes else []
    return [
        Request(path, key, [(start + lo, min(SLAB_BYTES, nbytes - lo))],
                lambda lo=lo: [tensor_bytes(dest)[lo : lo + SLAB_BYTES]])
        for lo in range(0, nbytes, SLAB_BYTES)
    ]


class StraightRecords:
    """Whole records read straight into their destinations (each passed ``lands_straight``
    and is at most SLAB_BYTES), taken in file order and handed out as one request per
    ~SLAB_BYTES: one object, sort key and completion for tens of records instead of a
    request per record (``straight_requests``). With the reader's straight check folded
    into its first pass over the pieces, a rank's ``read_data`` besides its copies went
    from 5.3-5.7 to 4.5-5.1 ms (590 records, 2-process warm load of 0.54 GB)."""

    def __init__(self, path: str):
        self.path = path
        self._key = ""  # the first record's key, for errors ("or one after it")
        self._records: list[tuple[int, torch.Tensor]] = []  # (file offset, destination)
        self._bytes = 0

    def add(self, key: str, start: int, dest: torch.Tensor) -> tuple[Request, ...]:
        """Take a record; the request it completes, if it does."""
        nbytes = dest.nbytes
        if not nbytes:
            return ()
        if not self._records:
            self._key = key
        self._records.append((start, dest))
        self._bytes += nbytes
        return self.flush() if self._bytes >= SLAB_BYTES else ()

    def flush(self) -> tuple[Request, ...]:
        """The request of the records taken since the last one, if any were."""
        if not self._records:
            return ()
        records = self._records
        self._records, self._bytes = [], 0
        return (Request(self.path, self._key, [(start, dest.nbytes) for start, dest in records],
                        lambda: [host_bytes(dest) for _, dest in records]),)


def _slabs(box: BoxRead) -> Iterator[BoxRead]:
    """Split a box along its outer dims so the source bytes it spans stay within SLAB_BYTES."""
    dim = next((d for d, n in enumerate(box.lengths) if n > 1), None)
    unit = numel(box.layout.shape[dim + 1 :]) * box.layout.dtype.itemsize if dim is not None else 0
    if dim is None or box.lengths[dim] * unit <= SLAB_BYTES:
        yield box
        return
    step = max(1, SLAB_BYTES // max(unit, 1))
    for start in range(0, box.lengths[dim], step):
        yield from _slabs(box.narrowed(dim, start, min(step, box.lengths[dim] - start)))


def _runs(shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[int, int, np.ndarray]:
    """Decompose a box of a dense array into contiguous runs.

    Returns (number of outer dims iterated, run length in elements, run starts in
    elements, in ascending order).
    """
    partial = max((d for d in range(len(shape)) if lengths[d] != shape[d]), default=-1)
    if partial < 0:
        return 0, numel(shape), np.zeros(1, dtype=np.int64)
    inner = numel(shape[partial + 1 :])
    starts = np.full(1, offsets[partial] * inner, dtype=np.int64)
    stride = inner * shape[partial]
    for d in range(partial - 1, -1, -1):
        idx = np.arange(offsets[d], offsets[d] + lengths[d], dtype=np.int64) * stride
        starts = (idx[:, None] + starts[None, :]).reshape(-1)
        stride *= shape[d]
    return partial, lengths[partial] * inner, starts


def _dense_request(box: BoxRead) -> Request:
    dtype = box.layout.dtype
    outer, run, starts = _runs(box.layout.shape, box.offsets, box.lengths)
    run_bytes = run * dtype.itemsize
    if len(starts) > 1 and run_bytes < SMALL_RUN_BYTES:
        return _span_request(box, int(starts[0]), int(starts[-1]) + run)
    ranges = [(box.base + int(s) * dtype.itemsize, run_bytes) for s in starts]
    staged = box.device is not None
    block = box.dest if staged or not outer else box.dest[(0,) * outer]  # staged: one copy per buffer, not per run
    if _direct_capable(box.dest, dtype) and block.is_contiguous():
        return Request(box.path, box.key, ranges, lambda: _dest_runs(box.dest, outer, run_bytes, staged),
                       box.resolve_in_place, box.device)
    temp = Scratch(box.lengths, dtype, box.device)

    def targets() -> list[Target]:
        data = tensor_bytes(temp.get(), staged)
        return [data[i * run_bytes : (i + 1) * run_bytes] for i in range(len(ranges))]

    return Request(box.path, box.key, ranges, targets, lambda: box.layout.copy_values(box.dest, temp.release()),
                   box.device, numel(box.lengths) * dtype.itemsize)


def _dest_runs(dest: torch.Tensor, outer: int, run_bytes: int, staged: bool) -> list[Target]:
    """Memory of each run inside the destination, in the order the runs are read."""
    data = storage_bytes(dest, staged)
    itemsize = dest.element_size()
    starts = np.full(1, dest.storage_offset(), dtype=np.int64)
    for d in range(outer - 1, -1, -1):
        idx = np.arange(dest.shape[d], dtype=np.int64) * dest.stride(d)
        starts = (idx[:, None] + starts[None, :]).reshape(-1)
    return [data[int(s) * itemsize : int(s) * itemsize + run_bytes] for s in starts]


def _span_request(box: BoxRead, first: int, last: int) -> Request:
    """Many tiny runs: read their enclosing span [first, last) once, copy the box out with strides."""
    itemsize = box.layout.dtype.itemsize
    span = Scratch(last - first, box.layout.dtype, box.device)
    ranges = [(box.base + first * itemsize, (last - first) * itemsize)]
    return Request(box.path, box.key, ranges, lambda: [tensor_bytes(span.get(), box.device is not None)],
                   lambda: box.copy_from(span.release(), -first), box.device, ranges[0][1])


def _strided_request(box: BoxRead) -> Request:
    """A record whose tensor is a strided (not row-major) view of its storage: read the span
    of storage the box touches, then copy the box out with the view's strides."""
    layout = box.layout
    first = layout.storage_offset + sum(o * s for o, s in zip(box.offsets, layout.stride))
    extent = 1 + sum((n - 1) * s for n, s in zip(box.lengths, layout.stride))
    span = Scratch(extent, layout.dtype, box.device)
    ranges = [(box.base + first * layout.dtype.itemsize, extent * layout.dtype.itemsize)]
    return Request(box.path, box.key, ranges, lambda: [tensor_bytes(span.get(), box.device is not None)],
                   lambda: box.copy_from(span.release(), layout.storage_offset - first), box.device, ranges[0][1])


def _verified_request(item: StoredItem, box: BoxRead, where: str) -> Request:
    """Read every byte the checksum covers, check it, then fill the destination.

    Staged bytes leave the host buffer once copied, so there the checksum runs piece by
    piece as the staging hands the payload over (``DeviceSpan.tap``)."""
    layout = box.layout
    staged = box.device is not None
    whole_chunk = box.lengths == layout.shape and layout.is_dense()
    direct = whole_chunk and _direct_capable(box.dest, layout.dtype) and box.dest.is_contiguous()
    scratch = None if direct else Scratch(layout.payload_nbytes // layout.dtype.itemsize, layout.dtype, box.device)
    if item.checksum is not None:  # our index: CRC32C of the whole record
        check = Verification("crc32c", item.checksum, where)
        head = bytearray(layout.payload_offset)
        tail = bytearray(item.length - layout.payload_offset - layout.payload_nbytes)
        ranges = [(item.offset, item.length)]
    else:  # stock record: the zip entry's CRC-32 of the storage bytes
        check = Verification("crc32", layout.payload_crc32, where)
        head = tail = bytearray()
        ranges = [(box.base, layout.payload_nbytes)]
    progress: list[int] = []  # staged: the checksum of the bytes handed over so far

    def tap(piece: memoryview) -> None:
        progress.append(check.update(progress.pop() if progress else check.update(0, memoryview(head)), piece))

    def targets() -> list[Target]:
        payload = tensor_bytes(box.dest if scratch is None else scratch.get(), staged)
        if isinstance(payload, DeviceSpan):
            payload.tap = tap
        return [memoryview(head), payload, memoryview(tail)]

    def complete() -> None:
        if staged:
            check.confirm(check.update(progress[0] if progress else check.update(0, memoryview(head)), memoryview(tail)))
        else:
            check.check(targets())  # host targets: memoryviews
        if scratch is None:
            box.resolve_in_place()
        else:
            box.copy_from(scratch.release(), layout.storage_offset)

    return Request(item.relative_path, box.key, ranges, targets, complete, box.device, 0 if direct else layout.payload_nbytes)
