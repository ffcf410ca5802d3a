"""One pickle stream from an object pickled earlier and what refers to it now.

A save's ``.metadata`` is DCP's ``Metadata`` pickled whole, though most of it, the
state dict's chunk lists, is the same object save after save wherever the global plan is
reused (``ShardSavePlanner(cache_plans=True)``, a training loop's saves): 10 of 15 ms on
the coordinator's critical path at 1,180 chunks, pickling the same lists again. Here an
object is pickled once (``pickled_prefix``) and each later pickle that contains it
(``dumps_after``) continues that stream: the later pickler starts from the earlier one's
memo, so the object and everything inside it are memo references. The result is one
ordinary protocol-4 pickle (without frames, which are optional) that ``pickle.load``
reads into the same object as a fresh ``pickle.dumps``.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

PROTOCOL = 4
_PROTO = pickle.PROTO + bytes([PROTOCOL])
_FRAME_HEADER = 9  # FRAME and its 8-byte length
_FRAME_SIZE_MIN = 4  # the C pickler writes a shorter last frame without a header


@dataclass(frozen=True, eq=False)
class PickledPrefix:
    """``obj`` pickled, ready to start a stream: its opcodes (left on the unpickler's stack,
    then popped; it stays in the memo) and the pickler's memo after it: the C pickler's own
    table (~40 bytes an entry, where a dict copy of it takes ~270), which holds every
    object it names, so no id in it can be reused by another object."""

    obj: Any
    opcodes: bytes
    memo: Any  # the pickler's memo proxy


def pickled_prefix(obj: Any) -> PickledPrefix:
    """``obj`` pickled once, for ``dumps_after``. The object must not change afterwards: a
    later stream would hold it as it was here."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, PROTOCOL)
    pickler.dump(obj)
    opcodes = _opcodes(buf.getvalue()) + pickle.POP
    buf.close()  # the pickler keeps its file: not the stream's bytes
    return PickledPrefix(obj, opcodes, pickler.memo)


def dumps_after(prefix: PickledPrefix, obj: Any) -> bytes:
    """The pickle of ``obj``, where every object of ``prefix`` (``prefix.obj`` itself and
    what it holds) is referenced rather than pickled again."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, PROTOCOL)
    pickler.memo = prefix.memo  # the table copied: the prefix's memo stays as it is
    pickler.dump(obj)
    return b"".join((_PROTO, prefix.opcodes, _opcodes(buf.getvalue()), pickle.STOP))


def _opcodes(stream: bytes) -> bytes:
    """The opcodes of a protocol-4 pickle ``pickle.Pickler`` wrote, without its PROTO,
    FRAME headers and STOP. The C pickler starts each frame at an opcode boundary with a
    FRAME header, except a last frame under 4 bytes; it writes a str or bytes of 64 KiB or
    more outside frames, starting with that object's opcode (never FRAME). Such a stream
    raises ValueError: the caller pickles afresh."""
    if not stream.startswith(_PROTO) or not stream.endswith(pickle.STOP):
        raise ValueError("not a protocol-4 pickle")
    view = memoryview(stream)
    parts, pos = [], len(_PROTO)
    while pos < len(stream):
        if stream[pos] == pickle.FRAME[0] and pos + _FRAME_HEADER <= len(stream):
            length = int.from_bytes(view[pos + 1 : pos + _FRAME_HEADER], "little")
            parts.append(view[pos + _FRAME_HEADER : pos + _FRAME_HEADER + length])
            pos += _FRAME_HEADER + length
        elif len(stream) - pos < _FRAME_SIZE_MIN:
            parts.append(view[pos:])
            pos = len(stream)
        else:
            raise ValueError(f"bytes outside a frame at {pos}")
    if pos != len(stream):
        raise ValueError("a frame runs past the end of the pickle")
    return b"".join(parts)[:-1]
