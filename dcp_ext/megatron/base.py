"""What every Megatron format adapter shares: options and metadata builders.

A Megatron checkpoint that is not a DCP directory (zarr arrays, legacy ``mp_rank_*``
files) is presented to DCP as a catalog: synthesized DCP ``Metadata`` whose chunks are
the pieces the checkpoint stores, each at a byte range of a file. DCP's planners then
reshard it like any other checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_ext.errors import CheckpointError, InvalidRequestError
from dcp_ext.runtime import options

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

    def __post_init__(self) -> None:
        iteration = self.iteration
        if not (iteration is None or iteration == "release" or (type(iteration) is int and iteration >= 0)):
            raise InvalidRequestError(f"MegatronOptions(iteration=...) must be an iteration number, 'release' or None, got {iteration!r}")
        if not isinstance(self.partition_dims, Mapping):
            raise InvalidRequestError(f"MegatronOptions(partition_dims=...) must map regexes to dims, got {self.partition_dims!r}")
        for pattern, dim in self.partition_dims.items():
            if not (dim is None or (type(dim) is int and dim >= 0)):
                raise InvalidRequestError(f"MegatronOptions(partition_dims=...): rule {pattern!r} has dim {dim!r}, expected 0, 1, ... or None")
            try:
                re.compile(pattern)
            except (TypeError, re.error) as exc:
                raise InvalidRequestError(f"MegatronOptions(partition_dims=...): {pattern!r} is not a regex ({exc})") from None
        options.flag("MegatronOptions", "allow_incomplete", self.allow_incomplete)

    def given(self) -> frozenset[str]:
        """The options set to other than their defaults: each must apply to the checkpoint read."""
        default = MegatronOptions()
        return frozenset(f.name for f in fields(self) if getattr(self, f.name) != getattr(default, f.name))

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
