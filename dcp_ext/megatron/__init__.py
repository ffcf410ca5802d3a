"""Read Megatron checkpoints (torch_dist, zarr, legacy ``mp_rank_*``) through ShardReader.

Importing this package registers the Megatron formats with ``dcp_ext.storage.catalog_formats``.
"""

from dcp_ext.formats.stand_ins import MegatronValue
from dcp_ext.megatron.base import IncompleteSaveError, MegatronOptions
from dcp_ext.megatron.common_state import load_common_state
from dcp_ext.megatron.detect import detect_format

__all__ = [
    "IncompleteSaveError",
    "MegatronOptions",
    "MegatronValue",
    "detect_format",
    "load_common_state",
]
