"""Bytes items are checked by the reader, whichever planner decodes them.

DCP's ``DefaultLoadPlanner.load_bytes`` decodes a non-tensor item with
``torch.load(weights_only=False)``: a hostile checkpoint runs code there, and that is the
planner most people pass. So ``ShardReader`` hands every read path (DCP catalog, two-stage
exchange, Megatron sources) a ``SafeBytesPlanner``: each bytes item is first decoded by
the restricted loader (``safe_torch_load``), and only bytes that pass reach the caller's
planner, as ``CheckedBytes`` carrying the decoded object (``ShardLoadPlanner`` takes it
rather than decode again). A refusal raises ``UnsafeCheckpointError`` naming the file,
the key and the refused globals.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from dcp_ext.formats.safe_load import CheckedBytes, safe_load_bytes

READER_OPT_OUT = "ShardReader(allow_unsafe_bytes=True)"


class SafeBytesPlanner:
    """Forwards everything to ``planner``; ``load_bytes`` passes the restricted loader first.

    ``where(read_item)`` names the checkpoint, file and key for the error message.
    """

    def __init__(self, planner: LoadPlanner, where: Callable[[ReadItem], str]):
        self._planner = planner
        self._where = where
        # called once per read item: bound here, not found through __getattr__ each time
        self.resolve_tensor = planner.resolve_tensor
        self.commit_tensor = planner.commit_tensor

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        data = value.getvalue()
        decoded = safe_load_bytes(data, self._where(read_item), READER_OPT_OUT)
        self._planner.load_bytes(read_item, CheckedBytes(data, decoded))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)
