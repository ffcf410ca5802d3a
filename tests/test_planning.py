"""Global save planning: balanced dedup, validation, caching (no processes needed)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from planning_util import deduped


def _item(fqn: str, nbytes: int) -> WriteItem:
    size = torch.Size([nbytes])
    return WriteItem(
        index=MetadataIndex(fqn, [0]),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size([0]), size),
            properties=TensorProperties(dtype=torch.uint8),
            size=size,
        ),
    )


def _bytes_per_rank(plans: list[SavePlan]) -> list[int]:
    return [sum(i.tensor_storage_size() for i in p.items) for p in plans]


def test_balanced_where_first_seen_greedy_is_not():
    # REFERENCE.md: stock dedup ends 200 B vs 600 B here; 400/400 is possible.
    plans = [
        SavePlan([_item("r1", 200), _item("r2", 200)]),
        SavePlan([_item("r1", 200), _item("r2", 200), _item("own", 400)]),
    ]
    written = deduped(plans)
    assert _bytes_per_rank(written) == [400, 400]


def test_every_item_written_exactly_once_by_a_holder():
    plans = [SavePlan([_item(f"t{k}", 10 * (k + 1)) for k in range(r, 12)]) for r in range(4)]
    written = deduped(plans)
    names = [i.index.fqn for p in written for i in p.items]
    assert sorted(names) == sorted(f"t{k}" for k in range(12))
    for rank, plan in enumerate(written):
        assert all(int(i.index.fqn[1:]) >= rank for i in plan.items)  # only holders write
    loads = _bytes_per_rank(written)
    assert max(loads) - min(loads) <= 120


def test_an_invalid_global_plan_is_a_checkpoint_error_and_a_value_error():
    """Chunks that leave part of a tensor unsaved: DCP raises ValueError, we a subclass of both."""
    import pytest

    from dcp_ext import CheckpointError, InvalidRequestError
    from planning_util import global_plan, shard_item

    plans = [SavePlan([shard_item("w", [0], [3], [8])]), SavePlan([shard_item("w", [4], [4], [8])])]
    with pytest.raises(InvalidRequestError, match="Failed to validate global plan") as info:
        global_plan(plans)
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, ValueError)


def test_every_public_error_derives_from_checkpoint_error():
    import dcp_ext
    from dcp_ext.megatron import IncompleteSaveError

    errors = [getattr(dcp_ext, n) for n in dcp_ext.__all__ if n.endswith("Error")] + [IncompleteSaveError]
    assert len(errors) >= 7
    for error in errors:
        assert issubclass(error, dcp_ext.CheckpointError), error
    assert issubclass(dcp_ext.ReplicaMismatchError, ValueError)  # as before: callers may catch ValueError


def test_a_rank_spreads_its_items_over_files_by_chunk_bytes():
    """Each shard weighs its own bytes, not its whole tensor's (tensor_storage_size)."""
    from dcp_ext.storage.writer import item_nbytes, split_by_bytes
    from planning_util import shard_item

    items = [
        shard_item("a", [0, 0], [900, 10], [1000, 10]),
        shard_item("a", [900, 0], [100, 10], [1000, 10]),
        shard_item("b", [0, 0], [100, 10], [4000, 10]),
        shard_item("c", [0, 0], [500, 10], [500, 10]),
    ]
    files = split_by_bytes(items, 2)
    assert sorted(sum(item_nbytes(i) for i in f) for f in files) == [700 * 40, 900 * 40]
