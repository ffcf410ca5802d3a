"""dcp_ext: faster, safer storage and planners for torch.distributed.checkpoint."""

from dcp_ext.errors import (
    CheckpointError,
    CheckpointExistsError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    IgnoredOptionsError,
    InvalidRequestError,
    StorageFullError,
    UnsafeCheckpointError,
)
import dcp_ext.exchange  # registers the two-stage executor  # noqa: F401
import dcp_ext.megatron  # registers the Megatron formats  # noqa: F401
from dcp_ext.conversion.hf_export import export_safetensors
from dcp_ext.observe import LoadReport, SaveReport, add_report_callback, remove_report_callback
from dcp_ext.planning.placements import PlacementFn, checkpoint_state_dict, with_checkpoint_placements
from dcp_ext.planning.planners import ShardLoadPlanner, ShardSavePlanner
from dcp_ext.planning.replica_check import ReplicaMismatchError
from dcp_ext.runtime.lru import clear_caches
from dcp_ext.storage.catalog import clear_metadata_cache
from dcp_ext.storage.reader import ReadStats, ShardReader
from dcp_ext.storage.writer import ShardWriter

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "IgnoredOptionsError",
    "InvalidRequestError",
    "LoadReport",
    "PlacementFn",
    "ReadStats",
    "ReplicaMismatchError",
    "SaveReport",
    "ShardLoadPlanner",
    "ShardReader",
    "ShardSavePlanner",
    "ShardWriter",
    "StorageFullError",
    "UnsafeCheckpointError",
    "add_report_callback",
    "checkpoint_state_dict",
    "clear_caches",
    "clear_metadata_cache",
    "export_safetensors",
    "remove_report_callback",
    "with_checkpoint_placements",
]
