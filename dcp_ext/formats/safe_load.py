"""``torch.load`` for non-tensor checkpoint content, never a plain unpickle.

Used for DCP bytes items (``ShardReader`` checks every one before a planner sees it,
``ShardLoadPlanner.load_bytes`` decodes them) and Megatron's ``common.pt`` / legacy
``model_optim_rng.pt``. Besides tensors and plain containers these hold an
``argparse.Namespace``, numpy arrays and scalars (RNG state, step counters), bytes and
Transformer Engine's ``io.BytesIO`` extra states, which ``weights_only=True`` refuses, so
we allow exactly those classes (nothing that can run code). Anything else is reported
with the source and the refused globals, instead of silently widening the allowlist.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import bisect
import io
import os
import pathlib
import pickle
import pickletools
import re
import signal
import types
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import torch

from dcp_ext.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from dcp_ext.formats.faults import shown
from dcp_ext.formats.stand_ins import MegatronValue, megatron_stand_ins, megatron_value

_MULTIARRAY = (getattr(np, "_core", None) or np.core).multiarray
_PLAIN_KINDS = "biufc"  # numpy dtype kinds: bool, int, uint, float, complex
_ATOMS = frozenset({int, float, complex, bool, str, bytes, bytearray, type(None)})


def _signal(value: Any) -> signal.Signals:
    """``signal.Signals(value)`` for a pickle naming the class: a member is shared by the whole
    process, and registered as a function its type is no allowlisted one, so a pickle's BUILD
    cannot rename the interpreter's ``SIGTERM``."""
    return signal.Signals(value)


def _posix_path(*parts: Any) -> pathlib.PosixPath:
    """``pathlib.PosixPath(*parts)`` from strings only, its private slots out of a pickle's reach."""
    if not all(isinstance(part, str) for part in parts):
        raise TypeError(f"a path is built from strings, not {[type(p).__name__ for p in parts]}")
    return pathlib.PosixPath(*parts)


# every plain bool / int / uint / float / complex width, platform aliases included
_PLAIN_DTYPE_CODES = "?" + np.typecodes["AllInteger"] + np.typecodes["AllFloat"]

SAFE_GLOBALS: list[Any] = [
    argparse.Namespace,
    io.BytesIO,  # Transformer Engine ``_extra_state`` (plain bytes, no code)
    bytes,  # ``b""`` pickles as ``bytes()`` (non-empty bytes use ``_codecs.encode``, allowed by torch)
    frozenset,  # a plain container like the ``set`` torch already allows
    types.SimpleNamespace,
    (_signal, "signal.Signals"),  # Megatron-LM's ``args.exit_signal``
    (_posix_path, "pathlib.PosixPath"),  # building one touches no file
    (_posix_path, "pathlib._local.PosixPath"),  # as Python 3.13 pickles it
    megatron_value,  # a Megatron class's stand-in saved again (``stand_ins``)
    np.ndarray,
    np.dtype,
    # numpy arrays, and scalars (a dtype and its raw bytes), under numpy 2's module name and numpy
    # 1's: Megatron-LM's RNG state pickled under numpy 1 names ``numpy.core.multiarray._reconstruct``
    *((getattr(_MULTIARRAY, name), f"{module}.{name}")
      for module in ("numpy._core.multiarray", "numpy.core.multiarray") for name in ("_reconstruct", "scalar")),
    # dtype classes are checked when a dtype is built: object, string, void (structured) and
    # datetime dtypes stay refused
    *dict.fromkeys(type(np.dtype(code)) for code in _PLAIN_DTYPE_CODES),
]
ALLOWED_TEXT = (
    "only tensors, plain containers (dict, list, tuple, set, frozenset), bytes, argparse.Namespace, "
    "types.SimpleNamespace, io.BytesIO, pathlib.PosixPath, signal.Signals members, numpy arrays and scalars of "
    "bool/int/uint/float/complex dtypes, and Megatron's own enums and configs (as stand-ins) are allowed"
)


