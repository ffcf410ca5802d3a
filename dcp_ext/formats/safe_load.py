"""``torch.load`` for non-tensor checkpoint content, never a plain unpickle.

Used for DCP bytes items (``ShardLoadPlanner.load_bytes``) and Megatron's ``common.pt`` /
legacy ``model_optim_rng.pt``. Besides tensors and plain containers these hold an
``argparse.Namespace``, numpy RNG state and Transformer Engine's ``io.BytesIO`` extra
states, which ``weights_only=True`` refuses, so we allow exactly those classes (nothing
that can run code). Anything else is reported with the source and the classes, instead of
silently widening the allowlist.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
from typing import Any

import numpy as np
import torch

from dcp_ext.errors import UnsafeCheckpointError

SAFE_GLOBALS: list[Any] = [
    argparse.Namespace,
    io.BytesIO,  # Transformer Engine ``_extra_state`` (plain bytes, no code)
    np.ndarray,
    np.dtype,
    (getattr(np, "_core", None) or np.core).multiarray._reconstruct,  # numpy RNG state arrays
    *{type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.uint8)},
]


def safe_torch_load(source: str | os.PathLike[str] | bytes, where: str, mmap: bool = False) -> Any:
    """Load a ``torch.save`` file or byte string with ``weights_only=True`` and our allowlist.

    ``mmap=True`` (local files) maps tensor storages instead of reading them, so only the
    pickle is read now and tensor bytes are read when a box of them is copied.
    """
    stream: Any = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(stream, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        if isinstance(stream, io.BytesIO):
            stream.seek(0)
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(stream)
        except Exception:  # noqa: BLE001 - the listing is a hint only
            unsafe = []
        unsafe = [name for name in unsafe if not _allowed(name)]
        detail = ", ".join(unsafe) or str(exc).strip().splitlines()[-1]
        raise UnsafeCheckpointError(
            f"{where}: refuses to unpickle {detail} (only tensors, plain containers, "
            "argparse.Namespace, io.BytesIO and numpy arrays are allowed)"
        ) from None


def _allowed(name: str) -> bool:
    return any(name.endswith(f".{getattr(g, '__name__', '')}") for g in SAFE_GLOBALS)
