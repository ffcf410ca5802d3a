"""Helpers every test layer shares: data to save, garbage destinations, bit-exact checks.

One place for what tests kept re-typing: deterministic tensors and state dicts
(plain and DTensor), destinations that start from garbage (a load that skips an item
cannot pass), comparisons that name the first differing element (usable inside gloo
workers, where pytest does not rewrite asserts), one-process save/load through our
storage, object plans for planner tests, and the process's memory.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import crc32c
import fsspec
import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.formats.index import StoredItem
from dcp_ext.formats.torch_record import TensorLayout, parse_tensor_record
from dcp_ext.planning.global_plan import GlobalPlan, plan_globally
from dcp_ext.planning.local_plan import assigned_items
from dcp_ext.planning.plan_table import table_from_items
from dcp_ext.storage.reader import ReadStats

FIXTURES = Path(__file__).resolve().parent / "fixtures"  # committed files of real producers
GARBAGE = -7777  # no test data holds it: an unwritten destination element shows


# -- data --------------------------------------------------------------------------------
def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Deterministic values of any plain dtype; narrow integers stay non-negative, clear of
    ``GARBAGE``, wide ones (int32, int64) take both signs."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    high = min(torch.iinfo(dtype).max, 2**40)
    low = -high if high >= 2**31 - 1 and torch.iinfo(dtype).min < 0 else 0  # wide: GARBAGE ~never drawn
    return torch.randint(low, high, shape, generator=generator, dtype=dtype)


def make_globals(specs: Mapping[str, tuple], seed: int) -> dict[str, torch.Tensor]:
    """Global tensors for ``{name: (shape, dtype, ...)}``, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    return {name: random_tensor(spec[0], spec[1], g) for name, spec in specs.items()}


