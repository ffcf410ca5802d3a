"""Safetensors export: read back by the real consumers (safetensors, stock HuggingFaceStorageReader)."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageReader

from dcp_ext import CheckpointError, InvalidRequestError, ShardLoadPlanner, ShardReader, export_safetensors
from dcp_ext.cli.main import main as cli

from megatron_fixtures import write_legacy, write_torch_dist, write_zarr
from support import assert_tensor_equal, garbage_like, save

INDEX = "model.safetensors.index.json"


def mixed_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "embed.weight": torch.randn(37, 16, generator=g),
        "layers.0.w": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "layers.0.b": torch.randn(16, generator=g).half(),
        "layers.1.w": torch.randn(16, 16, generator=g).to(torch.float64),
        "ids": torch.randint(-(2**40), 2**40, (9,), generator=g),
        "mask": torch.rand(5, generator=g) > 0.5,
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "step": 12,
        "name": "run-7",
    }


def tensors_of(state: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def read_with_safetensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of an export through ``safetensors.torch.load_file``, shards per the index."""
    index = json.loads((path / INDEX).read_text())
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        out.update(load_file(path / name))
    assert {k: index["weight_map"][k] for k in out} == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    return out


def assert_tensors_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        assert_tensor_equal(got[key], value, key)


def test_export_of_a_dcp_checkpoint_reads_back_bit_exact_everywhere(tmp_path):
    state = mixed_state()
    save(state, tmp_path / "ckpt")
    report = export_safetensors(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=2500)
    want = tensors_of(state)
    assert report.keys == len(want) and sorted(report.skipped) == ["name", "step"]
    assert len(report.files) >= 3 and report.files[0] == f"model-00001-of-{len(report.files):05d}.safetensors"
    assert sorted(os.listdir(tmp_path / "hf")) == sorted([*report.files, INDEX])
    assert_tensors_equal(read_with_safetensors(tmp_path / "hf"), want)
    with safe_open(tmp_path / "hf" / report.files[0], framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        for key in f.keys():
            assert_tensor_equal(f.get_slice(key)[:], want[key], key)
    dest = {k: garbage_like(v) for k, v in want.items() if v.numel()}
    dcp.load(dest, storage_reader=HuggingFaceStorageReader(str(tmp_path / "hf")))
    assert_tensors_equal(dest, {k: v for k, v in want.items() if v.numel()})
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []


def test_dtype_casts_floating_point_tensors_only_and_filters_select_keys(tmp_path):
    state = mixed_state()
    save(state, tmp_path / "ckpt")
    export_safetensors(tmp_path / "ckpt", tmp_path / "hf", dtype=torch.bfloat16, include=r"^(layers|ids)", exclude=r"\.b$")
    got = read_with_safetensors(tmp_path / "hf")
    assert set(got) == {"layers.0.w", "layers.1.w", "ids"}
    assert_tensor_equal(got["layers.1.w"], state["layers.1.w"].to(torch.bfloat16), "layers.1.w")
    assert_tensor_equal(got["ids"], state["ids"], "ids")  # int64 kept


def test_dtype_that_would_cast_no_tensor_is_refused(tmp_path):
    """A selection without floating-point tensors exported them as they were under a dtype
    that cast nothing (an empty selection is refused the same way)."""
    save(mixed_state(), tmp_path / "ckpt")
    with pytest.raises(InvalidRequestError, match=r"dtype=torch.bfloat16\) \(dcp-ext convert --dtype\) would cast nothing: "
                                                  r"none of the 1 tensors exported \(include='\^ids\$', exclude=None\) is floating-point"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "hf", dtype=torch.bfloat16, include=r"^ids$")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist", "zarr"])
def test_export_of_megatron_formats(tmp_path, fmt):
    writer = {"legacy": lambda r: write_legacy(r, tp=2, pp=2, num_layers=2), "torch_dist": write_torch_dist,
              "zarr": write_zarr}[fmt]
    (tmp_path / "src").mkdir()
    want = writer(str(tmp_path / "src"))
    report = export_safetensors(tmp_path / "src", tmp_path / "hf", max_shard_bytes=4096)
    got = read_with_safetensors(tmp_path / "hf")
    assert_tensors_equal({k: got[k] for k in want}, want)
    assert report.skipped  # args / iteration / objects are listed, not exported


def test_destination_rules_and_failed_exports_leave_nothing(tmp_path):
    state = mixed_state()
    save(state, tmp_path / "ckpt")
    (tmp_path / "taken").mkdir()
    with pytest.raises(InvalidRequestError, match="is an existing directory"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "taken")
    export_safetensors(tmp_path / "ckpt", tmp_path / "taken", overwrite=True)
    assert set(read_with_safetensors(tmp_path / "taken")) == set(tensors_of(state))
    with pytest.raises(InvalidRequestError, match="must be a float dtype"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "x", dtype=torch.int32)
    data_file = next(p for p in (tmp_path / "ckpt").iterdir() if p.suffix == ".distcp")
    data_file.unlink()  # the export fails mid-way
    with pytest.raises(BaseException, match="missing"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "taken"]


def test_overwrite_replaces_the_export_files_and_keeps_the_rest(tmp_path, monkeypatch):
    """``overwrite`` replaced the whole directory: the config.json and tokenizer files the
    README tells users to copy beside an export were deleted, and so was everything in an
    unrelated directory. Now only the export's own files change, as with save_pretrained."""
    state = mixed_state()
    save(state, tmp_path / "ckpt")
    out = tmp_path / "real"
    export_safetensors(tmp_path / "ckpt", out, max_shard_bytes=1000)  # several shards
    (out / "config.json").write_text("{}")
    (out / "tokenizer").mkdir()
    (out / "tokenizer" / "vocab.txt").write_text("a b")
    (out / "readme.link").symlink_to("config.json")
    (tmp_path / "link").symlink_to(out)  # a symlinked destination: the export lands where it points
    export_safetensors(tmp_path / "ckpt", tmp_path / "link", overwrite=True, include="embed")
    assert (tmp_path / "link").is_symlink()
    assert sorted(os.listdir(out)) == ["config.json", "model-00001-of-00001.safetensors", INDEX, "readme.link", "tokenizer"]
    assert (out / "tokenizer" / "vocab.txt").read_text() == "a b" and os.readlink(out / "readme.link") == "config.json"
    assert_tensors_equal(read_with_safetensors(out), {"embed.weight": state["embed.weight"]})
    monkeypatch.chdir(out / "tokenizer")  # the directory the export would move holds the current one
    with pytest.raises(InvalidRequestError, match="holds the current directory"):
        export_safetensors(tmp_path / "ckpt", out, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "link", "real"]


def test_overwrite_refuses_a_destination_holding_a_mount_point(tmp_path):
    """The swap moved the directory and then removed the old one: the files on a file
    system mounted inside it were deleted, and the removal failed (EBUSY) after the export
    had been published."""
    import subprocess

    save(mixed_state(), tmp_path / "ckpt")
    mount = tmp_path / "out" / "data"
    mount.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mount)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        (mount / "precious.txt").write_text("kept")
        with pytest.raises(InvalidRequestError, match="data is a mount point, which the export cannot replace"):
            export_safetensors(tmp_path / "ckpt", tmp_path / "out", overwrite=True)
        assert (mount / "precious.txt").read_text() == "kept" and sorted(os.listdir(tmp_path)) == ["ckpt", "out"]
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_an_export_never_replaces_its_source(tmp_path):
    """Before, ``overwrite=True`` into the source (or a directory holding it) replaced it
    with the export: the checkpoint was gone."""
    state = mixed_state()
    save(state, tmp_path / "runs" / "ckpt")
    for target in (tmp_path / "runs" / "ckpt", tmp_path / "runs"):
        with pytest.raises(InvalidRequestError, match="holds the source checkpoint"):
            export_safetensors(tmp_path / "runs" / "ckpt", target, overwrite=True)
    assert cli(["convert", str(tmp_path / "runs" / "ckpt"), str(tmp_path / "runs"), "--to", "hf", "--overwrite"]) == 2
    want = tensors_of(state)
    got = {k: garbage_like(v) for k, v in want.items()}
    dcp.load(got, storage_reader=ShardReader(tmp_path / "runs" / "ckpt"), planner=ShardLoadPlanner(), no_dist=True)
    assert_tensors_equal(got, want)


