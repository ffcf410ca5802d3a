"""``dcp-ext convert`` / ``inspect`` on all three Megatron formats; the result verifies and loads."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from dcp_ext import ShardWriter
from dcp_ext.cli.main import main as cli

from megatron_fixtures import OBJECTS, write_legacy, write_torch_dist, write_zarr
from support import load_tensors

WRITERS = {
    "legacy": lambda root: (write_legacy(root, tp=2, pp=2, num_layers=2), ("args", "iteration")),
    "torch_dist": lambda root: (write_torch_dist(root), tuple(OBJECTS)),
    "zarr": lambda root: (write_zarr(root), ("rng_state/shard_0_1",)),
}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_convert_round_trip_verifies_and_loads(tmp_path, capsys, fmt):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    want, byte_keys = WRITERS[fmt](str(src))
    assert cli(["inspect", "--json", str(src)]) == 0
    listed = {k["key"]: k for k in json.loads(capsys.readouterr().out)["keys"]}
    assert set(want) | set(byte_keys) <= set(listed)
    assert all(listed[k]["shape"] == list(v.shape) for k, v in want.items())
    assert cli(["convert", str(src), str(dst)]) == 0
    assert cli(["verify", str(dst)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("OK:")
    original, _ = load_tensors(src, want, extra=byte_keys)
    converted, reader = load_tensors(dst, want, extra=byte_keys)
    assert reader.catalog.format == "dcp"  # an ordinary DCP checkpoint now
    assert {k: converted[k] for k in byte_keys} == {k: original[k] for k in byte_keys}


def test_convert_reports_bad_partition_rule(tmp_path, capsys):
    assert cli(["convert", str(tmp_path), str(tmp_path / "out"), "--partition-dim", "nodim"]) == 2
    assert capsys.readouterr().err.strip() == "error: --partition-dim 'nodim' is not REGEX=DIM (DIM 0, 1, ... or 'none')"


@pytest.mark.parametrize("writer", ["stock", "ours"])
def test_convert_keeps_the_state_dicts_nesting(tmp_path, writer):
    """DCP records how it flattened a nested state dict (``Metadata.planner_data``); stock
    tools rebuild the nesting from it (``_load_state_dict_from_keys``, ``dcp_to_torch_save``).
    A converted checkpoint recorded none, so they returned dotted keys."""
    state = {"model": {"layer.weight": torch.randn(4, 3)}, "optim": {"state": {"layer.weight": {"step": 3}}}}
    storage = dcp.FileSystemWriter(tmp_path / "src") if writer == "stock" else ShardWriter(tmp_path / "src")
    dcp.save(state, storage_writer=storage, no_dist=True)
    assert cli(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    got = _load_state_dict_from_keys(checkpoint_id=str(tmp_path / "dst"))
    assert sorted(got) == ["model", "optim"] and got["optim"] == {"state": {"layer.weight": {"step": 3}}}
    assert got["model"]["layer.weight"].equal(state["model"]["layer.weight"])
