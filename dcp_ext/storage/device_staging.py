"""Loads into device memory: disk reads land in a bounded pool of host buffers, and each
filled buffer is copied to the device while the next one is read. Saves from device
memory (``HostCopies``) go the other way through the same kind of pool.

A ``Request`` whose destination lives off the CPU (``Request.device``) hands the executor
``DeviceSpan``s where a host request hands memoryviews: byte ranges of the destination (or
of a temporary on its device, for boxes that need a strided gather, a dtype cast or the
record's conj/neg bits). ``DeviceStaging.read`` carves those spans into pieces of at most
one staging buffer, reads the file into the buffer, queues the buffer's host-to-device
copies (``non_blocking``, all in one call, on a side stream of the device), records an
event and takes the next buffer; a buffer goes back to the pool only once its event has
completed. So a load holds at most ``count`` buffers of host memory, pinned for CUDA
(``pin_memory=True``, from torch's caching host allocator, so a later load reuses the
pinned pages), never a temporary per request, and a request of any size flows through
them piece by piece.
``finish`` waits for every copy and every device operation the requests queued, so the
destinations are complete when the executor returns.

Nothing here is CUDA-only: on a CPU destination the stream is absent and copies are
synchronous, which is how the tests drive this path on machines without a GPU.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Union

import torch

from dcp_ext.formats.torch_record import host_bytes
from dcp_ext.storage.location import RangeReader

STAGING_BUFFERS = 4  # host buffers one load may hold: 128 MiB with the default size
STAGING_BUFFER_BYTES = 32 << 20  # one disk read / one host-to-device copy at most


class DeviceSpan:
    """Bytes of a 1-d ``uint8`` tensor (on a device, or a CPU tensor forced through staging)
    that reads land in, where host requests use a memoryview.

    A span is a byte range of its tensor kept as numbers: slicing one calls no torch
    operation, and the staging narrows the tensor once per copy. Every torch call from the
    reading threads releases and retakes the GIL, and those handovers, not the bytes, are
    what a load of thousands of tensors spends its time on.

    ``tap`` sees the host copy of the span's bytes piece by piece, in file order, before
    they leave for the device (a running checksum). Executors that assign bytes instead of
    staging them (the two-stage exchange) copy through ``__setitem__``.
    """

    __slots__ = ("base", "extent", "start", "nbytes", "tap")

    def __init__(
        self,
        base: torch.Tensor,
        tap: Callable[[memoryview], None] | None = None,
        start: int = 0,
        nbytes: int | None = None,
        extent: int | None = None,
    ):
        self.base = base
        self.extent = base.numel() if extent is None else extent  # the base's bytes
        self.start = start
        self.nbytes = self.extent - start if nbytes is None else nbytes
        self.tap = tap

    @property
    def tensor(self) -> torch.Tensor:
        return self.bytes_at(self.start, self.nbytes)

    def bytes_at(self, start: int, nbytes: int) -> torch.Tensor:
        """The base's bytes ``[start, start + nbytes)`` as a tensor (the whole base is the
        base itself: no torch call, which a load of many small tensors makes per tensor)."""
        return self.base if start == 0 and nbytes == self.extent else self.base.narrow(0, start, nbytes)

    def __getitem__(self, part: slice) -> DeviceSpan:
        first, stop, step = part.indices(self.nbytes)
        if step != 1:
            raise ValueError(f"a DeviceSpan is sliced with step 1, got {part}")
        return DeviceSpan(self.base, None, self.start + first, max(0, stop - first), self.extent)

    def __setitem__(self, part: slice, data: memoryview) -> None:
        if self.tap is not None:
            self.tap(data)
        if len(data):
            self[part].tensor.copy_(torch.frombuffer(data, dtype=torch.uint8))


Target = Union[memoryview, DeviceSpan]


class StagingPool:
    """At most ``count`` host buffers of ``buffer_bytes``, allocated on first need and reused.

    A buffer released with events (its copies still in flight) is handed out again only
    once they completed: a free buffer first, then a finished one, then a new one while
    under ``count``, else the oldest in flight (waiting for its copies). ``allocated``
    counts the buffers ever made; it never exceeds ``count``.
    """

    def __init__(self, count: int = STAGING_BUFFERS, buffer_bytes: int = STAGING_BUFFER_BYTES, pin: bool = False):
        if count < 1 or buffer_bytes < 1:
            raise ValueError(f"staging pool needs at least one buffer of at least one byte, got {count} x {buffer_bytes}")
        self.count, self.buffer_bytes, self.pin = count, buffer_bytes, pin
        self.allocated = 0
        self._free: list[torch.Tensor] = []
        self._in_flight: deque[tuple[torch.Tensor, list[Any]]] = deque()
        self._changed = threading.Condition()

    def acquire(self) -> torch.Tensor:
        with self._changed:
            while True:
                if self._free:
                    return self._free.pop()
                oldest = self._in_flight[0] if self._in_flight else None
                if oldest is not None and (self.allocated == self.count or all(e.query() for e in oldest[1])):
                    self._in_flight.popleft()
                    break
                if self.allocated < self.count:
                    self.allocated += 1
                    oldest = None
                    break
                self._changed.wait()  # every buffer is being filled: one comes back soon
        if oldest is None:
            return torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=self.pin)
        buffer, events = oldest
        for event in events:  # its copies were the first queued: the wait is the shortest
            event.synchronize()
        return buffer

    def release(self, buffer: torch.Tensor, events: Sequence[Any] = ()) -> None:
        """Give a buffer back; with ``events``, once they completed (its copies are done)."""
        with self._changed:
            if events:
                self._in_flight.append((buffer, list(events)))
            else:
                self._free.append(buffer)
            self._changed.notify()

    def drain(self) -> None:
        """Wait for every copy still reading from a buffer."""
        with self._changed:
            in_flight, self._in_flight = list(self._in_flight), deque()
            for buffer, events in in_flight:
                for event in events:
                    event.synchronize()
                self._free.append(buffer)
            self._changed.notify_all()

    @property
    def idle(self) -> int:
        """Buffers not being filled (free or with copies in flight)."""
        with self._changed:
            return len(self._free) + len(self._in_flight)


class HostCopies:
    """Saves from device memory: a device tensor's bytes go to the record writer piece by
    piece through the pool's host buffers (pinned where CUDA is), so a save holds at most
    the pool, never a host copy of a whole tensor (``Tensor.cpu()``: pageable, as large as
    the tensor). A thread copies a piece and writes it before taking the next buffer, so
    it never waits for a buffer while holding one; writer threads overlap one another's
    copies and writes. The copies run on the stream that was current where the save
    began (the writer threads' own current stream is the device's default one), so they
    follow the work that produced the tensors. CPU tensors take the same path when handed
    here (tests)."""

    def __init__(self, count: int = STAGING_BUFFERS, buffer_bytes: int = STAGING_BUFFER_BYTES):
        self.pool = StagingPool(count, buffer_bytes, pin=torch.cuda.is_available())
        self._caller = torch.cuda.current_stream() if torch.cuda.is_initialized() else None  # made on the save's thread

    def copy_out(self, tensor: torch.Tensor, write: Callable[[memoryview], int]) -> None:
        """Hand ``write`` the bytes of the dense ``tensor`` in order, at most a buffer at a time."""
        flat = tensor.reshape(-1).view(torch.uint8)
        caller = self._caller if self._caller is not None and self._caller.device == tensor.device else None
        with torch.cuda.stream(caller) if caller is not None else nullcontext():
            for start in range(0, flat.numel(), self.pool.buffer_bytes):
                n = min(self.pool.buffer_bytes, flat.numel() - start)
                buffer = self.pool.acquire()
                try:
                    piece = buffer[:n]
                    piece.copy_(flat[start : start + n])  # device to host: returns once the copy is done
                    write(host_bytes(piece))
                finally:
                    self.pool.release(buffer)


@dataclass
class _Piece:
    """Part of a DeviceSpan staged at ``start`` in the current buffer."""

    span: DeviceSpan
    offset: int  # in the span
    nbytes: int
    start: int  # in the buffer


class DeviceStaging:
    """One load's host staging for every request that lands off the CPU.

    Copies go to one side stream per CUDA device, which first waits for the work already
    queued on the caller's stream (the destinations may just have been filled there).

    At most one reading thread per staging buffer works here at a time: a thread beyond
    that could only wait for a buffer, and each torch call it made would hand the GIL over
    once more. On an H200 host (16 cores, 4.3 GB in 3,445 tensors, warm page cache) 16
    threads over the 4 buffers loaded 3.4-4.0 GB/s, 4 threads 5.1 GB/s.
    """

    def __init__(self, pool: StagingPool):
        self.pool = pool
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self._turns = threading.BoundedSemaphore(pool.count)

    @classmethod
    def for_devices(cls, devices: set[torch.device], count: int, buffer_bytes: int) -> DeviceStaging:
        pin = any(device.type == "cuda" for device in devices) and torch.cuda.is_available()
        staging = cls(StagingPool(count, buffer_bytes, pin))
        staging.add_devices(devices)
        return staging

    def add_devices(self, devices: set[torch.device]) -> None:
        """Side streams for devices met for the first time, before their first request is
        read (the dict is replaced, not changed: reading threads hold the old one)."""
        streams = dict(self.streams)
        for device in devices:
            if device.type == "cuda" and device not in streams:
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                streams[device] = stream
        self.streams = streams

    @contextmanager
    def device_work(self) -> Iterator[None]:
        """Device work queued by this thread inside (temporaries, copies, the requests'
        gathers and casts) goes to the side streams, in the order it is queued; the thread
        waits for its turn first."""
        with ExitStack() as stack:
            stack.enter_context(self._turns)
            for stream in self.streams.values():
                stack.enter_context(torch.cuda.stream(stream))
            yield

    def read(self, reader: RangeReader, runs: Sequence[tuple[int, Sequence[Target]]]) -> int:
        """Fill runs whose targets may be DeviceSpans; returns the bytes read."""
        total = 0
        buffer: torch.Tensor | None = None
        host_runs: list[tuple[int, list[memoryview]]] = []
        pieces: list[_Piece] = []
        try:
            for offset, targets in runs:
                current: list[memoryview] = []
                host_runs.append((offset, current))
                for target in targets:
                    if not isinstance(target, DeviceSpan):
                        current.append(target)
                        offset += target.nbytes
                        continue
                    done = 0
                    while done < target.nbytes:
                        if buffer is None:
                            buffer, used = self.pool.acquire(), 0
                            view = host_bytes(buffer)
                        n = min(target.nbytes - done, self.pool.buffer_bytes - used)
                        current.append(view[used : used + n])
                        pieces.append(_Piece(target, done, n, used))
                        used, done, offset = used + n, done + n, offset + n
                        if used == self.pool.buffer_bytes:  # full: read it, send it, go on in a new one
                            total += self._flush(reader, host_runs, buffer, pieces)
                            buffer, pieces, current = None, [], []
                            host_runs = [(offset, current)]
            total += self._flush(reader, host_runs, buffer, pieces)
            buffer = None
        finally:
            if buffer is not None:  # a read failed: nothing was queued from this buffer
                self.pool.release(buffer)
        return total

    def _flush(
        self, reader: RangeReader, host_runs: list[tuple[int, list[memoryview]]], buffer: torch.Tensor | None, pieces: list[_Piece]
    ) -> int:
        """Read the runs gathered so far, then queue the copies out of ``buffer``."""
        total = reader.read_runs([(offset, views) for offset, views in host_runs if views])
        if buffer is None:
            return total
        host = host_bytes(buffer)
        for piece in pieces:
            if piece.span.tap is not None:
                piece.span.tap(host[piece.start : piece.start + piece.nbytes])
        copies = list(_merged(pieces))
        if copies:  # one torch call for every copy out of the buffer: each call hands the GIL over
            sizes = [nbytes for _, nbytes in copies]
            sources = buffer.split_with_sizes([*sizes, self.pool.buffer_bytes - sum(sizes)])
            torch._foreach_copy_([dest for dest, _ in copies], sources[: len(copies)], non_blocking=True)
        events = []
        for stream in self.streams.values():
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        self.pool.release(buffer, events)
        return total

    def finish(self) -> None:
        """Wait until every copy and every device operation of the load has completed."""
        self.pool.drain()
        for stream in self.streams.values():
            stream.synchronize()


def _merged(pieces: list[_Piece]) -> Iterator[tuple[torch.Tensor, int]]:
    """(device bytes, length) of the copies, in buffer order (the pieces fill the buffer from
    its start, one after another): pieces adjacent in one span's tensor (runs of one
    contiguous destination) become one copy."""
    if not pieces:
        return
    first = pieces[0]
    span, place, nbytes = first.span, first.span.start + first.offset, first.nbytes
    for piece in pieces[1:]:
        piece_place = piece.span.start + piece.offset
        if piece.span.base is span.base and piece_place == place + nbytes:
            nbytes += piece.nbytes
            continue
        yield span.bytes_at(place, nbytes), nbytes
        span, place, nbytes = piece.span, piece_place, piece.nbytes
    yield span.bytes_at(place, nbytes), nbytes
