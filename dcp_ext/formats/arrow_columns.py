"""Arrow arrays made from numpy and read back into it through their buffers.

pyarrow's own conversions (``pa.array`` of anything, ``Array.to_numpy``) go through its
pandas bridge, which imports pandas on first use where it is installed: 0.3-0.4 s of the
first save and of the first load in a process (a resumed job), on a path that needs
nothing of pandas. The index's columns are fixed-width numbers, booleans and strings,
which these helpers build from and read as buffers (little-endian, as Arrow's are on
every platform torch runs on), with validity bitmaps for the nulls.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa


def numbers(values: np.ndarray | Sequence[int], arrow_type: pa.DataType, valid: np.ndarray | None = None) -> pa.Array:
    """A fixed-width number array of ``values`` (cast to the type's width); null where
    ``valid`` is False."""
    data = np.ascontiguousarray(values, dtype=_NUMPY[arrow_type.id])
    return pa.Array.from_buffers(arrow_type, len(data), [_bitmap(valid), pa.py_buffer(data)])


def booleans(values: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
    """A boolean array of ``values``; null where ``valid`` is False."""
    bits = np.packbits(np.asarray(values, bool), bitorder="little")
    return pa.Array.from_buffers(pa.bool_(), len(values), [_bitmap(valid), pa.py_buffer(bits)])


def strings(values: Sequence[str | None]) -> pa.Array:
    """A string array; None entries are null."""
    encoded = [b"" if v is None else v.encode() for v in values]
    ends = np.cumsum([len(b) for b in encoded], dtype=np.int64)
    offsets = np.concatenate([[0], ends]).astype(np.int32)
    valid = None if all(v is not None for v in values) else np.array([v is not None for v in values], bool)
    return pa.Array.from_buffers(pa.string(), len(values), [_bitmap(valid), pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))])


def lists(ends: np.ndarray, values: pa.Array, valid: np.ndarray | None = None) -> pa.Array:
    """A list array whose row ``i`` holds ``values[ends[i] : ends[i + 1]]``; null where
    ``valid`` is False."""
    offsets = np.ascontiguousarray(ends, np.int32)
    return pa.Array.from_buffers(pa.list_(values.type), len(offsets) - 1, [_bitmap(valid), pa.py_buffer(offsets)], children=[values])


def as_numbers(array: pa.Array, dtype: type) -> np.ndarray:
    """A fixed-width column's values (read-only, no copy), nulls included as whatever
    bytes they hold: the caller checks ``null_count`` or ``is_valid``."""
    buffer = array.buffers()[1]
    if buffer is None:  # an empty or all-null array may have none
        return np.zeros(len(array), dtype)
    return np.frombuffer(buffer, dtype)[array.offset : array.offset + len(array)]


def as_booleans(array: pa.Array) -> np.ndarray:
    """A boolean column's values, nulls as whatever bits they hold."""
    buffer = array.buffers()[1]
    if buffer is None:
        return np.zeros(len(array), bool)
    return np.unpackbits(np.frombuffer(buffer, np.uint8), bitorder="little")[array.offset : array.offset + len(array)].astype(bool)


def is_valid(array: pa.Array) -> np.ndarray:
    """Per row, not null: read from the validity bitmap (no Arrow compute kernels, whose
    thread pool can abort the interpreter at exit, see ``index.decode_index``)."""
    bitmap = array.buffers()[0]
    if bitmap is None or array.null_count == 0:
        return np.broadcast_to(True, (len(array),))  # read-only: a million Trues not stored
    bits = np.unpackbits(np.frombuffer(bitmap, np.uint8), bitorder="little")
    return bits[array.offset : array.offset + len(array)].astype(bool)


def _bitmap(valid: np.ndarray | None) -> pa.Buffer | None:
    if valid is None or bool(np.all(valid)):
        return None
    return pa.py_buffer(np.packbits(np.asarray(valid, bool), bitorder="little"))


_NUMPY = {
    pa.int8().id: np.int8,
    pa.int32().id: np.int32,
    pa.int64().id: np.int64,
    pa.uint32().id: np.uint32,
}
