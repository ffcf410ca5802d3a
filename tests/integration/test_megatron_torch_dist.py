"""Megatron torch_dist checkpoints: completeness, flattened-range tensors, common state."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from dcp_ext import ShardReader
from dcp_ext.megatron import IncompleteSaveError, MegatronOptions, load_common_state

from megatron_fixtures import COMMON, FLAT, OBJECTS, write_torch_dist
from mp import run_job
from support import dtensor_load_job, load_error, load_tensors


@pytest.mark.parametrize("common", ["common.pt", "object"])
def test_loads_bit_exact_with_flattened_tensor_restored(tmp_path, common):
    want = write_torch_dist(str(tmp_path), common=common)
    state, reader = load_tensors(tmp_path, want, extra=tuple(OBJECTS))
    assert tuple(reader.read_metadata().state_dict_metadata[FLAT].size) == (2, 30, 10)
    assert state["decoder.layers.self_attention.core_attention._extra_state/shard_1_2"] == [{"fp8": 1}]
    got = load_common_state(tmp_path)
    assert isinstance(got["args"], argparse.Namespace) and got["iteration"] == COMMON["iteration"]


@pytest.mark.mp
def test_flattened_tensor_loads_into_dtensors(tmp_path):
    want = write_torch_dist(str(tmp_path))
    run_job(dtensor_load_job, 2, str(tmp_path), want)


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
