"""DCP stream transforms (``_extensions=[ZStandard()]``): stored bytes decoded whole.

Stock writers may pass every record through a chain of ``StreamTransformExtension``s and
record the chain per item in ``.metadata`` (``_StorageInfo.transform_descriptors``, e.g.
``["stream.zstd/1"]``). A transformed record has no byte-addressable payload, so it is read
whole and decoded through DCP's own ``ExtensionRegistry`` (which knows every extension
torch ships and those registered with it); the decoded bytes are an ordinary record.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

from dcp_ext.errors import CorruptCheckpointError

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
        stream: io.IOBase = io.BytesIO(stored)
        for extension in extensions:
            if isinstance(extension, StreamTransformExtension):
                stream = extension.transform_from(stream)
        record = stream.read(limit + 1)
    except Exception as exc:  # unknown descriptor, missing codec, corrupt compressed bytes
        raise CorruptCheckpointError(
            f"{where}: cannot undo stream transforms {list(descriptors)} ({type(exc).__name__}: {exc})"
        ) from None
    if len(record) > limit:
        raise CorruptCheckpointError(f"{where}: stream transforms {list(descriptors)} expand past {limit} bytes")
    return record
