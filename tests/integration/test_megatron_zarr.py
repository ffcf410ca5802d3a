"""Megatron zarr checkpoints read through TensorStore."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from dcp_ext import CorruptCheckpointError, ShardReader
from dcp_ext.cli.main import main as cli
from dcp_ext.megatron import IncompleteSaveError, MegatronOptions, load_common_state

from megatron_fixtures import COMMON, write_zarr
from mp import run_job
from support import FIXTURES, dtensor_load_job, load_error, load_tensors

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


ZARR_FIXTURE = FIXTURES / "megatron" / "mcore012_zarr_tp2"  # written by megatron-core 0.12.2
EMB = "embedding.word_embeddings.weight"  # shape [18, 10] in chunks [9, 10]: files 0.0 and 1.0


def _real_zarr(tmp_path, zarray_text: str | None = None):
    """A copy of the real fixture, the word embedding's .zarray replaced by ``zarray_text``."""
    root = tmp_path / "ckpt"
    shutil.copytree(ZARR_FIXTURE, root)
    if zarray_text is not None:
        (root / EMB / ".zarray").write_text(zarray_text)
    return root


def _zarray(**changes) -> str:
    return json.dumps(json.loads((ZARR_FIXTURE / EMB / ".zarray").read_text()) | changes)


def test_chunk_grid_its_directory_does_not_hold_is_refused_before_it_is_built(tmp_path):
    # 1,000 chunks claimed, 2 files: enumerated whole before (shape [N, N] in chunks [1, 1]: N**2)
    root = _real_zarr(tmp_path, _zarray(shape=[9000, 10]))
    with pytest.raises(CorruptCheckpointError) as err:
        ShardReader(root).read_metadata()
    assert f"{EMB}/.zarray: array '{EMB}'" in str(err.value)
    assert "has 1,000 chunks, of which its directory holds 2" in str(err.value)


def test_lost_chunk_files_fail_only_the_loads_that_need_them(tmp_path):
    # megatron-core writes every chunk (fill_value None, write_empty_chunks=True)
    root = _real_zarr(tmp_path)
    os.remove(root / EMB / "1.0")
    os.remove(root / "decoder.final_layernorm.weight" / "0")  # its only chunk
    metadata = ShardReader(root).read_metadata()
    assert len(metadata.state_dict_metadata[EMB].chunks) == 2
    err = load_error({EMB: torch.zeros(18, 10)}, root)
    assert EMB in str(err) and "1.0" in str(err)


@pytest.mark.parametrize(
    "text, message",
    [
        (_zarray(dtype=None), "dtype is None, expected a numpy dtype name"),  # np.dtype(None) is float64
        (_zarray(shape=[-18, 10]), r"shape is \[-18, 10\], expected a list of sizes"),  # -18 % 9 == 0
        (_zarray(shape=[18.9, 10]), r"shape is \[18.9, 10\], expected a list of sizes"),  # int() truncated it
        (_zarray(shape=[2**70, 10], chunks=[2**69, 10]), r"shape is \[1180591620717411303424, 10\]"),
        (_zarray(shape=[0]).replace("[0]", "[1e400, 10]"), r"shape is \[inf, 10\]"),
        (_zarray(chunks=[True, 10]), r"chunks is \[True, 10\]"),
        (_zarray(dimension_separator=5), "dimension_separator is 5, expected '.' or '/'"),
        ("[" * 100_000 + "]" * 100_000, "unreadable zarr metadata \\(RecursionError"),
    ],
    ids=["dtype-null", "negative", "float", "2**70", "1e400", "bool", "separator", "nested"],
)
def test_malformed_zarray_is_corruption_naming_the_file(tmp_path, text, message):
    root = _real_zarr(tmp_path, text)
    with pytest.raises(CorruptCheckpointError, match=message) as err:
        ShardReader(root).read_metadata()
    assert str(err.value).startswith(f"{root}/{EMB}/.zarray: ")


def test_an_array_that_lost_its_zarray_is_named_not_dropped(tmp_path):
    """Arrays are found by their .zarray: without it, the tensor vanished from the
    checkpoint (verify said OK, convert copied one key fewer)."""
    ckpt = tmp_path / "zarr"
    shutil.copytree(ZARR_FIXTURE, ckpt)
    os.remove(ckpt / "embedding.word_embeddings.weight" / ".zarray")
    with pytest.raises(CorruptCheckpointError, match=r"embedding.word_embeddings.weight: holds zarr chunk files .* but no .zarray"):
        ShardReader(ckpt).read_metadata()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda root: (root / EMB / "0.0").write_bytes(b"\0\0\0\0" + (root / EMB / "0.0").read_bytes()),
         "the file holds 364 bytes, but its record is 360 bytes"),  # a chunk shifted by 4 bytes
        (lambda root: (root / EMB / ".zarray").write_text(_zarray(dtype="<f2")),
         "the file holds 360 bytes, but its record is 180 bytes"),  # float32 chunks read as float16
    ],
    ids=["chunk-file-longer", "dtype-half-the-size"],
)
def test_a_chunk_file_of_another_size_than_its_chunk_is_refused(tmp_path, capsys, edit, message):
    """A zarr chunk file holds exactly one chunk (megatron-core writes them uncompressed):
    a longer one loaded its first bytes, shifted or reinterpreted, and verify said OK."""
    root = _real_zarr(tmp_path)
    edit(root)
    err = load_error({EMB: torch.zeros(18, 10)}, root)
    assert isinstance(err, CorruptCheckpointError) and f"file '{EMB}/0.0' key '{EMB}': {message}" in str(err)
    assert cli(["verify", str(root)]) == 1
    assert f"FAULT {EMB}/0.0: key '{EMB}': {message}" in capsys.readouterr().out


@pytest.mark.parametrize("to", ["dcp", "hf"])
def test_convert_refuses_a_claim_its_files_do_not_back_before_allocating_it(tmp_path, capsys, to):
    """.zarray claiming [2**41, 10] float32 over two 360-byte chunk files: convert and
    export allocated the 88 TB tensor first (a traceback; or the allocation, where the
    host overcommits) and found the files short only when reading."""
    root = _real_zarr(tmp_path, _zarray(shape=[2**41, 10], chunks=[2**40, 10]))
    assert cli(["convert", str(root), str(tmp_path / "out"), "--to", to]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"file '{EMB}/0.0' key '{EMB}': item needs bytes up to 43980465111040" in err
