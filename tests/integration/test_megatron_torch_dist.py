"""Megatron torch_dist checkpoints: completeness, flattened-range tensors, common state."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import shutil
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from dcp_ext import CorruptCheckpointError, ShardLoadPlanner, ShardReader
from dcp_ext.cli.main import main as cli
from dcp_ext.formats.stand_ins import megatron_value
from dcp_ext.megatron import IncompleteSaveError, MegatronOptions, MegatronValue, load_common_state
from dcp_ext.storage.verify import verify_checkpoint

from megatron_fixtures import COMMON, FLAT, OBJECTS, write_torch_dist
from support import FIXTURES, load_error, load_tensors


@pytest.mark.parametrize("common", ["common.pt", "object"])
def test_loads_bit_exact_with_flattened_tensor_restored(tmp_path, common):
    want = write_torch_dist(str(tmp_path), common=common)
    state, reader = load_tensors(tmp_path, want, extra=tuple(OBJECTS))
    assert tuple(reader.read_metadata().state_dict_metadata[FLAT].size) == (2, 30, 10)
    assert state["decoder.layers.self_attention.core_attention._extra_state/shard_1_2"] == [{"fp8": 1}]
    got = load_common_state(tmp_path)
    assert isinstance(got["args"], argparse.Namespace) and got["iteration"] == COMMON["iteration"]


def test_missing_metadata_json_is_an_incomplete_save(tmp_path):
    want = write_torch_dist(str(tmp_path), complete=False)
    err = load_error(want, tmp_path)
    assert "incomplete Megatron save" in str(err) and "allow_incomplete" in str(err)
    with pytest.raises(IncompleteSaveError):
        ShardReader(tmp_path).read_metadata()
    load_tensors(tmp_path, want, megatron=MegatronOptions(allow_incomplete=True))


def test_plain_dcp_checkpoints_are_untouched(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.0)}, storage_writer=dcp.FileSystemWriter(tmp_path))
    load_tensors(tmp_path, {"w": torch.arange(6.0)})
    assert not os.path.exists(tmp_path / "metadata.json")


TORCH_DIST_FIXTURE = FIXTURES / "megatron" / "mcore016_tp2_dp2_ep2"  # written by megatron-core 0.16.1
NORM = "decoder.final_layernorm.weight"


def _real_torch_dist(tmp_path, mcore_data=None):
    """A copy of the real fixture, ``mcore_data`` set on its ``.metadata`` when given."""
    root = tmp_path / "ckpt"
    shutil.copytree(TORCH_DIST_FIXTURE, root)
    if mcore_data is not None:
        with open(root / ".metadata", "rb") as f:
            metadata = pickle.load(f)  # the committed fixture: trusted here
        metadata.mcore_data = mcore_data
        with open(root / ".metadata", "wb") as f:
            pickle.dump(metadata, f)
    return root


def _reformulated(shape):
    return {NORM: {"nd_reformulated_orig_global_shape": shape}}


@pytest.mark.parametrize(
    "mcore_data, message",
    [
        ([1, 2], "mcore_data is a list, expected a dict by key"),
        ("abc", "mcore_data is a str, expected a dict by key"),
        (_reformulated(["a"]), r"mcore_data\['decoder.final_layernorm.weight'\]\['nd_reformulated_orig_global_shape'\] is \['a'\]"),
        (_reformulated([None]), r"is \[None\], expected a list of sizes"),
        (_reformulated([2**70]), r"is \[1180591620717411303424\], expected a list of sizes"),
        (_reformulated(7), "is 7, expected a list of sizes"),
    ],
    ids=["list", "str", "text-size", "none-size", "2**70", "int"],
)
def test_malformed_mcore_data_is_corruption_naming_the_file(tmp_path, mcore_data, message):
    root = _real_torch_dist(tmp_path, mcore_data)
    with pytest.raises(CorruptCheckpointError, match=message) as err:
        ShardReader(root).read_metadata()
    assert str(err.value).startswith(f"{root}/.metadata: ")


def test_deeply_nested_metadata_json_is_corruption_naming_it(tmp_path):
    root = _real_torch_dist(tmp_path)
    (root / "metadata.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CorruptCheckpointError, match=r"metadata.json: not valid JSON \(RecursionError"):
        ShardReader(root).read_metadata()


DISTOPT_FIXTURES = ["mcore014_pp2_dp2_distopt", "mcore015_tp2_dp2_distopt"]  # flattened-range optimizer state


def _distopt_expected(name: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / "megatron" / f"{name}.expected.safetensors")


def _flip_flattened_record_byte(root) -> tuple[str, str]:
    """Flip a byte in the middle of the record holding a flattened range; (file, key)."""
    reader = ShardReader(root, cache_metadata=False)
    reader.read_metadata()
    index = next(i for i in reader.catalog.items if i.fqn.startswith("optimizer.state.exp_avg.decoder.layers"))
    item, layout = reader.catalog.items[index], reader.catalog.known_layout(index)
    with open(root / item.relative_path, "r+b") as f:
        f.seek(item.offset + layout.payload_offset + layout.payload_nbytes // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    return item.relative_path, index.fqn


@pytest.mark.parametrize("name", DISTOPT_FIXTURES)
def test_verified_load_of_flattened_ranges_checks_their_records(name):
    """Each box of a flattened range is read from its whole record, whose zip CRC-32 is
    checked (before: the box's bytes were taken for a record: "not a readable torch.save
    tensor record")."""
    load_tensors(FIXTURES / "megatron" / name, _distopt_expected(name), verify_checksums=True)


@pytest.mark.parametrize("name", DISTOPT_FIXTURES)
def test_flipped_byte_in_flattened_record_is_caught(tmp_path, name):
    root = tmp_path / name
    shutil.copytree(FIXTURES / "megatron" / name, root)
    before = verify_checkpoint(str(root))
    assert before.ok, before.faults[:3]
    path, key = _flip_flattened_record_byte(root)
    want = _distopt_expected(name)
    err = load_error({key: want[key]}, root, verify_checksums=True)
    assert isinstance(err, CorruptCheckpointError) and "crc32 mismatch" in str(err) and path in str(err)
    after = verify_checkpoint(str(root))
    assert len(after.faults) == 1 and path in after.faults[0] and "crc32 mismatch" in after.faults[0]
    assert after.items_checked == before.items_checked  # every record once, however many boxes it holds


@pytest.mark.parametrize("to", ["dcp", "hf"])
def test_convert_refuses_a_record_its_file_does_not_hold_before_allocating_its_tensor(tmp_path, capsys, to):
    """A ``.metadata`` whose final norm claims 2**44 elements (32 TiB of bfloat16) in a record
    as long, in a file of 78 KB: convert and export allocated the tensor before any read
    found the file short (a traceback: no memory; or the allocation, where it is granted)."""
    root = _real_torch_dist(tmp_path)
    with open(root / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the committed fixture: trusted here
    md = metadata.state_dict_metadata[NORM]
    md.size = md.chunks[0].sizes = torch.Size([2**44])
    index = next(i for i in metadata.storage_data if i.fqn == NORM)
    stored = metadata.storage_data[index]
    metadata.storage_data[index] = dataclasses.replace(stored, length=stored.length + 2**45)
    with open(root / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    assert cli(["convert", str(root), str(tmp_path / "out"), "--to", to]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"file '{stored.relative_path}' key '{NORM}': item needs bytes up to {stored.offset + stored.length + 2**45}" in err


# -- written by Megatron-LM's own save_checkpoint (tests/fixtures/megatron/generate_megatron_lm.py) --
MEGATRON_LM_TORCH_DIST = FIXTURES / "megatron" / "megatron_lm019_torch_dist_tp2"


def test_megatron_lm_torch_dist_checkpoint_loads_bit_exact_with_its_objects():
    """A real training run's torch_dist save: every tensor (model and optimizer state) as
    megatron-core loads it, and its objects through dcp.load: ``common_state`` (args with
    Megatron's enums, as stand-ins without megatron-core), the rerun state machine's state,
    the RNG state pickled under numpy 1."""
    want = load_file(f"{MEGATRON_LM_TORCH_DIST}.expected.safetensors")
    state, reader = load_tensors(MEGATRON_LM_TORCH_DIST, want)
    objects = {key: None for key, md in reader.catalog.metadata.state_dict_metadata.items()
               if isinstance(md, BytesStorageMetadata)}
    assert {"common_state/shard_0_1", "rerun_state_machine_state/shard_0_2", "rng_state/shard_0.1_1.2"} <= set(objects)
    dcp.load(objects, storage_reader=ShardReader(MEGATRON_LM_TORCH_DIST), planner=ShardLoadPlanner(), no_dist=True)
    [common] = objects["common_state/shard_0_1"]
    assert common["iteration"] == 7 and common["args"].tensor_model_parallel_size == 2
    assert common["args"].model_type == megatron_value("megatron.core.enums.ModelType", (1,), None)
    assert common["args"].exit_signal is signal.SIGTERM
    rerun = common["rerun_state_machine"]
    assert isinstance(rerun["mode"], MegatronValue) and rerun["mode"].args == ("validate_results",)
    assert rerun["state"] == megatron_value("megatron.core.rerun_state_machine.RerunState", (0,), None)
    [[rng]] = objects["rng_state/shard_0.1_1.2"]
    assert rng["np_rng_state"][0] == "MT19937"
    assert load_common_state(MEGATRON_LM_TORCH_DIST)["args"] == common["args"]
