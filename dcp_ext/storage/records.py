"""Write one DCP item as stock DCP does (a ``torch.save`` record or raw bytes), checksummed.

The record format is exactly stock's, so stock ``FileSystemReader`` reads our files.
While ``torch.save`` streams the record out we compute a CRC32C of every byte and note
where the tensor bytes start: ``torch.save`` hands the storage to ``write`` as one
zero-copy buffer at the tensor's own address. The index can then send later reads
straight there. (Empty tensors have no such write; for them the record's captured first
and last few KiB go through the reader's zip parser.)
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import IO, cast

import crc32c
import numpy as np
import torch
from torch.distributed.checkpoint._extension import StreamTransformExtension

from dcp_ext.formats.index import StoredItem
from dcp_ext.formats.torch_record import PROBE_BYTES, parse_tensor_record


SMALL_WRITE = 64 << 10  # below this a write is gathered with its neighbours, not passed on


class RecordSink:
    """File wrapper handed to ``torch.save``: tracks position, checksum, head and tail.

    ``torch.save`` hands over a record in about 40 writes, all but the tensor bytes a few
    dozen bytes long (zip headers, the pickle); those are gathered and passed to the file
    and the checksum as one piece, so a record costs a few calls instead of ~120.
    """

    def __init__(self, out: IO[bytes], checksums: bool):
        self.out = out
        self.checksums = checksums
        self.position = 0
        self._start = 0
        self._crc = 0
        self._head = bytearray()
        self._tail = bytearray()
        self._payload: tuple[int, int] = (0, -1)  # (address, nbytes) of the expected tensor bytes
        self._pending = bytearray()  # small writes not yet passed on
        self.payload_offset: int | None = None  # where they landed, relative to the record

    def begin(self, payload: torch.Tensor | None = None) -> None:
        self._start, self._crc = self.position, 0
        self._head.clear()
        self._tail.clear()
        self._payload = (payload.data_ptr(), payload.nbytes) if payload is not None else (0, -1)
        self.payload_offset = None

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if n == self._payload[1] and self.payload_offset is None and _address(view) == self._payload[0]:
            self.payload_offset = self.position - self._start
        if n < SMALL_WRITE:
            self._pending += view
        else:
            self._pass_on()
            self._pass(view)
        if self._payload[1] < 0:  # no payload to spot: keep the ends for the zip parser
            if len(self._head) < PROBE_BYTES:
                self._head += view[: PROBE_BYTES - len(self._head)]
            self._tail += view[-PROBE_BYTES:]
            del self._tail[:-PROBE_BYTES]
        self.position += n
        return n

    @property
    def record_start(self) -> int:
        return self._start

    @property
    def record_length(self) -> int:
        return self.position - self._start

    def _pass(self, data: memoryview | bytearray) -> None:
        self.out.write(data)
        if self.checksums:
            self._crc = crc32c.crc32c(data, self._crc)

    def _pass_on(self) -> None:
        """Pass the gathered small writes on (the file copies them: the buffer is reused)."""
        if self._pending:
            self._pass(self._pending)
            self._pending.clear()

    def flush(self) -> None:
        """Nothing: ``torch.save`` flushes after every record, which would cost a write
        syscall per record; ``finish`` passes a record's last bytes on and the file is
        flushed once, where it is closed."""

    def read_at(self, offset: int, n: int) -> bytes:
        """Bytes of the current record, served from the captured head and tail."""
        length = self.record_length
        if offset + n <= len(self._head):
            return bytes(self._head[offset : offset + n])
        tail_start = length - len(self._tail)
        if offset >= tail_start:
            return bytes(self._tail[offset - tail_start : offset - tail_start + n])
        raise AssertionError("record header not captured")  # zip headers always sit at the ends

    def finish(self, relative_path: str, payload_offset: int, transforms: tuple[str, ...] = ()) -> StoredItem:
        """The record is complete: pass its last bytes on and describe it."""
        self._pass_on()
        return StoredItem(
            relative_path,
            self._start,
            self.record_length,
            payload_offset,
            self._crc if self.checksums else None,
            transforms,
        )


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]


def dense_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns exactly its values in row-major order (what we store).

    Conj/neg views are resolved: ``torch.save`` would write the unresolved storage plus a
    bit that the index (which records only where the bytes are) does not carry.
    """
    tensor = tensor.detach().resolve_conj().resolve_neg()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    ):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def write_tensor(
    sink: RecordSink, relative_path: str, tensor: torch.Tensor, where: str, transform: StreamTransformExtension | None = None
) -> StoredItem:
    tensor = dense_cpu(tensor)
    if transform is not None:
        return _write_transformed(sink, relative_path, transform, lambda stream: torch.save(tensor, stream))
    sink.begin(tensor if tensor.nbytes else None)
    torch.save(tensor, sink)
    payload_offset = sink.payload_offset
    if payload_offset is None:
        payload_offset = parse_tensor_record(sink.record_length, sink.read_at, where).payload_offset
    return sink.finish(relative_path, sink.record_start + payload_offset)


def write_bytes(
    sink: RecordSink, relative_path: str, data: io.BytesIO, transform: StreamTransformExtension | None = None
) -> StoredItem:
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