def safe_torch_load(
    source: str | os.PathLike[str] | bytes | IO[bytes],
    where: str,
    mmap: bool = False,
    layout_only: bool = False,
    megatron: bool = False,
) -> Any:
    """Load a ``torch.save`` file, file object or byte string with ``weights_only=True`` and
    our allowlist.

    Megatron's own classes become inert stand-ins (``stand_ins``); ``megatron=True``
    (Megatron-LM's own files) also takes the generators of their RNG state so.

    ``mmap=True`` (local files) maps tensor storages instead of reading them.
    ``layout_only=True`` reads only the pickle and the zip directory: tensors come back on
    the meta device (shape, strides, dtype, no data), each storage knowing where its bytes
    sit in the file (``stored_at``), so a reader can then fetch just the byte ranges it needs.
    Both take each storage's bytes from where the pickle says, so both first load the layout
    and check every storage against its zip entry (``_check_storages``).
    """
    stream: Any = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    if layout_only or mmap:  # both take each storage's bytes from the file as its pickle claims them
        entries = _storage_entries(stream, where)
        state = _torch_load(source, stream, where, "meta", False, megatron)
        _check_storages(state, entries, where)
        if layout_only:
            return _plain_numpy(state, where)
        if hasattr(stream, "seek"):
            stream.seek(0)
    return _plain_numpy(_torch_load(source, stream, where, "cpu", mmap, megatron), where)


def _plain_numpy(state: Any, where: str) -> Any:
    """``state``, after refusing any numpy array or scalar of an object, string, structured
    or datetime dtype: an allowlisted ``numpy.dtype`` or ``ndarray`` call builds one without
    the dtype class the allowlist leaves out."""
    for path, value in _leaves(state):
        dtype = value if isinstance(value, np.dtype) else value.dtype if isinstance(value, (np.ndarray, np.generic)) else None
        if dtype is not None and dtype.kind not in _PLAIN_KINDS:
            raise UnsafeCheckpointError(f"{where}: {path} is a numpy value of dtype {shown(str(dtype))} ({ALLOWED_TEXT})")
    return state


def _allowed(megatron: bool) -> list[Any]:
    """Our allowlist for one load (the Megatron stand-ins yield to the user's own classes)."""
    taken = {_global_name(g) for g in torch.serialization.get_safe_globals()}
    return [*SAFE_GLOBALS, *megatron_stand_ins(taken, megatron)]


