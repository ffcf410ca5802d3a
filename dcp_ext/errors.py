"""The one exception family dcp_ext raises for bad checkpoints and bad requests.

Every message names the checkpoint, the file and the key involved, so an operator can
act on it without a debugger.
"""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException


def rank_failure(error: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's ``CheckpointException`` wrapping (twice
    for a load inside a save, as ``dcp-ext convert`` runs), else ``error`` itself."""
    while isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    return error


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


class ReplicaMismatchError(CheckpointError, ValueError):
    """Ranks declare the same key and offsets with different data; DCP would keep one silently."""


class InvalidRequestError(CheckpointError, ValueError):
    """A state dict, placements, plans or options that cannot be saved or loaded as asked.

    Also a ``ValueError``: DCP's own planners raise that for the same mistakes, and
    callers catch it.
    """


class IgnoredOptionsError(InvalidRequestError):
    """Options given that the checkpoint read cannot use: ``names``, the ones it reads
    (``used``) and its ``kind``, as the API spells them, so that a front end that spells
    them otherwise (the CLI's flags) can say the same in its own words."""

    def __init__(self, message: str, names: tuple[str, ...] = (), used: tuple[str, ...] = (), kind: str = ""):
        super().__init__(message)
        self.names = names
        self.used = used
        self.kind = kind


class StorageFullError(CheckpointError):
    """A save ran out of space (ENOSPC, EDQUOT); names the checkpoint, the file and the bytes
    it needed. The failed save's files are removed; the previous checkpoint stays.

    The ``OSError`` is its ``__cause__``, also on the other ranks: DCP pickles a failing
    rank's exception to them, and plain pickling drops the cause.
    """

    def __reduce__(self) -> tuple:
        return _with_cause, (type(self), self.args, self.__cause__)


def _with_cause(cls: type[BaseException], args: tuple, cause: BaseException | None) -> BaseException:
    error = cls(*args)
    error.__cause__ = cause
    return error
