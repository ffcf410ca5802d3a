"""No silent options: an option of the wrong kind, or one that cannot take effect for the
checkpoint at hand, raises an error naming it, before anything is read or written.

Found trying the API as a user would: every reader flag was taken by its truthiness, so
``allow_unsafe_bytes="false"`` (a non-empty string) turned the restricted loader off and
a hostile checkpoint ran code under DCP's default planner; ``MegatronOptions(iteration=5)``
on a torch_dist, zarr or plain DCP checkpoint was accepted and ignored.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_ext import InvalidRequestError, ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.conversion.hf_export import export_safetensors
from dcp_ext.megatron import MegatronOptions

from megatron_fixtures import write_legacy
from support import RunsCode, sample_state, save

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TORCH_DIST = FIXTURES / "megatron" / "mcore016_tp2_dp2_ep2"
ZARR = FIXTURES / "megatron" / "mcore012_zarr_tp2"
SAFETENSORS = FIXTURES / "hf" / "tiny_llama"

BAD_OPTIONS = [  # (constructor, option, value)
    (ShardReader, "verify_checksums", "no"),
    (ShardReader, "cache_metadata", 0),
    (ShardReader, "require_commit_marker", "x"),
    (ShardReader, "two_stage", 1),
    (ShardReader, "share_metadata", "no"),
    (ShardReader, "allow_unsafe_bytes", "false"),
    (ShardReader, "on_report", "print"),
    (ShardReader, "megatron", "bogus"),
    (ShardReader, "thread_count", 0),
    (ShardWriter, "sync_files", "yes"),
    (ShardWriter, "checksums", None),
    (ShardWriter, "overwrite", "false"),
    (ShardWriter, "on_report", 3),
    (ShardWriter, "thread_count", True),
]


@pytest.mark.parametrize("make, option, value", BAD_OPTIONS, ids=lambda v: v.__name__ if isinstance(v, type) else repr(v))
def test_a_storage_option_of_the_wrong_kind_is_refused_by_name(tmp_path, make, option, value):
    with pytest.raises(InvalidRequestError, match=rf"{make.__name__}\({option}=\.\.\.\) must be"):
        make(tmp_path, **{option: value})


@pytest.mark.parametrize("make, option, value", [
    (ShardLoadPlanner, "allow_unsafe_bytes", "false"),
    (ShardSavePlanner, "check_replicas", "no"),
    (ShardSavePlanner, "replica_locality", 1),
    (ShardSavePlanner, "cache_plans", "false"),
    (ShardSavePlanner, "tp_dim", 0),
    (ShardSavePlanner, "tp_dim", ""),
    (ShardSavePlanner, "group", "world"),
    (ShardSavePlanner, "enable_plan_caching", "no"),  # DCP's name for cache_plans: it was taken by truthiness
    (ShardLoadPlanner, "placement_fn", "by_ep"),
    # DCP's own flags, which DCP takes by truthiness: "false" turned partial loads on
    (ShardLoadPlanner, "allow_partial_load", "false"),
    (ShardLoadPlanner, "flatten_state_dict", "false"),
    (ShardSavePlanner, "flatten_sharded_tensors", "no"),
    (ShardSavePlanner, "dedup_replicated_tensors", "yes"),
], ids=lambda v: v.__name__ if isinstance(v, type) else repr(v))
def test_a_planner_option_of_the_wrong_kind_is_refused_by_name(make, option, value):
    kwargs = {option: value, **({"replica_locality": True} if option == "tp_dim" else {})}
    if option == "placement_fn":
        kwargs["mesh"] = object()  # refused first: not a DeviceMesh
        with pytest.raises(InvalidRequestError, match=r"ShardLoadPlanner\(mesh=\.\.\.\) must be a DeviceMesh"):
            make(**kwargs)
        return
    with pytest.raises(InvalidRequestError, match=rf"{make.__name__}\({option}=\.\.\.\) must be"):
        make(**kwargs)


def test_dcp_planner_flags_passed_by_position_are_checked_too():
    with pytest.raises(InvalidRequestError, match=r"ShardLoadPlanner\(flatten_state_dict=\.\.\.\) must be True or False, got 'x'"):
        ShardLoadPlanner("x")
    with pytest.raises(InvalidRequestError, match="ShardLoadPlanner takes at most 3 positional arguments"):
        ShardLoadPlanner(True, True, False, True)
    assert ShardLoadPlanner(True, True, True).allow_partial_load  # as DefaultLoadPlanner takes them
    assert ShardSavePlanner(True, False).flatten_sharded_tensors is False


@pytest.mark.parametrize("make", [ShardWriter, ShardReader])
@pytest.mark.parametrize("path", [None, "", 3])
def test_a_checkpoint_that_is_no_path_is_refused_by_name(make, path):
    """Was a bare AssertionError (and, for "", the current directory)."""
    with pytest.raises(InvalidRequestError, match=r"a checkpoint is a directory path or URL, got "):
        make(path)


def test_a_string_false_never_opens_the_unsafe_path(tmp_path):
    """The canary is not created under the stock reader and DCP's default planner's
    unpickling either: ``ShardLoadPlanner(allow_unsafe_bytes="false")`` is refused."""
    canary = tmp_path / "canary"
    data = io.BytesIO()
    torch.save(RunsCode(str(canary)), data)
    dcp.save({"evil": io.BytesIO(data.getvalue())}, storage_writer=dcp.FileSystemWriter(tmp_path / "ckpt"))
    with pytest.raises(InvalidRequestError, match="allow_unsafe_bytes"):
        ShardLoadPlanner(allow_unsafe_bytes="false")
    with pytest.raises(InvalidRequestError, match="allow_unsafe_bytes"):
        ShardReader(tmp_path / "ckpt", allow_unsafe_bytes="false")
    assert not canary.exists()


def test_an_exchange_budget_without_two_stage_is_refused(tmp_path):
    with pytest.raises(InvalidRequestError, match=r"exchange_budget_bytes=\.\.\.\) is the budget of two_stage=True"):
        ShardReader(tmp_path, exchange_budget_bytes=1 << 20)
    with pytest.raises(InvalidRequestError, match=r"exchange_budget_bytes=\.\.\.\) must be a positive integer"):
        ShardReader(tmp_path, two_stage=True, exchange_budget_bytes="1MB")
    assert ShardReader(tmp_path, two_stage=True, exchange_budget_bytes=1 << 20).exchange_budget_bytes == 1 << 20


@pytest.mark.parametrize("kwargs, message", [
    ({"iteration": "abc"}, "iteration=...) must be an iteration number"),
    ({"iteration": -1}, "iteration=...) must be an iteration number"),
    ({"partition_dims": {"(": 0}}, "'(' is not a regex"),
    ({"partition_dims": {"fc1": "0"}}, "rule 'fc1' has dim '0'"),
    ({"partition_dims": [("fc1", 0)]}, "partition_dims=...) must map regexes to dims"),
    ({"allow_incomplete": "yes"}, "allow_incomplete=...) must be True or False"),
])
def test_megatron_options_of_the_wrong_kind_are_refused(kwargs, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        MegatronOptions(**kwargs)


def _plain_dcp(root: Path) -> Path:
    save({"w": torch.arange(4.0)}, root / "dcp")
    return root / "dcp"


def _legacy(root: Path) -> Path:
    write_legacy(str(root / "legacy"), tp=2, pp=1, num_layers=2)
    return root / "legacy"


@pytest.mark.parametrize("checkpoint, options, applies", [
    (lambda root: TORCH_DIST, MegatronOptions(allow_incomplete=True), True),
    (lambda root: TORCH_DIST, MegatronOptions(iteration=5), False),
    (lambda root: ZARR, MegatronOptions(allow_incomplete=True), True),
    (lambda root: ZARR, MegatronOptions(partition_dims={"fc1": 0}), False),
    (_legacy, MegatronOptions(iteration=20, partition_dims={"fc1": 0}), True),
    (_legacy, MegatronOptions(allow_incomplete=True), False),
    (_plain_dcp, MegatronOptions(allow_incomplete=True), False),
    (lambda root: SAFETENSORS, MegatronOptions(iteration="release"), False),
], ids=["torch_dist+allow_incomplete", "torch_dist+iteration", "zarr+allow_incomplete", "zarr+partition_dims",
        "legacy+iteration,partition_dims", "legacy+allow_incomplete", "dcp+allow_incomplete", "safetensors+iteration"])
def test_a_megatron_option_the_checkpoint_does_not_read_is_refused(tmp_path, checkpoint, options, applies):
    reader = ShardReader(checkpoint(tmp_path), megatron=options)
    if applies:
        assert reader.read_metadata().state_dict_metadata
        return
    with pytest.raises(InvalidRequestError, match=r"megatron=MegatronOptions\(\w+=\.\.\.\) would be ignored"):
        reader.read_metadata()


@pytest.mark.parametrize("option", ["include", "exclude"])
def test_an_export_filter_that_is_not_a_regex_is_refused_before_writing(tmp_path, option):
    with pytest.raises(InvalidRequestError, match=rf"{option}='\[a-' is not a regular expression"):
        export_safetensors(SAFETENSORS, tmp_path / "out", **{option: "[a-"})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rules, message", [
    ({r"linear_qvk\.weight$": 0}, r"\['linear_qvk\\\\.weight\$'\] match no parameter"),
    ({r"linear_fc1\.weight$": 0, "nothing_here": 1}, r"\['nothing_here'\] match no parameter"),
])
def test_a_partition_rule_matching_no_parameter_is_refused(tmp_path, rules, message):
    """A typo in a rule was silently ignored: the default rules split the tensor instead."""
    write_legacy(str(tmp_path / "legacy"), tp=2, pp=1, num_layers=2)
    with pytest.raises(InvalidRequestError, match=message):
        ShardReader(tmp_path / "legacy", megatron=MegatronOptions(partition_dims=rules)).read_metadata()


def test_partition_rules_for_a_checkpoint_without_tensor_parallelism_are_refused(tmp_path):
    write_legacy(str(tmp_path / "legacy"), tp=1, pp=2, num_layers=2)
    with pytest.raises(InvalidRequestError, match=r"partition_dims=\.\.\.\) would be ignored: the checkpoint has TP=1"):
        ShardReader(tmp_path / "legacy", megatron=MegatronOptions(partition_dims={"fc1": 0})).read_metadata()


@pytest.mark.parametrize("kwargs, message", [
    ({"max_shard_bytes": "5GB"}, r"export_safetensors\(max_shard_bytes=\.\.\.\) must be a positive integer"),
    ({"max_shard_bytes": 1.5}, r"export_safetensors\(max_shard_bytes=\.\.\.\) must be a positive integer"),
    ({"dtype": "bfloat16"}, r"dtype='bfloat16': export casts floating-point tensors"),
    ({"overwrite": "false"}, r"export_safetensors\(overwrite=\.\.\.\) must be True or False"),  # replaced an export
    ({"progress": "x"}, r"export_safetensors\(progress=\.\.\.\) must be callable"),  # failed after the whole export
])
def test_export_options_of_the_wrong_kind_are_refused(tmp_path, kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        export_safetensors(SAFETENSORS, tmp_path / "out", **kwargs)


def test_progress_callbacks_of_the_wrong_kind_are_refused_by_name(tmp_path):
    """``verify_checkpoint(progress='x')`` raised a bare TypeError once data was read, and
    ``convert`` a TypeError from a writer thread wrapped in DCP's CheckpointException."""
    from dcp_ext.megatron.convert import convert
    from dcp_ext.storage.verify import verify_checkpoint

    save(sample_state(), tmp_path / "ckpt")
    with pytest.raises(InvalidRequestError, match=r"verify_checkpoint\(progress=\.\.\.\) must be callable or None, got 'x'"):
        verify_checkpoint(str(tmp_path / "ckpt"), progress="x")
    with pytest.raises(InvalidRequestError, match=r"convert\(progress=\.\.\.\) must be callable or None, got 'x'"):
        convert(tmp_path / "ckpt", tmp_path / "out", progress="x")
    assert not (tmp_path / "out").exists()


