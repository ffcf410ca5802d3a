"""Turn DCP read items into byte-range requests that land in the destination tensor.

A stored chunk is a dense row-major block inside a file. The box a load needs from it
decomposes into runs of contiguous bytes; when the destination holds those runs
contiguously too (the usual case: a whole chunk, or rows of it) the file bytes are read
straight into the destination's memory. Otherwise they go into a temporary buffer no
larger than the box (never the whole record) and are copied over. Boxes above
``SLAB_BYTES`` are split so temporary memory per request stays bounded.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import crc32c
import numpy as np
import torch

from dcp_ext.errors import ChecksumMismatchError
from dcp_ext.formats.index import StoredItem
from dcp_ext.formats.torch_record import TensorLayout, numel

SLAB_BYTES = 32 << 20  # largest temporary buffer one request may allocate
SMALL_RUN_BYTES = 4096  # runs below this are read as one span and copied with strides


@dataclass
class Request:
    """Bytes to read from one file and what to do once they have landed."""

    path: str
    key: str
    ranges: list[tuple[int, int]]  # (file offset, length), ascending and disjoint
    targets: Callable[[], list[memoryview]]  # allocated when the request runs
    complete: Callable[[], None] = lambda: None  # verify / copy into the destination

    @property
    def start(self) -> int:
        return self.ranges[0][0]

    @property
    def nbytes(self) -> int:
        return sum(length for _, length in self.ranges)


def storage_bytes(tensor: torch.Tensor) -> memoryview:
    """Writable bytes of a CPU tensor's whole storage (index with byte offsets)."""
    storage = tensor.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    return memoryview(flat.numpy()).cast("B")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU tensor."""
    start = tensor.storage_offset() * tensor.element_size()
    return storage_bytes(tensor)[start : start + tensor.numel() * tensor.element_size()]


def _direct_capable(dest: torch.Tensor, dtype: torch.dtype) -> bool:
    return dest.device.type == "cpu" and dest.dtype == dtype and not dest.is_conj() and not dest.is_neg()


@dataclass(frozen=True)
class Verification:
    """A checksum to check over the bytes a request reads, in file order."""

    algorithm: str  # "crc32c" (our index, whole record) or "crc32" (zip entry, payload)
    expected: int
    where: str

    def check(self, pieces: list[memoryview]) -> None:
        value = 0
        for piece in pieces:
            value = crc32c.crc32c(piece, value) if self.algorithm == "crc32c" else zlib.crc32(piece, value)
        if value != self.expected:
            raise ChecksumMismatchError(
                f"{self.where}: {self.algorithm} mismatch (recorded {self.expected:#010x}, read {value:#010x}); "
                "the stored bytes are corrupt"
            )


def bytes_request(item: StoredItem, key: str, where: str, verify: bool) -> tuple[Request, bytearray]:
    """Read a whole bytes item; returns the request and the buffer it fills."""
    buf = bytearray(item.length)
    check = Verification("crc32c", item.checksum, where) if verify and item.checksum is not None else None

    def complete() -> None:
        if check is not None:
            check.check([memoryview(buf)])

    request = Request(item.relative_path, key, [(item.offset, item.length)], lambda: [memoryview(buf)], complete)
    return request, buf


def tensor_requests(
    item: StoredItem,
    layout: TensorLayout,
    box_offsets: tuple[int, ...],
    box_lengths: tuple[int, ...],
    dest: torch.Tensor,
    key: str,
    where: str,
    verify: bool,
) -> list[Request]:
    """Requests that fill ``dest`` with the box of the stored chunk ``item``."""
    if numel(box_lengths) == 0:
        return []
    base = item.offset + layout.payload_offset
    if verify and (item.checksum is not None or layout.payload_crc32 is not None):
        return [_verified_request(item, layout, base, box_offsets, box_lengths, dest, key, where)]
    if not layout.is_dense():
        return [_strided_request(item.relative_path, layout, base, box_offsets, box_lengths, dest, key)]
    return [
        _dense_request(item.relative_path, layout, base, offs, lens, sub, key)
        for offs, lens, sub in _slabs(box_offsets, box_lengths, dest, layout.shape, layout.dtype.itemsize)
    ]


def _slabs(
    offsets: tuple[int, ...], lengths: tuple[int, ...], dest: torch.Tensor, shape: tuple[int, ...], itemsize: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]:
    """Split a box along its outer dims so the source bytes it spans stay within SLAB_BYTES."""
    dim = next((d for d, n in enumerate(lengths) if n > 1), None)
    unit = numel(shape[dim + 1 :]) * itemsize if dim is not None else 0
    if dim is None or lengths[dim] * unit <= SLAB_BYTES:
        yield offsets, lengths, dest
        return
    step = max(1, SLAB_BYTES // max(unit, 1))
    for start in range(0, lengths[dim], step):
        n = min(step, lengths[dim] - start)
        sub_offsets = offsets[:dim] + (offsets[dim] + start,) + offsets[dim + 1 :]
        sub_lengths = lengths[:dim] + (n,) + lengths[dim + 1 :]
        yield from _slabs(sub_offsets, sub_lengths, dest.narrow(dim, start, n), shape, itemsize)


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


def _dense_request(
    path: str,
    layout: TensorLayout,
    base: int,
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    dest: torch.Tensor,
    key: str,
) -> Request:
    itemsize = layout.dtype.itemsize
    outer, run, starts = _runs(layout.shape, offsets, lengths)
    run_bytes = run * itemsize
    if len(starts) > 1 and run_bytes < SMALL_RUN_BYTES:
        return _span_request(path, layout, base, offsets, lengths, dest, key, starts, run)
    ranges = [(base + int(s) * itemsize, run_bytes) for s in starts]
    block = dest[(0,) * outer] if outer else dest
    if _direct_capable(dest, layout.dtype) and block.is_contiguous():
        return Request(path, key, ranges, lambda: _dest_runs(dest, outer, run_bytes))
    temp = torch.empty(lengths, dtype=layout.dtype)

    def targets() -> list[memoryview]:
        data = tensor_bytes(temp)
        return [data[i * run_bytes : (i + 1) * run_bytes] for i in range(len(ranges))]

    return Request(path, key, ranges, targets, lambda: dest.copy_(temp))


def _dest_runs(dest: torch.Tensor, outer: int, run_bytes: int) -> list[memoryview]:
    """Memory of each run inside the destination, in the order the runs are read."""
    data = storage_bytes(dest)
    itemsize = dest.element_size()
    starts = np.full(1, dest.storage_offset(), dtype=np.int64)
    for d in range(outer - 1, -1, -1):
        idx = np.arange(dest.shape[d], dtype=np.int64) * dest.stride(d)
        starts = (idx[:, None] + starts[None, :]).reshape(-1)
    return [data[int(s) * itemsize : int(s) * itemsize + run_bytes] for s in starts]


def _span_request(
    path: str,
    layout: TensorLayout,
    base: int,
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    dest: torch.Tensor,
    key: str,
    starts: np.ndarray,
    run: int,
) -> Request:
    """Many tiny runs: read their enclosing span once and copy the box out with strides."""
    itemsize = layout.dtype.itemsize
    first, last = int(starts[0]), int(starts[-1]) + run
    span = torch.empty(last - first, dtype=layout.dtype)

    def complete() -> None:
        box_start = sum(o * s for o, s in zip(offsets, layout.stride)) - first
        dest.copy_(span.as_strided(lengths, layout.stride, box_start))

    return Request(path, key, [(base + first * itemsize, (last - first) * itemsize)], lambda: [tensor_bytes(span)], complete)


def _strided_request(
    path: str,
    layout: TensorLayout,
    base: int,
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    dest: torch.Tensor,
    key: str,
) -> Request:
    """A record whose tensor is a strided view of its storage: read the storage, view, copy."""
    storage = torch.empty(layout.payload_nbytes // layout.dtype.itemsize, dtype=layout.dtype)

    def complete() -> None:
        whole = storage.as_strided(layout.shape, layout.stride, layout.storage_offset)
        dest.copy_(_box(whole, offsets, lengths))

    return Request(path, key, [(base, layout.payload_nbytes)], lambda: [tensor_bytes(storage)], complete)


def _box(tensor: torch.Tensor, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, o, n)
    return tensor


def _verified_request(
    item: StoredItem,
    layout: TensorLayout,
    base: int,
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    dest: torch.Tensor,
    key: str,
    where: str,
) -> Request:
    """Read every byte the checksum covers, check it, then fill the destination."""
    whole_chunk = tuple(lengths) == layout.shape and layout.is_dense()
    direct = whole_chunk and _direct_capable(dest, layout.dtype) and dest.is_contiguous()
    storage = dest if direct else torch.empty(layout.payload_nbytes // layout.dtype.itemsize, dtype=layout.dtype)
    if item.checksum is not None:  # our index: CRC32C of the whole record
        check = Verification("crc32c", item.checksum, where)
        head = bytearray(layout.payload_offset)
        tail = bytearray(item.length - layout.payload_offset - layout.payload_nbytes)
        ranges = [(item.offset, item.length)]
    else:  # stock record: the zip entry's CRC-32 of the storage bytes
        check = Verification("crc32", layout.payload_crc32, where)
        head = tail = bytearray()
        ranges = [(base, layout.payload_nbytes)]

    def targets() -> list[memoryview]:
        return [memoryview(head), tensor_bytes(storage), memoryview(tail)]

    def complete() -> None:
        check.check(targets())
        if not direct:
            whole = storage.as_strided(layout.shape, layout.stride, layout.storage_offset)
            dest.copy_(_box(whole, offsets, lengths))

    return Request(item.relative_path, key, ranges, targets, complete)
