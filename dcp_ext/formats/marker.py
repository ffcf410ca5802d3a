"""The commit marker: a small JSON file written after everything else of a save.

On local disks ``.metadata`` is renamed into place, an atomic switch. Object stores have
no atomic rename (fsspec's ``mv`` is copy + delete), so there the save writes the index
and ``.metadata`` directly and then this marker, which names the exact ``.metadata`` and
index bytes (size and CRC32C) it commits. A reader that finds our index vouching for
``.metadata`` but no matching marker is looking at a save that was interrupted or is
still running. The marker also guards the index itself against corruption.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import crc32c

from dcp_ext.errors import CorruptCheckpointError

MARKER_NAME = ".dcp_ext_commit"
MARKER_FORMAT = "dcp_ext-commit/1"


@dataclass(frozen=True)
class CommitMarker:
    save_id: str
    metadata_size: int
    metadata_crc32c: int
    index_size: int
    index_crc32c: int
    metadata_stamp: list[Any] | None = None  # ``Location.stamp`` of the committed .metadata (absent in older markers)

    @classmethod
    def for_bytes(cls, save_id: str, metadata_bytes: bytes, index_bytes: bytes, metadata_stamp: list[Any] | None = None) -> CommitMarker:
        sizes_and_crcs = (len(metadata_bytes), crc32c.crc32c(metadata_bytes), len(index_bytes), crc32c.crc32c(index_bytes))
        return cls(save_id, *sizes_and_crcs, metadata_stamp)

    def encode(self) -> bytes:
        return json.dumps({"format": MARKER_FORMAT, **asdict(self)}).encode()

    @classmethod
    def decode(cls, data: bytes, source: str) -> CommitMarker:
        try:
            fields = json.loads(data)
            if fields.pop("format") != MARKER_FORMAT:
                raise ValueError("unknown format")
            marker = cls(**fields)
            if not isinstance(marker.save_id, str) or not all(
                type(v) is int for v in (marker.metadata_size, marker.metadata_crc32c, marker.index_size, marker.index_crc32c)
            ) or not (marker.metadata_stamp is None or (type(marker.metadata_stamp) is list and all(type(v) in (int, str) for v in marker.metadata_stamp))):
                raise ValueError("wrong field types")
            return marker
        except Exception as exc:  # untrusted bytes
            raise CorruptCheckpointError(f"{source}: unreadable commit marker ({type(exc).__name__}: {exc})") from None

    def commits_metadata(self, metadata_bytes: bytes) -> bool:
        return self.metadata_size == len(metadata_bytes) and self.metadata_crc32c == crc32c.crc32c(metadata_bytes)

    def commits_index(self, index_bytes: bytes) -> bool:
        return self.index_size == len(index_bytes) and self.index_crc32c == crc32c.crc32c(index_bytes)
