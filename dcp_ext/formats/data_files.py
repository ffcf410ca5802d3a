"""The data-file naming rule, written once, and what any file name in a checkpoint may be.

Ours: ``__{rank}_{token}_{n}.distcp``, the token new per save, so a save never overwrites
a file the live ``.metadata`` references and a failed save's files are known by their
token. Stock DCP: ``__{rank}_{n}.distcp``. Both start with the saving rank, which is how
a reader finds "its own" files (TP-replica locality) and how ``inspect --stats`` groups
bytes per rank.
"""

from __future__ import annotations

import re

from dcp_ext.errors import UnsafeCheckpointError

SUFFIX = ".distcp"
_NAME = re.compile(r"^__(?P<rank>\d+)_(?:(?P<token>[0-9a-f]{12})_)?(?P<n>\d+)\.distcp$")
_ANY = re.compile(r"^__(?P<rank>\d+)_[^/]*\.distcp$")  # also other writers' variants of the rule


def data_file_name(rank: int, token: str, n: int) -> str:
    return f"{rank_prefix(rank)}{token}_{n}{SUFFIX}"


def rank_prefix(rank: int) -> str:
    """What every data file written by ``rank`` starts with."""
    return f"__{rank}_"


def is_data_file(name: str) -> bool:
    return _ANY.match(name) is not None


def saving_rank(name: str) -> int | None:
    match = _ANY.match(name)
    return int(match["rank"]) if match else None


def save_token(name: str) -> str | None:
    """The save token in one of our data file names, else None (stock names have none)."""
    match = _NAME.match(name)
    return match["token"] if match else None


def check_relative_name(root: str, name: object, key: str = "") -> str:
    """Return ``name`` if it is a plain relative path inside the checkpoint, else raise."""
    where = f" (key {key!r})" if key else ""
    if not isinstance(name, str) or not name:
        raise UnsafeCheckpointError(f"{root}: file name {name!r}{where} is not a non-empty string")
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or "\x00" in name or ":" in parts[0] or any(
        p in ("", ".", "..") for p in parts
    ):
        raise UnsafeCheckpointError(
            f"{root}: file name {name!r}{where} escapes the checkpoint directory; "
            "expected a relative name such as '__0_0.distcp'"
        )
    return name