def test_stock_planner_options_that_cannot_take_effect_are_refused():
    """``dedup_save_to_lowest_rank=True`` was accepted and ignored (the planner balances
    replicas over ranks); ``enable_plan_caching`` overrode ``cache_plans=False``."""
    with pytest.raises(InvalidRequestError, match=r"dedup_save_to_lowest_rank=True\): this planner spreads"):
        ShardSavePlanner(dedup_save_to_lowest_rank=True)
    with pytest.raises(InvalidRequestError, match=r"dedup_save_to_lowest_rank=True\): this planner spreads"):
        ShardSavePlanner(True, True, None, True)  # DefaultSavePlanner's positional order
    with pytest.raises(InvalidRequestError, match="enable_plan_caching=True and cache_plans=False .* are the same switch"):
        ShardSavePlanner(enable_plan_caching=True, cache_plans=False)
    assert ShardSavePlanner(enable_plan_caching=True).cache_plans is True


def test_other_values_of_the_wrong_kind_are_refused_by_name(tmp_path):
    """A report callback that is not callable warned with a traceback on every later save
    and load; storage_options that are no dict failed inside fsspec without naming them.
    numpy integers are integers, as stock takes them."""
    import numpy as np

    from dcp_ext.observe import add_report_callback

    with pytest.raises(InvalidRequestError, match=r"add_report_callback\(fn\) needs a callable, got 'print'"):
        add_report_callback("print")
    with pytest.raises(InvalidRequestError, match="memory://b/ck: storage_options must be a dict"):
        ShardWriter("memory://b/ck", storage_options="anon=True")
    for falsy in ([], 0, ""):  # these passed for a local path as "no options"
        with pytest.raises(InvalidRequestError, match=f"{tmp_path}: storage_options must be a dict of the filesystem's options"):
            ShardReader(tmp_path, storage_options=falsy)
    assert ShardReader(tmp_path, storage_options={}).location.root == str(tmp_path)
    assert ShardWriter(tmp_path, thread_count=np.int64(2)).thread_count == 2
    with pytest.raises(InvalidRequestError, match=r"thread_count=\.\.\.\) must be a positive integer"):
        ShardWriter(tmp_path, thread_count=np.bool_(True))
