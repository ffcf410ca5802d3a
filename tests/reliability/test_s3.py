"""Object storage for real: ``s3://`` through fsspec/s3fs against moto's S3 server on loopback.

The server runs in this process (``moto.server.ThreadedMotoServer``) and is started and
stopped by the fixtures; worker processes of multi-process jobs reach it over HTTP.
S3 has no atomic rename, so these tests also pin down the commit marker: a checkpoint
of ours without it is refused by default, stock checkpoints (no index, no marker) load.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
import s3fs
import torch
import torch.distributed.checkpoint as dcp
from moto import server as moto_server
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_ext import CheckpointError, InvalidRequestError, ShardReader, ShardSavePlanner, ShardWriter
from dcp_ext.errors import rank_failure
from dcp_ext.formats.index import PREVIOUS_INDEX_NAME
from dcp_ext.formats.marker import MARKER_NAME
from dcp_ext.formats.torch_record import RecordLayouts
from dcp_ext.runtime.crash import CRASH_ENV
from dcp_ext.storage.location import FsspecRangeReader
from dcp_ext.storage.verify import verify_checkpoint

from mp import WorkerError, run_job
from support import assert_state_dict_equal, garbage_like, load, sample_state, save

pytestmark = [pytest.mark.mp, pytest.mark.s3]

BUCKET = "dcp-ext-tests"


class S3Server:
    """moto's S3 server on 127.0.0.1; can be killed and restarted on the same port (state kept)."""

    def __init__(self) -> None:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.port = 0
        self.start()

    def start(self) -> None:
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.port = self.server.get_host_and_port()[1]

    def stop(self) -> None:
        self.server.stop()

    @property
    def options(self) -> dict:
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{self.port}", "region_name": "us-west-2"},
            "config_kwargs": {"retries": {"max_attempts": 2}, "connect_timeout": 2, "read_timeout": 20},
            "skip_instance_cache": True,
        }

    def fs(self):
        return s3fs.S3FileSystem(**self.options)


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    server.fs().mkdir(BUCKET)
    yield server
    server.stop()


@pytest.fixture
def url(s3) -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex}"


def test_round_trip_with_commit_marker(s3, url):
    state = sample_state(1)
    save(state, url, storage_options=s3.options)
    names = {os.path.basename(p) for p in s3.fs().ls(url)}
    assert {".metadata", MARKER_NAME} <= names and not any(n.endswith(".tmp") for n in names)
    got, reader = load(state, url, storage_options=s3.options, verify_checksums=True)
    assert_state_dict_equal(got, state)
    assert reader.catalog.indexed and reader.catalog.committed
    report = verify_checkpoint(url, storage_options=s3.options)
    assert report.ok and report.items_checked == 6, report.faults


def test_overwrite_on_s3_switches_whole_and_cleans_up(s3, url):
    first, second = sample_state(1), sample_state(2)
    save(first, url, storage_options=s3.options)
    assert_state_dict_equal(load(first, url, storage_options=s3.options)[0], first)
    save(second, url, storage_options=s3.options)
    got, reader = load(second, url, storage_options=s3.options)  # cached metadata must not be served
    assert_state_dict_equal(got, second)
    data_files = {os.path.basename(p) for p in s3.fs().ls(url) if p.endswith(".distcp")}
    assert data_files == {i.relative_path for i in reader.catalog.items.values()}


