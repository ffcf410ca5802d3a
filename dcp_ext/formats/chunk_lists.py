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
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata

from dcp_ext.runtime.gc_pause import gc_paused

Boxes = tuple[np.ndarray, np.ndarray]  # (offsets, sizes) of a key's chunks, (chunks, ndim) int64 each


class ChunkListsOnDemand(Mapping[str, Any]):
    """{fqn: TensorStorageMetadata or BytesStorageMetadata}; ``state`` holds each tensor
    key's entry with its chunk list still to fill, ``boxes(k)`` gives key number ``k``'s
    (position in ``state``) chunk boxes in metadata order."""

    def __init__(self, state: dict[str, Any], boxes: Callable[[int], Boxes]) -> None:
        self._state = state
        self._boxes = boxes
        self._key_of = {fqn: k for k, fqn in enumerate(state)}
        self._built = np.array([not isinstance(md, TensorStorageMetadata) for md in state.values()], bool)

    def __getitem__(self, fqn: str) -> Any:
        k = self._key_of[fqn]
        md = self._state[fqn]
        if not self._built[k]:
            with gc_paused():
                off, size = self._boxes(k)
                md.chunks = list(map(ChunkStorageMetadata, torch_sizes(off), torch_sizes(size)))
            self._built[k] = True  # a racing thread builds an equal list
        return md

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)

    def __contains__(self, fqn: object) -> bool:
        return fqn in self._key_of

    def __reduce__(self) -> tuple[type, tuple[dict[str, Any]]]:
        with gc_paused():
            return dict, ({fqn: self[fqn] for fqn in self},)


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
            return pickle.loads, (pickled,)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(Metadata)}
        fields["state_dict_metadata"] = dict(self.state_dict_metadata)  # every chunk list built
        return Metadata, tuple(fields.values())


def torch_sizes(values: np.ndarray) -> Iterable[torch.Size]:
    """Rows of ``values`` as torch.Size objects; one shared object when all rows are equal
    (the chunks of a key mostly have one size), which also keeps a pickle small."""
    if len(values) and bool(np.all(values == values[0])):
        return itertools.repeat(torch.Size(values[0].tolist()), len(values))
    return map(torch.Size, values.tolist())
