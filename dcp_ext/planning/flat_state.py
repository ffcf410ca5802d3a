"""A state dict's flat view (DCP's ``flatten_state_dict``) in one walk, where DCP's walks change nothing else.

DCP's default planners set up by walking the whole state dict two or three times: a
load's ``_init_state_dict`` (meta tensors made real), ``_flatten_sharded_tensors`` (which
rebuilds every nested dict) and ``flatten_state_dict``; a save's the last two. A load of
590 DTensors at 2 processes spent 5.4 ms of its main thread there (9 us a value). For a
tree of dicts with string keys and lists (an optimizer's param groups) whose leaves are
plain tensors and DTensors off the meta device, scalars, or lists and tuples of scalars,
the first two change nothing that a load reads (a load's set-up copies such lists and
tuples, equal), and the third's result (the flat dict and each key's path) is what one
walk gives. Anything else (other key types, ShardedTensors, meta tensors, other objects,
a list element without leaves, a flattened key met twice, checkpoints of DCP's 2.3
layout) returns None: the caller takes DCP's own set-up, with its behaviour and errors.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import _version
from torch.distributed.tensor import DTensor

_TENSORS = (torch.Tensor, DTensor)
# what DCP's walks pass as they are (a load's set-up turns any other object, a complex number too, into None)
_SCALARS = frozenset((int, float, bool, str, bytes, type(None), io.BytesIO))

FlatView = tuple[dict[str, Any], dict[str, tuple[str | int, ...]]]  # DCP's flattened state dict and its mappings


def flat_view(state_dict: dict[str, Any]) -> FlatView | None:
    """``flatten_state_dict(state_dict)`` where DCP's set-up walks would change nothing else; else None."""
    if _version._derived_version == "2_3":  # DCP flattens by its older walk then
        return None
    flat: dict[str, Any] = {}
    mappings: dict[str, tuple[str | int, ...]] = {}

    def leaf(path: tuple[str | int, ...], fqn: str, value: Any) -> int | None:
        if fqn in flat:  # DCP raises its own error for it
            return None
        flat[fqn] = value
        mappings[fqn] = path
        return 1

    def visit(path: tuple[str | int, ...], fqn: str, value: Any) -> int | None:
        """Leaves ``value`` adds at ``path`` (joined: ``fqn``); None where DCP's walks must run."""
        kind = type(value)
        if kind in _TENSORS:
            return None if value.device.type == "meta" else leaf(path, fqn, value)  # DCP's load set-up allocates it
        if kind in _SCALARS:
            return leaf(path, fqn, value)
        if isinstance(value, dict):
            added = 0
            for key, item in value.items():
                got = visit((*path, key), f"{fqn}.{key}", item) if type(key) is str else None
                if got is None:
                    return None
                added += got
            return added
        if kind is list and not _terminal(value):  # DCP walks into it, element by element
            added = 0
            for i, item in enumerate(value):
                got = visit((*path, i), f"{fqn}.{i}", item)
                if not got:  # an element without leaves: DCP's rebuild puts None in its place
                    return None
                added += got
            return added
        return leaf(path, fqn, value) if kind in (list, tuple) and _plain(value) else None

    for key, value in state_dict.items():
        if type(key) is not str or visit((key,), key, value) is None:
            return None
    return flat, mappings


def _terminal(values: list[Any]) -> bool:
    """DCP's ``_is_terminal`` for a list: a leaf unless it holds a tensor, a mapping or such a list."""
    return not any(
        isinstance(v, (torch.Tensor, Mapping)) or (isinstance(v, list) and not _terminal(v)) for v in values
    )


def _plain(values: list[Any] | tuple[Any, ...]) -> bool:
    """A list or tuple of scalars (and of such lists and tuples): what DCP's walks keep as it
    is (a load's set-up copies it, equal), such as a param group's ``params`` or ``betas``."""
    return all(type(v) in _SCALARS or (type(v) in (list, tuple) and _plain(v)) for v in values)
