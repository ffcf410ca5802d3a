"""Multi-process save/load round trips through ShardWriter/ShardReader.

Each job saves a state dict mixing DTensors (even, uneven and empty shards),
replicated plain tensors, several dtypes, empty tensors, nested dicts and
non-tensor objects, then loads it into garbage-filled destinations at the
same world size and compares every value bit-exact.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from dcp_ext import InvalidRequestError, ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter

from mp import run_job
from support import assert_state_dict_equal, distributed_state, garbage_like, make_globals

pytestmark = pytest.mark.mp

# (name, global shape, dtype, placement) of the DTensor entries.  Shapes are
# chosen so that 2 and 4 ranks produce uneven and empty local shards.
DTENSOR_SPECS = [
    ("dt.shard0", (8, 6), torch.float32, Shard(0)),
    ("dt.shard1", (5, 8), torch.bfloat16, Shard(1)),
    ("dt.replicate", (3, 4), torch.float16, Replicate()),
    ("dt.uneven_rows", (7, 3), torch.int64, Shard(0)),  # 4 ranks: 2,2,2,1
    ("dt.one_row", (1, 4), torch.float32, Shard(0)),  # 2+ ranks: empty shards
    ("dt.uneven_cols", (3, 5), torch.float16, Shard(1)),  # 4 ranks: 2,2,1,0
    ("dt.bool", (6, 2), torch.bool, Shard(0)),
    ("dt.empty", (0, 3), torch.float32, Shard(0)),
]

# Plain tensors: every rank holds the same value (replicated, written once).
PLAIN_SPECS = [
    ("plain.fp32", (16, 16), torch.float32),
    ("plain.bf16", (3, 3), torch.bfloat16),
    ("plain.fp16", (2, 3), torch.float16),
    ("plain.int64", (5,), torch.int64),
    ("plain.bool", (4, 4), torch.bool),
    ("plain.fp64_scalar", (), torch.float64),
]

# The tensor whose raw bytes are searched for in the data files (dedup check).
DEDUP_PROBE = "plain.fp32"


SPECS = {name: (shape, dtype) for name, shape, dtype, *_ in DTENSOR_SPECS + PLAIN_SPECS}
PLACEMENTS = {name: placement for name, _, _, placement in DTENSOR_SPECS}


def _nested(flat: dict) -> dict:
    """``{"dt.shard0": x}`` -> ``{"dt": {"shard0": x}}``."""
    out: dict = {}
    for name, value in flat.items():
        group, key = name.split(".")
        out.setdefault(group, {})[key] = value
    return out


def _objects() -> dict:
    return {
        "step": 17,
        "name": "run-\u00fc-42",
        "cfg": {"lr": 0.5, "betas": (0.9, 0.99), "tag": "adamw"},
        "history": [1, 2, 3, "x"],
        "nothing": None,
    }


def _object_placeholders() -> dict:
    return {
        "step": -1,
        "name": "",
        "cfg": {"lr": -1.0, "betas": (), "tag": ""},
        "history": [],
        "nothing": "placeholder",
    }


def build(mesh, seed: int, *, destination: bool):
    """Return (state_dict, expected) for this rank.

    ``destination=False`` gives the state to save; ``destination=True`` gives
    garbage-filled destinations of identical structure.  ``expected`` holds the
    values (local shards for DTensors) that a correct load must produce.
    """
    flat_sd, flat_exp = distributed_state(make_globals(SPECS, seed), mesh, PLACEMENTS, destination=destination)
    sd: dict = {**_nested(flat_sd), "empty": {}, "model": {"layer1": {}, "layer2": {"inner": {}}}}
    exp: dict = {**_nested(flat_exp), "empty": {}, "model": {"layer1": {}, "layer2": {"inner": {}}}}

    for key, t in {"a": torch.empty(0), "b": torch.empty(0, 3, dtype=torch.int64)}.items():
        sd["empty"][key] = t.clone()
        exp["empty"][key] = t.clone()

    # Nested dicts holding tensors and objects.
    g2 = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(4, 3, generator=g2)
    b = torch.randn(4, generator=g2).to(torch.bfloat16)
    inner = torch.arange(10, dtype=torch.int64) * (seed + 3)
    sd["model"]["layer1"]["w"] = garbage_like(w) if destination else w.clone()
    sd["model"]["layer1"]["b"] = garbage_like(b) if destination else b.clone()
    sd["model"]["layer2"]["inner"]["idx"] = garbage_like(inner) if destination else inner.clone()
    exp["model"]["layer1"]["w"] = w
    exp["model"]["layer1"]["b"] = b
    exp["model"]["layer2"]["inner"]["idx"] = inner

    sd["objects"] = _object_placeholders() if destination else _objects()
    exp["objects"] = _objects()
    return sd, exp


def _tensor_refs(sd: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in sd.items():
        path = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out.update(_tensor_refs(v, path))
        elif isinstance(v, torch.Tensor):
            out[path] = v
    return out


def _get(sd: dict, path: str):
    for part in path.split("."):
        sd = sd[part]
    return sd


def _load_and_check(path: str, mesh, seed: int, reader_kwargs: dict) -> dict:
    dest, expected = build(mesh, seed, destination=True)
    refs = _tensor_refs(dest)
    reader = ShardReader(path, **reader_kwargs)
    dcp.load(dest, storage_reader=reader, planner=ShardLoadPlanner())
    # Tensors are loaded in place: the destination objects stay the same.
    for p, t in refs.items():
        got = _get(dest, p)
        assert got is t, f"{p}: load replaced the destination tensor instead of filling it"
        if isinstance(t, DTensor):
            assert got.placements == t.placements, f"{p}: placements changed"
    assert_state_dict_equal(dest, expected)
    stats = reader.stats
    tensor_bytes = sum(t.numel() * t.element_size() for t in _tensor_refs(expected).values())
    assert stats.bytes_read >= tensor_bytes, f"reader.stats.bytes_read={stats.bytes_read} < {tensor_bytes} loaded"
    return {"items_read": stats.items_read, "bytes_read": stats.bytes_read}


def _check_metadata(path: str) -> None:
    md = ShardReader(path).read_metadata()
    for name, shape, dtype in PLAIN_SPECS:
        tmd = md.state_dict_metadata[name]
        assert tuple(tmd.size) == shape, f"{name}: metadata size {tuple(tmd.size)} != {shape}"
        assert tmd.properties.dtype == dtype, f"{name}: metadata dtype {tmd.properties.dtype}"
        assert len(tmd.chunks) == 1, f"{name}: replicated tensor has {len(tmd.chunks)} chunks"
        entries = [idx for idx in md.storage_data if idx.fqn == name]
        assert len(entries) == 1, f"{name}: {len(entries)} storage_data entries for a replicated tensor"
    # Every DTensor's chunks tile its global shape exactly (no overlap, no gap).
    for name, shape, dtype, _ in DTENSOR_SPECS:
        tmd = md.state_dict_metadata[name]
        assert tuple(tmd.size) == shape, f"{name}: metadata size {tuple(tmd.size)} != {shape}"
        assert tmd.properties.dtype == dtype, f"{name}: metadata dtype {tmd.properties.dtype}"
        cover = torch.zeros(shape, dtype=torch.int32)
        for c in tmd.chunks:
            sl = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))
            cover[sl] += 1
        assert bool((cover == 1).all()), f"{name}: chunks {tmd.chunks} do not tile {shape} exactly once"
    for name in ("objects.step", "objects.name", "objects.cfg.lr", "objects.history"):
        assert name in md.state_dict_metadata, f"bytes item {name} missing from metadata"


def _check_probe_written_once(path: str, glob: dict) -> None:
    """The replicated probe tensor's raw bytes occur exactly once on disk."""
    probe = glob[DEDUP_PROBE].contiguous().numpy().tobytes()
    hits = 0
    for root, _, files in os.walk(path):
        for fname in files:
            if fname.startswith(".metadata"):
                continue
            with open(os.path.join(root, fname), "rb") as f:
                hits += f.read().count(probe)
    assert hits == 1, f"replicated tensor {DEDUP_PROBE} stored {hits} times under {path} (expected once)"