def test_a_tensor_its_chunks_do_not_cover_is_refused_not_exported_with_garbage(tmp_path):
    """A stock .metadata naming a larger tensor than its chunks hold (a custom planner that
    dropped a rank's items): a load leaves the rest as it was, an export would write
    uninitialized memory."""
    dcp.save({"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(tmp_path / "ckpt"))
    with open(tmp_path / "ckpt" / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    metadata.state_dict_metadata["w"].size = torch.Size([5, 4])
    with open(tmp_path / "ckpt" / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(CheckpointError, match=r"ckpt: key 'w': the checkpoint holds 12 of the 20 elements this rank's destination needs"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_key_safetensors_reserves_is_refused_before_writing(tmp_path):
    """``__metadata__`` is the header's string map: a tensor under it made a file that
    safetensors itself cannot open."""
    save({"w": torch.zeros(3), "__metadata__": torch.ones(2)}, tmp_path / "ckpt")  # after a tensor: the message names the checkpoint
    with pytest.raises(InvalidRequestError, match=f"{tmp_path / 'ckpt'}: key '__metadata__': safetensors reserves this name"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    export_safetensors(tmp_path / "ckpt", tmp_path / "out", exclude="^__metadata__$")
    assert_tensors_equal(read_with_safetensors(tmp_path / "out"), {"w": torch.zeros(3)})


def test_cli_convert_to_hf_exports_tensors_and_names_skipped_items(tmp_path, capsys):
    state = mixed_state()
    save(state, tmp_path / "ckpt")
    argv = ["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "hf", "--max-shard-size", "2KB"]
    assert cli(argv) == 0
    out = capsys.readouterr().out
    assert "exported 8 tensors" in out and "skipped 2 non-tensor items: step, name" in out
    assert_tensors_equal(read_with_safetensors(tmp_path / "hf"), tensors_of(state))
    assert cli(["convert", str(tmp_path / "ckpt"), str(tmp_path / "d"), "--dtype", "bfloat16"]) == 2
    assert capsys.readouterr().err.strip() == "error: --dtype only applies with --to hf"
    assert cli([*argv[:2], str(tmp_path / "h2"), "--to", "hf", "--max-shard-size", "lots"]) == 2
    assert "--max-shard-size 'lots' is not a size" in capsys.readouterr().err
    assert cli([*argv[:2], str(tmp_path / "h3"), "--to", "hf", "--max-shard-size", "0.5B"]) == 2  # rounds to 0 bytes
    assert "--max-shard-size '0.5B' is not a size" in capsys.readouterr().err


def test_packed_float4_exports_as_safetensors_writes_it(tmp_path):
    """F4, its header shape counting 4-bit values, as the safetensors library writes and
    reads it; a cast to another dtype, which torch cannot make, is refused naming the key
    (it failed with a NotImplementedError traceback)."""
    w4 = torch.randint(0, 256, (4, 6), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    save({"w4": w4, "other": torch.randn(3)}, tmp_path / "ckpt")
    export_safetensors(tmp_path / "ckpt", tmp_path / "hf")
    [name] = [n for n in os.listdir(tmp_path / "hf") if n.endswith(".safetensors")]
    got = load_file(str(tmp_path / "hf" / name))
    assert got["w4"].dtype == torch.float4_e2m1fn_x2 and torch.equal(got["w4"].view(torch.uint8), w4.view(torch.uint8))
    with pytest.raises(InvalidRequestError, match="key 'w4': torch cannot cast torch.float4_e2m1fn_x2 to torch.bfloat16"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "hf16", dtype=torch.bfloat16)
    assert not os.path.exists(tmp_path / "hf16")


def test_a_damaged_key_left_out_does_not_stop_the_export(tmp_path):
    """The export checks that the files hold the records of the keys it copies before it
    allocates them; a check of every key refused an export that excluded the damaged one."""
    src = tmp_path / "ckpt"
    want = torch.arange(1000.0)
    dcp.save({"keep": want, "zz_broken": torch.ones(1000)}, storage_writer=dcp.FileSystemWriter(src), no_dist=True)
    [data] = [src / n for n in os.listdir(src) if n.endswith(".distcp")]
    os.truncate(data, os.path.getsize(data) - 100)  # the last record only: zz_broken's
    export_safetensors(src, tmp_path / "hf", exclude="zz_broken")
    [name] = [n for n in os.listdir(tmp_path / "hf") if n.endswith(".safetensors")]
    assert list(load_file(str(tmp_path / "hf" / name))) == ["keep"]
    assert torch.equal(load_file(str(tmp_path / "hf" / name))["keep"], want)
    with pytest.raises(CheckpointError, match=r"key 'zz_broken': item needs bytes up to \d+ but the file has"):
        export_safetensors(src, tmp_path / "hf_all")
