"""A process's first save and first load (a resumed job's) import nothing they do not use.

pyarrow's own conversions import pandas on first use where it is installed (0.3-0.4 s);
the index is read and written through Arrow buffers instead (``formats.arrow_columns``).
CI has no pandas, so a stand-in ``pandas`` package on the path says whether anything
imports it (and fails the import, as pyarrow then treats pandas as absent).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_STAND_IN = 'import sys\nsys.stderr.write("pandas imported\\n")\nraise ImportError("a stand-in")\n'

_JOB = """
import sys, torch, torch.distributed.checkpoint as dcp
from dcp_ext import ShardLoadPlanner, ShardReader, ShardSavePlanner, ShardWriter
path = sys.argv[1]
state = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}, "step": 7}
if sys.argv[2] == "save":
    dcp.save(state, storage_writer=ShardWriter(path), planner=ShardSavePlanner(), no_dist=True)
else:
    got = {"model": {"w": torch.full((3, 4), -1.0), "b": torch.zeros(5, dtype=torch.bfloat16)}, "step": 0}
    dcp.load(got, storage_reader=ShardReader(path), planner=ShardLoadPlanner(), no_dist=True)
    assert torch.equal(got["model"]["w"], state["model"]["w"]) and got["step"] == 7
print("done")
"""


@pytest.mark.mp
def test_a_first_save_and_a_first_load_do_not_import_pandas(tmp_path):
    stand_in = tmp_path / "site" / "pandas"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text(_STAND_IN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    for step in ("save", "load"):  # each in a fresh process
        done = subprocess.run([sys.executable, "-c", _JOB, str(tmp_path / "ckpt"), step],
                              capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr
        assert "pandas imported" not in done.stderr, f"{step}: {done.stderr}"