def roundtrip_job(rank: int, world: int, base: str, url_variants: tuple) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    seed = 1000 + world
    report = {}
    for variant in ("path",) + tuple(url_variants):
        if variant == "memory":
            # The memory filesystem lives in this process only (1-rank jobs).
            assert world == 1
            path = f"memory://dcp_ext_roundtrip_{uuid.uuid4().hex}/ckpt"
        elif variant == "file":
            path = "file://" + os.path.join(base, "file_url")
        else:
            path = os.path.join(base, "plain_path")
        sd, _ = build(mesh, seed, destination=False)
        dcp.save(sd, storage_writer=ShardWriter(path), planner=ShardSavePlanner())
        # The source state is not modified by saving.
        _, expected_src = build(mesh, seed, destination=False)
        assert_state_dict_equal(sd, expected_src, "source-after-save")

        report[variant] = _load_and_check(path, mesh, seed, {})
        # Second load of the same checkpoint: checksum verification and
        # two I/O threads must give identical values.
        _load_and_check(path, mesh, seed, {"verify_checksums": True, "thread_count": 2})

        if rank == 0:
            glob = make_globals(SPECS, seed)
            _check_metadata(path)
            if variant != "memory":
                local = path[len("file://"):] if path.startswith("file://") else path
                _check_probe_written_once(local, glob)
        dist.barrier()
    return report