def test_a_save_over_a_checkpoint_deletes_the_retired_files_in_one_request(s3, url, monkeypatch):
    """s3fs deletes a list of keys a thousand a request: the retired files (four data
    files and the index set aside) go in one request, not one each."""
    batches: list[list[str]] = []
    bulk_delete, rm_file = s3fs.S3FileSystem._bulk_delete, s3fs.S3FileSystem._rm_file

    async def counted_bulk_delete(self, pathlist, **kwargs):  # the real request, counted
        batches.append([os.path.basename(p) for p in pathlist])
        return await bulk_delete(self, pathlist, **kwargs)

    async def counted_rm_file(self, path, **kwargs):
        batches.append([os.path.basename(path)])
        return await rm_file(self, path, **kwargs)

    first, second = sample_state(1), sample_state(2)
    save(first, url, storage_options=s3.options, thread_count=4)
    old = {os.path.basename(p) for p in s3.fs().ls(url) if p.endswith(".distcp")}
    monkeypatch.setattr(s3fs.S3FileSystem, "_bulk_delete", counted_bulk_delete)
    monkeypatch.setattr(s3fs.S3FileSystem, "_rm_file", counted_rm_file)
    save(second, url, storage_options=s3.options, thread_count=4)
    retired = [batch for batch in batches if old & set(batch)]
    assert len(old) == 4 and len(retired) == 1 and old | {PREVIOUS_INDEX_NAME} == set(retired[0]), batches
    got, reader = load(second, url, storage_options=s3.options)
    assert_state_dict_equal(got, second)
    assert {os.path.basename(p) for p in s3.fs().ls(url) if p.endswith(".distcp")} == {
        i.relative_path for i in reader.catalog.items.values()}


def _sharded_save_job(rank: int, world: int, url: str, options: dict) -> None:
    mesh = init_device_mesh("cpu", (world,))
    full = _resharding_state()
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    dcp.save(state, storage_writer=ShardWriter(url, storage_options=options), planner=ShardSavePlanner())


def _resharding_state() -> dict:
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(9, 16, generator=g), "e": torch.randn(5, 3, generator=g).to(torch.bfloat16)}


def test_resharded_load_from_two_process_save(s3, url):
    run_job(_sharded_save_job, 2, url, s3.options)
    want = _resharding_state()
    got, reader = load(want, url, storage_options=s3.options)  # one process reads both ranks' chunks
    assert_state_dict_equal(got, want)
    assert len({i.relative_path for i in reader.catalog.items.values()}) >= 2


def _two_stage_load_job(rank: int, world: int, url: str, options: dict) -> int:
    want = _resharding_state()
    state = {k: garbage_like(v) for k, v in want.items()}
    reader = ShardReader(url, storage_options=options, two_stage=True)
    dcp.load(state, storage_reader=reader)
    for name, value in want.items():
        assert torch.equal(state[name], value), name
    return reader.stats.bytes_read


def test_two_stage_load_from_s3_reads_each_byte_once(s3, url):
    run_job(_sharded_save_job, 2, url, s3.options)
    reads = run_job(_two_stage_load_job, 2, url, s3.options)  # both ranks need everything
    unique = sum(v.numel() * v.element_size() for v in _resharding_state().values())
    assert unique <= sum(reads) <= 1.05 * unique


def test_stock_checkpoint_on_s3_loads_without_a_marker(s3, url):
    state = {k: v for k, v in sample_state(4).items() if isinstance(v, torch.Tensor)}
    dcp.save(state, storage_writer=FsspecWriter(url, **s3.options))
    got, reader = load(state, url, storage_options=s3.options)
    assert_state_dict_equal(got, state)
    assert not reader.catalog.indexed and reader.catalog.committed


@pytest.mark.parametrize("verify", [False, True])
def test_stock_records_on_s3_are_fetched_in_one_request_or_probed_together(s3, url, monkeypatch, verify):
    """Stock records on S3 (an async filesystem): a load of whole chunks fetches each record
    in one request and copies its box out on landing, with no probe of its ends; a
    verified load (which keeps to the probe) fetches the ends of all of the file's records
    in one batch of concurrent requests and parses them from memory on the planning
    thread, where each end was a round trip of its own. Bit-exact both ways."""
    state = {f"w{i}": torch.randn(64, 32 + i) for i in range(40)}
    dcp.save(state, storage_writer=FsspecWriter(url, **s3.options))
    parsed_on: list[str] = []
    real_parse = RecordLayouts.parse
    monkeypatch.setattr(RecordLayouts, "parse", lambda self, *a: parsed_on.append(threading.current_thread().name) or real_parse(self, *a))
    requests: list[int] = []  # ranges per batch of concurrent requests
    real_read_runs = FsspecRangeReader.read_runs
    monkeypatch.setattr(FsspecRangeReader, "read_runs", lambda self, runs: requests.append(len(runs)) or real_read_runs(self, runs))
    got, reader = load(state, url, storage_options=s3.options, verify_checksums=verify)
    assert_state_dict_equal(got, state)
    if not verify:
        assert parsed_on == [] and sum(requests) <= len(state), requests  # at most a request a record (neighbours merge)
        return
    assert parsed_on == ["MainThread"] * len(state)
    assert len(requests) < len(state), requests  # the ends in one batch, then the reads


