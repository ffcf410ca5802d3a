"""DCP stream transforms (``_extensions=[ZStandard()]``): stored bytes decoded whole.

Stock writers may pass every record through a chain of ``StreamTransformExtension``s and
record the chain per item in ``.metadata`` (``_StorageInfo.transform_descriptors``, e.g.
``["stream.zstd/1"]``). A transformed record has no byte-addressable payload, so it is read
whole and decoded through a DCP ``ExtensionRegistry`` of the extensions torch ships (a
writer's own extensions live in the registry it was given, which a checkpoint does not
name); the decoded bytes are an ordinary record.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

from dcp_ext.errors import CorruptCheckpointError, InvalidRequestError

_REGISTRY = ExtensionRegistry()
RECORD_OVERHEAD = 1 << 16  # a torch.save record's zip entries around its tensor bytes
BYTES_ITEM_LIMIT = 1 << 30  # a decoded bytes item (its size is recorded nowhere)


def record_limit(payload_nbytes: int | None) -> int:
    """Largest decoded record: a tensor chunk's bytes plus the zip around them, or the
    bytes-item cap."""
    return BYTES_ITEM_LIMIT if payload_nbytes is None else payload_nbytes + RECORD_OVERHEAD


def decode(descriptors: Sequence[str], stored: bytes | bytearray, where: str, limit: int) -> bytes:
    """The record behind ``stored``: the transforms undone, last applied first.

    A record that decodes to more than ``limit`` bytes is refused: compressed bytes from a
    hostile checkpoint must not expand without bound.
    """
    try:
        extensions = _REGISTRY.from_descriptor_list(list(descriptors))
    except ValueError as exc:  # a stock writer's own extension, registered in its registry only
        raise InvalidRequestError(
            f"{where}: written through stream transforms {list(descriptors)}, which this reader cannot undo "
            f"({exc}); it decodes the extensions torch ships (stream.zstd). Load this checkpoint with "
            "FileSystemReader(path, _extension_registry=...) holding the writer's extensions"
        ) from None
    try:
        stream: io.IOBase = _BufferStream(stored)
        for extension in extensions:
            if isinstance(extension, StreamTransformExtension):
                stream = extension.transform_from(stream)
        record = stream.read(limit + 1)
    except Exception as exc:  # missing codec, corrupt compressed bytes
        raise CorruptCheckpointError(
            f"{where}: cannot undo stream transforms {list(descriptors)} ({type(exc).__name__}: {exc})"
        ) from None
    if len(record) > limit:
        raise CorruptCheckpointError(f"{where}: stream transforms {list(descriptors)} expand past {limit} bytes")
    return record


class _BufferStream(io.RawIOBase):
    """A readable stream over bytes in memory without copying them (``io.BytesIO`` copies
    a bytearray: a second copy of each compressed record while it was decoded)."""

    def __init__(self, data: bytes | bytearray):
        self.data = memoryview(data)
        self.pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = max(0, min(len(buffer), len(self.data) - self.pos))
        buffer[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n
