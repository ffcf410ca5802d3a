"""Checks of constructor options: a value of the wrong kind raises an error naming the
option, instead of being taken for what its truthiness says (``allow_unsafe_bytes="false"``
is a non-empty string: truthy, so it would turn a safety check off)."""

from __future__ import annotations

from typing import Any

import numpy as np

from dcp_ext.errors import InvalidRequestError


def flag(owner: str, name: str, value: Any, *, optional: bool = False) -> Any:
    """``value`` if it is a bool (or None where ``optional``); else InvalidRequestError."""
    if isinstance(value, bool) or (optional and value is None):
        return value
    expected = "True, False or None" if optional else "True or False"
    raise InvalidRequestError(f"{owner}({name}=...) must be {expected}, got {value!r}")


def positive_int(owner: str, name: str, value: Any) -> int:
    """``value`` as an int if it is an integer of at least 1 (a numpy integer too, as stock
    takes them; not a bool); else InvalidRequestError."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1:
        return int(value)
    raise InvalidRequestError(f"{owner}({name}=...) must be a positive integer, got {value!r}")


def callback(owner: str, name: str, value: Any) -> Any:
    """``value`` if it is callable or None; else InvalidRequestError."""
    if value is None or callable(value):
        return value
    raise InvalidRequestError(f"{owner}({name}=...) must be callable or None, got {value!r}")
