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


def _layout_by_name(name: str) -> torch.layout:
    """Safe stand-in for ``torch.serialization._get_layout`` (name -> layout)."""
    layout = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(layout, torch.layout):
        raise UnsafeCheckpointError(f"metadata names an unknown tensor layout {name!r}")
    return layout


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" and name in _METADATA_CLASSES:
            return getattr(dcp_metadata, name)
        if module == "torch.distributed.checkpoint.planner" and name in _PLAN_CLASSES:
            return getattr(dcp_planner, name)
        if module == _LEGACY_SHARDED_TENSOR and name in _LEGACY_NAMES:
            return getattr(dcp_metadata, _LEGACY_NAMES[name])
        if (module, name) == ("torch.distributed.checkpoint.filesystem", "_StorageInfo"):
            return dcp_filesystem._StorageInfo
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


def load_metadata_pickle(data: bytes, source: str) -> dcp_metadata.Metadata:
    """Decode ``.metadata`` bytes read from ``source`` (named in every error)."""
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
