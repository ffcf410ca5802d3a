"""Read Megatron checkpoints (torch_dist, zarr, legacy ``mp_rank_*``) through ShardReader."""

from dcp_ext.megatron.base import IncompleteSaveError, MegatronOptions, MegatronSource
from dcp_ext.megatron.common_state import load_common_state
from dcp_ext.megatron.detect import detect_format, open_source

__all__ = [
    "IncompleteSaveError",
    "MegatronOptions",
    "MegatronSource",
    "detect_format",
    "load_common_state",
    "open_source",
]
