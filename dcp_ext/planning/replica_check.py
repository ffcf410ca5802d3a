"""Save-time check that chunks DCP will dedup as replicas really hold the same data.

DCP keeps one writer per (key, offsets) and never looks at the data, so ranks that declare
the same chunk with different contents (EP experts under an FSDP-only DTensor, per-rank
state under a shared key) produce a checkpoint that silently loads the wrong shard. Each
rank attaches a small digest per chunk to its local plan (a row per plan row); the
coordinator compares them (``global_plan.check_replicas``).
The digest hashes up to ``SAMPLES`` evenly spaced elements (all of a small chunk), so the
cost per chunk is constant however large the tensor is.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dcp_ext.errors import ReplicaMismatchError  # noqa: F401 - raised by the replica checks that import it from here
from dcp_ext.planning.placements import axis_name, describe_mesh

SAMPLES = 1024

ChunkKey = tuple[str, tuple[int, ...], tuple[int, ...]]  # fqn, offsets, sizes


# integers of each element width: elements are sampled as their bit patterns, since torch
# has no take kernel for float8 or uint16/32/64 on CPU
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def chunk_digest(tensor: torch.Tensor) -> bytes:
    """Digest of dtype, shape and up to SAMPLES evenly spaced elements (bit patterns)."""
    flat = tensor.detach()
    if flat.is_conj() or flat.is_neg():  # hash values: a conj/neg view's bytes are not its values
        flat = flat.resolve_conj().resolve_neg()
    bits = flat.view(_BITS[flat.element_size()]) if flat.element_size() in _BITS else flat
    if flat.numel() > SAMPLES:
        sample = torch.take(bits, _sample_index(flat.numel(), flat.device))
    else:
        sample = bits.reshape(-1)
    data = sample.cpu().numpy().tobytes()  # C order whatever the strides (a 1-element view may keep any stride)
    header = f"{flat.dtype}{tuple(flat.shape)}".encode()
    return hashlib.blake2b(header + data, digest_size=16).digest()


@functools.lru_cache(maxsize=256)
def _sample_index(numel: int, device: torch.device) -> torch.Tensor:
    """The SAMPLES evenly spaced element positions of a tensor of ``numel`` elements: the
    same for every chunk of one size (a third of a digest's cost to make), so made once."""
    return torch.linspace(0, numel - 1, SAMPLES, dtype=torch.float64).long().to(device)


# a non-tensor item's row: not compared (stock compares none), but the same on every rank, so
# the hash of a set of chunks it belongs to stays known (a zero row made it unknown: one
# replicated `step` beside the replicated tensors of a rank turned their check off)
BYTES_ROW = np.frombuffer(hashlib.blake2b(b"dcp_ext: a non-tensor item", digest_size=16).digest(), np.uint64)


def chunk_digest_rows(
    items: list[WriteItem], lookup: Callable[[MetadataIndex], object], rows: Iterable[int] | None = None
) -> np.ndarray:
    """(len(items), 2) uint64: the digest of every tensor chunk in ``items`` (``lookup``
    finds the data), or of the chunks at ``rows`` alone; ``BYTES_ROW`` for non-tensor items,
    zero rows where no tensor is at hand or no digest was asked for."""
    out = np.zeros((len(items), 2), np.uint64)
    for row in range(len(items)) if rows is None else rows:
        item = items[row]
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            out[row] = BYTES_ROW
            continue
        tensor = lookup(item.index)
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta or tuple(tensor.shape) != tuple(item.tensor_data.chunk.sizes):
            continue  # nothing comparable at hand; the check stays silent for this chunk
        out[row] = np.frombuffer(chunk_digest(tensor), np.uint64)
    return out


def held_alone(obj: object, world: int, mesh_sizes: dict[int, int]) -> bool:
    """Whether no other rank should declare a chunk of ``obj`` under the same offsets: a
    DTensor sharded on every dimension of a mesh that spans all ``world`` ranks of the job
    holds a region of its own on each rank (only empty shards can share offsets, with no
    data to compare). Not one over a wrapper of local shards (torchrec's), which names its
    own offsets. ``mesh_sizes``: each mesh's size by id, asked once per plan (a mesh's
    ``size()`` is Python over its layout, ~4 us)."""
    if type(obj) is not DTensor or type(obj._local_tensor) is not torch.Tensor:
        return False
    mesh = obj.device_mesh
    size = mesh_sizes.get(id(mesh))
    if size is None:  # the meshes live as long as the plan
        size = mesh_sizes[id(mesh)] = mesh.size()
    return size == world and all(p.is_shard() for p in obj.placements)


_ALONE = 0xA10E << 48  # high bits of a mark's first word


def alone_marks(rows: list[int], rank: int) -> np.ndarray:
    """(len(rows), 2) uint64 stand-ins for the digests of chunks held alone: ``rank`` and
    the row, never a digest another rank sends, so a chunk that another rank declares
    after all (ranks whose meshes or placements disagree) is refused as a mismatch."""
    out = np.empty((len(rows), 2), np.uint64)
    out[:, 0] = _ALONE | rank
    out[:, 1] = np.asarray(rows, np.uint64) + 1
    return out


def is_alone_mark(digest: np.ndarray) -> bool:
    """Whether a digest row is an ``alone_marks`` row."""
    return int(digest[0]) >> 48 == _ALONE >> 48


def mismatch_message(
    conflicts: list[tuple[ChunkKey, list[list[int]], list[int]]], total: int, mesh: DeviceMesh | None
) -> str:
    """``conflicts``: (fqn, offsets, sizes), the groups of ranks that agree, and the ranks
    that hold the chunk as a DTensor sharded over every rank (``alone_marks``), per chunk."""
    lines = []
    for (fqn, offsets, sizes), groups, alone in conflicts[:5]:
        versions = " vs ".join(f"ranks {ranks}{_coordinates(mesh, ranks)}" for ranks in groups)
        if alone:
            versions += (f" (ranks {alone} hold it in a DTensor sharded over every rank, which no other rank "
                         "can also hold: the ranks' meshes, placements or key types disagree)")
        lines.append(f"  {fqn!r} chunk at offsets {list(offsets)} size {list(sizes)}: {versions}")
    more = f"\n  ... and {total - 5} more" if total > 5 else ""
    where = f"checkpoint mesh {describe_mesh(mesh)}" if mesh is not None else "no checkpoint mesh given"
    return (
        f"{total} chunk(s) are declared by several ranks with the same key and offsets but "
        f"different data; DCP would keep one copy and every rank would load it ({where}):\n"
        + "\n".join(lines)
        + more
        + "\nGive each rank's shard its own offsets (ShardSavePlanner(placement_fn=..., mesh=...) or "
        "dcp_ext.with_checkpoint_placements), or pass check_replicas=False if the difference is intended "
        "and one rank's copy may stand for all, as stock DCP saves it (per-rank statistics such as BatchNorm's "
        "running_mean/running_var without SyncBatchNorm)."
    )


def _coordinates(mesh: DeviceMesh | None, ranks: list[int]) -> str:
    if mesh is None:
        return ""
    coords = []
    for rank in ranks:
        found = (mesh.mesh == rank).nonzero()
        where = ", ".join(f"{axis_name(mesh, a)}={c}" for a, c in enumerate(found[0].tolist())) if len(found) else "outside"
        coords.append(f"{rank}: {where}")
    return f" ({'; '.join(coords)})"
