"""The restricted loader for non-tensor items: what is safe loads, what is not is named."""

from __future__ import annotations

import io
import os
import pickle
import pickletools

import numpy as np
import pytest
import torch

from dcp_ext.errors import CheckpointError, UnsafeCheckpointError
from dcp_ext.formats.safe_load import safe_torch_load
from dcp_ext.formats.safe_pickle import largest_memo_slot

PLAIN_DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
                np.float16, np.float32, np.float64, np.longdouble, np.complex64, np.complex128, np.longlong]


def saved(obj) -> bytes:
    """What DCP stores for a non-tensor item: ``torch.save`` of it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def same(got, want) -> bool:
    """Same kind (array or scalar), dtype, shape and values (``np.longlong`` loads as ``np.int64``)."""
    kind = np.ndarray if isinstance(want, np.ndarray) else np.generic
    return isinstance(got, kind) and got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)


@pytest.mark.parametrize("dtype", PLAIN_DTYPES, ids=lambda t: t.__name__)
def test_numpy_arrays_and_scalars_of_plain_dtypes_load(dtype):
    array = (np.arange(6).reshape(2, 3) % 2).astype(dtype)
    scalar = dtype(1)
    got = safe_torch_load(saved({"a": array, "s": scalar, "0d": np.array(1, dtype=dtype)}), "key 'x'")
    assert same(got["a"], array) and same(got["s"], scalar) and same(got["0d"], np.array(1, dtype=dtype))


@pytest.mark.parametrize("value", [b"", b"\x00abc", bytearray(b""), bytearray(b"xy")], ids=repr)
def test_bytes_and_bytearrays_load(value):
    got = safe_torch_load(saved({"v": value}), "key 'x'")
    assert type(got["v"]) is type(value) and got["v"] == value


def test_plain_containers_load():
    value = {"set": {1, 2}, "frozenset": frozenset({"a", 3}), "tuple": (1, [2.5, None]), "empty": frozenset()}
    got = safe_torch_load(saved(value), "key 'x'")
    assert got == value and type(got["frozenset"]) is frozenset and type(got["set"]) is set


class Payload:
    """Pickles as a call of ``func(*args)``."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


class Custom:
    """A harmless class nobody registered."""


@pytest.mark.parametrize(
    "obj, name",
    [
        (Payload(os.system, "true"), "posix.system"),
        (Payload(print, "x"), "builtins.print"),
        ({"k": [Custom()]}, "test_safe_load.Custom"),
        (np.array(["a"], dtype=object), "numpy.dtypes.ObjectDType"),
        (np.array([1], dtype="datetime64[s]"), "numpy.dtypes.DateTime64DType"),
    ],
    ids=["os.system", "print", "custom class", "object array", "datetime array"],
)
@pytest.mark.parametrize("encoding", ["torch.save", "raw pickle"])
def test_refusal_names_the_refused_global(obj, name, encoding):
    data = saved(obj) if encoding == "torch.save" else pickle.dumps(obj, protocol=2)
    with pytest.raises(UnsafeCheckpointError) as info:
        safe_torch_load(data, "file 'f.distcp' key 'x'")
    message = str(info.value)
    assert name in message and "file 'f.distcp' key 'x'" in message, message
    assert "Check the documentation" not in message


@pytest.mark.parametrize("data", [b"", b"garbage", saved({"a": 1})[:-30]], ids=["empty", "garbage", "truncated"])
def test_unreadable_bytes_are_a_checkpoint_error(data):
    with pytest.raises(CheckpointError, match="key 'x'"):
        safe_torch_load(data, "key 'x'")


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_largest_memo_slot_is_the_one_the_opcodes_name(protocol):
    """The fast opcode walk agrees with pickletools on every protocol (text PUT in 0,
    LONG_BINPUT past 255 objects in 1-3, MEMOIZE only from 4)."""
    obj = {"keys": [f"k{i}" for i in range(400)], "nested": [[b"x" * 300, 2.5, None, True, 10**40]] * 3,
           "text": "\u00fc" * 70_000, "size": torch.Size([2, 3]), "dtype": torch.float16}
    data = pickle.dumps(obj, protocol=protocol)
    named = [arg for op, arg, _ in pickletools.genops(data) if op.name in ("PUT", "LONG_BINPUT")]
    assert largest_memo_slot(data) == max(named, default=-1)
    for broken in (b"\xff" + data, data[:-1], data[: len(data) // 2], b"\x80\x04\x8e" + (1 << 40).to_bytes(8, "little") + b"."):
        with pytest.raises(ValueError):  # no opcode, no STOP, cut short, a length past the end (allocated first)
            largest_memo_slot(broken)
