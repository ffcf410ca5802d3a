"""NTPShard: a rank's pieces of one global tensor, saved and loaded in place by DCP.

A spare rank under nonuniform TP holds several non-contiguous row ranges of a tensor,
which neither a plain tensor nor a DTensor can describe. DCP asks any tensor for its
chunks through three hooks (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``); a ``torch.Tensor`` subclass is needed because DCP's load
planner drops non-tensor objects (``_init_state_dict``) and looks chunks up only on
tensors (``find_state_dict_object``). The wrapper has the global shape, owns no data and
supports no tensor math: the pieces are views of the caller's tensors, so a load writes
straight into them.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from dcp_ext.errors import InvalidRequestError
from dcp_ext.ntp.layout import Range


class NTPShard(torch.Tensor):
    """Global-shaped handle on the local pieces of a tensor; build it with :func:`ntp_shard`."""

    _pieces: tuple[torch.Tensor, ...]
    _chunks: tuple[ChunkStorageMetadata, ...]

    @staticmethod
    def __new__(
        cls,
        pieces: Sequence[torch.Tensor],
        chunks: Sequence[ChunkStorageMetadata],
        global_shape: torch.Size,
        dtype: torch.dtype,
        device: torch.device,
    ) -> NTPShard:
        self = torch.Tensor._make_wrapper_subclass(cls, global_shape, dtype=dtype, device=device)
        self._pieces = tuple(pieces)
        self._chunks = tuple(chunks)
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise TypeError(
            f"NTPShard is a handle for dcp.save/dcp.load and runs no tensor ops ({func}; dcp.async_save's "
            "staging copy is one); use .pieces for the local data"
        )

    def __repr__(self) -> str:  # the default repr would run tensor ops
        rows = [(c.offsets, c.sizes) for c in self._chunks]
        return f"NTPShard(shape={tuple(self.shape)}, dtype={self.dtype}, chunks(offsets, sizes)={rows})"

    @property
    def pieces(self) -> tuple[torch.Tensor, ...]:
        """The local pieces (views sharing storage with what :func:`ntp_shard` was given)."""
        return self._pieces

    # -- DCP's chunk protocol ---------------------------------------------------------------
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk, properties=TensorProperties.create_from_tensor(piece), size=self.shape
                ),
            )
            for piece, chunk in zip(self._pieces, self._chunks)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return list(self._chunks)

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        hint = index.index
        if hint is not None and hint < len(self._chunks) and self._chunks[hint].offsets == index.offset:
            return self._pieces[hint]
        for piece, chunk in zip(self._pieces, self._chunks):
            if chunk.offsets == index.offset:
                return piece
        raise InvalidRequestError(f"{index.fqn}: this rank holds no piece at offsets {index.offset}")


def ntp_shard(
    local_pieces: torch.Tensor | Sequence[torch.Tensor],
    layout: Sequence[Range],
    global_shape: Sequence[int],
    partition_dim: int = 0,
) -> NTPShard:
    """Wrap a rank's pieces of a tensor partitioned along ``partition_dim`` for DCP.

    ``layout`` holds the pieces' [start, stop) ranges (e.g. ``NonuniformTP.row_map``).
    ``local_pieces`` is one tensor per range, or a single local tensor holding the ranges
    back to back along ``partition_dim`` (a spare's local parameter); it is split into
    views. Pieces are detached views, so ``dcp.load`` fills the caller's tensors in place.
    """
    shape = torch.Size(global_shape)
    dim = _check_dim(partition_dim, len(shape))
    try:  # integers of any kind (numpy's too), never a float cut short
        ranges = [(operator.index(a), operator.index(b)) for a, b in layout]
    except (TypeError, ValueError):
        raise InvalidRequestError(f"layout ranges must be (start, stop) integer pairs, got {list(layout)}") from None
    if not ranges and isinstance(local_pieces, torch.Tensor):  # a rank that owns no rows (row_map gave [])
        ranges = [(0, 0)]
    _check_ranges(ranges, shape[dim])
    lengths = [b - a for a, b in ranges]
    if isinstance(local_pieces, torch.Tensor):
        if local_pieces.dim() != len(shape) or local_pieces.shape[dim] != sum(lengths):
            raise InvalidRequestError(
                f"local tensor of shape {tuple(local_pieces.shape)} does not hold {sum(lengths)} "
                f"rows of a {tuple(shape)} tensor along dim {dim}"
            )
        pieces = list(torch.split(local_pieces, lengths, dim))
    else:
        pieces = list(local_pieces)
        if len(pieces) != len(ranges):
            raise InvalidRequestError(f"{len(pieces)} pieces for {len(ranges)} ranges")
    if not pieces:
        raise InvalidRequestError("no pieces: pass an empty local tensor (0 rows) so the dtype is known")
    dtype, device = pieces[0].dtype, pieces[0].device
    chunks = []
    for piece, (start, stop) in zip(pieces, ranges):
        want = shape[:dim] + torch.Size([stop - start]) + shape[dim + 1 :]
        if piece.shape != want or piece.dtype != dtype or piece.device != device:
            raise InvalidRequestError(
                f"piece for rows [{start}, {stop}) is {tuple(piece.shape)} {piece.dtype} on {piece.device}; "
                f"expected {tuple(want)} {dtype} on {device}"
            )
        offsets = [0] * len(shape)
        offsets[dim] = start
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=piece.shape))
    kept = [(p.detach(), c) for p, c in zip(pieces, chunks) if c.sizes[dim]]
    return NTPShard([p for p, _ in kept], [c for _, c in kept], shape, dtype, device)


def _check_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise InvalidRequestError(f"partition_dim {dim} out of range for a {ndim}-d tensor")
    return dim % ndim


def _check_ranges(ranges: list[Range], size: int) -> None:
    ordered = sorted(ranges)
    for (start, stop), nxt in zip(ordered, ordered[1:] + [(size, size)]):
        if not 0 <= start <= stop <= nxt[0]:
            raise InvalidRequestError(f"ranges {ranges} must be disjoint and within [0, {size})")
