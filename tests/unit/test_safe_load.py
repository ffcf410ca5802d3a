"""The restricted loader for non-tensor items: what is safe loads, what is not is named."""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pathlib
import pickle
import pickletools
import signal
import struct
import types
import zipfile

import numpy as np
import pytest
import torch

from dcp_ext.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from dcp_ext.formats.safe_load import safe_torch_load
from dcp_ext.formats.safe_pickle import largest_memo_slot
from dcp_ext.formats.stand_ins import MegatronValue, megatron_value

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


def renamed_globals(obj, renames: dict[str, str]) -> bytes:
    """``torch.save`` of ``obj`` in torch's legacy (non-zip) stream, its pickles naming each
    global ``module.name`` of ``renames`` as the value says (GLOBAL opcodes are text lines)."""
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=False, pickle_protocol=2)
    data = buf.getvalue()
    for old, new in renames.items():
        line = "c{}\n{}\n".format(*old.rsplit(".", 1)).encode()
        assert line in data, old
        data = data.replace(line, "c{}\n{}\n".format(*new.rsplit(".", 1)).encode())
    return data


@pytest.mark.parametrize("modules", [("numpy._core.multiarray", "numpy.core.multiarray"),
                                     ("numpy.core.multiarray", "numpy._core.multiarray")],
                         ids=["written by numpy 1", "written by numpy 2"])
def test_numpy_arrays_load_under_either_numpy_module_name(modules):
    """numpy 1 pickles arrays and scalars as ``numpy.core.multiarray._reconstruct`` /
    ``scalar``, numpy 2 as ``numpy._core...``: Megatron-LM's RNG state comes in both."""
    state = np.random.RandomState(7).get_state()
    value = {"np_rng_state": state, "scalar": np.float32(2.5)}
    natural = np.ndarray.__reduce__(np.zeros(1))[0].__module__  # where this numpy defines _reconstruct
    old, new = modules if natural == modules[0] else modules[::-1]
    renames = {f"{old}.{name}": f"{new}.{name}" for name in ("_reconstruct", "scalar")}
    got = safe_torch_load(renamed_globals(value, renames), "key 'x'")
    assert got["np_rng_state"][0] == "MT19937" and np.array_equal(got["np_rng_state"][1], state[1])
    assert same(got["scalar"], np.float32(2.5))


def test_stdlib_values_in_args_load():
    """What Megatron-LM's ``args`` holds besides plain values: a signal, paths, a SimpleNamespace."""
    value = {"exit_signal": signal.SIGTERM, "save": pathlib.PosixPath("/ckpt/run"), "ns": types.SimpleNamespace(a=1)}
    got = safe_torch_load(saved(value), "key 'x'")
    assert got == value and got["exit_signal"] is signal.SIGTERM


class _Backend(enum.Enum):
    flash = 1
    auto = 5


@dataclasses.dataclass
class _Config:
    lr: float
    betas: tuple


