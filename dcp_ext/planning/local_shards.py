"""A rank's local chunks and save items, a DTensor's layout worked out once per plan.

DCP works out a DTensor's local shape and global offset from its placements (10-50 us,
more on larger meshes) every time a planner asks: for a save's write item, again in each
``resolve_data``, and for a load's chunk list. The answer is the same for every DTensor
of one global shape, mesh and placements (an FSDP2 model has a few such layouts for
thousands of parameters), so a plan keeps it in a memo per layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list, _create_write_items
from torch.distributed.tensor import DTensor

from dcp_ext.errors import InvalidRequestError
from dcp_ext.runtime.frozen import frozen

ChunkMemo = dict[tuple[Any, ...], list[ChunkStorageMetadata]]  # DTensor layout -> its local chunks
# sub-byte integer dtypes: torch.save has no storage type for them
SUB_BYTE_DTYPES = frozenset(
    d for bits in range(1, 8) for d in (getattr(torch, f"uint{bits}", None), getattr(torch, f"int{bits}", None)) if d
)


def local_chunks(obj: torch.Tensor, memo: ChunkMemo) -> list[ChunkStorageMetadata]:
    """DCP's chunk list of ``obj`` (``_create_chunk_list``); a plain DTensor's from ``memo``.

    A DTensor whose local tensor is itself a subclass lists that tensor's chunks: DCP's."""
    if type(obj) is not DTensor or type(obj._local_tensor) is not torch.Tensor:
        return _create_chunk_list(obj)
    layout = (obj.shape, id(obj.device_mesh), obj.placements)  # the meshes live as long as the plan
    chunks = memo.get(layout)
    if chunks is None:  # a racing thread (a writer's resolve_data) computes the same list
        chunks = memo[layout] = _create_chunk_list(obj)  # raises for Partial placements, as DCP's does
    return chunks


def local_write_items(state_dict: dict[str, Any], memo: ChunkMemo) -> list[WriteItem]:
    """The items of DCP's ``create_default_local_save_plan`` for ``state_dict``, in its
    order and with its fields; a plain DTensor's chunk from ``memo``."""
    items: list[WriteItem] = []
    for fqn, obj in state_dict.items():
        if isinstance(obj, torch.Tensor):
            check_savable(fqn, obj)
        if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            continue  # this rank is outside the tensor's submesh
        if type(obj) is DTensor and type(obj._local_tensor) is torch.Tensor:
            items += [_dtensor_item(fqn, obj, chunk) for chunk in local_chunks(obj, memo)]
        elif type(obj) is torch.Tensor:
            items.append(_tensor_item(fqn, obj))
        else:
            items += _create_write_items(fqn, obj)
    return items


def check_savable(fqn: str, tensor: torch.Tensor) -> None:
    """Refuse, by key, a tensor DCP cannot store (it fails later, naming nothing)."""
    if tensor.layout != torch.strided:
        raise InvalidRequestError(
            f"key {fqn!r}: a {str(tensor.layout).removeprefix('torch.')} tensor cannot be saved, only strided "
            "(dense) ones; save tensor.to_dense(), or its parts (indices and values) under keys of their own"
        )
    if tensor.dtype in SUB_BYTE_DTYPES:
        raise InvalidRequestError(
            f"key {fqn!r}: {tensor.dtype} tensors cannot be saved (torch.save has no storage for sub-byte "
            "integers); save tensor.view(torch.uint8), the same bytes, and view them back after the load"
        )


def _dtensor_item(fqn: str, obj: DTensor, chunk: ChunkStorageMetadata) -> WriteItem:
    """DCP's ``_create_write_items_for_dtensor`` with the chunk given. DCP takes the
    properties of ``to_local()``, an autograd call in grad mode (12 us an item); they are
    the local tensor's, with ``requires_grad`` as ``to_local()`` would return it."""
    local = obj._local_tensor
    requires_grad = obj.requires_grad if torch.is_grad_enabled() else local.requires_grad
    return _write_item(fqn, WriteItemType.SHARD, chunk.offsets, chunk.sizes, local, requires_grad, obj.size())


def _tensor_item(fqn: str, obj: torch.Tensor) -> WriteItem:
    """DCP's ``_create_write_item_for_tensor``: the whole tensor as one chunk at offset 0
    (through DCP's constructors a rank's items took 14.3 us a plain tensor at 20,000
    keys, now 6.2)."""
    size = obj.size()
    return _write_item(fqn, WriteItemType.TENSOR, torch.Size([0] * len(size)), size, obj, obj.requires_grad, size)


def _write_item(
    fqn: str, kind: WriteItemType, offsets: torch.Size, sizes: torch.Size, local: torch.Tensor, requires_grad: bool, size: torch.Size
) -> WriteItem:
    """A tensor's write item as DCP's constructors make it, its properties those of
    ``TensorProperties.create_from_tensor(local)`` with ``requires_grad``; DCP's frozen
    dataclasses built without their constructors (``runtime.frozen``)."""
    return frozen(
        WriteItem,
        index=frozen(MetadataIndex, fqn=fqn, offset=offsets, index=None),
        type=kind,
        tensor_data=frozen(
            TensorWriteData,
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties(
                dtype=local.dtype,
                layout=local.layout,
                requires_grad=requires_grad,
                memory_format=torch.contiguous_format,
                pin_memory=local.is_pinned(),
            ),
            size=size,
        ),
    )
