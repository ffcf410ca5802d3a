"""Per-phase reports of saves and loads: phases, byte counts, callbacks and log records.

One 2-process gloo job (shared by the tests below) saves a checkpoint, loads it plainly
and with the two-stage loader, saves with a callback that raises, and saves with
``dcp.async_save``; every rank records what its callbacks and the ``dcp_ext`` logger got.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_ext import (
    LoadReport,
    SaveReport,
    ShardLoadPlanner,
    ShardReader,
    ShardSavePlanner,
    ShardWriter,
    add_report_callback,
    remove_report_callback,
)
from dcp_ext.formats.index import INDEX_NAME
from dcp_ext.observe import LOAD_PHASES, SAVE_PHASES

from mp import run_job
from support import assert_tensor_equal, garbage, garbage_like

pytestmark = pytest.mark.mp

WORLD = 2
TOLERANCE_S = 1e-6  # float rounding between the phase sums and the total


def _tensors() -> dict[str, torch.Tensor]:
    """Three records of 64 KiB, so a two-stage load spreads reads over both ranks."""
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(256, 128, generator=g), "r": torch.randn(128, 128, generator=g)}


def _sharded_state(mesh) -> dict:
    full = _tensors()
    return {"w": distribute_tensor(full["w"], mesh, [Shard(0)]), "r": full["r"].clone(), "step": 7}


class _Records(logging.Handler):
    """Keeps what the ``dcp_ext`` logger emits: (level, message, the report dict)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, str, dict | None]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelname, record.getMessage(), getattr(record, "dcp_ext", None)))


def _explode(report) -> None:
    raise RuntimeError("monitoring is down")


def _job(rank: int, world: int, root: str) -> dict:
    """Every operation of the module; returns what this rank observed of each."""
    logger = logging.getLogger("dcp_ext")
    logger.setLevel(logging.INFO)
    handler = _Records()
    logger.addHandler(handler)
    everywhere: list = []
    add_report_callback(everywhere.append)
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}

    mine: list = []
    writer = ShardWriter(f"{root}/main", on_report=mine.append)
    dcp.save(_sharded_state(mesh), storage_writer=writer, planner=ShardSavePlanner())
    out["save"] = (mine[:], writer.last_report)

    mine.clear()
    reader = ShardReader(f"{root}/main", on_report=mine.append)
    dest = {k: garbage_like(v) if torch.is_tensor(v) else -1 for k, v in _sharded_state(mesh).items()}
    dcp.load(dest, storage_reader=reader, planner=ShardLoadPlanner())
    out["load"] = (mine[:], reader.last_report, reader.stats)

    mine.clear()
    full = _tensors()
    dest = {k: garbage_like(v) for k, v in full.items()}
    staged = ShardReader(f"{root}/main", two_stage=True, on_report=mine.append)
    dcp.load(dest, storage_reader=staged, planner=ShardLoadPlanner())
    for name, value in dest.items():
        assert_tensor_equal(value, full[name], name)
    out["two_stage"] = (mine[:], staged.stats)
    out["operations"] = 3  # the global callback and the logger saw exactly these
    out["everywhere"] = everywhere[:]
    out["logged"] = handler.records[:]
    remove_report_callback(everywhere.append)

    handler.records.clear()
    raising = ShardWriter(f"{root}/raising", on_report=_explode)
    dcp.save(_sharded_state(mesh), storage_writer=raising, planner=ShardSavePlanner())
    out["raising"] = (raising.last_report, handler.records[:], len(everywhere))

    threads: list[str] = []
    background = ShardWriter(f"{root}/async", on_report=lambda r: threads.append(threading.current_thread().name))
    response = dcp.async_save(_sharded_state(mesh), storage_writer=background, planner=ShardSavePlanner())
    (response.upload_completion if isinstance(response, AsyncSaveResponse) else response).result(timeout=60)
    out["async"] = (threads, threading.current_thread().name, background.last_report)
    logger.removeHandler(handler)
    return out


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("observe")
    return root, run_job(_job, WORLD, str(root))


def _check_phases(report, phases: tuple[str, ...]) -> None:
    assert list(report.seconds) == [*phases, "total"], report.seconds
    assert all(seconds >= 0 for seconds in report.seconds.values()), report.seconds
    assert report.seconds["total"] + TOLERANCE_S >= sum(report.seconds[p] for p in phases), report.seconds


