"""Run a DCP load plan against a Megatron source, boxes filled in parallel."""

from __future__ import annotations

import io
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from dcp_ext.errors import CheckpointError
from dcp_ext.megatron.base import ChunkRead, MegatronSource


def read_source_items(
    source: MegatronSource, items: list[ReadItem], planner: LoadPlanner, thread_count: int
) -> tuple[int, set[str]]:
    """Fill every item of a plan; returns (bytes read, files touched).

    Planner callbacks (``load_bytes``, ``commit_tensor``) run on the calling thread, only
    the copies run on the pool, as in the ordinary read path.
    """
    tasks: list[Callable[[], ChunkRead]] = []
    commits: list[Callable[[], None]] = []
    total, files = 0, set()
    for item in items:
        if item.type == LoadItemType.BYTE_IO:
            data = source.read_bytes(item.storage_index.fqn)
            planner.load_bytes(item, io.BytesIO(data))
            total += len(data)
            files.update(source.chunk_files(item.storage_index))
            continue
        dest = planner.resolve_tensor(item).detach()
        if tuple(dest.shape) != tuple(item.lengths):
            raise CheckpointError(
                f"{source.url}: key {item.storage_index.fqn!r}: destination has shape {list(dest.shape)} "
                f"but the plan reads {list(item.lengths)}"
            )
        index, offsets, lengths = item.storage_index, tuple(item.storage_offsets), tuple(item.lengths)
        tasks.append(lambda i=index, o=offsets, n=lengths, d=dest: source.read_tensor(i, o, n, d))
        commits.append(lambda i=item, d=dest: planner.commit_tensor(i, d))
    if tasks:
        with ThreadPoolExecutor(min(thread_count, len(tasks)), thread_name_prefix="dcp_ext-mcore") as pool:
            for result in pool.map(lambda task: task(), tasks):
                total += result.nbytes
                files.update(result.files)
    for commit in commits:
        commit()
    return total, files