def test_checkpoint_without_marker_is_refused_unless_opted_out(s3, url):
    state = sample_state(5)
    save(state, url, storage_options=s3.options)
    s3.fs().rm_file(f"{url}/{MARKER_NAME}")
    with pytest.raises(CheckpointError, match=r"not committed.*require_commit_marker=False"):
        ShardReader(url, storage_options=s3.options).read_metadata()
    report = verify_checkpoint(url, storage_options=s3.options)
    assert not report.ok and "not committed" in report.faults[0]
    assert_state_dict_equal(load(state, url, storage_options=s3.options, require_commit_marker=False)[0], state)


def test_convert_copies_an_uncommitted_checkpoint_only_when_told(s3, url, tmp_path):
    """The refusal told CLI users to pass require_commit_marker=False, which no dcp-ext
    option took; --allow-uncommitted now does (the endpoint from the environment)."""
    from dcp_ext.megatron.convert import convert

    state = sample_state(6)
    save(state, url, storage_options=s3.options)
    s3.fs().rm_file(f"{url}/{MARKER_NAME}")
    with pytest.raises(CheckpointError, match=r"not committed.*--allow-uncommitted"):
        convert(url, f"{url}-copy", storage_options=s3.options)
    convert(url, f"{url}-copy", storage_options=s3.options, require_commit_marker=False)
    assert_state_dict_equal(load(state, f"{url}-copy", storage_options=s3.options)[0], state)
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{s3.port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-west-2"}
    cli = [sys.executable, "-m", "dcp_ext.cli.main", "convert", url, str(tmp_path / "cli")]
    refused = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--allow-uncommitted" in refused.stderr, refused.stderr
    copied = subprocess.run([*cli, "--allow-uncommitted"], env=env, capture_output=True, text=True, timeout=120)
    assert copied.returncode == 0, copied.stderr
    assert_state_dict_equal(load(state, tmp_path / "cli")[0], state)


def _crashing_save_job(rank: int, world: int, url: str, options: dict, seed: int, phase: str) -> None:
    os.environ[CRASH_ENV] = phase
    save(sample_state(seed), url, storage_options=options)


@pytest.mark.parametrize(
    "phase, outcome",
    [("after-data", "old"), ("after-index", "old"), ("before-marker", "uncommitted-new")],
)
def test_client_killed_mid_commit_on_s3(s3, url, phase, outcome):
    """No atomic rename: before the marker lands, the new checkpoint is not loadable by default."""
    old, new = sample_state(1), sample_state(2)
    save(old, url, storage_options=s3.options)
    with pytest.raises(WorkerError, match="SIGKILL"):
        run_job(_crashing_save_job, 1, url, s3.options, 2, phase)
    if outcome == "old":  # checksums included: the index the old .metadata needs was set aside, not overwritten
        assert_state_dict_equal(load(old, url, storage_options=s3.options, cache_metadata=False, verify_checksums=True)[0], old)
        assert verify_checkpoint(url, storage_options=s3.options).ok
    else:
        with pytest.raises(CheckpointError, match="not committed"):
            ShardReader(url, storage_options=s3.options, cache_metadata=False).read_metadata()
        opted_out = load(new, url, storage_options=s3.options, cache_metadata=False, require_commit_marker=False)[0]
        assert_state_dict_equal(opted_out, new)  # every data file was written before .metadata
    fresh = sample_state(3)
    save(fresh, url, storage_options=s3.options)
    assert_state_dict_equal(load(fresh, url, storage_options=s3.options, cache_metadata=False)[0], fresh)
    assert PREVIOUS_INDEX_NAME not in {os.path.basename(p) for p in s3.fs().ls(url)}  # retired by the commit


def _big_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(128, 512, generator=g) for i in range(64)}  # 16 MiB in 64 records: a save outlasts the kill


