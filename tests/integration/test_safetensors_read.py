"""ShardReader opens Hugging Face safetensors checkpoints written by the real producers:
``safetensors.torch.save_file``, ``huggingface_hub.save_torch_state_dict`` (sharded, with
``model.safetensors.index.json``) and stock ``HuggingFaceStorageWriter`` (multi-process,
with its DCP sharding info), at 1, 2 and 4 processes, bit-exact."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_ext import CheckpointError, CorruptCheckpointError, ShardLoadPlanner, ShardReader
from dcp_ext.cli.main import main as cli

from mp import run_job
from support import assert_tensor_equal, dtensor_load_job, load_tensors


def model_tensors() -> dict[str, torch.Tensor]:
    """Odd sizes so that DTensor shards cut across rows and columns unevenly."""
    g = torch.Generator().manual_seed(11)
    return {
        "embed.weight": torch.randn(19, 12, generator=g),
        "layers.0.attn.qkv.weight": torch.randn(30, 12, generator=g).to(torch.bfloat16),
        "layers.0.attn.qkv.bias": torch.randn(30, generator=g).half(),
        "layers.0.mlp.fc1.weight": torch.randn(14, 12, generator=g),
        "layers.0.norm.weight": torch.randn(12, generator=g).to(torch.bfloat16),
        "position_ids": torch.arange(21, dtype=torch.int64),
        "mask": torch.rand(9, generator=g) > 0.5,
    }


def write(producer: str, path: str) -> dict[str, torch.Tensor]:
    tensors = model_tensors()
    if producer == "save_file":
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    elif producer == "huggingface_hub":
        os.makedirs(path, exist_ok=True)
        save_torch_state_dict(tensors, path, max_shard_size=1000)  # several shards + index
    return tensors


@pytest.mark.parametrize("producer", ["save_file", "huggingface_hub"])
def test_loads_bit_exact_reading_only_the_tensor_bytes(tmp_path, producer):
    want = write(producer, str(tmp_path))
    if producer == "huggingface_hub":
        assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 2
    _, reader = load_tensors(tmp_path, want)
    assert reader.stats.bytes_read == sum(t.numel() * t.element_size() for t in want.values())
    part = {"layers.0.mlp.fc1.weight": want["layers.0.mlp.fc1.weight"]}
    assert load_tensors(tmp_path, part)[1].stats.files_opened == 1


def test_destination_dtype_is_cast_as_stock_dcp_does(tmp_path):
    want = write("save_file", str(tmp_path))
    state = {"layers.0.attn.qkv.weight": torch.full((30, 12), 7.0, dtype=torch.float32)}
    dcp.load(state, storage_reader=ShardReader(tmp_path), planner=ShardLoadPlanner())
    assert_tensor_equal(state["layers.0.attn.qkv.weight"], want["layers.0.attn.qkv.weight"].float(), "qkv")


@pytest.mark.mp
@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_loads_at_2_and_4_processes(tmp_path, world):
    want = write("huggingface_hub", str(tmp_path))
    run_job(dtensor_load_job, world, str(tmp_path), want)


@pytest.mark.mp
def test_two_stage_reads_each_byte_once_per_group(tmp_path):
    want = write("huggingface_hub", str(tmp_path))
    stats = run_job(dtensor_load_job, 2, str(tmp_path), want, True)
    assert sum(s.bytes_read for s in stats) == sum(t.numel() * t.element_size() for t in want.values())


def hf_writer_job(rank: int, world: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(4)
    full = {"w": torch.randn(7, 4, generator=g), "b": torch.randn(3, 5, generator=g).to(torch.bfloat16)}
    state = {"w": distribute_tensor(full["w"], mesh, [Shard(0)]), "b": distribute_tensor(full["b"], mesh, [Shard(1)])}
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))


@pytest.mark.mp
def test_stock_hugging_face_writer_output_with_dcp_offsets_loads_resharded(tmp_path):
    run_job(hf_writer_job, 2, str(tmp_path))
    g = torch.Generator().manual_seed(4)
    want = {"w": torch.randn(7, 4, generator=g), "b": torch.randn(3, 5, generator=g).to(torch.bfloat16)}
    metadata = ShardReader(tmp_path).read_metadata()
    assert [len(metadata.state_dict_metadata[k].chunks) for k in ("w", "b")] == [2, 2]
    load_tensors(tmp_path, want)  # 2 -> 1 process
    run_job(dtensor_load_job, 4, str(tmp_path), want)  # 2 -> 4 processes


@pytest.mark.mp
def test_a_missing_file_of_a_distributed_hugging_face_save_is_refused_not_left_as_a_hole(tmp_path):
    """The global shape is inferred from the pieces, so a lost file would leave rows of the
    destination unloaded (stock HuggingFaceStorageReader does that silently)."""
    run_job(hf_writer_job, 2, str(tmp_path))
    victim = next(p for p in sorted(tmp_path.glob("shard-00001-*.safetensors")))
    victim.unlink()
    with pytest.raises(CorruptCheckpointError, match=r"w: chunks cover 12 elements of 28 \(key 'w' in shard-00002-"):
        ShardReader(tmp_path).read_metadata()


def test_shards_of_an_earlier_save_that_the_index_does_not_name_are_not_read(tmp_path):
    """A re-sharded model downloaded over an older one: the index says which files count."""
    old = {k: torch.full_like(v, 7) for k, v in model_tensors().items()}
    os.makedirs(tmp_path / "old")
    save_torch_state_dict(old, tmp_path / "old", max_shard_size=600)
    want = write("huggingface_hub", str(tmp_path / "model"))
    for stale in (tmp_path / "old").glob("*.safetensors"):
        assert not (tmp_path / "model" / stale.name).exists()
        stale.rename(tmp_path / "model" / stale.name)
    load_tensors(tmp_path / "model", want)
    index = json.loads((tmp_path / "model" / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: f"./{v}" for k, v in index["weight_map"].items()}  # transformers joins these too
    (tmp_path / "model" / "model.safetensors.index.json").write_text(json.dumps(index))
    load_tensors(tmp_path / "model", want)


def test_a_key_in_two_files_without_an_index_is_refused_naming_both(tmp_path):
    want = write("save_file", str(tmp_path))
    save_file({"mask": want["mask"]}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(CorruptCheckpointError, match=r"mask: chunks cover 18 elements of 9 \(key 'mask' in extra.safetensors, model.safetensors\)"):
        ShardReader(tmp_path).read_metadata()


def test_a_load_reports_the_checkpoints_fault_again_when_dcp_asks_for_per_rank_metadata(tmp_path):
    """After a failed read_metadata() DCP asks for the rank's own ``__0.metadata``: the
    answer is the first fault again, not "neither .metadata nor __0.metadata"."""
    want = write("save_file", str(tmp_path))
    save_file({"mask": want["mask"]}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(BaseException) as info:
        load_tensors(tmp_path, want)
    assert str(info.value).count("chunks cover 18 elements of 9") == 2 and "__0.metadata" not in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu])  # e8m0: was "corrupt"
def test_fnuz_and_mx_float8_files_written_by_safetensors_load_bit_exact(tmp_path, dtype):
    want = {"a": torch.randn(5, 3).to(dtype), "b": torch.randn(4).to(dtype)}
    save_file(want, str(tmp_path / "model.safetensors"))
    got = load_file(str(tmp_path / "model.safetensors"))
    out, _ = load_tensors(tmp_path, want)
    for key in want:
        assert torch.equal(out[key].view(torch.uint8), got[key].view(torch.uint8))


def test_cli_inspect_verify_and_export_round_trip(tmp_path, capsys):
    want = write("huggingface_hub", str(tmp_path / "hf"))
    assert cli(["inspect", "--json", str(tmp_path / "hf")]) == 0
    keys = {k["key"]: k for k in json.loads(capsys.readouterr().out)["keys"]}
    assert set(keys) == set(want) and keys["embed.weight"]["shape"] == [19, 12]
    assert cli(["verify", str(tmp_path / "hf")]) == 0
    assert "items carry no checksum" in capsys.readouterr().out
    assert cli(["convert", str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 0
    assert cli(["convert", str(tmp_path / "dcp"), str(tmp_path / "back"), "--to", "hf"]) == 0
    load_tensors(tmp_path / "dcp", want)
    load_tensors(tmp_path / "back", want)


def test_verify_checksums_is_refused_not_ignored(tmp_path):
    want = write("save_file", str(tmp_path))
    with pytest.raises(BaseException) as info:
        load_tensors(tmp_path, want, verify_checksums=True)
    assert "verify_checksums=True" in str(info.value) and "records no checksums" in str(info.value)


# -- bad input --------------------------------------------------------------------------------
def header_of(path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def rewrite(path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def corrupt(kind: str, path) -> None:
    header, data = header_of(path)
    if kind == "truncated":
        path.write_bytes(path.read_bytes()[:-40])
    elif kind == "offsets outside the file":
        header["mask"]["data_offsets"] = [len(data) - 4, len(data) + 5]
        rewrite(path, header, data)
    elif kind == "overlapping tensors":
        begin = header["embed.weight"]["data_offsets"][0]
        header["position_ids"]["data_offsets"] = [begin, begin + 21 * 8]
        rewrite(path, header, data)
    elif kind == "header over 100 MB":
        path.write_bytes(struct.pack("<Q", 100_000_001) + path.read_bytes()[8:])
    elif kind == "size disagrees with shape":
        header["mask"]["shape"] = [10]
        rewrite(path, header, data)
    elif kind == "dtype not a string":
        header["mask"]["dtype"] = ["BOOL"]
        rewrite(path, header, data)
    elif kind == "header length one short":  # the JSON still parses (padded with a space): every tensor a byte off
        text = json.dumps(header).encode() + b" "
        path.write_bytes(struct.pack("<Q", len(text) - 1) + text + data)
    elif kind == "bytes after the last tensor":
        rewrite(path, header, data + b"junk")
    elif kind == "deeply nested header":
        text = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    elif kind == "a field twice":  # json.loads keeps the last; the safetensors loader refuses the file
        text = json.dumps(header).encode().replace(b'"shape": [', b'"shape": [2], "shape": [', 1)
        path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    elif kind == "__metadata__ a list":
        rewrite(path, header | {"__metadata__": []}, data)
    elif kind == "a size-0 tensor 2**70 wide":  # no bytes, but no torch.Size holds it either
        rewrite(path, header | {"empty": {"dtype": "F32", "shape": [0, 2**70], "data_offsets": [0, 0]}}, data)
    elif kind in SHARDING_INFO:
        sharding = {key: {"saved_offsets": [0] * len(entry["shape"])} for key, entry in header.items() if key != "__metadata__"}
        first = next(iter(sharding))
        text = SHARDING_INFO[kind](json.dumps(sharding), first)
        rewrite(path, header | {"__metadata__": {"DCP_SHARDING_INFO": text}}, data)


SHARDING_INFO = {  # how stock's HuggingFaceStorageWriter's per-key chunk offsets may be damaged
    "offsets as text": lambda text, key: text.replace(f'"{key}": {{"saved_offsets": [0', f'"{key}": {{"saved_offsets": ["0"', 1),
    "offsets as floats": lambda text, key: text.replace(f'"{key}": {{"saved_offsets": [0', f'"{key}": {{"saved_offsets": [2.7', 1),
    "sharding info nested deep": lambda text, key: '{"a":' + "[" * 100_000 + "]" * 100_000 + "}",
}


@pytest.mark.parametrize("kind, message", [
    ("truncated", r"key '[\w.]+': bytes .* past the end of the data \(\d+ bytes; truncated\?\)"),
    ("offsets outside the file", r"'mask'.*past the end of the data"),
    ("overlapping tensors", r"tensors '\w[\w.]*' and '\w[\w.]*' overlap"),
    ("header length one short", r"data bytes \[\d+, \d+\) belong to no tensor \(at the end\)"),
    ("bytes after the last tensor", r"data bytes \[\d+, \d+\) belong to no tensor \(at the end\)"),
    ("header over 100 MB", r"header claims 100000001 bytes"),
    ("size disagrees with shape", r"key 'mask': data_offsets .* hold 9 bytes, but BOOL \[10\] needs 10"),
    ("dtype not a string", r"key 'mask': dtype \['BOOL'\] is none of the safetensors dtypes"),
    ("deeply nested header", r"header is not valid JSON \(RecursionError"),
    ("a field twice", r"header is not valid JSON \(ValueError: repeated field 'shape'\)"),
    ("__metadata__ a list", r"__metadata__ must map strings to strings"),
    ("a size-0 tensor 2**70 wide", r"key 'empty': invalid shape \[0, 1180591620717411303424\]"),
    ("offsets as text", r"DCP_SHARDING_INFO gives offsets \['0'"),
    ("offsets as floats", r"DCP_SHARDING_INFO gives offsets \[2.7"),
    ("sharding info nested deep", r"unreadable DCP_SHARDING_INFO in __metadata__ \(RecursionError"),
])
def test_bad_files_get_a_clear_error_naming_file_and_key(tmp_path, kind, message):
    write("save_file", str(tmp_path))
    corrupt(kind, tmp_path / "model.safetensors")
    with pytest.raises(CorruptCheckpointError, match=message) as info:
        ShardReader(tmp_path).read_metadata()
    assert "model.safetensors" in str(info.value)


def test_key_in_the_index_but_not_in_its_file_is_refused(tmp_path):
    write("huggingface_hub", str(tmp_path))
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.weight"] = next(iter(index["weight_map"].values()))
    index_path.write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match=r"index.json: key 'lm_head.weight' is mapped to 'model-0000\d"):
        ShardReader(tmp_path).read_metadata()


def test_a_directory_with_neither_metadata_nor_safetensors_is_no_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"\.metadata is missing"):
        ShardReader(tmp_path).read_metadata()


def test_verify_notes_a_shard_the_index_leaves_out(tmp_path):
    """Stock HuggingFaceStorageReader reads every *.safetensors file, the index ignored:
    a stray shard could give it other data than ours, and verify said a plain OK."""
    from dcp_ext.storage.verify import verify_checkpoint

    write("huggingface_hub", str(tmp_path))
    save_file({"extra": torch.ones(3)}, tmp_path / "model-00099-of-00099.safetensors")
    report = verify_checkpoint(str(tmp_path))
    assert report.ok and report.unreferenced_files == ["model-00099-of-00099.safetensors"]


def _float4(*shape: int, seed: int) -> torch.Tensor:
    """Packed float4 (two 4-bit values a byte): random bytes, as torch has no fill for it."""
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).view(
        torch.float4_e2m1fn_x2)


def test_packed_float4_written_by_safetensors_loads_bit_exact(tmp_path):
    """safetensors writes a (4, 6) float4_e2m1fn_x2 tensor as F4 of shape [4, 12] (it counts
    4-bit values): the file was called corrupt, every key of it lost."""
    want = {"w4": _float4(4, 6, seed=0), "other": torch.randn(3)}
    save_file(want, str(tmp_path / "model.safetensors"))
    header, _ = header_of(tmp_path / "model.safetensors")
    assert header["w4"]["dtype"] == "F4" and header["w4"]["shape"] == [4, 12]
    out = {"w4": _float4(4, 6, seed=1), "other": torch.full((3,), 7.0)}
    dcp.load(out, storage_reader=ShardReader(tmp_path), planner=ShardLoadPlanner(), no_dist=True)
    got = load_file(str(tmp_path / "model.safetensors"))
    assert out["w4"].shape == got["w4"].shape == (4, 6)
    assert torch.equal(out["w4"].view(torch.uint8), got["w4"].view(torch.uint8)) and torch.equal(out["other"], got["other"])


@pytest.mark.parametrize("dtype, shape, error, message", [
    ("F6_E2M3", [4], CheckpointError, "key 'w': dtype F6_E2M3 has no torch dtype to load it into"),
    ("F4", [3], CorruptCheckpointError, r"key 'w': F4 shape \[3\] does not pack into bytes"),
])
def test_safetensors_dtypes_torch_cannot_hold_are_named(tmp_path, dtype, shape, error, message):
    write("save_file", str(tmp_path))
    header, data = header_of(tmp_path / "model.safetensors")
    rewrite(tmp_path / "model.safetensors", header | {"w": {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]}}, data)
    with pytest.raises(error, match=message) as err:
        ShardReader(tmp_path).read_metadata()
    assert type(err.value) is error
