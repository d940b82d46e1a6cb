"""The performance page is made from the committed benchmark results, and stays so.

``benchmarks/plot.py --check`` draws the plots from ``benchmarks/results/*.json`` and fails when
docs/performance.md's tables are not what the data give; the benchmarks' ``--json`` files are
what it reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.json"))


def test_the_performance_page_matches_the_committed_results():
    pytest.importorskip("matplotlib", reason="the plot extra draws the plots")
    done = subprocess.run(
        [sys.executable, "benchmarks/plot.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_each_result_file_says_what_ran_where_and_when(path):
    doc = json.loads(path.read_text())
    assert doc["format"] == "gpu_serde-benchmark-results/1"
    assert "date" in doc and doc["source"] and doc["benchmark"]
    assert doc["machine"]["gpu"] and "simulated" in doc["machine"]
    assert doc["versions"]["python"] and doc["versions"]["cuda-core"]
    for row in doc["results"]:
        assert {"metric", "engine", "series", "value", "unit"} <= row.keys()
        assert row["unit"] in ("s", "bytes", "x")


def test_a_benchmarks_json_is_what_the_plot_script_reads(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import plot
    from _common import result, write_json

    path = tmp_path / "run.json"
    row = result("handoff", "ray", "gpu_serde.kept", 0.001, path="task argument", size="1 GiB")
    monkeypatch.setattr(sys, "argv", ["benchmarks/buffer_task.py", "--json", str(path)])
    write_json(str(path), "buffer_task", [row])
    [run] = plot.load([str(path)])
    assert run.rows == [row] and run.doc["command"].startswith("python benchmarks/buffer_task.py")
    assert run.doc["machine"]["simulated"] is True  # this CPU machine's simulated GPUs
    assert os.path.basename(run.path) == "run.json"
