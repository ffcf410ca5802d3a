"""Checkpoint text on the user's terminal.

Keys, file names and the messages naming them are the checkpoint author's strings. A
control character in one (a carriage return, a backspace, an escape sequence) would
rewrite what the terminal shows, so every command's output shows each one escaped, as
``repr`` writes it. A table cell escapes newlines and tabs too: a key must not break its row.
"""

from __future__ import annotations

_CONTROLS = [*range(0x20), *range(0x7F, 0xA0)]  # C0, DEL and C1: what a terminal acts on


def _escapes(keep: str) -> dict[int, str]:
    return {code: repr(chr(code))[1:-1] for code in _CONTROLS if chr(code) not in keep}


_LINE_ESCAPES = _escapes(keep="\n\t")
_CELL_ESCAPES = _escapes(keep="")


def for_terminal(text: str) -> str:
    """``text`` with control characters escaped, its newlines and tabs kept."""
    return text.translate(_LINE_ESCAPES)


def for_cell(text: str) -> str:
    """``text`` on one line of a table: every control character escaped."""
    return text.translate(_CELL_ESCAPES)