@pytest.mark.parametrize(
    "world,url_variants",
    [
        pytest.param(1, ("memory",), id="1proc+memory_url"),
        pytest.param(2, ("file",), id="2proc+file_url"),
        pytest.param(4, (), id="4proc", marks=pytest.mark.slow),
    ],
)
def test_every_kind_of_entry_round_trips_bit_exact(tmp_path, world, url_variants):
    reports = run_job(roundtrip_job, world, str(tmp_path), url_variants)
    assert [sorted(r) for r in reports] == [sorted(("path",) + url_variants)] * world


def empty_rank_job(rank: int, world: int, path: str) -> None:
    """Rank 1 has nothing to save (a pipeline stage without state): its plan table is empty."""
    state = {"stage0.w": torch.arange(12.0).reshape(3, 4), "step": 7} if rank == 0 else {}
    dcp.save(state, storage_writer=ShardWriter(path), planner=ShardSavePlanner())
    out = {"stage0.w": garbage_like(state["stage0.w"]), "step": 0} if rank == 0 else {}
    dcp.load(out, storage_reader=ShardReader(path), planner=ShardLoadPlanner())
    assert_state_dict_equal(out, state, f"rank {rank}")


@pytest.mark.mp
def test_a_rank_with_an_empty_state_dict_saves_with_the_others(tmp_path):
    run_job(empty_rank_job, 2, str(tmp_path / "ckpt"))


def test_an_empty_state_dict_saves_and_loads(tmp_path):
    dcp.save({}, storage_writer=ShardWriter(tmp_path), planner=ShardSavePlanner(), no_dist=True)
    dcp.load({}, storage_reader=ShardReader(tmp_path), planner=ShardLoadPlanner(), no_dist=True)
    assert (tmp_path / ".metadata").is_file()


def test_a_key_that_is_not_unicode_text_is_refused_by_name(tmp_path):
    """``os.fsdecode`` of a name that is not UTF-8 gives lone surrogates; stock DCP pickles
    such a key, our index cannot store it. Before: a bare UnicodeEncodeError from pyarrow in
    the commit, naming neither the key nor the checkpoint. The checkpoint before stays."""
    dcp.save({"ok": torch.ones(2)}, storage_writer=ShardWriter(tmp_path), planner=ShardSavePlanner(), no_dist=True)
    with pytest.raises(CheckpointException) as info:
        dcp.save({"layer\udcff.w": torch.arange(4.0), "ok": torch.zeros(2)}, storage_writer=ShardWriter(tmp_path),
                 planner=ShardSavePlanner(), no_dist=True)
    error = next(iter(info.value.failures.values()))[0]
    assert "key 'layer\\udcff.w' is not valid Unicode text" in str(error) and str(tmp_path) in str(error), error
    out = {"ok": garbage_like(torch.ones(2))}
    dcp.load(out, storage_reader=ShardReader(tmp_path), planner=ShardLoadPlanner(), no_dist=True)
    assert_state_dict_equal(out, {"ok": torch.ones(2)})


@pytest.mark.parametrize("reader", ["stock", "ours"])
def test_a_stored_number_loads_into_a_0d_tensor_in_place(tmp_path, reader):
    """An optimizer saved with float ``lr``/``step``, resumed into one that keeps them as
    tensors: DCP's planner puts the float in the tensor's place (a load into the model's
    own tensors would not take effect); ShardLoadPlanner writes it into the tensor, cast
    to its dtype. A stock checkpoint and one of ours alike."""
    stored = {"lr": 0.01, "step": 7, "flag": True, "half": 1.5}
    storage = dcp.FileSystemWriter(tmp_path) if reader == "stock" else ShardWriter(tmp_path)
    dcp.save(stored, storage_writer=storage, no_dist=True)
    dst = {"lr": torch.tensor(-1.0, dtype=torch.float64), "step": torch.tensor(-1.0), "flag": torch.tensor(False),
           "half": torch.nn.Parameter(torch.tensor(-1.0, dtype=torch.bfloat16))}
    state = dict(dst)
    dcp.load(state, storage_reader=ShardReader(tmp_path), planner=ShardLoadPlanner(), no_dist=True)
    assert all(state[k] is dst[k] for k in dst)
    assert_state_dict_equal(dst, {"lr": torch.tensor(0.01, dtype=torch.float64), "step": torch.tensor(7.0),
                                  "flag": torch.tensor(True), "half": torch.tensor(1.5, dtype=torch.bfloat16)})


