"""Every format the reader opens goes through the one read path: catalog of byte ranges,
then an executor. So two-stage loads, stats and the checksum option behave alike for
DCP (ours, stock, Megatron torch_dist), Megatron zarr and legacy, and safetensors.

Checkpoints: the real megatron-core fixtures (torch_dist 0.16.1, zarr 0.12.2), a legacy
checkpoint of ``torch.save``d rank files, a stock DCP save, and safetensors written by the
``safetensors`` library; expected values come from those producers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from dcp_ext import InvalidRequestError, ShardLoadPlanner, ShardReader

from megatron_fixtures import write_legacy
from mp import run_job
from support import FIXTURES, assert_tensor_equal, garbage_like

MEGATRON_FIXTURES = FIXTURES / "megatron"


def _stock(path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    want = {"a": torch.randn(64, 48, generator=g), "b": torch.randn(300, generator=g).to(torch.bfloat16)}
    dcp.save(want, storage_writer=dcp.FileSystemWriter(str(path)))
    return want


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    path.mkdir()
    save_file({"w": torch.randn(96, 40, generator=g), "n": torch.randn(40, generator=g).half()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    return load_file(str(path / "model.safetensors"))


def _legacy(path: Path) -> dict[str, torch.Tensor]:
    path.mkdir()
    return write_legacy(str(path), tp=2, pp=1, num_layers=2)


def _fixture(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(MEGATRON_FIXTURES / f"{name}.expected.safetensors"))


FORMATS = {
    # name: (make or locate the checkpoint -> (path, expected tensors), records checksums)
    "dcp-stock": (lambda tmp: (tmp / "ckpt", _stock(tmp / "ckpt")), True),
    "torch_dist": (lambda tmp: (MEGATRON_FIXTURES / "mcore016_tp2_dp2_ep2", _fixture("mcore016_tp2_dp2_ep2")), True),
    "zarr": (lambda tmp: (MEGATRON_FIXTURES / "mcore012_zarr_tp2", _fixture("mcore012_zarr_tp2")), False),
    "legacy": (lambda tmp: (tmp / "ckpt", _legacy(tmp / "ckpt")), False),
    "safetensors": (lambda tmp: (tmp / "ckpt", _safetensors(tmp / "ckpt")), False),
}


def _load_everything(rank: int, world: int, path: str, want: dict[str, torch.Tensor], two_stage: bool) -> int:
    """Every rank loads every tensor (data-parallel replicas); returns bytes read from storage."""
    state = {k: garbage_like(v) for k, v in want.items()}
    reader = ShardReader(path, two_stage=two_stage)
    dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner())
    for key, value in want.items():
        assert_tensor_equal(state[key], value, f"rank {rank} {key}")
    return reader.stats.bytes_read


@pytest.mark.mp
@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_two_stage_reads_each_byte_once_per_group_in_every_format(tmp_path, fmt):
    path, want = FORMATS[fmt][0](tmp_path)
    plain = run_job(_load_everything, 2, str(path), want, False)
    exchanged = run_job(_load_everything, 2, str(path), want, True)
    needed = sum(v.nbytes for v in want.values())
    assert plain[0] == plain[1] >= needed  # each replica read everything itself (small holes read through)
    assert sum(exchanged) == needed  # together they read each needed byte once


@pytest.mark.parametrize("fmt", FORMATS)
def test_verified_loads_check_checksums_or_say_the_format_has_none(tmp_path, fmt):
    path, want = FORMATS[fmt][0](tmp_path)
    state = {k: garbage_like(v) for k, v in want.items()}
    reader = ShardReader(path, verify_checksums=True)
    if FORMATS[fmt][1]:
        dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner())
        for key, value in want.items():
            assert_tensor_equal(state[key], value, key)
    else:  # the option cannot take effect: refused when the metadata is opened
        with pytest.raises(InvalidRequestError, match=rf"verify_checksums=True, but a {fmt} checkpoint records no checksums"):
            reader.read_metadata()


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_reports_its_reads(tmp_path, fmt):
    """Stats and reports come from the one path: a load of one tensor reads about its bytes."""
    path, want = FORMATS[fmt][0](tmp_path)
    key, value = max(want.items(), key=lambda kv: kv[1].nbytes)
    state = {key: garbage_like(value)}
    reader = ShardReader(path, cache_metadata=False)
    dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner())
    assert_tensor_equal(state[key], value, key)
    report = reader.last_report
    assert report is not None and report.items_read >= 1 and report.metadata_reads == 1
    assert value.nbytes <= report.bytes_read <= value.nbytes + (64 << 10)  # record headers at most


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_loads_from_an_fsspec_url(tmp_path, fmt):
    """The same catalogs and executors serve fsspec URLs (here fsspec's in-memory store)."""
    import fsspec

    path, want = FORMATS[fmt][0](tmp_path)
    url = f"memory://one-read-path/{fmt}"
    memory = fsspec.filesystem("memory")
    memory.put(str(path), url, recursive=True)
    try:
        state = {k: garbage_like(v) for k, v in want.items()}
        dcp.load(state, storage_reader=ShardReader(url, require_commit_marker=False), planner=ShardLoadPlanner())
        for key, value in want.items():
            assert_tensor_equal(state[key], value, key)
    finally:
        memory.rm(url, recursive=True)
