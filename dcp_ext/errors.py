"""The one exception family dcp_ext raises for bad checkpoints and bad requests.

Every message names the checkpoint, the file and the key involved, so an operator can
act on it without a debugger.
"""


class CheckpointError(RuntimeError):
    """Base class: anything wrong with a checkpoint or with how it is being used."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes or metadata disagree with what the checkpoint claims."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A verified read found bytes whose checksum differs from the recorded one."""


class UnsafeCheckpointError(CheckpointError):
    """Metadata tries something a checkpoint must never do (code, path escape)."""


class CheckpointExistsError(CheckpointError):
    """A save with ``overwrite=False`` found a committed checkpoint in place."""


class InvalidRequestError(CheckpointError, ValueError):
    """A state dict, placements, plans or options that cannot be saved or loaded as asked.

    Also a ``ValueError``: DCP's own planners raise that for the same mistakes, and
    callers catch it.
    """