def as_megatron(obj) -> bytes:
    """``obj`` saved with our ``_Backend`` and ``_Config`` named as Megatron names its classes,
    as a file written where megatron-core is installed names them (tests/fixtures/megatron
    holds such files written by Megatron itself)."""
    return renamed_globals(obj, {
        f"{__name__}._Backend": "megatron.core.transformer.enums.AttnBackend",
        f"{__name__}._Config": "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    })


@pytest.mark.parametrize("megatron_file", [True, False], ids=["Megatron file", "DCP bytes item"])
def test_megatron_classes_load_as_inert_stand_ins(megatron_file):
    """In Megatron-LM's rank files and ``common.pt``, and in the DCP bytes items of its
    torch_dist / torch_dcp checkpoints (``common_state``, ``args``)."""
    data = as_megatron({"attention_backend": _Backend.auto, "config": _Config(1e-3, (0.9, 0.95))})
    got = safe_torch_load(data, "f.pt", megatron=megatron_file)
    backend, config = got["attention_backend"], got["config"]
    assert isinstance(backend, MegatronValue) and backend.type_name == "megatron.core.transformer.enums.AttnBackend"
    assert backend.args == (5,) and repr(backend) == "megatron.core.transformer.enums.AttnBackend(5)"
    assert config.type_name == "megatron.core.optimizer.optimizer_config.OptimizerConfig"
    assert config.state == {"lr": 1e-3, "betas": (0.9, 0.95)}
    # saved again (a converted checkpoint's args), it loads with the plain allowlist, equal
    again = safe_torch_load(saved(got), "key 'x'")
    assert again == got and hash(again["attention_backend"]) == hash(backend)


def test_a_megatron_class_the_user_registered_is_used_instead_of_the_stand_in():
    data = as_megatron({"attention_backend": _Backend.auto, "config": _Config(1e-3, (0.9, 0.95))})
    with torch.serialization.safe_globals([(_Backend, "megatron.core.transformer.enums.AttnBackend")]):
        got = safe_torch_load(data, "f.pt", megatron=True)
    assert got["attention_backend"] is _Backend.auto


@pytest.mark.parametrize("args", [(1, (), None), ("x", [1], None)], ids=["name not a string", "args not a tuple"])
def test_a_stand_in_rebuilt_from_a_hostile_pickle_is_refused(args):
    with pytest.raises(CheckpointError, match="key 'x'"):
        safe_torch_load(pickle.dumps(Payload(megatron_value, *args), protocol=2), "key 'x'")


def test_a_generator_is_a_stand_in_in_megatron_files_only():
    """Megatron's RNG state may hold CUDA generators, which a machine without a GPU cannot
    build; anywhere else a ``torch.Generator`` is the user's own and stays refused, never
    silently replaced by a stand-in."""
    data = saved({"rng": torch.Generator().manual_seed(3)})
    with pytest.raises(UnsafeCheckpointError, match="torch._C.Generator"):
        safe_torch_load(data, "key 'x'")
    got = safe_torch_load(data, "f.pt", megatron=True)["rng"]
    assert isinstance(got, MegatronValue) and got.type_name == "torch._C.Generator"



class _Reduced:
    """Pickles as ``func(*args)`` followed by a BUILD of ``state``."""

    def __init__(self, func, args, state):
        self.func, self.args, self.state = func, args, state

    def __reduce__(self):
        return self.func, self.args, self.state


@pytest.mark.parametrize("megatron_file", [False, True], ids=["DCP bytes item", "Megatron file"])
def test_a_pickle_cannot_rename_the_interpreters_signals(megatron_file):
    """``signal.Signals(15)`` is the process's own SIGTERM: a BUILD on it renamed SIGTERM for
    the whole process (the next save of Megatron's ``args.exit_signal`` then stored SIGKILL)."""
    data = saved({"exit_signal": _Reduced(signal.Signals, (15,), {"_name_": "SIGKILL", "_value_": 9})})
    with pytest.raises(CheckpointError, match="key 'x'"):
        safe_torch_load(data, "key 'x'", megatron=megatron_file)
    assert signal.SIGTERM.name == "SIGTERM" and signal.SIGTERM.value == 15


@pytest.mark.parametrize("value", [
    _Reduced(pathlib.PosixPath, ("/a",), (None, {"_str": "/etc/passwd"})),
    _Reduced(pathlib.PosixPath, ("/a",), (None, {"_str": 5})),
    Payload(pathlib.PosixPath, b"/a"),
], ids=["forged string", "broken string", "bytes part"])
def test_a_path_is_built_from_strings_only_and_takes_no_state(value):
    with pytest.raises(CheckpointError, match="key 'x'"):
        safe_torch_load(saved({"save": value}), "key 'x'")


@pytest.mark.parametrize("code", ["O", "<U2", "<M8[s]", "V8"])
def test_numpy_dtypes_outside_the_plain_kinds_are_refused_however_built(code):
    """An allowlisted ``numpy.dtype`` call builds any dtype without the dtype class the
    allowlist leaves out (a dtype BUILD needs it; an array's state does not)."""
    dtype = np.dtype(code)
    for value in (Payload(np.dtype, code), np.zeros(2, dtype=dtype) if code != "O" else np.array(["a", 7], dtype=object)):
        data = saved({"v": value})
        with pytest.raises(UnsafeCheckpointError, match="key 'x'"):
            safe_torch_load(data, "key 'x'")


def _storage_claiming(container, claim: int) -> bytes:
    """``torch.save`` of ``{"secret": 16 floats, "held": container}`` (container holding a
    4-float tensor), that tensor's storage then claiming ``claim`` elements from byte 4 of its
    entry: reading it maps the bytes beyond its entry."""
    buf = io.BytesIO()
    torch.save({"secret": torch.arange(100, 116, dtype=torch.float32), "held": container}, buf)
    src, out = zipfile.ZipFile(io.BytesIO(buf.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("/data.pkl"):
                key = data.index(b"X\x01\x00\x00\x001")  # storage '1': the held tensor's
                numel = data.index(b"K\x04t", key)
                offset = data.index(b"QK\x00K\x04", numel)
                data = (data[:numel] + b"J" + struct.pack("<i", claim) + b"t" + data[numel + 3 : offset]
                        + b"QJ" + struct.pack("<i", 1) + b"K\x04" + data[offset + 5 :])
            archive.writestr(info.filename, data)
    return out.getvalue()


@pytest.mark.parametrize("container", [
    types.SimpleNamespace(t=torch.zeros(4)),
    megatron_value("megatron.core.optimizer.optimizer_config.OptimizerConfig", (), {"t": torch.zeros(4)}),
], ids=["SimpleNamespace", "Megatron stand-in"])
def test_tensors_inside_every_admitted_container_are_checked_against_their_entry(tmp_path, container):
    """A memory-mapped or layout-only load takes a storage's bytes from where its pickle says;
    a tensor in a SimpleNamespace or a stand-in's state escaped that check and read beyond its entry."""
    path = tmp_path / "model_optim_rng.pt"
    path.write_bytes(_storage_claiming(container, 160))
    for kwargs in ({"mmap": True}, {"layout_only": True}):
        with pytest.raises(CorruptCheckpointError, match="claims a storage of 640 bytes"):
            safe_torch_load(str(path), "model_optim_rng.pt", megatron=True, **kwargs)


def test_a_stand_in_holding_itself_prints():
    value = megatron_value("megatron.core.rerun_state_machine.RerunState", (), None)
    value.state = {"self": value}
    assert repr(value) == "megatron.core.rerun_state_machine.RerunState({'self': ...})"
