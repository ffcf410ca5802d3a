"""What every Megatron format adapter shares: options, the source interface, metadata builders.

A Megatron checkpoint that is not a DCP directory (zarr arrays, legacy ``mp_rank_*``
files) is presented to DCP as a *source*: synthesized DCP ``Metadata`` whose chunks are
the pieces the checkpoint stores, plus a way to fill a destination box from one chunk.
DCP's planners then reshard it like any other checkpoint.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_ext.errors import CheckpointError

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


class IncompleteSaveError(CheckpointError):
    """A Megatron checkpoint whose save never finished (``metadata.json`` is missing)."""


@dataclass(frozen=True)
class MegatronOptions:
    """How to read a Megatron checkpoint.

    Args:
        iteration: legacy format only: an iteration number or ``"release"``; default:
            the one named by ``latest_checkpointed_iteration.txt``.
        partition_dims: legacy format only: ``{regex: dim}`` TP split rules tried before
            the defaults (``re.search`` on the parameter name; ``None`` = replicated).
        allow_incomplete: load a torch_dist/zarr save whose ``metadata.json`` is missing.
    """

    iteration: int | str | None = None
    partition_dims: Mapping[str, int | None] = field(default_factory=dict)
    allow_incomplete: bool = False

    def cache_key(self) -> tuple[Any, ...]:
        return (self.iteration, tuple(sorted(self.partition_dims.items(), key=repr)), self.allow_incomplete)


@dataclass(frozen=True)
class ChunkRead:
    """What filling one box cost: bytes taken from storage and the files they came from."""

    nbytes: int
    files: frozenset[str]


class MegatronSource(ABC):
    """A checkpoint that is not a DCP directory, presented as DCP metadata."""

    format: str  # "zarr" or "legacy"
    url: str
    metadata: Metadata

    @abstractmethod
    def read_tensor(
        self, index: MetadataIndex, offsets: tuple[int, ...], lengths: tuple[int, ...], dest: torch.Tensor
    ) -> ChunkRead:
        """Fill ``dest`` with the box (``offsets`` relative to the chunk) of chunk ``index``."""

    @abstractmethod
    def read_bytes(self, fqn: str) -> bytes:
        """The serialized bytes item ``fqn`` (a ``torch.save`` stream, as DCP stores them)."""

    @abstractmethod
    def chunk_files(self, index: MetadataIndex) -> list[str]:
        """Files (relative to the checkpoint) that hold chunk ``index``; for ``inspect``."""

    @abstractmethod
    def signature(self) -> tuple[Any, ...]:
        """Changes when the files the source was built from change (cache validation)."""


def tensor_metadata(
    dtype: torch.dtype | TensorProperties, shape: tuple[int, ...], chunks: list[Box]
) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        dtype if isinstance(dtype, TensorProperties) else TensorProperties(dtype=dtype),
        torch.Size(shape),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )


def build_metadata(tensors: dict[str, TensorStorageMetadata], byte_keys: list[str]) -> Metadata:
    entries: dict[str, Any] = dict(tensors)
    entries.update({key: BytesStorageMetadata() for key in byte_keys})
    return Metadata(state_dict_metadata=entries)
