"""Megatron zarr checkpoints read through TensorStore."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dcp_ext import ShardReader
from dcp_ext.megatron import IncompleteSaveError, MegatronOptions, load_common_state

from megatron_fixtures import COMMON, write_zarr
from mp import run_job
from support import dtensor_load_job, load_error, load_tensors

QKV = "decoder.layers.self_attention.linear_qkv.weight"


def test_loads_bit_exact_including_bf16(tmp_path):
    want = write_zarr(str(tmp_path))
    state, reader = load_tensors(tmp_path, want, extra=("rng_state/shard_0_1",))
    assert state["rng_state/shard_0_1"] == {"seed": 5}
    assert reader.catalog.format == "zarr"
    assert len(reader.read_metadata().state_dict_metadata[QKV].chunks) == 4  # zarr chunks = DCP chunks
    assert load_common_state(tmp_path)["iteration"] == COMMON["iteration"]


def test_reads_only_the_chunks_it_needs(tmp_path):
    want = write_zarr(str(tmp_path))
    os.remove(tmp_path / QKV / "1.1.0")  # a chunk this load never touches
    norm = "decoder.final_layernorm.weight"
    _, reader = load_tensors(tmp_path, {norm: want[norm]})
    assert reader.stats.files_opened == 1
    err = load_error({QKV: torch.zeros(2, 30, 10)}, tmp_path)
    assert QKV in str(err) and "1.1.0" in str(err)


@pytest.mark.mp
@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_loads_cut_across_zarr_chunks(tmp_path, world):
    want = write_zarr(str(tmp_path))
    run_job(dtensor_load_job, world, str(tmp_path), want)


def test_shape_that_disagrees_with_chunks_is_refused(tmp_path):
    write_zarr(str(tmp_path))
    path = tmp_path / QKV / ".zarray"
    meta = json.loads(path.read_text())
    meta["chunks"] = [1, 7, 10]
    path.write_text(json.dumps(meta))
    with pytest.raises(Exception, match="shape \\[2, 30, 10\\] but chunks \\[1, 7, 10\\]"):
        ShardReader(tmp_path).read_metadata()


def test_missing_metadata_json(tmp_path):
    want = write_zarr(str(tmp_path), complete=False)
    with pytest.raises(IncompleteSaveError, match="metadata.json"):
        ShardReader(tmp_path).read_metadata()
    load_tensors(tmp_path, want, megatron=MegatronOptions(allow_incomplete=True))


def test_two_stage_without_a_process_group_is_an_error(tmp_path):
    from dcp_ext import InvalidRequestError

    from support import sample_state, save

    save(sample_state(), tmp_path)
    with pytest.raises(InvalidRequestError, match=r"two_stage=True\) exchanges bytes between ranks and needs"):
        ShardReader(tmp_path, two_stage=True).read_metadata()
