"""The errors for structurally invalid checkpoint metadata, shared by every place that
checks it (the pickled ``.metadata`` item by item, our index column by column), so a
fault reads the same whichever path found it."""

from __future__ import annotations

import reprlib
from typing import Any

from dcp_ext.errors import CorruptCheckpointError

_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 200  # a key name whole; a hostile megabyte value cut short


def shown(value: Any) -> str:
    """``repr(value)`` for a message, bounded: the value comes from a file and may be huge."""
    return _SHOWN.repr(value)


def invalid_tensor_facts(source: str, fqn: str, dtype: Any, shape: Any) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{source}: tensor {fqn!r} has an invalid dtype {dtype!r} or shape {shape!r}")


def invalid_byte_range(source: str, fqn: str, offset: Any, length: Any, payload: Any) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{source}: key {fqn!r} has an invalid byte range offset={offset!r} length={length!r} tensor data at {payload!r}"
    )


def chunk_outside_tensor(source: str, fqn: str, offsets: Any, sizes: Any, shape: Any) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{source}: tensor {fqn!r} chunk at {list(offsets)} of size {list(sizes)} "
        f"does not fit its global shape {list(shape)}"
    )


def file_too_short(where: str, end: int, size: int) -> CorruptCheckpointError:
    """An item's byte range runs past its file: checked before a buffer of that size is made."""
    return CorruptCheckpointError(f"{where}: item needs bytes up to {end} but the file has {size} bytes (truncated?)")


def record_too_small(
    source: str, fqn: str, offsets: Any, nbytes: int, file: str, offset: int, length: int, payload: int
) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{source}: tensor {fqn!r} chunk at {list(offsets)} needs {nbytes} bytes but its record in "
        f"{file!r} (bytes [{offset}, {offset + length}), tensor data at {payload}) cannot hold them"
    )
