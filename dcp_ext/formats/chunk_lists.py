"""``Metadata.state_dict_metadata`` whose chunk lists are built when a key is first asked for.

DCP's metadata holds a ``ChunkStorageMetadata`` (two ``torch.Size``) per chunk. At a
million chunks and more, building them all costs seconds and hundreds of MB that neither a
rank loading a few keys nor a coordinator planning a save needs: both answer from numpy
columns. The mapping builds a key's list on first access; ``MetadataOnDemand`` around it
pickles as a stock ``Metadata`` with a plain dict, which stock DCP and our reader read.
"""

from __future__ import annotations

import dataclasses
import itertools
import pickle
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata

from dcp_ext.formats.pickle_splice import PickledPrefix, dumps_after, pickled_prefix
from dcp_ext.runtime.gc_pause import gc_paused

T = TypeVar("T")
Boxes = tuple[np.ndarray, np.ndarray]  # (offsets, sizes) of a key's chunks, (chunks, ndim) int64 each


class ChunkListsOnDemand(Mapping[str, Any]):
    """{fqn: TensorStorageMetadata or BytesStorageMetadata}; ``state`` holds each tensor
    key's entry with its chunk list still to fill, ``boxes(k)`` gives key number ``k``'s
    (position in ``state``) chunk boxes in metadata order."""

    def __init__(self, state: dict[str, Any], boxes: Callable[[int], Boxes]) -> None:
        self._state = state
        self._boxes = boxes
        self._key_of = {fqn: k for k, fqn in enumerate(state)}
        self._names = list(state)
        self._built = np.array([not isinstance(md, TensorStorageMetadata) for md in state.values()], bool)
        self._derived: dict[Callable[[Any], Any], Any] = {}
        self._prefix: PickledPrefix | None = None  # kept: see pickled()
        self._spliceable = True  # False once its pickle could not start a stream or was too large to keep

    def __getitem__(self, fqn: str) -> Any:
        k = self._key_of[fqn]
        md = self._state[fqn]
        if not self._built[k]:
            with gc_paused():
                self._build(k, md)
        return md

    def _build(self, k: int, md: TensorStorageMetadata) -> None:
        off, size = self._boxes(k)
        md.chunks = list(map(ChunkStorageMetadata, torch_sizes(off), torch_sizes(size)))
        self._built[k] = True  # a racing thread builds an equal list

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)

    def __contains__(self, fqn: object) -> bool:
        return fqn in self._key_of

    def __reduce__(self) -> tuple[type, tuple[dict[str, Any]]]:
        return dict, (self.plain(),)

    def plain(self) -> dict[str, Any]:
        """The mapping as a plain dict, every chunk list built."""
        with gc_paused():
            for k in np.flatnonzero(~self._built).tolist():
                self._build(k, self._state[self._names[k]])
            return dict(self._state)

    def derived(self, make: Callable[[Any], T]) -> T:
        """``make(self)``, worked out once per mapping: what a save's index takes from it.
        The global plan a save reuses (``cache_plans``) keeps this mapping, which nothing
        changes once built (a racing thread makes an equal value)."""
        if make not in self._derived:
            with gc_paused():
                self._derived[make] = make(self)
        return self._derived[make]

    def pickled(self) -> PickledPrefix | None:
        """The chunk lists pickled as a plain dict, for ``MetadataOnDemand.dumps``; kept for
        the next save if at most ``SPLICED_BYTES``: the global plan a save reuses
        (``cache_plans``) keeps this mapping, which nothing changes once built, and the kept
        pickler's memo holds every object the pickle made (~1 KB a chunk). A larger one
        serves this save only; later saves pickle the metadata afresh (None). None also
        where it cannot start a stream (``pickled_prefix``)."""
        if self._prefix is not None or not self._spliceable:
            return self._prefix
        try:
            with gc_paused():
                prefix = pickled_prefix(self.plain())
        except ValueError:
            self._spliceable = False
            return None
        if len(prefix.opcodes) <= SPLICED_BYTES:
            self._prefix = prefix
        else:
            self._spliceable = False
        return prefix


