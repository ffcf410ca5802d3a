"""Fuzzing metadata and index contents: the reader raises CheckpointError or loads correctly.

Hypothesis mutates a real checkpoint: values inside the ``.metadata`` objects (stock
path, no index), values of index rows and header (index path), and raw bytes of both
files. Whatever it produces, ``read_metadata`` either raises ``CheckpointError`` or
returns, and the load then either fails with ``CheckpointError`` (or with DCP's own
planner refusing a checkpoint that does not match the state dict, or failing to unpickle
a bytes item handed over unverified) or fills every tensor with its shape and dtype.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import tempfile
import traceback
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException

from dcp_ext import CheckpointError, ShardLoadPlanner, ShardReader
from dcp_ext.formats.index import INDEX_NAME
from dcp_ext.formats.marker import MARKER_NAME

from support import assert_state_dict_equal, garbage_state, sample_state, save

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
STATE = sample_state(3)
WEIRD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, -1, 1, 2**31, 2**60, 2**63 - 1]),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(["..", "/etc/passwd", "../x.distcp", "a/../../b", "w", "nested.h", "\x00"]),
    st.lists(st.integers(min_value=-3, max_value=2**40), max_size=4),
    st.builds(lambda xs: torch.Size(xs), st.lists(st.integers(min_value=0, max_value=2**62), max_size=3)),
    st.sampled_from([torch.float32, torch.int64, torch.bool, torch.bfloat16]),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fuzz")
    save(STATE, path, thread_count=2)
    return path


def fuzzed_copy(pristine: Path) -> Path:
    work = Path(tempfile.mkdtemp(prefix="dcp_ext_fuzz_"))
    shutil.copytree(pristine, work, dirs_exist_ok=True)
    return work


def check_reader_contract(path: Path, verify: bool) -> None:
    """The property every fuzzed checkpoint must satisfy."""
    try:
        ShardReader(path, cache_metadata=False).read_metadata()
    except CheckpointError:
        return
    out = garbage_state(STATE)
    reader = ShardReader(path, cache_metadata=False, verify_checksums=verify)
    try:
        dcp.load(out, storage_reader=reader, planner=ShardLoadPlanner())
    except CheckpointException as exc:
        error, stack = next(iter(exc.failures.values()))
        if isinstance(error, CheckpointError):
            return
        raised_in = stack[-1].filename if stack else ""
        assert "dcp_ext" not in raised_in, f"reader raised {error!r} at {raised_in}:\n{''.join(traceback.format_list(stack))}"
        if not any(frame.name == "load_bytes" for frame in stack):  # DCP unpickling a bytes item: any error
            assert isinstance(error, (RuntimeError, ValueError, KeyError)), f"planner raised {error!r}"
        return
    for key, want in STATE.items():
        if isinstance(want, torch.Tensor):
            assert out[key].shape == want.shape and out[key].dtype == want.dtype, key


def test_pristine_copy_loads_bit_exact(pristine):
    work = fuzzed_copy(pristine)
    out = garbage_state(STATE)
    dcp.load(out, storage_reader=ShardReader(work, verify_checksums=True), planner=ShardLoadPlanner())
    assert_state_dict_equal(out, STATE)
    shutil.rmtree(work)


# -- .metadata objects (stock path: our index and marker removed) ---------------------------
def _targets(metadata) -> list[tuple[object, str]]:
    """(object, attribute or key) pairs a mutation may overwrite."""
    found: list[tuple[object, str]] = [(metadata, a) for a in ("state_dict_metadata", "storage_data", "planner_data", "version")]
    for fqn, md in metadata.state_dict_metadata.items():
        found.append((metadata.state_dict_metadata, fqn))
        if hasattr(md, "chunks"):
            found += [(md, "size"), (md, "chunks"), (md.properties, "dtype")]
            for chunk in md.chunks:
                found += [(chunk, "offsets"), (chunk, "sizes")]
    for info in metadata.storage_data.values():
        found += [(info, "relative_path"), (info, "offset"), (info, "length"), (info, "transform_descriptors")]
    return found


def _assign(target: object, name: str, value: object) -> None:
    if isinstance(target, dict):
        target[name] = value
    else:
        object.__setattr__(target, name, value)  # frozen dataclasses included


@FUZZ
@given(data=st.data(), verify=st.booleans())
def test_fuzzed_metadata_objects(pristine, data, verify):
    work = fuzzed_copy(pristine)
    try:
        with open(work / ".metadata", "rb") as f:
            metadata = pickle.load(f)  # our own checkpoint: trusted here
        targets = _targets(metadata)
        for _ in range(data.draw(st.integers(1, 3))):
            target, name = data.draw(st.sampled_from(targets))
            _assign(target, name, data.draw(WEIRD))
        (work / ".metadata").write_bytes(pickle.dumps(metadata))
        (work / INDEX_NAME).unlink()
        (work / MARKER_NAME).unlink()
        check_reader_contract(work, verify)
    finally:
        shutil.rmtree(work)


# -- index rows and header (index path; marker removed so the index is trusted) -------------
@FUZZ
@given(data=st.data(), verify=st.booleans())
def test_fuzzed_index_contents(pristine, data, verify):
    work = fuzzed_copy(pristine)
    try:
        table = pq.read_table(work / INDEX_NAME)
        rows, header = table.to_pydict(), json.loads(table.schema.metadata[b"dcp_ext"])
        for _ in range(data.draw(st.integers(1, 3))):
            if data.draw(st.booleans()):
                column = data.draw(st.sampled_from(sorted(rows)))
                row = data.draw(st.integers(0, len(rows[column]) - 1))
                rows[column][row] = data.draw(_column_values(column))
            else:
                key = data.draw(st.sampled_from(["order", "tensors", "planner_data", "storage_meta", "version"]))
                header[key] = data.draw(_header_values(header, key))
        try:
            fuzzed = pa.table(rows, schema=table.schema.with_metadata({b"dcp_ext": json.dumps(header).encode()}))
        except (pa.ArrowException, OverflowError):
            return  # not representable in the index schema: nothing to read
        sink = io.BytesIO()
        pq.write_table(fuzzed, sink)
        (work / INDEX_NAME).write_bytes(sink.getvalue())
        (work / MARKER_NAME).unlink()
        check_reader_contract(work, verify)
    finally:
        shutil.rmtree(work)


def _column_values(column: str) -> st.SearchStrategy:
    ints = st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, -1, 1, 64, 4096, 2**60]))
    return {
        "fqn": st.sampled_from(["w", "b", "ids", "nested.h", "nested.step", "name", "zz", ""]),
        "offsets": st.lists(ints, max_size=3),
        "sizes": st.lists(ints, max_size=3),
        "dtype": st.sampled_from(["float32", "int64", "float16", "bfloat16", "bool", "load", None]),
        "file": st.sampled_from(["..", "/etc/passwd", "x.distcp", "../a", "", None]),
        "checksum": st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    }.get(column, ints)


def _header_values(header: dict, key: str) -> st.SearchStrategy:
    if key == "tensors" and isinstance(header["tensors"], dict) and header["tensors"]:  # an earlier draw may have replaced it
        fqn = next(iter(header["tensors"]))
        spec = st.tuples(st.sampled_from(["float32", "int8", "load", 3]), st.lists(st.integers(-2, 2**62), max_size=3),
                         st.booleans(), st.booleans()).map(list)
        return st.one_of(spec.map(lambda s: {**header["tensors"], fqn: s}), st.just({}), st.just([]))
    return st.one_of(st.none(), st.integers(), st.text(max_size=5), st.just([]), st.just({}), st.just(header[key]))


# -- raw bytes of .metadata and of the index ------------------------------------------------
@FUZZ
@given(data=st.data(), name=st.sampled_from([".metadata", INDEX_NAME]), verify=st.booleans())
def test_fuzzed_metadata_and_index_bytes(pristine, data, name, verify):
    work = fuzzed_copy(pristine)
    try:
        raw = bytearray((work / name).read_bytes())
        for _ in range(data.draw(st.integers(1, 8))):
            pos = data.draw(st.integers(0, len(raw) - 1))
            raw[pos] = data.draw(st.integers(0, 255))
        if data.draw(st.booleans()):
            raw = raw[: data.draw(st.integers(0, len(raw)))]
        (work / name).write_bytes(bytes(raw))
        if data.draw(st.booleans()):
            (work / MARKER_NAME).unlink()
        check_reader_contract(work, verify)
    finally:
        shutil.rmtree(work)
