"""``gpu-serde demo`` as a user runs it: real local Dask and Ray clusters, here on simulated GPUs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import env_without_driver


@pytest.mark.parametrize("engine", ["dask", pytest.param("ray", marks=pytest.mark.slow)])
def test_the_demo_shows_one_uuid_and_hands_the_buffer_on_simulated_gpus(engine):
    done = subprocess.run(
        [sys.executable, "-m", "gpu_serde.tools.cli", "demo", "--engine", engine],
        env=env_without_driver(),  # as on a machine without a GPU: the demo simulates its own
        capture_output=True,
        text=True,
        timeout=280,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "running on 4 SIMULATED GPUs" in out
    handed = "buffer hand-off (64 MiB from an IPC-enabled pool"
    assert out.index("UUID received") < out.index(handed) < out.index("cannot see it, and says so")
    assert out.count("pattern verified, no copy") == 3  # worker-1 to each other GPU worker
    assert f"{engine}: the same UUID everywhere; buffer verified on 3 workers;" in out
    assert f"routed with gpu_serde.{engine}.on()" in out  # its rows count in the verdict
    rows = [line.split() for line in out.splitlines() if line.startswith("worker-")]
    assert len({row[2] for row in rows}) > 1  # the workers number that GPU differently
    assert len({row[3] for row in rows}) == 1  # and all resolved it to the same one


def test_a_failed_or_wrong_hand_off_is_reported_as_failed_never_as_verified(capsys):
    from gpu_serde.tools import demo

    def timed_out():
        raise TimeoutError("no answer in 120 s")

    exporter = {"ordinal": 1, "uuid": "GPU-a", "pattern": b"\x01\x02\x03\x04"}
    wrong_gpu = {
        "from": "worker-1",
        "to": "worker-2",
        "exporter": exporter,
        "ordinal": 0,
        "uuid": "GPU-b",
        "verified": True,
        "mapped": True,
    }
    hops = [demo._hop("worker-0", timed_out), wrong_gpu]
    assert demo._handoff(hops) == ""  # the verdict: nothing verified
    out = capsys.readouterr().out
    assert "worker-1 -> worker-0: FAILED: TimeoutError: no answer in 120 s" in out
    assert "FAILED: ANOTHER GPU (GPU-b, sent GPU-a)" in out
    assert "pattern verified" not in out
