"""The dcp-ext command line: inspect, verify and the demo job, run as real processes."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import sample_state, save

from dcp_ext.formats.index import INDEX_NAME


def dcp_ext_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dcp_ext.cli.main", *args], capture_output=True, text=True, timeout=300)


def test_inspect_lists_every_key(tmp_path):
    save(sample_state(), tmp_path)
    result = dcp_ext_cli("inspect", "--json", str(tmp_path))
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    keys = {k["key"]: k for k in info["keys"]}
    assert set(keys) == {"w", "b", "ids", "nested.h", "nested.step", "name"}
    assert keys["w"]["shape"] == [64, 48] and keys["w"]["dtype"] == "float32" and keys["b"]["dtype"] == "bfloat16"
    assert info["index"] is True
    table = dcp_ext_cli("inspect", str(tmp_path))
    assert table.returncode == 0 and "nested.h" in table.stdout and "float16" in table.stdout


@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_verify_passes_a_good_checkpoint(tmp_path, writer):
    if writer == "ours":
        save(sample_state(), tmp_path)
    else:
        dcp.save(sample_state(), storage_writer=dcp.FileSystemWriter(tmp_path))
    result = dcp_ext_cli("verify", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("OK:")


def test_verify_reports_each_fault_with_file_and_key(tmp_path):
    save({"a": torch.arange(1000.0), "b": torch.ones(300)}, tmp_path, thread_count=1)
    data_file = next(p for p in tmp_path.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 3] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    result = dcp_ext_cli("verify", str(tmp_path))
    assert result.returncode == 1
    faults = [line for line in result.stdout.splitlines() if line.startswith("FAULT")]
    assert len(faults) == 1 and data_file.name in faults[0] and "mismatch" in faults[0]
    data_file.unlink()
    result = dcp_ext_cli("verify", "--json", str(tmp_path))
    report = json.loads(result.stdout)
    assert result.returncode == 1 and not report["ok"]
    assert any(data_file.name in f and "missing" in f for f in report["faults"])


def test_verify_reports_overlapping_and_missing_chunks(tmp_path):
    save({"t": torch.arange(12.0).reshape(4, 3)}, tmp_path)
    with open(tmp_path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    metadata.state_dict_metadata["t"].size = torch.Size([5, 3])  # one row no chunk covers
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    os.unlink(tmp_path / INDEX_NAME)
    result = dcp_ext_cli("verify", str(tmp_path))
    assert result.returncode == 1 and "t: chunks cover 12 elements of 15" in result.stdout


def test_verify_of_a_directory_without_checkpoint_fails(tmp_path):
    result = dcp_ext_cli("verify", str(tmp_path))
    assert result.returncode == 1 and ".metadata is missing" in result.stdout


@pytest.mark.slow
def test_demo_job_round_trips_bit_exact(tmp_path):
    result = dcp_ext_cli("demo", "--json", "--workdir", str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["ok"] and report["mismatches"] == [] and report["tensors_checked"] > 100
    assert report["save_world"] == 4 and report["load_world"] == 2