@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "uint1", "int4"])
def test_a_tensor_dcp_cannot_store_is_refused_by_key(tmp_path, kind):
    """Stock DCP fails on these deep inside (``Cannot access storage of SparseTensorImpl``,
    ``KeyError: 'dtype torch.uint1 is not recognized'`` from torch.save), naming no key."""
    bad = {"sparse_coo": lambda: torch.eye(3).to_sparse(), "sparse_csr": lambda: torch.eye(3).to_sparse_csr(),
           "uint1": lambda: torch.zeros(8, dtype=torch.uint1), "int4": lambda: torch.zeros(8, dtype=torch.int4)}[kind]()
    dcp.save({"ok": torch.ones(2)}, storage_writer=ShardWriter(tmp_path), planner=ShardSavePlanner(), no_dist=True)
    with pytest.raises(CheckpointException) as info:
        dcp.save({"ok": torch.zeros(2), "layer.w": bad}, storage_writer=ShardWriter(tmp_path),
                 planner=ShardSavePlanner(), no_dist=True)
    error = next(iter(info.value.failures.values()))[0]
    assert isinstance(error, InvalidRequestError) and "key 'layer.w'" in str(error), error
    assert ("only strided" if kind.startswith("sparse") else "tensor.view(torch.uint8)") in str(error)
    out = {"ok": garbage_like(torch.ones(2))}
    dcp.load(out, storage_reader=ShardReader(tmp_path), planner=ShardLoadPlanner(), no_dist=True)
    assert_state_dict_equal(out, {"ok": torch.ones(2)})


def test_stored_numbers_for_one_tensor_under_several_keys_stay_apart(tmp_path):
    """torch.optim shares a tensor default ``lr`` across param groups: written in place,
    the last group's value won for every group. Keys sharing a tensor each get a new one."""
    dcp.save({"g0.lr": 0.5, "g1.lr": 0.25, "flag": np.bool_(True)}, storage_writer=ShardWriter(tmp_path), no_dist=True)
    shared = torch.tensor(-1.0, dtype=torch.float64)
    flag = torch.tensor(0)
    state = {"g0.lr": shared, "g1.lr": shared, "flag": flag}
    dcp.load(state, storage_reader=ShardReader(tmp_path), planner=ShardLoadPlanner(), no_dist=True)
    assert_state_dict_equal(state, {"g0.lr": torch.tensor(0.5, dtype=torch.float64),
                                    "g1.lr": torch.tensor(0.25, dtype=torch.float64), "flag": torch.tensor(1)})
    assert shared.item() == -1.0 and state["flag"] is flag  # a tensor of one key is still filled in place


FULL = torch.arange(256.0).reshape(4, 64)


def grad_destination_job(rank: int, world: int, path: str) -> None:
    """Saved as column shards; loaded into replicated DTensors made with ``from_local`` over
    tensors that require grad (a module's own parameters wrapped by hand), so each
    destination is filled from several chunks, the later ones after the first was written."""
    mesh = init_device_mesh("cpu", (world,))
    state = {f"w{i}": DTensor.from_local(FULL[:, rank * 32:(rank + 1) * 32] + i, mesh, [Shard(1)], run_check=False) for i in range(4)}
    dcp.save(state, storage_writer=ShardWriter(path), planner=ShardSavePlanner())
    locals_ = {f"w{i}": torch.full((4, 64), float("nan"), requires_grad=True) for i in range(4)}
    out = {k: DTensor.from_local(v, mesh, [Replicate()], run_check=False) for k, v in locals_.items()}
    dcp.load(out, storage_reader=ShardReader(path), planner=ShardLoadPlanner())
    for i in range(4):
        assert torch.equal(locals_[f"w{i}"].detach(), FULL + i), f"rank {rank} w{i}"


@pytest.mark.mp
def test_dtensors_over_tensors_that_require_grad_load_from_several_chunks(tmp_path):
    """ShardLoadPlanner narrowed the local tensor of ``from_local``, a view made in no-grad
    mode: after the first read wrote into it, the next narrow raised autograd's "A view was
    created in no_grad mode and its base ... has been modified inplace". Stock loads it."""
    run_job(grad_destination_job, 2, str(tmp_path))
