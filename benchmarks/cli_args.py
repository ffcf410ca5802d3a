"""argparse types the benchmarks share: a bad argument ends in one usage line before any
measuring, not in a traceback minutes later (an output file that cannot be written was
found only when the results were ready, and they were lost)."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

from dcp_ext.cli.arg_types import positive_int

__all__ = ["existing_dir", "output_file", "positive_float", "positive_int"]


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {value}")
    return value


def existing_dir(text: str) -> Path:
    """A directory a benchmark can make its work directory in (tried: permission bits do
    not tell, as root, that /proc refuses)."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: not an existing directory")
    try:
        os.rmdir(tempfile.mkdtemp(dir=path))
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: cannot make a directory in it ({exc.strerror})") from None
    return path


def output_file(text: str) -> Path:
    """A results file whose directory exists (made here) and can be written: a file is
    made beside it and removed, so a run is not lost to a path that takes no file."""
    path = Path(text)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: cannot create its directory ({exc.strerror})") from None
    if path.is_dir() or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text}: cannot be written")
    try:
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}."):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: cannot be written ({exc.strerror})") from None
    return path