def distributed_state(
    glob: Mapping[str, torch.Tensor], mesh, placements: Mapping[str, Any], *, destination: bool
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(state_dict, expected)`` for this rank: the names in ``placements`` as DTensors on
    ``mesh`` (a placement or a list of them), the rest of ``glob`` as plain tensors.

    ``destination=True`` fills every tensor with garbage; ``expected`` holds what a correct
    load leaves (a DTensor's local shard).
    """
    state: dict[str, Any] = {}
    expected: dict[str, torch.Tensor] = {}
    for name, tensor in glob.items():
        source = garbage_like(tensor) if destination else tensor.clone()
        if name in placements:
            placement = placements[name]
            placement = list(placement) if isinstance(placement, (list, tuple)) else [placement]
            state[name] = distribute_tensor(source, mesh, placement, src_data_rank=None)
            expected[name] = distribute_tensor(tensor, mesh, placement, src_data_rank=None).to_local().clone()
        else:
            state[name] = source
            expected[name] = tensor.clone()
    return state, expected


def sample_state(seed: int = 0) -> dict:
    """A small nested state dict: fp32, bf16, int64, fp16 tensors and plain objects."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 48, generator=g),
        "b": torch.randn(48, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1000, (33,), generator=g),
        "nested": {"h": torch.randn(16, 8, generator=g).half(), "step": seed},
        "name": f"ckpt-{seed}",
    }


def evict(path: str | os.PathLike[str]) -> None:
    """Drop a file's pages from the page cache (its own, clean pages: no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def garbage_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor of t's dtype and shape whose every element differs from test data
    (``GARBAGE``; for bool the negation of ``t``)."""
    if t.dtype == torch.bool:
        return torch.logical_not(t)
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return torch.full(t.shape, float(GARBAGE), dtype=torch.float32).to(t.dtype)
    if torch.iinfo(t.dtype).min > GARBAGE:  # unsigned: the largest value instead
        return torch.full(t.shape, torch.iinfo(t.dtype).max, dtype=t.dtype)
    return torch.full(t.shape, GARBAGE, dtype=t.dtype)


def garbage(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A new garbage tensor (see ``garbage_like``)."""
    return garbage_like(torch.empty(shape, dtype=dtype))


def garbage_state(state: dict) -> dict:
    """Load destinations shaped like ``state``: tensors of garbage, objects emptied."""
    out: dict = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = garbage_state(value)
        elif isinstance(value, torch.Tensor):
            out[key] = garbage_like(value)
        else:
            out[key] = type(value)()
    return out


# -- bit-exact comparisons (readable without pytest's assert rewriting) --------------------
def assert_tensor_equal(actual: Any, expected: Any, name: str = "tensor") -> None:
    """Bit-exact equality of dtype, shape and every element's bytes.

    A DTensor ``actual`` is compared by its local shard; ``expected`` is then
    the expected local shard.
    """
    if isinstance(actual, DTensor):
        actual = actual.to_local()
    if isinstance(expected, DTensor):
        expected = expected.to_local()
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{name}: expected a tensor, got {type(actual).__name__}: {actual!r}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype} != expected {expected.dtype}")
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.numel() == 0:
        return
    if not torch.equal(_bits(actual), _bits(expected)):
        raise AssertionError(f"{name}: values differ{_first_diff(actual, expected)}")


def assert_state_dict_equal(actual: Any, expected: Any, path: str = "") -> None:
    """Recursive bit-exact comparison of nested dicts/lists of tensors and objects."""
    where = path or "<root>"
    if isinstance(expected, torch.Tensor):
        assert_tensor_equal(actual, expected, where)
    elif isinstance(expected, dict):
        if not isinstance(actual, dict):
            raise AssertionError(f"{where}: expected a dict, got {type(actual).__name__}")
        if set(actual) != set(expected):
            raise AssertionError(
                f"{where}: keys differ: missing {sorted(map(str, set(expected) - set(actual)))}, "
                f"extra {sorted(map(str, set(actual) - set(expected)))}"
            )
        for k in expected:
            assert_state_dict_equal(actual[k], expected[k], f"{path}.{k}" if path else str(k))
    elif isinstance(expected, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in expected):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            raise AssertionError(f"{where}: expected {type(expected).__name__} of {len(expected)}, got {actual!r}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_state_dict_equal(a, e, f"{where}[{i}]")
    elif type(actual) is not type(expected) or actual != expected:
        raise AssertionError(
            f"{where}: {actual!r} ({type(actual).__name__}) != expected {expected!r} ({type(expected).__name__})"
        )


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    ne = _bits(a) != _bits(b)  # bit patterns: NaNs and -0.0 count as the values they are
    idx = ne.nonzero()
    if idx.numel() == 0:
        return ""
    first = tuple(int(i) for i in idx[0])
    return f"; {int(ne.sum())} elements differ, first at {first}: {a[first].item()!r} vs {b[first].item()!r}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


# -- one-process save and load through our storage ----------------------------------------
def save(state: dict, path, **writer_kwargs) -> None:
    dcp.save(state, storage_writer=ShardWriter(path, **writer_kwargs), planner=ShardSavePlanner())


def load(like: dict, path, planner: LoadPlanner | None = None, **reader_kwargs) -> tuple[dict, ShardReader]:
    """Load into garbage shaped like ``like`` through ShardReader (and ShardLoadPlanner unless given)."""
    out = garbage_state(like)
    reader = ShardReader(path, **reader_kwargs)
    dcp.load(out, storage_reader=reader, planner=planner or ShardLoadPlanner())
    return out, reader


def load_error(like: dict, path, planner: LoadPlanner | None = None, **reader_kwargs) -> BaseException:
    """Load expecting failure; return the exception the rank raised inside DCP.

    DCP wraps a rank's exception in CheckpointException (a BaseException) together with
    its traceback; tests assert on the original.
    """
    try:
        load(like, path, planner, **reader_kwargs)
    except CheckpointException as exc:
        return next(iter(exc.failures.values()))[0]
    raise AssertionError(f"loading {path} unexpectedly succeeded")


def load_tensors(path, want: dict[str, torch.Tensor], extra: tuple[str, ...] = (), **reader_kwargs) -> tuple[dict, ShardReader]:
    """Load every key of ``want`` (plus bytes items ``extra``) into garbage plain tensors;
    check them bit-exact. Returns the loaded state and the reader (for its stats)."""
    state: dict = {k: garbage_like(v) for k, v in want.items()}
    state.update({k: None for k in extra})
    reader = ShardReader(path, **reader_kwargs)
    dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner())
    for key, value in want.items():
        assert_tensor_equal(state[key], value, key)
    return state, reader


def cycled_placement(n: int, tensor: torch.Tensor):
    """Shard(0) / Shard(last) / Replicate in turn over keys, so cuts fall across stored splits."""
    choice = n % 3
    if choice == 2 or tensor.dim() == 0:
        return Replicate()
    return Shard(0 if choice == 0 else tensor.dim() - 1)


def dtensor_load_job(rank: int, world: int, path: str, want: dict[str, torch.Tensor], two_stage: bool = False) -> ReadStats:
    """gloo worker: load ``want`` into garbage DTensors on a 1-D mesh (``cycled_placement``),
    check this rank's shards bit-exact; returns the reader's stats."""
    mesh = init_device_mesh("cpu", (world,))
    specs = {k: cycled_placement(n, v) for n, (k, v) in enumerate(sorted(want.items()))}
    state = {k: distribute_tensor(garbage_like(want[k]), mesh, [p], src_data_rank=None) for k, p in specs.items()}
    reader = ShardReader(path, two_stage=two_stage)
    dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner())
    for key, p in specs.items():
        expected = distribute_tensor(want[key], mesh, [p], src_data_rank=None).to_local()
        assert_tensor_equal(state[key].to_local(), expected, f"rank {rank}/{world} {key} {p}")
    return reader.stats


# -- raw records: the reader's byte ranges without a checkpoint ---------------------------
READ_BOXES = [  # (offsets, lengths) to read of a (64, 48) tensor
    ((0, 0), (64, 48)),  # whole chunk
    ((16, 0), (32, 48)),  # rows: one contiguous run
    ((0, 24), (64, 24)),  # right half of every row: many runs
    ((5, 3), (7, 2)),  # tiny runs: read as one span
    ((63, 47), (1, 1)),
]


DESTINATION_KINDS = ["contiguous", "view", "other_dtype"]


def box_destination(kind: str, lengths: tuple[int, ...]) -> torch.Tensor:
    """Garbage to read a float32 box into: contiguous, a strided view into a larger
    tensor, or float64 (a cast on the way in)."""
    if kind == "contiguous":
        return garbage(lengths)
    if kind == "view":
        return garbage((lengths[0] + 3, lengths[1] + 5))[1 : 1 + lengths[0], 2 : 2 + lengths[1]]
    return garbage(lengths, torch.float64)


def write_records(directory: Path, tensors: list[torch.Tensor], name: str = "f.distcp") -> list[tuple[StoredItem, TensorLayout]]:
    """Write ``torch.save`` records back to back (100 bytes of padding before each) into one
    file; the index entries carry each record's CRC32C, as ``ShardWriter`` writes them."""
    data = bytearray()
    spans = []
    for tensor in tensors:
        data += b"x" * 100
        buf = io.BytesIO()
        torch.save(tensor, buf)
        spans.append((len(data), buf.getvalue()))
        data += buf.getvalue()
    (Path(directory) / name).write_bytes(bytes(data))
    return [
        (
            StoredItem(name, start, len(record), checksum=crc32c.crc32c(record)),
            parse_tensor_record(len(record), lambda o, n, r=record: r[o : o + n], name),
        )
        for start, record in spans
    ]


# -- plans without processes --------------------------------------------------------------
def local_save_plans(state: dict) -> list[SavePlan]:
    """The SavePlan a rank of a one-rank job makes for ``state``: real DCP objects, the kind
    megatron-core stores inside ``.metadata``."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    return [planner.create_local_plan()]


def shard_item(fqn: str, offsets, sizes, shape, dtype=torch.float32) -> WriteItem:
    """A SHARD WriteItem as a rank's planner makes it."""
    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    return WriteItem(
        index=MetadataIndex(fqn, chunk.offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=dtype), size=torch.Size(shape)),
    )


def global_plan(plans: list[SavePlan], **kwargs) -> GlobalPlan:
    """The coordinator's plan for these ranks' plans."""
    return plan_globally([table_from_items(p.items) for p in plans], **kwargs)


def deduped(plans: list[SavePlan], **kwargs) -> list[SavePlan]:
    """What each rank writes after the coordinator's planning."""
    result = global_plan(plans, **kwargs)
    return [SavePlan(assigned_items(p.items, a)) for p, a in zip(plans, result.assignments)]


def digest_rows(*digests: bytes | None) -> np.ndarray:
    """Chunk-digest rows (16 bytes each, None for no digest) as ranks send them."""
    out = np.zeros((len(digests), 2), np.uint64)
    for row, d in enumerate(digests):
        if d is not None:
            out[row] = np.frombuffer(d.ljust(16, b"."), np.uint64)
    return out


# -- storage that counts what it serves ---------------------------------------------------
class MeteredFileSystem(LocalFileSystem):
    """The real local filesystem behind fsspec (``metered://``), counting per path the bytes
    ranged reads return (``fetched``: ``cat_file``, which ``cat_ranges`` calls) and the bytes
    read through opened files (``streamed``). Counts are per process."""

    protocol = "metered"
    fetched: dict[str, int] = {}
    streamed: dict[str, int] = {}

    def cat_file(self, path, start=None, end=None, **kwargs):  # noqa: ANN001, ANN201
        data = super().cat_file(path, start=start, end=end, **kwargs)
        self.fetched[path] = self.fetched.get(path, 0) + len(data)
        return data

    def _open(self, path, mode="rb", **kwargs):  # noqa: ANN001, ANN201
        handle = super()._open(path, mode, **kwargs)
        if "r" in mode:
            read = handle.read

            def counted(*args: Any) -> bytes:
                data = read(*args)
                self.streamed[path] = self.streamed.get(path, 0) + len(data)
                return data

            handle.read = counted
        return handle

    @classmethod
    def served(cls, name: str) -> int:
        """Bytes served of files called ``name``, both ways."""
        return sum(n for counts in (cls.fetched, cls.streamed) for path, n in counts.items() if Path(path).name == name)

    @classmethod
    def reset(cls) -> None:
        cls.fetched.clear()
        cls.streamed.clear()


fsspec.register_implementation("metered", MeteredFileSystem, clobber=True)


# -- memory --------------------------------------------------------------------------------
def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident set (or another ``/proc/self/status`` field, e.g. VmHWM)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


class RunsCode:
    """Unpickling calls os.system (touching ``canary``): what a hostile checkpoint's bytes
    item would do."""

    def __init__(self, canary: str):
        self.canary = canary

    def __reduce__(self):
        return os.system, (f"touch {self.canary}",)