def test_save_reports_every_phase_once_per_rank(observed):
    root, results = observed
    for rank, result in enumerate(results):
        reports, last = result["save"]
        assert len(reports) == 1 and reports[0] is not None and reports[0] == last
        report = reports[0]
        assert isinstance(report, SaveReport) and report.rank == rank
        assert report.is_coordinator == (rank == 0)
        _check_phases(report, SAVE_PHASES)
        assert report.seconds["write"] > 0 and report.files_written >= 1
        if rank == 0:  # only the coordinator builds and commits the metadata
            assert report.seconds["metadata"] > 0 and report.seconds["commit"] > 0
            written = [root / "main" / name for name in (".metadata", INDEX_NAME)]
            assert report.metadata_bytes == sum(path.stat().st_size for path in written)
        else:
            assert report.seconds["metadata"] == report.seconds["commit"] == report.metadata_bytes == 0
    stored = ShardReader(root / "main").read_metadata().storage_data
    assert sum(result["save"][1].items_written for result in results) == len(stored)  # each item once


def test_bytes_written_equal_the_data_files_on_disk(observed):
    root, results = observed
    on_disk = sorted((root / "main").glob("*.distcp"))
    reports = [result["save"][1] for result in results]
    assert sum(r.bytes_written for r in reports) == sum(p.stat().st_size for p in on_disk)
    assert sum(r.files_written for r in reports) == len(on_disk)
    for rank, report in enumerate(reports):
        mine = [p for p in on_disk if p.name.startswith(f"__{rank}_")]
        assert report.bytes_written == sum(p.stat().st_size for p in mine)


def test_load_report_matches_read_stats(observed):
    _, results = observed
    for rank, result in enumerate(results):
        reports, last, stats = result["load"]
        assert len(reports) == 1 and reports[0] == last
        report = reports[0]
        assert isinstance(report, LoadReport) and report.rank == rank
        _check_phases(report, LOAD_PHASES)
        assert report.seconds["read"] > 0 and report.seconds["exchange"] == 0
        assert (report.bytes_read, report.files_opened, report.items_read, report.metadata_reads) == (
            stats.bytes_read,
            stats.files_opened,
            stats.items_read,
            stats.metadata_reads,
        )
        assert report.bytes_read > 0 and report.bytes_received == stats.bytes_received == 0


def test_two_stage_load_reports_exchange(observed):
    _, results = observed
    needed = sum(t.numel() * t.element_size() for t in _tensors().values())
    reports = []
    for result in results:
        (report,), stats = result["two_stage"]
        _check_phases(report, LOAD_PHASES)
        assert report.seconds["exchange"] > 0
        assert report.bytes_received == stats.bytes_received > 0
        assert report.bytes_read + report.bytes_received == needed  # read here or sent by the other rank
        reports.append(report)
    assert sum(r.bytes_read for r in reports) == needed  # every stored byte read once


def test_global_callback_and_log_record_once_per_rank_per_operation(observed):
    _, results = observed
    for result in results:
        own = [result["save"][1], result["load"][1], result["two_stage"][0][0]]
        assert result["everywhere"] == own  # in order, each once
        infos = [(message, payload) for level, message, payload in result["logged"] if level == "INFO"]
        assert len(infos) == result["operations"]
        for (message, payload), report in zip(infos, own):
            assert payload == report.to_dict() and message == report.summary()
            assert payload["kind"] in message and payload["checkpoint"] in message


def test_raising_callback_is_logged_and_the_save_completes(observed):
    root, results = observed
    loaded = {"r": garbage((128, 128))}
    dcp.load(loaded, storage_reader=ShardReader(root / "raising"), planner=ShardLoadPlanner())
    assert torch.equal(loaded["r"], _tensors()["r"])
    for rank, result in enumerate(results):
        report, records, global_calls = result["raising"]
        assert report is not None and report.rank == rank
        warnings = [message for level, message, _ in records if level == "WARNING"]
        assert len(warnings) == 1 and "_explode" in warnings[0] and "save report" in warnings[0]
        assert global_calls == result["operations"]  # removed callbacks are not called again


def test_async_save_reports_from_the_background_thread(observed):
    _, results = observed
    for rank, result in enumerate(results):
        threads, caller, report = result["async"]
        assert len(threads) == 1 and threads[0] != caller
        assert report.rank == rank and report.bytes_written > 0
        _check_phases(report, SAVE_PHASES)
