"""The real-GPU tier (``pytest -m gpu``): the same scenarios on a real NVIDIA GPU and driver.

Every test here fails, never skips, when no real GPU is visible. A receiver proves it holds the
real device by making it current and allocating on it.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
from cuda.core import Device

import gpu_serde
from helpers import run_child

pytestmark = pytest.mark.gpu

USE = """
d = pickle.loads(data)
try:
    real = gpu_serde.resolve(d)
    real.set_current()
    real.allocate(1 << 20, stream=real.default_stream).close()
    report(kind="device", ordinal=real.device_id, uuid=real.uuid)
except gpu_serde.DeviceNotVisibleError as exc:
    report(kind="not visible", uuid=exc.uuid, message=str(exc))
"""


def env_with(cvd: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("GPU_SERDE_SIM_GPUS", None)
    if cvd is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = cvd
    return env


@pytest.fixture(scope="module")
def installed(real_gpu):
    gpu_serde.install()
    yield real_gpu
    gpu_serde.uninstall()


def test_round_trip_returns_the_same_real_device(installed):
    d = Device(0)
    assert pickle.loads(pickle.dumps(d)) is d
    assert gpu_serde.visible_devices()[0].uuid == "GPU-" + d.uuid
    assert gpu_serde.visible_devices()[0].pci_bus_id  # from the driver, not the runtime


def test_a_child_selecting_the_gpu_by_uuid_gets_it(installed):
    info = installed[0]
    got = run_child(USE, env_with(info.uuid), pickle.dumps(Device(0)))
    assert got == {"kind": "device", "ordinal": 0, "uuid": info.uuid[4:]}


def test_a_child_selecting_by_uuid_prefix_gets_it(installed):
    info = installed[0]
    got = run_child(USE, env_with(info.uuid[:12]), pickle.dumps(Device(0)))
    assert got["uuid"] == info.uuid[4:]


def test_a_child_with_an_empty_cuda_visible_devices_gets_the_typed_error(installed):
    got = run_child(USE, env_with(""), pickle.dumps(Device(0)))
    assert got["kind"] == "not visible"
    assert got["uuid"] == installed[0].uuid
    assert "CUDA_VISIBLE_DEVICES is empty" in got["message"]


def test_ray_tasks_get_the_real_gpu_or_the_typed_error(installed):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray.cluster_utils import Cluster

    import gpu_serde.ray

    uuid = installed[0].uuid
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    c.add_node(
        num_cpus=2, num_gpus=1, resources={"gpu_node": 9}, env_vars={"CUDA_VISIBLE_DEVICES": uuid}
    )
    c.add_node(
        num_cpus=2, num_gpus=0, resources={"blind_node": 9}, env_vars={"CUDA_VISIBLE_DEVICES": ""}
    )
    gpu_serde.ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote(max_retries=0)
        def use(device):
            d = gpu_serde.resolve(device)
            d.set_current()
            d.allocate(1 << 20, stream=d.default_stream).close()
            return d.device_id, d.uuid, os.environ.get("CUDA_VISIBLE_DEVICES")

        got = ray.get(use.options(num_gpus=1, resources={"gpu_node": 1}).remote(Device(0)))
        assert got[:2] == (0, uuid[4:])
        with pytest.raises(gpu_serde.DeviceNotVisibleError) as info:
            ray.get(use.options(resources={"blind_node": 1}).remote(Device(0)))
        assert info.value.uuid == uuid

        @ray.remote(num_gpus=1, resources={"gpu_node": 1})
        class Holder:
            def device(self):
                return Device(0)

        h = Holder.remote()
        back = ray.get(h.device.remote())
        assert back.uuid == uuid[4:]
        ray.kill(h)
    finally:
        ray.shutdown()
        c.shutdown()


def test_dask_workers_get_the_real_gpu_or_the_typed_error(installed):
    from distributed import Client, Nanny, Scheduler, SpecCluster

    import gpu_serde.dask

    uuid = installed[0].uuid
    workers = {
        name: {
            "cls": Nanny,
            "options": {"nthreads": 1, "host": "127.0.0.1", "env": {"CUDA_VISIBLE_DEVICES": cvd}},
        }
        for name, cvd in {"gpu": uuid, "blind": "", "gpu2": uuid}.items()
    }
    scheduler = {
        "cls": Scheduler,
        "options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"},
    }
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        gpu_serde.dask.register(client)
        client.wait_for_workers(3, timeout=120)
        by_name = {w["name"]: a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}

        def use(device):
            d = gpu_serde.resolve(device)
            d.set_current()
            d.allocate(1 << 20, stream=d.default_stream).close()
            return d.device_id, d.uuid

        def make():
            return Device(0)

        ok = client.submit(use, Device(0), workers=[by_name["gpu"]], pure=False)
        assert ok.result(timeout=120) == (0, uuid[4:])
        bad = client.submit(use, Device(0), workers=[by_name["blind"]], pure=False)
        with pytest.raises(gpu_serde.DeviceNotVisibleError):
            bad.result(timeout=120)
        again = client.submit(os.getpid, workers=[by_name["blind"]], pure=False)
        assert again.result(timeout=60) > 0  # the blind worker survived
        made = client.submit(make, workers=[by_name["gpu"]], pure=False)
        assert made.result(timeout=60).uuid == uuid[4:]  # result back to the client
        moved = client.submit(use, made, workers=[by_name["gpu2"]], pure=False)
        assert moved.result(timeout=60) == (0, uuid[4:])  # worker to worker


@pytest.mark.parametrize("engine", ["dask", "ray"])
def test_the_demo_hands_a_buffer_to_every_other_gpu_worker(installed, engine):
    done = subprocess.run(
        [sys.executable, "-m", "gpu_serde.tools.cli", "demo", "--engine", engine],
        env=env_with(os.environ.get("CUDA_VISIBLE_DEVICES")),
        capture_output=True,
        text=True,
        timeout=280,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    verified = [line for line in out.splitlines() if "pattern verified, no copy" in line]
    assert len(verified) == max(len(installed), 2) - 1, out  # the layout has >= 2 GPU workers
    assert "SIMULATED" not in out and "skipped" not in out and "FAILED" not in out
    workers = f"{len(verified)} worker{'s' if len(verified) != 1 else ''}"
    assert f"{engine}: the same UUID everywhere; buffer verified on {workers}" in out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-m", "gpu", "-v"]))
