"""Legacy Megatron ``mp_rank_*`` checkpoints load through ShardReader, bit-exact."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from dcp_ext import ShardLoadPlanner, ShardReader
from dcp_ext.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from dcp_ext.cli.main import main as cli
from dcp_ext.formats.safe_load import safe_torch_load
from dcp_ext.formats.stand_ins import megatron_value
from dcp_ext.megatron import MegatronOptions, MegatronValue, load_common_state
from dcp_ext.storage.verify import verify_checkpoint

from megatron_fixtures import write_legacy
from mp import run_job
from support import FIXTURES, assert_tensor_equal, dtensor_load_job, garbage_like, load_error, load_tensors

QKV0 = "decoder.layers.0.self_attention.linear_qkv.weight"


def rank_file(root, iteration_dir: str, name: str) -> str:
    return os.path.join(root, iteration_dir, name, "model_optim_rng.pt")


def test_tp2_loads_bit_exact_with_args_and_iteration(tmp_path):
    want = write_legacy(str(tmp_path), tp=2, pp=1, num_layers=2)
    state, _ = load_tensors(tmp_path, want, extra=("args", "iteration", "checkpoint_version"))
    assert isinstance(state["args"], argparse.Namespace) and state["args"].tensor_model_parallel_size == 2
    assert state["iteration"] == 20 and state["checkpoint_version"] == 3.0


def test_tp2_pp2_swiglu_keys_have_global_layer_numbers(tmp_path):
    want = write_legacy(str(tmp_path), tp=2, pp=2, num_layers=4)
    assert "decoder.layers.3.mlp.linear_fc1.weight" in want
    _, reader = load_tensors(tmp_path, want)
    assert reader.catalog.format == "legacy"
    assert set(reader.catalog.metadata.state_dict_metadata) == set(want) | {"args", "iteration", "checkpoint_version"}


def test_expert_parallel_checkpoint_renumbers_experts(tmp_path):
    # TP2 x EP2 without PP: directories are mp_rank_TT_EEE, told apart from PP by args
    want = write_legacy(str(tmp_path), tp=2, pp=1, ep=2, num_layers=2, moe=True)
    assert os.path.isdir(tmp_path / "iter_0000020" / "mp_rank_01_001")
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight" in want
    load_tensors(tmp_path, want)


def test_reads_only_the_files_holding_the_requested_part(tmp_path):
    want = write_legacy(str(tmp_path), tp=2, pp=2, num_layers=4)
    key = "decoder.final_layernorm.weight"  # bf16, replicated, on the last stage only
    _, reader = load_tensors(tmp_path, {key: want[key]})
    assert reader.stats.files_opened == 1


@pytest.mark.mp
@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_loads_cut_across_tp_splits(tmp_path, world):
    want = write_legacy(str(tmp_path), tp=2, pp=2, num_layers=4)
    run_job(dtensor_load_job, world, str(tmp_path), want)


@pytest.mark.mp
def test_two_ranks_each_read_one_tp_file_for_their_rows(tmp_path):
    want = write_legacy(str(tmp_path), tp=2, pp=1, num_layers=1)
    stats = run_job(dtensor_load_job, 2, str(tmp_path), {QKV0: want[QKV0]})  # Shard(0): rows of one TP shard
    assert [s.files_opened for s in stats] == [1, 1]


def test_latest_iteration_loads_by_default_and_an_older_one_on_request(tmp_path):
    write_legacy(str(tmp_path), tp=1, pp=1, num_layers=1, iteration=5)
    newer = write_legacy(str(tmp_path), tp=1, pp=1, num_layers=1, iteration=9)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "9"
    load_tensors(tmp_path, newer)
    older, _ = load_tensors(tmp_path, {}, extra=("iteration",), megatron=MegatronOptions(iteration=5))
    assert older["iteration"] == 5
    load_tensors(tmp_path / "iter_0000005", {}, extra=("iteration",))  # pointing at one iteration works too
    os.remove(tmp_path / "latest_checkpointed_iteration.txt")
    err = load_error({"iteration": None}, tmp_path)
    assert "iter_0000005" in str(err) and "iteration=N" in str(err)


def test_release_directory_loads_bit_exact(tmp_path):
    want = write_legacy(str(tmp_path), tp=2, pp=1, num_layers=1, iteration="release")
    load_tensors(tmp_path, want)


def test_missing_rank_file_names_its_coordinates(tmp_path):
    write_legacy(str(tmp_path), tp=2, pp=2, num_layers=2)
    shutil.rmtree(tmp_path / "iter_0000020" / "mp_rank_01_001")
    with pytest.raises(CheckpointError, match="incomplete legacy checkpoint") as err:
        ShardReader(tmp_path).read_metadata()
    assert "mp_rank_01_001" in str(err.value) and "TP rank 1, PP rank 1, EP rank 0" in str(err.value)
    err = load_error({QKV0: torch.zeros(1)}, tmp_path)  # the same message reaches dcp.load's caller
    assert "mp_rank_01_001" in str(err) and "TP rank 1, PP rank 1, EP rank 0" in str(err)


def _rewrite(path: str, edit) -> None:
    state = torch.load(path, weights_only=False)
    edit(state["model"])
    torch.save(state, path)


def test_mismatched_tp_shapes_are_reported(tmp_path):
    write_legacy(str(tmp_path), tp=2, pp=1, num_layers=1)
    path = rank_file(tmp_path, "iter_0000020", "mp_rank_01")
    _rewrite(path, lambda m: m.__setitem__(QKV0, torch.zeros(3, 10)))
    err = load_error({QKV0: torch.zeros(1)}, tmp_path)
    assert "TP shards of" in str(err) and QKV0 in str(err) and "[3, 10]" in str(err)


def test_unknown_parameter_needs_a_partition_rule(tmp_path):
    write_legacy(str(tmp_path), tp=2, pp=1, num_layers=1)
    name = "decoder.layers.0.self_attention.linear_q_down.weight"
    full = torch.arange(40.0).reshape(4, 10)
    for rank in range(2):
        _rewrite(rank_file(tmp_path, "iter_0000020", f"mp_rank_0{rank}"),
                 lambda m, r=rank: m.__setitem__(name, full.chunk(2)[r].clone()))
    err = load_error({name: torch.zeros(4, 10)}, tmp_path)
    assert name in str(err) and "partition_dims" in str(err)
    load_tensors(tmp_path, {name: full}, megatron=MegatronOptions(partition_dims={r"linear_q_down\.weight$": 0}))


def test_common_state_and_unsafe_files(tmp_path):
    write_legacy(str(tmp_path), tp=2, pp=1, num_layers=1)
    common = load_common_state(tmp_path)
    assert common["iteration"] == 20 and common["args"].swiglu is True and "model" not in common
    _rewrite(rank_file(tmp_path, "iter_0000020", "mp_rank_00"), lambda m: m.__setitem__("evil", os.system))
    with pytest.raises(UnsafeCheckpointError, match="os.system|posix.system") as err:
        load_common_state(tmp_path)
    assert str(err.value).endswith("; register classes you trust with torch.serialization.add_safe_globals")


def test_cached_source_loads_each_file_once(tmp_path, monkeypatch):
    want = write_legacy(str(tmp_path), tp=2, pp=1, num_layers=1)
    calls = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    for _ in range(2):
        state = {QKV0: garbage_like(want[QKV0])}
        dcp.load(state, storage_reader=ShardReader(tmp_path), planner=ShardLoadPlanner())
        assert_tensor_equal(state[QKV0], want[QKV0])
    assert len(calls) == 2  # two rank files, each loaded once across both loads


@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2)])
def test_pre_mcore_nested_layout_loads_with_its_natural_keys(tmp_path, tp, pp):
    want = write_legacy(str(tmp_path), tp=tp, pp=pp, num_layers=4, pre_mcore=True)
    assert "language_model.encoder.layers.3.mlp.dense_h_to_4h.weight" in want  # SwiGLU halves, TP dim 0
    assert "language_model.embedding.word_embeddings.weight" in want
    _, reader = load_tensors(tmp_path, want)
    assert set(reader.catalog.metadata.state_dict_metadata) == set(want) | {"args", "iteration", "checkpoint_version"}


def test_model_without_parameter_tensors_is_an_error_not_an_empty_checkpoint(tmp_path):
    write_legacy(str(tmp_path), tp=1, pp=1, num_layers=1)
    path = rank_file(tmp_path, "iter_0000020", "mp_rank_00")
    state = torch.load(path, weights_only=False)
    state["model"] = {"language_model": {"encoder": {"note": "no tensors"}}}
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r"mp_rank_00/model_optim_rng.pt: no parameter tensors.*language_model\.encoder\.note"):
        ShardReader(tmp_path).read_metadata()


@pytest.mark.parametrize("extra_state", ["empty BytesIO", "empty bytes"])
def test_empty_extra_state_values_load(tmp_path, extra_state):
    """Megatron stores empty io.BytesIO / b"" extra states; they must not make a file unreadable."""
    import io

    value = io.BytesIO() if extra_state == "empty BytesIO" else b""
    want = write_legacy(str(tmp_path), tp=2, pp=1, num_layers=2, extra_state=value)
    load_tensors(tmp_path, want)


def test_parameters_viewing_one_buffer_read_only_their_bytes(tmp_path):
    """Megatron's DDP keeps parameters as views of one contiguous buffer, so ``torch.save``
    writes the buffer once and each parameter as (offset, strides) into it: a load of one
    parameter reads that parameter's bytes, not the buffer."""
    buffer = torch.arange(6 * 4096, dtype=torch.float32)
    model = {
        "embedding.word_embeddings.weight": buffer[:4096].view(64, 64),
        "decoder.layers.0.self_attention.linear_qkv.weight": buffer[4096:3 * 4096].view(128, 64),
        "decoder.final_layernorm.weight": buffer[3 * 4096:3 * 4096 + 64],
        "output_layer.weight": buffer[4 * 4096:].view(128, 64).t(),  # a strided (transposed) view
    }
    directory = tmp_path / "iter_0000003" / "mp_rank_00"
    directory.mkdir(parents=True)
    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, num_layers=1)
    torch.save({"model": model, "args": args, "iteration": 3, "checkpoint_version": 3.0}, directory / "model_optim_rng.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    for key, value in model.items():
        _, reader = load_tensors(tmp_path, {key: value.clone()})
        assert reader.stats.bytes_read == value.nbytes, key  # the buffer holds 6x more


def test_storage_offsets_point_at_the_stored_bytes(tmp_path):
    """``stored_at`` relies on torch reporting each storage's file offset for a meta-device
    load (not public API): the bytes at each reported offset must be that storage's, so a
    torch that changes it fails here; a tensor without it is refused loudly."""
    from dcp_ext.errors import CorruptCheckpointError
    from dcp_ext.formats.safe_load import safe_torch_load, stored_at

    shared = torch.arange(1000, dtype=torch.int16)
    storages = {"a": torch.rand(3, 5), "b": shared, "c": shared, "d": torch.randn(7).to(torch.bfloat16)}
    path = tmp_path / "f.pt"
    torch.save({"a": storages["a"], "b": shared[10:20], "c": shared[500:], "d": storages["d"]}, path)
    loaded = safe_torch_load(str(path), "f.pt", layout_only=True)
    with open(path, "rb") as raw:
        for key, tensor in loaded.items():
            assert tensor.device.type == "meta"
            raw.seek(stored_at(tensor, key))
            data = bytearray(raw.read(tensor.untyped_storage().nbytes()))
            assert torch.equal(torch.frombuffer(data, dtype=tensor.dtype), storages[key].reshape(-1)), key
    with pytest.raises(CorruptCheckpointError, match="did not report where this tensor's bytes are stored"):
        stored_at(torch.empty(3, device="meta"), "made on the meta device")


def test_empty_storages_before_others_pass_the_storage_check(tmp_path):
    """An empty entry has no bytes, so its data offset is the next entry's header: the check
    of storages against their zip entries took the next entry for it and refused the file."""
    want = {"a": torch.empty(0), "b": torch.arange(3.0), "c": torch.empty(0, 2, dtype=torch.int64), "d": torch.ones(2)}
    path = tmp_path / "f.pt"
    torch.save(want, path)
    layouts = safe_torch_load(str(path), "f.pt", layout_only=True)
    assert {k: tuple(v.shape) for k, v in layouts.items()} == {k: tuple(v.shape) for k, v in want.items()}
    mapped = safe_torch_load(str(path), "f.pt", mmap=True)
    for key, value in want.items():
        assert_tensor_equal(mapped[key], value, key)


def _tamper(root, edit) -> str:
    """A TP1 checkpoint whose rank file (and directory) ``edit(state, root)`` changed."""
    write_legacy(str(root), tp=1, pp=1, num_layers=2)
    path = rank_file(root, "iter_0000020", "mp_rank_00")
    state = torch.load(path, weights_only=False)  # our own fresh file
    edit(state, root)
    torch.save(state, path)
    return path


def _set_args(**values):
    return lambda state, root: [setattr(state["args"], k, v) for k, v in values.items()]


def _nest(state, depth: int) -> None:
    node = state["model"]
    for _ in range(depth):
        node["n"] = {}
        node = node["n"]


HOSTILE = {  # allowlisted values a hand-made rank file can hold: (edit, where, message)
    "model containing itself": (lambda s, r: s["model"].__setitem__("loop", s["model"]), "model_optim_rng.pt entry 'model'",
                                "'loop' is a dict met twice"),
    "dict shared twice": (lambda s, r: s["model"].update(a=(d := {"x": torch.ones(1)}), b=d), "model_optim_rng.pt entry 'model'",
                          "'b' is a dict met twice"),
    "dicts 40 deep": (lambda s, r: _nest(s, 40), "model_optim_rng.pt entry 'model'", "nests dicts more than 16 deep"),
    "negative TP": (_set_args(tensor_model_parallel_size=-1), "model_optim_rng.pt",
                    "args.tensor_model_parallel_size is -1, expected a positive integer"),
    "TP as text": (_set_args(tensor_model_parallel_size="two"), "model_optim_rng.pt",
                   "args.tensor_model_parallel_size is 'two', expected a positive integer"),
    "experts as text": (_set_args(num_experts="x"), "model_optim_rng.pt", "args.num_experts is 'x', expected a positive integer"),
    "superscript iteration": (lambda s, r: (r / "latest_checkpointed_iteration.txt").write_text("\u00b2"),
                              "latest_checkpointed_iteration.txt", "found '\u00b2'"),
    "5000-digit iteration": (lambda s, r: (r / "latest_checkpointed_iteration.txt").write_text("1" * 5000),
                             "latest_checkpointed_iteration.txt", "found '1111"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_values_in_a_rank_file_are_corruption_naming_it(tmp_path, case):
    edit, where, message = HOSTILE[case]
    _tamper(tmp_path, edit)
    with pytest.raises(CorruptCheckpointError) as err:
        ShardReader(tmp_path).read_metadata()
    assert where in str(err.value) and message in str(err.value) and len(str(err.value)) < 500


def test_parallel_sizes_beyond_the_rank_directories_present_are_named_briefly(tmp_path):
    # args claim TP=PP=300: 90,000 rank files, of which one directory exists (its name is no
    # PP>1 name); the message names the first few and counts the rest (it listed all: 6 MB)
    _tamper(tmp_path, _set_args(tensor_model_parallel_size=300, pipeline_model_parallel_size=300))
    with pytest.raises(CorruptCheckpointError, match="incomplete legacy checkpoint for TP=300 x PP=300 x EP=1") as err:
        ShardReader(tmp_path).read_metadata()
    message = str(err.value)
    assert "mp_rank_00_000/model_optim_rng.pt (TP rank 0, PP rank 0, EP rank 0)" in message
    assert message.endswith("and 89,992 more") and len(message) < 1000


def test_save_root_of_a_torch_dist_iteration_points_at_it(tmp_path):
    """Megatron-LM's --save root tracks torch_dist iterations too: the root was taken for a
    legacy save and failed with a bare "no mp_rank_* directories"."""
    iteration = tmp_path / "iter_0000007"
    shutil.copytree(FIXTURES / "megatron" / "mcore016_tp2_dp2_ep2", iteration)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7\n")
    with pytest.raises(CheckpointError, match=rf"no mp_rank_\* directories; .*torch_dist.*: open {iteration} itself"):
        ShardReader(tmp_path).read_metadata()
    assert ShardReader(iteration).read_metadata().state_dict_metadata


def _rezip(path: str, replace: dict[str, bytes] | None = None, compression: int = zipfile.ZIP_STORED) -> None:
    """Rewrite a ``torch.save`` file's zip, entries renamed by what follows the archive's
    top folder (``byteorder``, ``data/0``) replaced, every entry stored with ``compression``."""
    with zipfile.ZipFile(path) as archive:
        entries = [(info.filename, archive.read(info.filename)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", compression) as archive:
        for name, data in entries:
            archive.writestr(name, (replace or {}).get(name.split("/", 1)[1], data))


def _claims_more_than_stored(path: str) -> None:
    """The pickle of a state whose first tensor's storage is 4x larger, over the original's
    entries: the storage claims bytes its entry does not hold."""
    state = torch.load(path, weights_only=False)
    first = next(k for k, v in state["model"].items() if isinstance(v, torch.Tensor))
    state["model"][first] = torch.zeros(state["model"][first].numel() * 4, dtype=state["model"][first].dtype)
    bigger = path + ".bigger"
    torch.save(state, bigger)
    with zipfile.ZipFile(bigger) as archive:
        pickle_bytes = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
    os.remove(bigger)
    _rezip(path, {"data.pkl": pickle_bytes})


REZIPPED = {  # torch.save files whose storages this reader would take from the wrong bytes
    "big-endian": (lambda path: _rezip(path, {"byteorder": b"big"}), CheckpointError,
                   "its byteorder record says 'big'; this reader reads little-endian files only"),
    "deflated": (lambda path: _rezip(path, compression=zipfile.ZIP_DEFLATED), CorruptCheckpointError,
                 r"tensor 'model\.[\w.]+' claims a storage of \d+ bytes at byte \d+, but its entry "
                 r"'model_optim_rng/data/\d+' is compressed"),
    "a storage claiming 4x its entry": (_claims_more_than_stored, CorruptCheckpointError,
                                        r"claims a storage of (\d+) bytes at byte \d+, but its entry '[\w/]+' holds \d+ bytes"),
}


@pytest.mark.parametrize("case", REZIPPED)
def test_rank_files_whose_storages_are_not_where_torch_load_takes_them_are_refused(tmp_path, case):
    """The layout-only load (meta device) and the memory-mapped one take each storage's
    bytes from the file where the pickle says, without the checks of torch's plain load:
    a big-endian file segfaulted (torch byteswaps meta storages), a deflated one and an
    inflated storage claim loaded other bytes as the tensor, and verify said OK."""
    edit, error, message = REZIPPED[case]
    write_legacy(str(tmp_path), tp=1, pp=1, num_layers=2)
    path = rank_file(tmp_path, "iter_0000020", "mp_rank_00")
    edit(path)
    with pytest.raises(error, match=message) as err:
        ShardReader(tmp_path).read_metadata()
    assert str(err.value).startswith(f"{path}: ")
    with pytest.raises(error, match=message):
        safe_torch_load(path, path, mmap=True)  # load_common_state's read of the same file
    assert not verify_checkpoint(tmp_path).ok


def test_parallel_sizes_of_2_pow_62_are_named_without_building_them(tmp_path):
    # itertools.product made a tuple of each range before the first missing rank was named
    _tamper(tmp_path, _set_args(tensor_model_parallel_size=2**62))
    with pytest.raises(CorruptCheckpointError, match=r"TP=4611686018427387904 x PP=1 x EP=1: missing .*mp_rank_01/"):
        ShardReader(tmp_path).read_metadata()


@pytest.mark.parametrize("num_experts", [2, None])
def test_experts_numbered_past_what_args_give_each_rank_are_refused(tmp_path, num_experts):
    """Two EP ranks with 2 local experts each and args saying 2 experts in all: ranks' global
    numbers overlapped and the first stored expert won (one of four silently lost). Without
    num_experts each rank's count is inferred, and overlapping numbers are still refused."""
    want = write_legacy(str(tmp_path), tp=1, pp=1, ep=2, num_layers=1, moe=True)
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight" in want
    for directory in ("mp_rank_00_000", "mp_rank_00_001"):
        path = rank_file(tmp_path, "iter_0000020", directory)
        state = torch.load(path, weights_only=False)
        state["args"].num_experts = num_experts
        if num_experts is None and directory.endswith("0"):  # rank 0 holds a third: its numbers reach rank 1's
            state["model"].update({k.replace("local_experts.1.", "local_experts.2."): v for k, v in state["model"].items()
                                   if "local_experts.1." in k})
        torch.save(state, path)
    message = ("is local expert 1, but args.num_experts=2 over EP=2 gives each EP rank 1" if num_experts
               else r"are both 'decoder\.layers\.0\.mlp\.experts\.local_experts\.2\.")
    with pytest.raises(CorruptCheckpointError, match=message):
        ShardReader(tmp_path).read_metadata()


# -- written by Megatron-LM's own save_checkpoint (tests/fixtures/megatron/generate_megatron_lm.py) ----
LEGACY_FIXTURES = ["legacy019_tp2", "legacy019_pp2", "legacy019_ep2_moe", "legacy019_pp2_vpp2"]
NUMPY1_FIXTURES = {"legacy019_tp2", "legacy019_ep2_moe"}  # written under numpy 1.26


def _megatron_lm(name: str) -> tuple[str, dict[str, torch.Tensor]]:
    """The fixture's save root and megatron-core's own values for it."""
    return str(FIXTURES / "megatron" / name), load_file(FIXTURES / "megatron" / f"{name}.expected.safetensors")


def _pickle_of_rank_file(root: str) -> bytes:
    first = os.path.join(root, "iter_0000007", sorted(os.listdir(os.path.join(root, "iter_0000007")))[0], "model_optim_rng.pt")
    with zipfile.ZipFile(first) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))


@pytest.mark.parametrize("name", LEGACY_FIXTURES)
def test_megatron_lm_checkpoints_load_bit_exact_with_their_real_args(name):
    """Every weight as megatron-core loads it, and ``args`` as a real run saves it: Megatron's
    enums (stand-ins: megatron-core is not installed here), a signal, numpy 1 or 2 RNG state."""
    root, want = _megatron_lm(name)
    pickled = _pickle_of_rank_file(root)
    assert b"megatron.core.enums" in pickled and b"AttnBackend" in pickled and b"signal" in pickled
    assert (b"numpy.core.multiarray" in pickled) == (name in NUMPY1_FIXTURES)  # the fixture is what it claims
    state, reader = load_tensors(root, want, extra=("args", "iteration", "checkpoint_version"))
    assert set(reader.catalog.metadata.state_dict_metadata) == set(want) | {"args", "iteration", "checkpoint_version"}
    args = state["args"]
    assert state["iteration"] == 7 and state["checkpoint_version"] == 3.0 and args.ckpt_format == "torch"
    assert args.exit_signal is signal.SIGTERM
    assert args.model_type == megatron_value("megatron.core.enums.ModelType", (1,), None)
    assert isinstance(args.attention_backend, MegatronValue)
    assert args.attention_backend.type_name == "megatron.core.transformer.enums.AttnBackend"
    common = load_common_state(root)
    assert common["iteration"] == 7 and common["args"] == args and "rng_state" in common


@pytest.mark.parametrize("name", ["legacy019_tp2", "legacy019_pp2_vpp2"])
def test_megatron_lm_checkpoints_verify_and_convert(tmp_path, name, capsys):
    root, want = _megatron_lm(name)
    assert cli(["verify", root]) == 0
    assert cli(["convert", root, str(tmp_path / "converted")]) == 0
    state, _ = load_tensors(tmp_path / "converted", want, extra=("args",))
    stock = {"args": None}  # stock DCP unpickles our stand-ins with weights_only=False
    dcp.load(stock, storage_reader=dcp.FileSystemReader(tmp_path / "converted"), no_dist=True)
    assert stock["args"] == state["args"] and state["args"].model_type.args == (1,)


@pytest.mark.mp
@pytest.mark.parametrize("two_stage", [False, True], ids=["plain", "two-stage"])
def test_megatron_lm_tp2_checkpoint_loads_into_dtensors(two_stage):
    root, want = _megatron_lm("legacy019_tp2")
    run_job(dtensor_load_job, 2, root, want, two_stage)
