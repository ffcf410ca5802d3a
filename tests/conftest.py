"""Pytest wiring shared by every layer; the helpers themselves live in ``support.py``.

Markers (registered in pyproject.toml): ``mp`` starts processes (gloo jobs, CLI
subprocesses, servers), ``s3`` talks to the S3 server on loopback, ``slow`` is long.
``pytest -m "not mp"`` is the fast layer; CI runs everything.

Hypothesis runs the same examples on every run (profile ``repeatable``), so a red CI run
is one anyone can reproduce; ``--hypothesis-profile=explore`` draws new ones.
"""

from __future__ import annotations

import warnings

import pytest
from hypothesis import settings

from dcp_ext import clear_caches

import mp

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile("repeatable")  # before the plugin applies --hypothesis-profile


@pytest.fixture(autouse=True)
def _fresh_caches():
    clear_caches()
    yield
    clear_caches()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``mp.run_job`` refuses to start a job for a test without ``@pytest.mark.mp``; set
    before any fixture of the test (module-scoped ones included) runs."""
    mp.running_test_has_mp_mark = item.get_closest_marker("mp") is not None