@pytest.mark.parametrize("existing", [False, True], ids=["empty", "over-checkpoint"])
@pytest.mark.parametrize("objects_before_kill", [1, 3])
def test_server_killed_mid_save_leaves_no_loadable_half_checkpoint(s3, url, existing, objects_before_kill):
    old = _big_state(1)
    if existing:
        save(old, url, storage_options=s3.options, thread_count=4)
    before = set(s3.fs().ls(url)) if existing else set()
    errors: list[BaseException] = []

    def run_save() -> None:
        try:
            save(_big_state(2), url, storage_options=s3.options, thread_count=4)
        except BaseException as exc:  # the save must fail once the server is gone
            errors.append(exc)

    writer = threading.Thread(target=run_save)
    writer.start()
    watcher, deadline = s3.fs(), time.time() + 60
    while time.time() < deadline:
        watcher.invalidate_cache()
        new_objects = set(watcher.ls(url)) - before if watcher.exists(url) else set()
        if len(new_objects) >= objects_before_kill or not writer.is_alive():
            break
        time.sleep(0.005)
    s3.stop()
    writer.join(120)
    s3.start()
    assert not writer.is_alive()
    if not errors:
        pytest.skip("the save finished before the server went down")
    try:
        ShardReader(url, storage_options=s3.options, cache_metadata=False).read_metadata()
    except CheckpointError as exc:  # killed before .metadata (empty dir), or between it and the marker
        if "not committed" in str(exc):  # .metadata landed: the new checkpoint is whole, just unmarked
            new = _big_state(2)
            assert_state_dict_equal(load(new, url, storage_options=s3.options, require_commit_marker=False)[0], new)
        else:
            assert not existing and "no committed checkpoint" in str(exc), exc
        return
    got = load(old, url, storage_options=s3.options, cache_metadata=False)[0]
    is_old = existing and torch.equal(got["layer0"], old["layer0"])  # killed before .metadata
    assert_state_dict_equal(got, old if is_old else _big_state(2))  # else killed in cleanup: new, committed


WRONG_CREDENTIALS = '''
import json, logging, warnings
warnings.filterwarnings("ignore")
import boto3, s3fs, torch, torch.distributed.checkpoint as dcp
from moto import server as moto_server
from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
iam.create_user(UserName="u")
policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
iam.put_user_policy(UserName="u", PolicyName="all", PolicyDocument=json.dumps(policy))
key = iam.create_access_key(UserName="u")["AccessKey"]
def options(key_id, secret):
    return {"key": key_id, "secret": secret, "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-west-2"},
            "config_kwargs": {"retries": {"max_attempts": 1}}, "skip_instance_cache": True}
good, bad = options(key["AccessKeyId"], key["SecretAccessKey"]), options("AKIAWRONGWRONGWRONG", "wrong")
s3fs.S3FileSystem(**good).mkdir("bkt")
dcp.save({"w": torch.ones(4)}, storage_writer=ShardWriter("s3://bkt/ckpt", storage_options=good), planner=ShardSavePlanner(), no_dist=True)
for run in (
    lambda: dcp.load({"w": torch.zeros(4)}, storage_reader=ShardReader("s3://bkt/ckpt", storage_options=bad), planner=ShardLoadPlanner(), no_dist=True),
    lambda: dcp.save({"w": torch.zeros(4)}, storage_writer=ShardWriter("s3://bkt/new", storage_options=bad), planner=ShardSavePlanner(), no_dist=True),
):
    try:
        run()
        print("succeeded")
    except BaseException as exc:
        print(next(iter(exc.failures.values()))[0] if hasattr(exc, "failures") else exc)
server.stop()
'''


def test_wrong_credentials_are_named_with_the_checkpoint_and_file():
    """A server that checks credentials (its own process: moto reads the switch at start).
    Before, a load raised a bare PermissionError('Forbidden') naming nothing."""
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}  # the set-up's own IAM calls go through
    result = subprocess.run([sys.executable, "-c", WRONG_CREDENTIALS], env=env, capture_output=True, text=True, timeout=120)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2, result.stdout + result.stderr[-3000:]
    assert "s3://bkt/ckpt: cannot read .metadata (Forbidden)" in lines[0], lines
    assert lines[1].startswith("s3://bkt/new: cannot create the checkpoint directory (The AWS Access Key Id"), lines