class MetadataOnDemand(Metadata):
    """DCP's ``Metadata`` over a ``ChunkListsOnDemand``. It pickles as a stock ``Metadata``
    built from its fields with a plain dict, so whichever writer pickles it (stock
    ``FileSystemWriter`` too) writes a ``.metadata`` that stock DCP reads and that our
    reader, which refuses any global but DCP's classes, reads as well."""

    def broadcast_as(self, pickled: bytes) -> None:
        """``pickled``, this object's pickle as the writer just wrote it to ``.metadata``,
        stands for it in DCP's broadcast of it to every rank, which follows the writer's
        ``finish`` and pickled it again: 20 ms on the coordinator's critical path at 1,180
        chunks (pickling DCP's dataclasses costs 15-25 us a chunk). Once only, and only for
        torch's object collective: any other pickle (after the caller changed the object)
        is made afresh."""
        self.__dict__["_pickled"] = pickled

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        pickled = self.__dict__.pop("_pickled", None)
        if pickled is not None and sys._getframe(1).f_code.co_name == "_object_to_tensor":  # torch's broadcast
            return PickledMetadata, (pickled,)
        return self._reduced(dict(self.state_dict_metadata))  # every chunk list built

    def _reduced(self, state_dict_metadata: dict[str, Any]) -> tuple[type, tuple[Any, ...]]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(Metadata)}
        fields["state_dict_metadata"] = state_dict_metadata
        return Metadata, tuple(fields.values())

    def dumps(self) -> bytes:
        """This metadata's pickle (``.metadata``): what ``pickle.dumps`` makes of it, loading
        to an equal ``Metadata``, with the chunk lists pickled once per mapping
        (``ChunkListsOnDemand.pickled``): a training loop's saves reuse one global plan,
        whose lists were 10 of 15 ms of this pickle at 1,180 chunks."""
        keys = self.state_dict_metadata
        if isinstance(keys, ChunkListsOnDemand):
            prefix = keys.pickled()
            if prefix is not None:
                try:
                    with gc_paused():
                        return dumps_after(prefix, _Reduces(self._reduced(prefix.obj)))
                except ValueError:  # a str or bytes of 64 KiB or more in the rest: pickled afresh
                    pass
        return pickle.dumps(self)


_FIELDS = frozenset(f.name for f in dataclasses.fields(Metadata))


class PickledMetadata(Metadata):
    """The ``Metadata`` a save returns on every rank but the coordinator: the bytes DCP's
    broadcast delivered (``.metadata``'s, ``MetadataOnDemand.broadcast_as``), unpickled
    when a field is first read or set. Each of those ranks unpickled it whole before its
    ``dcp.save`` could return, for a value a training loop drops: 1,180 keys' chunk
    lists and storage data, 3 ms (4-5 beside the other rank's work on 2 cores). Any
    pickle of it is a stock ``Metadata``, as ``MetadataOnDemand``'s is."""

    def __init__(self, pickled: bytes | None = None, **fields: Any) -> None:
        if pickled is None:  # dataclasses.replace: the fields given
            super().__init__(**fields)
        else:  # the fields come from the bytes, on first use
            object.__setattr__(self, "_pickled", pickled)

    def __getattribute__(self, name: str) -> Any:
        if name in _FIELDS:
            object.__getattribute__(self, "_unpickle")()
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FIELDS:  # the other fields are unpickled first, not later over this one
            self._unpickle()
        object.__setattr__(self, name, value)

    def _unpickle(self) -> None:
        state = object.__getattribute__(self, "__dict__")
        pickled = state.get("_pickled")
        if pickled is not None:  # a racing thread unpickles the same fields
            state.update({name: value for name, value in vars(pickle.loads(pickled)).items() if name in _FIELDS})
            state.pop("_pickled", None)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return Metadata, tuple(getattr(self, f.name) for f in dataclasses.fields(Metadata))


SPLICED_BYTES = 4 << 20  # the largest chunk-list pickle kept across saves: ~30 K chunks, ~35 MB held


class _Reduces:
    """Pickles as ``reduced``, a ``__reduce__`` value."""

    __slots__ = ("reduced",)

    def __init__(self, reduced: tuple[Any, tuple[Any, ...]]) -> None:
        self.reduced = reduced

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.reduced


def torch_sizes(values: np.ndarray) -> Iterable[torch.Size]:
    """Rows of ``values`` as torch.Size objects; one shared object when all rows are equal
    (the chunks of a key mostly have one size), which also keeps a pickle small."""
    if len(values) == 1:  # most keys of a large job: no comparison
        return [torch.Size(values[0].tolist())]
    if len(values) and bool(np.all(values == values[0])):
        return itertools.repeat(torch.Size(values[0].tolist()), len(values))
    return map(torch.Size, values.tolist())
