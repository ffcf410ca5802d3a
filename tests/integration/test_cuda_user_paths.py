"""What users do with CUDA tensors beyond one load or one save: async saves while training
goes on, tensors produced on a side stream, module parameters, two ranks on a GPU through
the two-stage and shared-metadata readers, and the real producers' checkpoints loaded
into device memory.

Every test needs a CUDA device and is skipped without one (CI has none); they run where a
GPU is lent, and the closing notes give those runs.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter

from mp import run_job
from support import FIXTURES, assert_tensor_equal, garbage_like

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(2500, 4096, generator=g),  # 39 MiB: more than one staging buffer
        "rows": torch.randn(1000, 33, generator=g),
        "bf16": torch.randn(333, 7, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1 << 40, (999,), generator=g),
        "flag": torch.rand(100, generator=g) > 0.5,
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.25),
        "step": 7,
    }


def _on_cuda(state: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _assert_loads_into_cuda(path, want: dict, **reader_kwargs) -> None:
    dest = {k: garbage_like(v).cuda() if isinstance(v, torch.Tensor) else 0 for k, v in want.items()}
    dcp.load(dest, storage_reader=ShardReader(path, **reader_kwargs), planner=ShardLoadPlanner())
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert dest[key].is_cuda, key
            assert_tensor_equal(dest[key].cpu(), value, key)
        else:
            assert dest[key] == value, key


def _async_job(rank: int, world: int, base: str) -> None:
    for executor in (AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS):
        for step in range(2):  # the second save of an executor reuses what the first set up
            path = f"{base}/{executor.value}_{step}"
            state = _on_cuda(_state(step))
            future = dcp.async_save(state, storage_writer=ShardWriter(path), planner=ShardSavePlanner(),
                                    async_checkpointer_type=executor)
            for value in state.values():  # training goes on while the upload runs
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    value.add_(1)
            future.result()
            _assert_loads_into_cuda(path, _state(step))


@pytest.mark.mp
@CUDA
def test_cuda_async_saves_keep_the_values_of_their_step(tmp_path):
    run_job(_async_job, 1, str(tmp_path))


@CUDA
def test_cuda_work_queued_on_the_callers_stream_is_saved_and_loaded_in_order(tmp_path):
    """A save inside ``torch.cuda.stream(s)`` sees the values that s's queued kernels make;
    a load there lands after s's queued writes to the destination, and is complete for the
    default stream when ``dcp.load`` returns."""
    side = torch.cuda.Stream()
    a = torch.randn(2048, 2048, device="cuda")
    with torch.cuda.stream(side):
        side.wait_stream(torch.cuda.current_stream())
        x = a
        for _ in range(30):  # a long queue of work on the side stream
            x = torch.tanh(x @ a) * 0.5
        dcp.save({"x": x}, storage_writer=ShardWriter(tmp_path))
        want = x.cpu()
    torch.cuda.synchronize()
    dest = torch.full((2048, 2048), float("nan"), device="cuda")
    dcp.load({"x": dest}, storage_reader=ShardReader(tmp_path), planner=ShardLoadPlanner())
    assert torch.equal(dest.cpu(), want)  # .cpu() runs on the default stream
    late = torch.empty(2048, 2048, device="cuda")
    with torch.cuda.stream(side):
        late.copy_(torch.tanh(a @ a))  # queued before the load: the load must land after it
        dcp.load({"x": late}, storage_reader=ShardReader(tmp_path), planner=ShardLoadPlanner())
    torch.cuda.synchronize()
    assert torch.equal(late.cpu(), want)


@CUDA
@pytest.mark.parametrize("planner", [ShardLoadPlanner, lambda: None], ids=["ours", "default"])
def test_cuda_module_parameters_load_and_train_on(tmp_path, planner):
    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).cuda()

    saved, x = model(0), torch.randn(5, 64, device="cuda")
    dcp.save(saved.state_dict(), storage_writer=ShardWriter(tmp_path))
    for parameters in (lambda m: m.state_dict(), lambda m: dict(m.named_parameters())):
        loaded = model(1)
        dcp.load(parameters(loaded), storage_reader=ShardReader(tmp_path), planner=planner())
        assert all(p.requires_grad for p in loaded.parameters())
        out = loaded(x)
        assert torch.equal(out, saved(x))
        out.sum().backward()  # the loaded parameters still train


@CUDA
def test_cuda_corrupt_record_is_refused_and_the_next_load_works(tmp_path):
    state = _state(4)
    dcp.save(_on_cuda(state), storage_writer=ShardWriter(tmp_path / "bad"))
    dcp.save(_on_cuda(state), storage_writer=ShardWriter(tmp_path / "good"))
    data = max((tmp_path / "bad").glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(BaseException, match="crc32c mismatch") as caught:  # DCP's CheckpointException
        _assert_loads_into_cuda(tmp_path / "bad", state, verify_checksums=True)
    assert not isinstance(caught.value, AssertionError)
    _assert_loads_into_cuda(tmp_path / "good", state, verify_checksums=True)


@CUDA
def test_cuda_loads_of_megatron_and_hugging_face_checkpoints(tmp_path):
    for name in ("mcore019_tp2_dp2_ep2", "mcore012_zarr_tp2", "mcore015_tp2_dp2_distopt"):
        tensors = load_file(FIXTURES / "megatron" / f"{name}.expected.safetensors")
        objects = json.loads((FIXTURES / "megatron" / f"{name}.expected.json").read_text())["objects"]
        dest = {k: garbage_like(v).cuda() for k, v in tensors.items()} | {key: None for key in objects}
        dcp.load(dest, storage_reader=ShardReader(FIXTURES / "megatron" / name), planner=ShardLoadPlanner())
        for key, value in tensors.items():
            assert_tensor_equal(dest[key].cpu(), value, f"{name} {key}")
    model = FIXTURES / "hf" / "tiny_llama"
    want = {k: v for f in sorted(model.glob("*.safetensors")) for k, v in load_file(f).items()}
    dest = {k: garbage_like(v).cuda() for k, v in want.items()}
    dcp.load(dest, storage_reader=ShardReader(model), planner=ShardLoadPlanner())
    for key, value in want.items():
        assert_tensor_equal(dest[key].cpu(), value, key)


def _reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return {"w": torch.randn(1536, 1024, generator=g), "b": torch.randn(1000, generator=g),
            "e": torch.randn(8, 333, 17, generator=g).to(torch.bfloat16), "rep": torch.randn(640, 96, generator=g)}


def _two_ranks_job(rank: int, world: int, base: str) -> None:
    torch.cuda.set_device(0)  # both ranks on one GPU; the group is gloo
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("tp",))
    saved_as = {"w": [Shard(0)], "b": [Shard(0)], "e": [Shard(1)], "rep": [Replicate()]}
    resharded = {"w": [Shard(1)], "b": [Replicate()], "e": [Shard(0)], "rep": [Shard(0)]}

    def distributed(placements: dict) -> dict:
        return {k: distribute_tensor(v.cuda(), mesh, placements[k]) for k, v in _reference().items()}

    dcp.save(distributed(saved_as) | {"step": 11}, storage_writer=ShardWriter(base),
             planner=ShardSavePlanner(replica_locality=True))
    two_stage_reads = set()
    for placements in (saved_as, resharded):
        for options in ({}, {"two_stage": True}, {"share_metadata": True}, {"two_stage": True, "verify_checksums": True}):
            want = distributed(placements)
            dest: dict = {k: DTensor.from_local(garbage_like(v.to_local()).cuda(), mesh, placements[k], run_check=False,
                                                shape=v.shape, stride=v.stride()) for k, v in want.items()}
            dest["step"] = 0
            reader = ShardReader(base, **options)
            dcp.load(dest, storage_reader=reader, planner=ShardLoadPlanner())
            for key, value in want.items():
                assert dest[key].to_local().is_cuda, key
                assert_tensor_equal(dest[key].to_local().cpu(), value.to_local().cpu(), f"{options} {key}")
            assert dest["step"] == 11
            if options == {"two_stage": True}:
                read = torch.tensor([reader.stats.bytes_read])
                dist.all_reduce(read)
                two_stage_reads.add(int(read))
    assert len(two_stage_reads) == 1  # each stored byte read once by the group, whatever the layout
    diverged = distributed(saved_as)
    if rank == 1:
        diverged["rep"].to_local().add_(1)  # a whole copy: the digest samples elements
    with pytest.raises(BaseException, match="ReplicaMismatchError|replicas"):
        dcp.save(diverged, storage_writer=ShardWriter(f"{base}_diverged"), planner=ShardSavePlanner())


@pytest.mark.mp
@CUDA
def test_cuda_two_ranks_on_one_gpu_load_with_every_reader(tmp_path):
    run_job(_two_ranks_job, 2, str(tmp_path / "ckpt"))
