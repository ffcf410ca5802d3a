"""Exchange layer: moving checkpoint bytes between ranks with torch.distributed.

Importing it registers the ``"two_stage"`` executor with ``dcp_ext.storage.executors``.
"""

from dcp_ext.exchange import two_stage as two_stage
