"""Checkpoints written by the real megatron-core load bit-exact through ShardReader at 1, 2
and 4 processes, against values megatron-core's own loader returned: torch_dist from
0.16.1 (TP2 x DP2, EP2 experts, SwiGLU factories, Adam state, an RNG ShardedObject,
common.pt), the same from 0.19.2 (common state as the ``common_state`` ShardedObject, no
common.pt), zarr from 0.12.2 (TP2, bf16 norms, SwiGLU, RNG objects, common.pt), and a
GPTModel with the DistributedOptimizer's flattened-range format from 0.14.0 (PP2 x DP2,
fully-parallel save; ``.metadata`` holds ``MCoreSavePlan``s) and 0.15.3 (TP2 x DP2;
``.metadata`` is an ``MCoreMetadata``); the same model from 0.19.2 saved with cached plans
(``dp_reshardable`` optimizer buffers; ``.metadata`` pickles ``_StoragePrefix``) and from
0.12.2 as zarr (``{key}.sync`` lock directories beside the flattened arrays).

Fixture and expected values: ``tests/fixtures/megatron/generate.py`` (see its README).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_ext import CheckpointError, ShardLoadPlanner, ShardReader, UnsafeCheckpointError
from dcp_ext.cli.main import main as cli
from dcp_ext.formats.safe_pickle import load_metadata_pickle
from dcp_ext.megatron import load_common_state

from mp import run_job
from support import FIXTURES, assert_tensor_equal, garbage_like

MEGATRON_FIXTURES = FIXTURES / "megatron"
NAMES = {"mcore016_tp2_dp2_ep2": "0.16.1", "mcore019_tp2_dp2_ep2": "0.19.2", "mcore012_zarr_tp2": "0.12.2",
         "mcore014_pp2_dp2_distopt": "0.14.0", "mcore015_tp2_dp2_distopt": "0.15.3",
         "mcore019_tp2_dp2_distopt_cached": "0.19.2", "mcore012_zarr_dp2_distopt": "0.12.2"}
DISTOPT = {"mcore014_pp2_dp2_distopt": b"MCoreSavePlan", "mcore015_tp2_dp2_distopt": b"MCoreMetadata"}  # pickled classes


def expected(name: str) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(MEGATRON_FIXTURES / f"{name}.expected.safetensors"), json.loads((MEGATRON_FIXTURES / f"{name}.expected.json").read_text())


def as_json(obj):
    """The generator's JSON form (dicts, lists, numbers, strings, Namespaces)."""
    if isinstance(obj, argparse.Namespace):
        return {"namespace": as_json(vars(obj))}
    if isinstance(obj, dict):
        return {str(k): as_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [as_json(v) for v in obj]
    return obj


@pytest.mark.parametrize("name", NAMES)
def test_every_tensor_and_object_loads_bit_exact(name):
    tensors, info = expected(name)
    assert info["megatron_core"] == NAMES[name] and len(tensors) >= 8
    state = {k: garbage_like(v) for k, v in tensors.items()}
    state.update({key: None for key in info["objects"]})
    dcp.load(state, storage_reader=ShardReader(MEGATRON_FIXTURES / name), planner=ShardLoadPlanner())
    for key, value in tensors.items():
        assert_tensor_equal(state[key], value, key)
    for key, value in info["objects"].items():  # torch_dist stores a ShardedObject as [object], zarr bare
        got = state[key]
        if (MEGATRON_FIXTURES / name / ".metadata").exists():
            assert isinstance(got, list) and len(got) == 1, key
            got = got[0]
        assert as_json(got) == value, key
    common = load_common_state(MEGATRON_FIXTURES / name)
    assert {k: as_json(common[k]) for k in ("args", "iteration")} == {k: info["common"][k] for k in ("args", "iteration")}


def resharded_job(rank: int, world: int, names: list[str]) -> None:
    """Every tensor of every fixture as a DTensor, Shard(0) and Shard(last) in turn: cuts
    fall across the saved TP, EP and layer splits."""
    mesh = init_device_mesh("cpu", (world,))
    for name in names:
        tensors, _ = expected(name)
        specs = {k: Shard(0 if n % 2 else v.dim() - 1) for n, (k, v) in enumerate(sorted(tensors.items()))}
        state = {k: distribute_tensor(garbage_like(tensors[k]), mesh, [p], src_data_rank=None) for k, p in specs.items()}
        dcp.load(state, storage_reader=ShardReader(MEGATRON_FIXTURES / name), planner=ShardLoadPlanner())
        for key, placement in specs.items():
            want = distribute_tensor(tensors[key], mesh, [placement], src_data_rank=None).to_local()
            assert_tensor_equal(state[key].to_local(), want, f"rank {rank} {name} {key}")


@pytest.mark.mp
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_resharded_loads_at_2_and_4_processes(world):
    run_job(resharded_job, world, list(NAMES))


@pytest.mark.parametrize("name", NAMES)
def test_cli_inspect_verify_convert(tmp_path, capsys, name):
    tensors, _ = expected(name)
    ckpt = MEGATRON_FIXTURES / name
    assert cli(["inspect", "--json", str(ckpt)]) == 0
    listed = {k["key"]: k for k in json.loads(capsys.readouterr().out)["keys"]}
    assert all(listed[k]["shape"] == list(v.shape) for k, v in tensors.items())
    assert cli(["verify", str(ckpt)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("OK:")
    assert cli(["convert", str(ckpt), str(tmp_path / "ours")]) == 0
    assert ("note: common.pt (Megatron's common state" in capsys.readouterr().out) == (ckpt / "common.pt").exists()
    assert cli(["verify", str(tmp_path / "ours")]) == 0
    state = {k: garbage_like(v) for k, v in tensors.items()}
    dcp.load(state, storage_reader=ShardReader(tmp_path / "ours"), planner=ShardLoadPlanner())
    for key, value in tensors.items():
        assert_tensor_equal(state[key], value, key)


def test_metadata_holds_megatrons_save_plans():
    """What broke before: megatron-core pickles its local SavePlans into .metadata."""
    ckpt = MEGATRON_FIXTURES / "mcore016_tp2_dp2_ep2"
    raw = (ckpt / ".metadata").read_bytes()
    assert b"SavePlan" in raw and b"WriteItem" in raw
    assert len(ShardReader(ckpt).read_metadata().state_dict_metadata) > 40


def test_what_the_two_layouts_that_did_not_open_hold():
    """megatron-core 0.19.2 with cached save plans (``cached_metadata=True``: Megatron-LM's
    --ckpt-assume-constant-structure) pickles them into .metadata from its second save on,
    their storage_data a ``_StoragePrefix`` the metadata unpickler refused; 0.12.2's zarr
    save of the distributed optimizer leaves a ``{key}.sync`` directory of empty lock files
    beside each flattened array, read as an array of its own. Both now load bit-exact
    (``test_every_tensor_and_object_loads_bit_exact``, and resharded below)."""
    assert b"_StoragePrefix" in (MEGATRON_FIXTURES / "mcore019_tp2_dp2_distopt_cached" / ".metadata").read_bytes()
    zarr = MEGATRON_FIXTURES / "mcore012_zarr_dp2_distopt"
    locks = sorted(p.name for p in zarr.iterdir() if p.name.endswith(".sync"))
    assert len(locks) >= 20 and all((zarr / lock.removesuffix(".sync") / ".zarray").is_file() for lock in locks)
    assert (zarr / locks[0] / ".zarray").stat().st_size == 0
    assert not any(key.endswith(".sync") for key in ShardReader(zarr).read_metadata().state_dict_metadata)


@pytest.mark.parametrize("name", DISTOPT)
def test_flattened_range_optimizer_state_restored_to_global_shapes(name):
    """What broke before: megatron-core 0.12-0.15 pickle their own subclasses of DCP's
    SavePlan / Metadata into .metadata, and the distributed optimizer's state is stored
    in flattened ranges under reformulated shapes (``mcore_data``)."""
    tensors, _ = expected(name)
    raw = (MEGATRON_FIXTURES / name / ".metadata").read_bytes()
    assert DISTOPT[name] in raw
    mcore_data = load_metadata_pickle(raw, name).mcore_data
    flattened = [k for k, v in mcore_data.items() if v.get("nd_reformulated_orig_global_shape")]
    assert len(flattened) >= 20 and all(k.startswith("optimizer.state.") for k in flattened)
    metadata = ShardReader(MEGATRON_FIXTURES / name).read_metadata()
    assert all(tuple(metadata.state_dict_metadata[k].size) == tuple(tensors[k].shape) for k in flattened)


def test_a_missing_file_of_flattened_records_is_named(tmp_path):
    """Flattened tensors' places are read from their records with the metadata: a missing
    data file raised a bare FileNotFoundError naming no checkpoint, and `verify` stopped
    with exit 2 instead of a FAULT line."""
    import shutil

    ckpt = tmp_path / "distopt"
    shutil.copytree(MEGATRON_FIXTURES / "mcore015_tp2_dp2_distopt", ckpt)
    (ckpt / "__3_1.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"distopt: data file '__3_1.distcp' is missing; it holds records of flattened"):
        ShardReader(ckpt).read_metadata()
    assert cli(["verify", str(ckpt)]) == 1


def test_common_state_object_without_common_pt():
    """megatron-core >= 0.17 keeps the common state in the DCP data, not in common.pt."""
    ckpt = MEGATRON_FIXTURES / "mcore019_tp2_dp2_ep2"
    _, info = expected("mcore019_tp2_dp2_ep2")
    assert not (ckpt / "common.pt").exists() and "common_state/shard_0_1" in info["objects"]
    assert as_json(load_common_state(ckpt)) == info["common"]


def test_a_refused_metadata_pickle_gives_no_add_safe_globals_advice(tmp_path):
    """``add_safe_globals`` lets ``torch.load`` take a class, not the ``.metadata`` reader:
    only refusals of torch.save streams (``common.pt``, the ``common_state`` object, legacy
    rank files) say to register it. ``load_common_state`` gave that advice for any refusal."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(MEGATRON_FIXTURES / "mcore019_tp2_dp2_ep2", ckpt)
    (ckpt / ".metadata").write_bytes(pickle.dumps(os.system))
    with pytest.raises(UnsafeCheckpointError) as err:
        load_common_state(ckpt)
    assert ".metadata" in str(err.value) and "add_safe_globals" not in str(err.value), err.value


def test_converted_common_state_object_is_no_megatron_save(tmp_path):
    """``convert`` copies the ``common_state`` object: the result is our checkpoint, complete
    without Megatron's metadata.json, and still answers ``load_common_state``."""
    _, info = expected("mcore019_tp2_dp2_ep2")
    assert cli(["convert", str(MEGATRON_FIXTURES / "mcore019_tp2_dp2_ep2"), str(tmp_path / "ours")]) == 0
    assert not (tmp_path / "ours" / "metadata.json").exists()
    assert as_json(load_common_state(tmp_path / "ours")) == info["common"]


@pytest.mark.parametrize("name", ["mcore016_tp2_dp2_ep2", "mcore012_zarr_tp2"])
def test_load_common_state_checks_its_options_as_a_load_does(tmp_path, name):
    """``options`` served only legacy checkpoints: ``iteration`` or ``partition_dims`` on a
    torch_dist or zarr one were ignored, and a torch_dist save without metadata.json (an
    interrupted one) answered without ``allow_incomplete``, where a load of it is refused."""
    from dcp_ext import IgnoredOptionsError
    from dcp_ext.megatron import IncompleteSaveError, MegatronOptions

    source = MEGATRON_FIXTURES / name
    kind = "zarr" if "zarr" in name else "Megatron torch_dist"
    for given in ({"iteration": 5}, {"partition_dims": {"x": 0}}):
        with pytest.raises(IgnoredOptionsError, match=f"would be ignored: this {kind} checkpoint reads only allow_incomplete") as info:
            load_common_state(source, options=MegatronOptions(**given))
        assert (info.value.names, info.value.used, info.value.kind) == (tuple(given), ("allow_incomplete",), kind)
    _, info = expected(name)
    incomplete = tmp_path / "incomplete"
    shutil.copytree(source, incomplete)
    (incomplete / "metadata.json").unlink()
    with pytest.raises(IncompleteSaveError, match="metadata.json is missing"):
        load_common_state(incomplete)
    common = load_common_state(incomplete, options=MegatronOptions(allow_incomplete=True))
    assert as_json(common["iteration"]) == info["common"]["iteration"]


def test_load_common_state_of_a_save_interrupted_before_its_metadata(tmp_path):
    """megatron-core writes common.pt first, the data files next, metadata.json last: a
    save killed before its .metadata left common.pt and data files, which answered as a
    directory holding common.pt alone (and refused allow_incomplete as "ignored")."""
    from dcp_ext.megatron import IncompleteSaveError, MegatronOptions

    _, info = expected("mcore016_tp2_dp2_ep2")
    interrupted = tmp_path / "interrupted"
    shutil.copytree(MEGATRON_FIXTURES / "mcore016_tp2_dp2_ep2", interrupted)
    for name in (".metadata", "metadata.json"):
        (interrupted / name).unlink()
    with pytest.raises(IncompleteSaveError, match=r"metadata.json is missing .*\(dcp-ext convert --allow-incomplete\)"):
        load_common_state(interrupted)
    common = load_common_state(interrupted, options=MegatronOptions(allow_incomplete=True))
    assert as_json(common["iteration"]) == info["common"]["iteration"]
    alone = tmp_path / "alone"  # common.pt by itself is no save: it loads, and takes no options
    alone.mkdir()
    shutil.copy(interrupted / "common.pt", alone / "common.pt")
    assert as_json(load_common_state(alone)["iteration"]) == info["common"]["iteration"]


def test_a_converted_checkpoint_with_megatrons_common_pt_beside_it_loads(tmp_path):
    """convert's note sends users to the source's common.pt; put beside the copy (ours, with
    our index), it marked the copy as a Megatron save missing metadata.json, and both
    ShardReader and load_common_state refused it."""
    tensors, info = expected("mcore016_tp2_dp2_ep2")
    assert cli(["convert", str(MEGATRON_FIXTURES / "mcore016_tp2_dp2_ep2"), str(tmp_path / "ours")]) == 0
    shutil.copy(MEGATRON_FIXTURES / "mcore016_tp2_dp2_ep2" / "common.pt", tmp_path / "ours" / "common.pt")
    state = {k: garbage_like(v) for k, v in tensors.items()}
    dcp.load(state, storage_reader=ShardReader(tmp_path / "ours"), planner=ShardLoadPlanner(), no_dist=True)
    for key, value in tensors.items():
        assert_tensor_equal(state[key], value, key)
    assert as_json(load_common_state(tmp_path / "ours")["iteration"]) == info["common"]["iteration"]


def test_cache_metadata_false_keeps_no_torch_dist_view():
    """``cache_metadata=False`` keeps nothing, but each load of a torch_dist checkpoint kept
    its catalog and view (a 20,000-key one: 13 MiB a load, up to 16 of them); a cached
    catalog's view is kept with it, and found again."""
    from dcp_ext import clear_caches
    from dcp_ext.megatron import torch_dist

    clear_caches()
    path = MEGATRON_FIXTURES / "mcore016_tp2_dp2_ep2"
    for _ in range(3):
        ShardReader(path, cache_metadata=False).read_metadata()
    assert len(torch_dist._VIEWS) == 0
    readers = [ShardReader(path), ShardReader(path)]
    for reader in readers:
        reader.read_metadata()
    assert len(torch_dist._VIEWS) == 1 and readers[1].catalog is readers[0].catalog
    clear_caches()
