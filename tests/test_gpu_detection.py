"""The real-GPU tier (``pytest -m gpu``): Ray and dask-cuda find the real GPUs through the real NVML,
and a Device sent to what they start is the same GPU there (the CPU tier does this on the
stand-in NVML: tests/test_simulated_nvml.py, tests/test_dask_cuda.py).

Fails, never skips, without a real GPU, or without Ray or dask-cuda installed (wheels for the GPU
machine: ``../shared/device/make-wheelhouse dask-cuda nvidia-ml-py ...``, see docs/versions.md).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import pytest
from cuda.core import Device

import gpu_serde
from helpers import run_child

pytestmark = pytest.mark.gpu


def real_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("GPU_SERDE_SIM_GPUS", None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


RAY_DETECTS = """
import ray, gpu_serde.ray
from cuda.core import Device
# "local": start a cluster here, never join one that `ray start` left on this host
gpu_serde.ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)

@ray.remote(num_gpus=1, max_retries=0)
def use(device):
    d = gpu_serde.resolve(device)
    d.set_current()
    d.allocate(1 << 20, stream=d.default_stream).close()
    return d.uuid

report(gpus=ray.cluster_resources().get("GPU"), resolved=ray.get(use.remote(Device(0))),
       sent=Device(0).uuid)
ray.shutdown()
"""


def test_ray_counts_the_real_gpus_and_a_task_gets_the_drivers_device(real_gpu):
    seen = run_child(RAY_DETECTS, real_env(), timeout=300)
    assert seen["gpus"] == float(len(real_gpu))
    assert seen["resolved"] == seen["sent"] == real_gpu[0].uuid[4:]


@contextlib.contextmanager
def dask_cuda_worker(env: dict[str, str]):
    from gpu_serde.testing.clusters import Processes, cli, free_port

    tmp = tempfile.mkdtemp(prefix="gsdc-", dir="/tmp")
    procs = Processes(marker=tmp)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    common = ["--preload", "gpu_serde.dask", "--no-dashboard", "--dashboard-address", "127.0.0.1:0"]
    try:
        scheduler = [cli("dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port)]
        procs.start([*scheduler, *common, "--scheduler-file", f"{tmp}/s.json"], env, f"{tmp}/s.log")
        worker = [cli("dask"), "cuda", "worker", address, "--host", "127.0.0.1", "--nthreads", "1"]
        procs.start([*worker, *common, "--local-directory", tmp], env, f"{tmp}/w.log")
        yield address
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def use_on_worker(device) -> tuple:
    d = gpu_serde.resolve(device)
    d.set_current()
    d.allocate(1 << 20, stream=d.default_stream).close()
    return d.uuid, os.environ.get("CUDA_VISIBLE_DEVICES")


def test_dask_cuda_worker_with_the_preload_gets_the_clients_real_device(real_gpu):
    import dask_cuda  # noqa: F401 - fails the test, as the tier does, when dask-cuda is missing
    from distributed import Client

    here = os.path.dirname(os.path.abspath(__file__))  # the worker imports use_on_worker from here
    env = dict(
        real_env(), PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    )
    gpu_serde.install()
    try:
        with dask_cuda_worker(env) as address, Client(address, timeout=60) as client:
            client.wait_for_workers(len(real_gpu), timeout=120)
            for k in range(len(real_gpu)):
                for worker in client.scheduler_info()["workers"]:
                    uuid, cvd = client.submit(
                        use_on_worker, Device(k), workers=[worker], pure=False
                    ).result(timeout=120)
                    assert uuid == real_gpu[k].uuid[4:], cvd
    finally:
        gpu_serde.uninstall()