def _torch_load(source: Any, stream: Any, where: str, device: str, mmap: bool, megatron: bool) -> Any:
    try:
        with torch.serialization.safe_globals(_allowed(megatron)):
            return torch.load(stream, map_location=device, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        detail = ", ".join(refused_globals(source, megatron)) or _torch_reason(exc)
        raise UnsafeCheckpointError(  # torch.load takes the classes registered with it too
            f"{where}: refuses to unpickle {detail} ({ALLOWED_TEXT}); "
            "register classes you trust with torch.serialization.add_safe_globals"
        ) from None
    except Exception as exc:  # untrusted bytes: whatever torch.load trips over (IndexError, KeyError, struct.error...)
        raise CorruptCheckpointError(f"{where}: not a readable torch.save stream ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True)
class _Entry:
    """A storage's zip entry: where its header starts, how far its bytes may reach (the
    next entry's header or the central directory), its stored size and compression."""

    name: str
    header: int
    limit: int
    size: int
    compressed: bool


def _storage_entries(stream: Any, where: str) -> list[_Entry]:
    """The storage entries (``data/<key>``) of a ``torch.save`` zip archive, by header
    offset, after refusing an archive in big-endian byte order. A load that takes each
    storage's bytes from the file where the pickle says (meta-device layouts, ``mmap``)
    does not check them against the entry as torch's plain load does: a storage claiming
    more bytes than its entry, or a compressed entry, would give the bytes beside it (or
    the compressed ones), and torch byteswaps a big-endian archive's meta storages into
    a segmentation fault. Not a zip (torch's legacy pre-1.6 format): nothing to check."""
    opened = open(stream, "rb") if isinstance(stream, (str, os.PathLike)) else stream  # noqa: SIM115
    try:
        if not zipfile.is_zipfile(opened):
            return []
        opened.seek(0)
        with zipfile.ZipFile(opened) as archive:
            infos = sorted(archive.infolist(), key=lambda info: info.header_offset)
            limits = [info.header_offset for info in infos[1:]] + [archive.start_dir]
            order = next((info for info in infos if info.filename.rsplit("/", 1)[-1] == "byteorder"), None)
            text = b"little" if order is None else _entry_bytes(archive, opened, order)
            if text != b"little":
                raise CheckpointError(
                    f"{where}: its byteorder record says {shown(text.decode(errors='replace'))}; this reader reads "
                    "little-endian files only"
                )
    except CheckpointError:
        raise
    except Exception as exc:  # untrusted bytes: whatever zipfile trips over (names, versions, offsets)
        raise CorruptCheckpointError(f"{where}: not a readable torch.save archive ({type(exc).__name__}: {exc})") from None
    finally:
        if opened is not stream:
            opened.close()
        else:
            opened.seek(0)
    return [
        _Entry(info.filename, info.header_offset, limit, info.file_size, info.compress_type != zipfile.ZIP_STORED)
        for info, limit in zip(infos, limits)
        if "/data/" in f"/{info.filename}"
    ]


def _entry_bytes(archive: zipfile.ZipFile, stream: Any, info: zipfile.ZipInfo) -> bytes:
    """A small entry's bytes; an uncompressed one read past its local header without
    checking a CRC-32 (``torch.save`` leaves them out under ``set_crc32_options(False)``)."""
    if info.file_size > 64:
        return b"(longer than any byte order)"
    if info.compress_type != zipfile.ZIP_STORED:
        return archive.read(info.filename)
    stream.seek(info.header_offset)
    header = stream.read(30)
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"bad local header of entry {info.filename!r}")
    stream.seek(info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little"))
    return stream.read(info.file_size)


def _check_storages(state: Any, entries: list[_Entry], where: str) -> None:
    """Every tensor storage of a meta-device load lies inside one uncompressed storage
    entry that holds exactly the bytes its pickle claims, as torch's plain load demands."""
    if not entries:
        return
    headers = [entry.header for entry in entries]
    for path, tensor in _leaves(state):
        if not isinstance(tensor, torch.Tensor):
            continue
        storage = tensor.untyped_storage()
        offset, nbytes = stored_at(tensor, where), storage.nbytes()
        if not nbytes:  # nothing is read (an empty entry's data offset is the next entry's header)
            continue
        at = bisect.bisect_right(headers, offset) - 1
        entry = entries[at] if at >= 0 else None
        if entry is None:
            fault = "no storage entry starts before it"
        elif entry.compressed:
            fault = f"its entry {entry.name!r} is compressed"
        elif entry.size != nbytes:
            fault = f"its entry {entry.name!r} holds {entry.size} bytes"
        elif offset < entry.header + 30 + len(entry.name.encode()) or offset + nbytes > entry.limit:
            fault = f"that is not within its entry {entry.name!r} (bytes {entry.header} to {entry.limit})"
        else:
            continue
        raise CorruptCheckpointError(
            f"{where}: tensor {path} claims a storage of {nbytes} bytes at byte {offset}, but {fault}; "
            "torch.save stores each storage uncompressed, in an entry of exactly its size"
        )


def _leaves(state: Any) -> Iterator[tuple[str, Any]]:
    """(path, value) of every value in a loaded state that holds no others, through every
    container the allowlist admits (dicts, lists, tuples, sets, both namespaces, the Megatron
    stand-ins' arguments and state), walked without recursion, each container once."""
    stack: list[tuple[str, Any]] = [("", state)]
    seen: set[int] = set()
    while stack:
        path, value = stack.pop()
        children = _children(value)
        if children is None:
            yield shown(path or "(the whole state)"), value
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        stack.extend(reversed([  # in order; plain values hold nothing to check (a sampler's million indices)
            (f"{path}.{key}" if path else str(key), child) for key, child in children if type(child) not in _ATOMS
        ]))


def _children(value: Any) -> Iterable[tuple[Any, Any]] | None:
    """(key, child) pairs of a container the allowlist admits; None for anything else."""
    if isinstance(value, dict):
        return value.items()
    if isinstance(value, (list, tuple, set, frozenset)):
        return enumerate(value)
    if isinstance(value, (argparse.Namespace, types.SimpleNamespace)):
        return vars(value).items()
    if isinstance(value, MegatronValue):
        return (("args", value.args), ("state", value.state))
    return None


def stored_at(tensor: torch.Tensor, where: str) -> int:
    """Byte offset in its file of the storage of a tensor loaded with ``layout_only=True``.

    torch records it as ``UntypedStorage._checkpoint_offset`` when it loads a zip file onto
    the meta device (what ``torch.load(mmap=True)`` and fake-tensor loading build on); it is
    not public API, so a torch that stops setting it fails here, loudly, never with wrong
    offsets (tests/integration/test_megatron_legacy.py checks the offsets against the zip directory).
    """
    offset = getattr(tensor.untyped_storage(), "_checkpoint_offset", None)
    if not isinstance(offset, int) or offset < 0:
        raise CorruptCheckpointError(
            f"{where}: torch {torch.__version__} did not report where this tensor's bytes are stored "
            "(UntypedStorage._checkpoint_offset of a meta-device load); this reader needs it"
        )
    return offset


def safe_load_bytes(data: bytes, where: str, opt_out: str) -> Any:
    """Decode a DCP bytes item with ``safe_torch_load``; a refusal says how to trust it
    (``opt_out``: the switch of the caller, e.g. ``ShardReader(allow_unsafe_bytes=True)``)."""
    try:
        return safe_torch_load(data, where)
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{exc}, or pass {opt_out} for a checkpoint you trust") from None


class CheckedBytes(io.BytesIO):
    """A bytes item's stored bytes with the object the restricted loader made of them:
    ``ShardReader`` checks every bytes item before a planner sees it, and a planner that
    decodes with the same loader takes that object (``decode_bytes_item``) instead of
    unpickling the item again (a sampler's two million indices: seconds, twice)."""

    def __init__(self, data: bytes, decoded: Any):
        super().__init__(data)
        self.data = data
        self.decoded = decoded


def decode_bytes_item(value: io.BytesIO, where: str, opt_out: str) -> Any:
    """The object of a bytes item: the one checked by the reader when ``value`` carries it
    and its bytes were not rewritten since, else decoded here (``safe_load_bytes``)."""
    data = value.getvalue()
    if isinstance(value, CheckedBytes) and data is value.data:
        return value.decoded
    return safe_load_bytes(data, where, opt_out)


def refused_globals(source: str | os.PathLike[str] | bytes, megatron: bool = False) -> list[str]:
    """The globals a ``torch.save`` file or raw pickle names that the loader does not allow,
    found by reading its opcodes (nothing is imported or called). A hint for messages."""
    allowed = _allowed_paths(megatron)
    try:
        found = [name for stream in _pickles(source) for name in _globals_in(stream)]
    except Exception:  # a damaged zip (zipfile raises ValueError too): no hint, the refusal stands
        return []
    return list(dict.fromkeys(name for name in found if name not in allowed))


def _pickles(source: str | os.PathLike[str] | bytes) -> Iterator[IO[bytes]]:
    """The pickle streams of a source: each ``data.pkl`` of a zip record, else the bytes themselves."""
    opened = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else open(source, "rb")  # noqa: SIM115
    with opened:
        if not zipfile.is_zipfile(opened):
            opened.seek(0)
            yield opened
            return
        with zipfile.ZipFile(opened) as archive:
            for name in archive.namelist():
                if name == "data.pkl" or name.endswith("/data.pkl"):
                    yield io.BytesIO(archive.read(name))


def _globals_in(stream: IO[bytes]) -> Iterator[str]:
    """``module.name`` of every GLOBAL / STACK_GLOBAL in the consecutive pickles of ``stream``
    (legacy ``torch.save`` files hold several); stops at the first bytes that are no pickle."""
    strings: list[str] = []
    memo: dict[int, Any] = {}
    try:
        while True:
            for op, arg, _ in pickletools.genops(stream):
                if op.name == "GLOBAL":
                    yield _py3_name(*str(arg).split(" ", 1))
                elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                    yield _py3_name(strings[-2], strings[-1])
                elif op.name in ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"):
                    memo[len(memo) if arg is None else int(arg)] = strings[-1] if strings else None
                elif op.name in ("BINGET", "LONG_BINGET", "GET") and isinstance(memo.get(int(arg)), str):
                    strings.append(memo[int(arg)])
                elif isinstance(arg, str) and "UNICODE" in op.name:
                    strings.append(arg)
    except (ValueError, EOFError, IndexError, pickle.UnpicklingError, UnicodeDecodeError):
        return


def _py3_name(module: str, name: str) -> str:
    """``module.name`` as unpickling resolves it (protocol 2 writes ``__builtin__.print``)."""
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"


def _allowed_paths(megatron: bool) -> set[str]:
    """Full names of every global ``safe_torch_load`` accepts: torch's defaults, ours, the user's."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals

        paths = set(_get_allowed_globals())
    except ImportError:  # a hint only: report more names rather than fail
        paths = set()
    return paths | {_global_name(entry) for entry in [*_allowed(megatron), *torch.serialization.get_safe_globals()]}


def _global_name(entry: Any) -> str:
    """The name a pickle gives an allowlist entry: ``(object, "module.name")`` as
    ``add_safe_globals`` accepts, or an object's own module and name."""
    if isinstance(entry, tuple):
        return entry[1]
    return f"{getattr(entry, '__module__', '')}.{getattr(entry, '__qualname__', '')}"


def _torch_reason(exc: Exception) -> str:
    """The refused class from torch's message, else its reason line (never its boilerplate)."""
    text = str(exc)
    classes = re.findall(r"<class '([^']+)'>", text)
    if classes:
        return ", ".join(dict.fromkeys(classes))
    reason = text.split("WeightsUnpickler error:", 1)[-1] if "WeightsUnpickler error:" in text else ""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("Check the documentation")]
    return lines[0] if lines else text.strip().splitlines()[0]
