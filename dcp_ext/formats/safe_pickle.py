"""Load a stock DCP ``.metadata`` pickle without letting it run code.

Stock DCP calls ``pickle.load`` on ``.metadata``, so a crafted checkpoint runs arbitrary
code on every rank that opens it (pytorch #189308). This unpickler resolves only the
classes real ``.metadata`` files are built from; any other global, a malformed stream or
absurd nesting raises :class:`UnsafeCheckpointError` / :class:`CorruptCheckpointError`
before anything executes.

Besides DCP's metadata classes, real files carry:
- the local save plans (``SavePlan``, ``WriteItem``, ``TensorWriteData``,
  ``WriteItemType``): megatron-core's torch_dist strategy stores them in its metadata;
- ``torch.distributed._shard.sharded_tensor.metadata.TensorProperties`` and its
  ``MEM_FORMAT_ENCODING``: what DCP pickled before it had its own copies (torch < 2.2);
  they are decoded as today's DCP classes, which have the same fields and encoding.

Each admitted class is a frozen or plain dataclass or an Enum: unpickling one allocates
it and fills its fields (or looks an enum member up by value); none runs code of the
stream's choosing.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import pickletools
import re
from collections import OrderedDict
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import planner as dcp_planner

from dcp_ext.errors import CorruptCheckpointError, UnsafeCheckpointError
from dcp_ext.runtime.gc_pause import gc_paused

_METADATA_CLASSES = (
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
)
_PLAN_CLASSES = ("SavePlan", "WriteItem", "TensorWriteData", "WriteItemType")
_LEGACY_SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor.metadata"
_LEGACY_NAMES = {"TensorProperties": "TensorProperties", "MEM_FORMAT_ENCODING": "_MEM_FORMAT_ENCODING"}
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)
_PATH_CLASSES = ("PosixPath", "PurePosixPath", "PureWindowsPath")  # stock stores checkpoint_id as a Path
# megatron-core <= 0.15 pickles its own subclasses (one extra field, ``mcore_data``, read by
# ``megatron.torch_dist``): read as the DCP classes they extend, the field kept as an attribute
_MCORE_MODULE = "megatron.core.dist_checkpointing.strategies.torch"
_MCORE_CLASSES = {"MCoreSavePlan": dcp_planner.SavePlan, "MCoreMetadata": dcp_metadata.Metadata}


def _layout_by_name(name: str) -> torch.layout:
    """Safe stand-in for ``torch.serialization._get_layout`` (name -> layout)."""
    layout = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(layout, torch.layout):
        raise UnsafeCheckpointError(f"metadata names an unknown tensor layout {name!r}")
    return layout


# a storage item's location; and a local plan's storage_data, which megatron-core pickles
# into .metadata with its cached save plans (TorchDistSaveShardedStrategy(cached_metadata=True))
_FILESYSTEM_CLASSES = frozenset({"_StorageInfo", "_StoragePrefix"})


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" and name in _METADATA_CLASSES:
            return getattr(dcp_metadata, name)
        if module == "torch.distributed.checkpoint.planner" and name in _PLAN_CLASSES:
            return getattr(dcp_planner, name)
        if module == _LEGACY_SHARDED_TENSOR and name in _LEGACY_NAMES:
            return getattr(dcp_metadata, _LEGACY_NAMES[name])
        if module == _MCORE_MODULE and name in _MCORE_CLASSES:
            return _MCORE_CLASSES[name]
        if module == "torch.distributed.checkpoint.filesystem" and name in _FILESYSTEM_CLASSES:
            return getattr(dcp_filesystem, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout_by_name
        if (module, name) == ("torch", "Size"):
            return torch.Size
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "pathlib" and name in _PATH_CLASSES:
            return getattr(pathlib, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"refuses to load {module}.{name}: a DCP metadata pickle only holds DCP metadata classes"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("metadata pickles never contain persistent references")


def _argument_kinds() -> list[int | None]:
    """Per opcode byte, how its argument is laid out: n >= 0 fixed bytes, ``_LINE`` up to a
    newline, ``_TWO_LINES`` two of them, ``-k`` a k-byte length then that many bytes; None
    for a byte that is no opcode."""
    sized = {pickletools.TAKEN_FROM_ARGUMENT1: -1, pickletools.TAKEN_FROM_ARGUMENT4: -4,
             pickletools.TAKEN_FROM_ARGUMENT4U: -4, pickletools.TAKEN_FROM_ARGUMENT8U: -8}
    kinds: list[int | None] = [None] * 256
    for op in pickletools.opcodes:
        arg = op.arg
        if arg is None:
            kind = 0
        elif arg.name == "stringnl_noescape_pair":  # GLOBAL, INST: module and name lines
            kind = _TWO_LINES
        elif arg.n == pickletools.UP_TO_NEWLINE:
            kind = _LINE
        else:
            kind = arg.n if arg.n >= 0 else sized[arg.n]
        kinds[op.code.encode("latin-1")[0]] = kind
    kinds[pickle.LONG_BINPUT[0]] = _LONG_PUT
    kinds[pickle.STOP[0]] = _END
    return kinds


_LINE, _TWO_LINES, _LONG_PUT, _END = -100, -200, -300, -400
_ARGUMENT_KINDS = _argument_kinds()
_PUT = pickle.PUT[0]
_SHORT_BINUNICODE = pickle.SHORT_BINUNICODE[0]


def _fixed_run() -> re.Pattern[bytes]:
    """A run of opcodes whose arguments have a fixed size (LONG_BINPUT aside), skipped in C.

    The opcode sets are disjoint, so nothing is ever given back (possessive repeats: no
    backtracking state per opcode), argument-free opcodes go as runs, and the sizes are
    tried in the order DCP's metadata uses them most (gets and small ints take 1 or 4
    bytes): a 245 KB ``.metadata`` of 1,180 chunks is scanned in ~3.6 ms instead of ~5.8."""
    by_size: dict[int, list[int]] = {}
    for code, kind in enumerate(_ARGUMENT_KINDS):
        if kind is not None and kind >= 0:
            by_size.setdefault(kind, []).append(code)
    ops = {size: b"[" + b"".join(re.escape(bytes([c])) for c in codes) + b"]" for size, codes in by_size.items()}
    parts = [ops.pop(0) + b"++"] + [ops.pop(size) + b"." * size for size in (1, 4, 2) if size in ops]
    parts += [opcodes + b"." * size for size, opcodes in sorted(ops.items())]
    return re.compile(b"(?:" + b"|".join(parts) + b")*+", re.DOTALL)


_FIXED_RUN = _fixed_run()


def largest_memo_slot(data: bytes) -> int:
    """The largest memo slot a PUT / LONG_BINPUT of the pickle in ``data`` names (-1: none).

    The C unpickler grows its memo to twice a slot's number before storing anything, so a
    crafted 4-byte number in a 9-byte pickle asks for 64 GB; a legitimate pickle memoizes at
    most one object per opcode, so its slots stay below its length. One pass over the
    opcodes, skipping their arguments (runs of fixed-size ones by a regular expression);
    raises ValueError for bytes that are no pickle, or an argument length past its end
    (the unpickler allocates that length before reading: the same bomb)."""
    pos, end, largest, kinds, skip = 0, len(data), -1, _ARGUMENT_KINDS, _FIXED_RUN.match
    while True:
        pos = skip(data, pos).end()
        if pos >= end:
            raise ValueError("pickle ends before its STOP opcode")
        op = data[pos]
        # a short string: every opcode a DCP .metadata leaves to this loop (3,000 at 1,180 chunks),
        # taken first; anything else, a string cut short too, takes the general path and its errors
        if op == _SHORT_BINUNICODE and pos + 1 < end and (after := pos + 2 + data[pos + 1]) <= end:
            pos = after
            continue
        kind = kinds[op]
        pos += 1
        if kind is None:
            raise ValueError(f"byte {op:#04x} at {pos - 1} is no pickle opcode")
        if kind >= 0:  # a fixed-size argument the regular expression did not take: cut short
            raise ValueError(f"opcode {op:#04x} at {pos - 1} is cut short")
        if kind >= -8:  # a 1-, 4- or 8-byte length, then that many bytes (the C unpickler allocates them first)
            length = int.from_bytes(data[pos : pos - kind], "little")
            if pos - kind + length > end:
                raise ValueError(f"opcode {op:#04x} at {pos - 1} claims {length} bytes, past the end of the pickle")
            pos += -kind + length
        elif kind == _LONG_PUT:
            largest = max(largest, int.from_bytes(data[pos : pos + 4], "little"))
            pos += 4
        elif kind == _END:
            return largest
        else:
            stop = data.index(b"\n", pos)
            if op == _PUT:
                largest = max(largest, int(data[pos:stop]))
            pos = stop + 1 if kind == _LINE else data.index(b"\n", stop + 1) + 1


def load_metadata_pickle(data: bytes, source: str) -> dcp_metadata.Metadata:
    """Decode ``.metadata`` bytes read from ``source`` (named in every error)."""
    try:
        slot = largest_memo_slot(data)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{source}: metadata pickle is unreadable ({exc})") from None
    if slot >= len(data):
        raise CorruptCheckpointError(
            f"{source}: metadata pickle names memo slot {slot}, more than its {len(data)} bytes can hold"
        )
    try:
        with gc_paused():
            result = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{source}: {exc}") from None
    except RecursionError:
        raise UnsafeCheckpointError(f"{source}: metadata pickle is nested too deeply") from None
    except MemoryError:
        raise UnsafeCheckpointError(f"{source}: metadata pickle asks for an absurd allocation") from None
    except Exception as exc:  # any decode failure of untrusted bytes is corruption
        raise CorruptCheckpointError(f"{source}: metadata pickle is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(result, dcp_metadata.Metadata):
        raise CorruptCheckpointError(f"{source}: expected a DCP Metadata object, found {type(result).__name__}")
    return result
