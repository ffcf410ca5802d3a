"""C library functions Python's ``os`` module does not bind (``cachestat``'s syscall,
``sync_file_range``), taken from the symbols already loaded into the process: no library
search (``ctypes.util.find_library`` cost 9 ms at import)."""

from __future__ import annotations

import ctypes
import sys
from typing import Any


def loaded_function(name: str, argtypes: list[Any] | None = None) -> Any | None:
    """libc's ``name`` on Linux (errno kept for ``ctypes.get_errno``); None on another
    system or where the loaded C library lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    if argtypes is not None:
        function.argtypes = argtypes
    return function
