"""``gpu-serde simulate`` gives a CLI cluster simulated GPUs, as a user without a GPU starts one:
``dask scheduler`` as is, ``dask worker --preload gpu_serde.dask`` through
``gpu-serde simulate 2 -- ...``, and ``gpu-serde doctor`` sees the worker's two GPUs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from gpu_serde.testing import make_gpus
from gpu_serde.testing.clusters import Processes, cli, free_port

pytestmark = (
    pytest.mark.slow
)  # CLI-started clusters: the fast loop (scripts/test-fast) leaves them out


def without_gpus() -> dict[str, str]:
    """This environment without simulated GPUs: a shell on a machine without a GPU."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_SERDE_SIM_GPUS",)}
    env["LD_LIBRARY_PATH"] = ":".join(
        p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and "simdriver-" not in p
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def test_a_dask_worker_started_through_simulate_has_its_gpus():
    env = without_gpus()
    tmp = tempfile.mkdtemp(prefix="gss-", dir="/tmp")
    procs = Processes(tmp)
    address = f"tcp://127.0.0.1:{free_port()}"
    host, port = address.removeprefix("tcp://").split(":")
    common = ["--preload", "gpu_serde.dask", "--no-dashboard", "--dashboard-address", "127.0.0.1:0"]
    try:
        scheduler = [cli("dask"), "scheduler", "--host", host, "--port", port, *common]
        procs.start(scheduler, env, f"{tmp}/scheduler.log")
        worker = [sys.executable, "-m", "gpu_serde", "simulate", "2", "--", cli("dask"), "worker"]
        worker += [address, "--nthreads", "1", "--host", "127.0.0.1", *common]
        procs.start([*worker, "--local-directory", tmp], env, f"{tmp}/worker.log")
        doctor = [sys.executable, "-m", "gpu_serde", "doctor", "--scheduler", address]
        done = subprocess.run(
            [*doctor, "--expect", "1", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    assert done.returncode == 0, done.stdout + done.stderr
    workers = [p for p in json.loads(done.stdout)["processes"] if p["role"] == "worker"]
    assert [[u for _, u in w["gpus"]] for w in workers] == [[g.uuid for g in make_gpus(2)]]