def test_an_endpoint_that_does_not_answer_is_named_with_the_checkpoint():
    """botocore's EndpointConnectionError is no OSError: it passed every handler and named
    only an internal request (a listing URL), for the save, and for the load twice over
    (DCP's retry with per-rank metadata asked the store again and reported that)."""
    options = {"key": "x", "secret": "x", "skip_instance_cache": True,
               "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-west-2"},  # port 9: nothing listens
               "config_kwargs": {"retries": {"max_attempts": 1}}}
    state = {"w": torch.ones(4)}
    with pytest.raises(BaseException) as saved:
        dcp.save(state, storage_writer=ShardWriter("s3://bkt/ckpt", storage_options=options), planner=ShardSavePlanner(), no_dist=True)
    with pytest.raises(BaseException) as loaded:
        dcp.load(state, storage_reader=ShardReader("s3://bkt/ckpt", storage_options=options), no_dist=True)
    failure = rank_failure(saved.value)
    assert isinstance(failure, CheckpointError), repr(failure)
    assert str(failure).startswith("s3://bkt/ckpt: the object store failed (EndpointConnectionError"), failure
    message = str(rank_failure(loaded.value))
    assert message.count("s3://bkt/ckpt: the object store failed (EndpointConnectionError") == 2, message
    assert "__0.metadata" not in message, message


def test_cleanup_of_a_failed_save_on_a_store_that_is_gone_only_warns(caplog):
    """The cleanup is best effort: since the store's own failures became CheckpointErrors,
    one raised out of it and replaced the save's real error."""
    from dcp_ext.storage.location import Location
    from dcp_ext.storage.save_tracking import OpenSave

    for url in ("http://127.0.0.1:9/ckpt", "s3://bkt/ckpt"):  # port 9: nothing listens
        options = None if url.startswith("http") else {
            "key": "x", "secret": "x", "skip_instance_cache": True,
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-west-2"},
            "config_kwargs": {"retries": {"max_attempts": 1}}}
        with caplog.at_level("WARNING", logger="dcp_ext"):
            OpenSave(Location(url, options), "token", "", False).discard()
        assert f"{url}: could not remove the files of failed save token" in caplog.text


def test_a_misspelled_storage_option_is_named_as_one(s3, url):
    """s3fs hands storage_options to its client on the first request: a misspelled option
    failed the save with a bare TypeError from aiobotocore naming neither."""
    options = {**s3.options, "secrett": "x"}
    with pytest.raises(BaseException) as saved:
        save({"w": torch.ones(4)}, url, storage_options=options)
    with pytest.raises(CheckpointError) as read:
        ShardReader(url, storage_options=options).read_metadata()
    for failure in (rank_failure(saved.value), read.value):
        assert isinstance(failure, CheckpointError), repr(failure)
        assert str(failure) == (f"{url}: the object store client refused its settings; check storage_options "
                                "(AioSession.__init__() got an unexpected keyword argument 'secrett')")


def test_an_empty_path_segment_is_refused_before_anything_is_written(s3):
    """s3fs lists nothing under 'bucket//prefix' (the key keeps the '/'): every save there
    failed as if another job had removed its files, and left them in the bucket."""
    url = f"s3://{BUCKET}//{uuid.uuid4().hex}"
    for make in (lambda: ShardWriter(url, storage_options=s3.options), lambda: ShardReader(url, storage_options=s3.options)):
        with pytest.raises(InvalidRequestError, match=r"the path has an empty segment \('//'\).* remove the extra '/'"):
            make()
    assert not any("//" in key for key in s3.fs().find(BUCKET))


def test_a_prefix_that_is_an_object_is_named_as_a_file(s3, url):
    s3.fs().pipe(url.removeprefix("s3://"), b"not a checkpoint")
    with pytest.raises(CheckpointError, match=f"^{url}: is a file, not a checkpoint directory$"):
        ShardReader(url, storage_options=s3.options).read_metadata()
    assert verify_checkpoint(url, storage_options=s3.options).faults == [f"{url}: is a file, not a checkpoint directory"]
