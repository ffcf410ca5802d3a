"""The safetensors file format: an 8-byte header length, a JSON header, raw tensor bytes.

Header: ``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]},
"__metadata__": {str: str}}``; offsets count from the end of the header; tensors are
row-major, little-endian, packed without gaps. Encoding here lets the exporter stream
tensors into a file whose header it writes first; decoding validates what the official
loader validates (header size, offsets inside the file, no overlaps, sizes that match
shape and dtype), naming the file and key.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dcp_ext.errors import CheckpointError, CorruptCheckpointError, InvalidRequestError
from dcp_ext.formats.faults import shown
from dcp_ext.formats.validate import is_dims

MAX_HEADER_BYTES = 100_000_000  # the official loader's limit
METADATA_KEY = "__metadata__"

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.float8_e8m0fnu: "F8_E8M0",  # MX scales
    torch.complex64: "C64",
    torch.float4_e2m1fn_x2: "F4",  # the header counts 4-bit values: its last dim is twice torch's (_header_shape)
}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}
WITHOUT_TORCH_DTYPE = ("F6_E2M3", "F6_E3M2")  # safetensors dtypes torch has no dtype for
_PACKED = torch.float4_e2m1fn_x2  # two values per byte: one torch element


def _header_shape(dtype: torch.dtype, shape: tuple[int, ...], key: str) -> list[int]:
    """The shape a safetensors header gives a tensor of torch ``shape``."""
    if dtype is not _PACKED:
        return list(shape)
    if not shape:
        raise InvalidRequestError(f"key {key!r}: safetensors F4 holds no 0-d {dtype} (its shape counts 4-bit values)")
    return [*shape[:-1], shape[-1] * 2]


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie in a safetensors file (absolute file offsets)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def dtype_name(dtype: torch.dtype, key: str) -> str:
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise InvalidRequestError(f"key {key!r}: safetensors has no dtype for {dtype}")
    return name


def encode_header(
    tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[TensorEntry]]:
    """The file prefix (length + JSON, padded to 8 bytes) for ``tensors`` in this order,
    and where each tensor's bytes go."""
    header: dict[str, object] = {METADATA_KEY: dict(metadata or {})}
    offset = 0
    spans = []
    for name, (dtype, shape) in tensors.items():
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": dtype_name(dtype, name), "shape": _header_shape(dtype, tuple(shape), name),
                        "data_offsets": [offset, offset + nbytes]}
        spans.append((name, dtype, tuple(shape), offset, offset + nbytes))
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    return prefix, [TensorEntry(n, d, s, len(prefix) + b, len(prefix) + e) for n, d, s, b, e in spans]


def decode_header(prefix: bytes, file_size: int, where: str) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Entries and ``__metadata__`` of a file whose first bytes are ``prefix`` (at least
    8 + header length of them; see ``header_length``)."""
    length = header_length(prefix, file_size, where)
    try:
        header = json.loads(prefix[8 : 8 + length], object_pairs_hook=unique_fields)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: safetensors header is not valid JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{where}: safetensors header is not a JSON object")
    metadata = header.pop(METADATA_KEY, None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptCheckpointError(f"{where}: safetensors {METADATA_KEY} must map strings to strings")
    base = 8 + length
    entries = {name: _entry(name, info, base, f"{where} key {name!r}") for name, info in header.items()}
    _check_layout(entries, base, file_size, where)
    return entries, metadata


def unique_fields(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose names are unique (``json.loads`` keeps the last of a repeated
    one; the safetensors loader refuses the file)."""
    fields = dict(pairs)
    if len(fields) != len(pairs):
        repeated = sorted({name for name, _ in pairs if sum(n == name for n, _ in pairs) > 1})
        raise ValueError(f"repeated field {shown(repeated[0])}")
    return fields


def header_length(prefix: bytes, file_size: int, where: str) -> int:
    if len(prefix) < 8 or file_size < 8:
        raise CorruptCheckpointError(f"{where}: too short for a safetensors file ({file_size} bytes)")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(f"{where}: safetensors header claims {length} bytes (limit {MAX_HEADER_BYTES})")
    if 8 + length > file_size:
        raise CorruptCheckpointError(f"{where}: safetensors header of {length} bytes runs past the end of the file ({file_size} bytes)")
    return length


def _entry(name: str, info: object, base: int, where: str) -> TensorEntry:
    if not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"} or len(info) != 3:
        raise CorruptCheckpointError(f"{where}: expected dtype, shape and data_offsets, found {info!r}"[:300])
    dtype = DTYPES_BY_NAME.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    shape, offsets = info["shape"], info["data_offsets"]
    if info["dtype"] in WITHOUT_TORCH_DTYPE:
        raise CheckpointError(f"{where}: dtype {info['dtype']} has no torch dtype to load it into")
    if dtype is None:
        raise CorruptCheckpointError(
            f"{where}: dtype {info['dtype']!r} is none of the safetensors dtypes this reader knows "
            f"({', '.join(DTYPES_BY_NAME)})"
        )
    if not isinstance(shape, list) or not is_dims(shape):
        raise CorruptCheckpointError(f"{where}: invalid shape {shape!r}")
    if dtype is _PACKED and (not shape or shape[-1] % 2):  # 4-bit values, two to a torch element
        raise CorruptCheckpointError(f"{where}: F4 shape {shape} does not pack into bytes (its last dim must be even)")
    stored_shape, shape = shape, [*shape[:-1], shape[-1] // 2] if dtype is _PACKED else shape
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        raise CorruptCheckpointError(f"{where}: invalid data_offsets {offsets!r}")
    begin, end = offsets
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise CorruptCheckpointError(
            f"{where}: data_offsets {offsets} hold {end - begin} bytes, but {info['dtype']} {stored_shape} needs "
            f"{math.prod(shape) * dtype.itemsize}"
        )
    return TensorEntry(name, dtype, tuple(shape), base + begin, base + end)


def _check_layout(entries: dict[str, TensorEntry], base: int, file_size: int, where: str) -> None:
    """Every tensor inside the file, none overlapping another, and together they cover the
    data section exactly, back to back, as safetensors requires (its loader refuses a gap or
    an uncovered end): a header length one byte short parsed still (trailing spaces) and
    loaded every tensor shifted by a byte."""
    ordered = sorted(entries.values(), key=lambda e: (e.begin, e.end))
    previous: TensorEntry | None = None
    for entry in ordered:
        if entry.end > file_size:
            raise CorruptCheckpointError(
                f"{where} key {entry.name!r}: bytes [{entry.begin - base}, {entry.end - base}) lie past the end of "
                f"the data ({file_size - base} bytes; truncated?)"
            )
        if previous is not None and entry.begin < previous.end and entry.nbytes and previous.nbytes:
            raise CorruptCheckpointError(f"{where}: tensors {previous.name!r} and {entry.name!r} overlap")
        previous = entry if entry.nbytes else previous
    end = base
    for entry in ordered + [None]:
        begin = file_size if entry is None else entry.begin
        if begin != end:
            before = "at the end" if entry is None else f"before {entry.name!r}"
            raise CorruptCheckpointError(
                f"{where}: data bytes [{end - base}, {begin - base}) belong to no tensor ({before}); safetensors "
                "files hold their tensors back to back"
            )
        end = begin if entry is None else entry.end
