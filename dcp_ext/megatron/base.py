"""What every Megatron format adapter shares: options and metadata builders.

A Megatron checkpoint that is not a DCP directory (zarr arrays, legacy ``mp_rank_*``
files) is presented to DCP as a catalog: synthesized DCP ``Metadata`` whose chunks are
the pieces the checkpoint stores, each at a byte range of a file. DCP's planners then
reshard it like any other checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
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
