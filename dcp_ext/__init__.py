"""dcp_ext: faster, safer storage and planners for torch.distributed.checkpoint."""

from dcp_ext.errors import (
    CheckpointError,
    CheckpointExistsError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from dcp_ext.planning.planners import ShardLoadPlanner, ShardSavePlanner
from dcp_ext.storage.catalog import clear_metadata_cache
from dcp_ext.storage.reader import ReadStats, ShardReader
from dcp_ext.storage.writer import ShardWriter

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "ReadStats",
    "ShardLoadPlanner",
    "ShardReader",
    "ShardSavePlanner",
    "ShardWriter",
    "UnsafeCheckpointError",
    "clear_metadata_cache",
]
