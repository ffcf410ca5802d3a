"""Instances of DCP's frozen dataclasses built in bulk, without their constructors.

A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__`` (and
``MetadataIndex``'s copies its offset into a new ``torch.Size``): ~7 us for a ``ReadItem``
and its two indexes, per item of a load plan, where the values are already the types
the fields hold. The instance is the same object the constructor would make (its fields
in ``__dict__``), so it compares, hashes and pickles as one.
"""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


def frozen(cls: type[T], **fields: Any) -> T:
    """An instance of the dataclass ``cls`` holding ``fields``, each of its field's type."""
    instance = object.__new__(cls)
    instance.__dict__.update(fields)
    return instance


def replaced(obj: T, **changes: Any) -> T:
    """``dataclasses.replace(obj, **changes)`` for such an instance, without the
    constructors: a save's write items get their index hints so (7 -> 2 us an item), a
    matched record frame its CRC-32."""
    instance = object.__new__(type(obj))
    instance.__dict__.update(obj.__dict__, **changes)
    return instance
