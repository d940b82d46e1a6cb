"""Every documented way of starting Dask processes installs gpu_serde in each of them.

A CLI cluster that preloads gpu_serde only through Dask's configuration: the scheduler (no CUDA
driver) and worker ``yaml`` read a YAML file (``DASK_CONFIG``); workers ``env`` and ``blind`` read
``DASK_DISTRIBUTED__WORKER__PRELOAD``. The workers number the simulated GPUs differently
(``yaml``: 1,0; ``env``: 2,3,0; ``blind``: none). Clients in processes of their own are preloaded
by the YAML file or by ``DASK_DISTRIBUTED__CLIENT__PRELOAD``: each one's Device reaches every
worker as the same GPU (UUID checked on the worker), and a worker that cannot see it raises
``DeviceNotVisibleError``. Then ``LocalCluster`` with ``register(client)``, and the doctor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cuda.core import Device
from distributed import Client, LocalCluster

import gpu_serde
import gpu_serde.dask
from gpu_serde.testing.clusters import dask_cli_cluster

pytestmark = pytest.mark.slow  # the fast loop (scripts/test-fast) leaves these out

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.join(HERE, "dask_route_client.py")
PRELOAD = '["gpu_serde.dask"]'
YAML = """\
distributed:
  scheduler:
    preload: [gpu_serde.dask]
  worker:
    preload: [gpu_serde.dask]
  client:
    preload: [gpu_serde.dask]
"""


def without_driver(env: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in env.items() if k != "GPU_SERDE_SIM_GPUS"}
    env["LD_LIBRARY_PATH"] = ":".join(
        p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and "simdriver-" not in p
    )
    return env


@pytest.fixture(scope="module")
def config_cluster(host_gpus, tmp_path_factory):
    u = host_gpus
    folder = tmp_path_factory.mktemp("dask-config")
    (folder / "gpu_serde.yaml").write_text(YAML)
    base = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    yaml_env = {"DASK_CONFIG": str(folder)}
    env_preload = {"DASK_DISTRIBUTED__WORKER__PRELOAD": PRELOAD}
    workers = {"yaml": f"{u[1]},{u[0]}", "env": f"{u[2]},{u[3]},{u[0]}", "blind": ""}
    with dask_cli_cluster(
        workers,
        env=base,
        scheduler_env={**without_driver(base), **yaml_env},
        preload=False,
        worker_env={"yaml": yaml_env, "env": env_preload, "blind": env_preload},
    ) as address:
        yield {"address": address, "workers": workers, "yaml": yaml_env, "base": base}


def run_client(cluster: dict, extra: dict[str, str]) -> dict:
    env = {**cluster["base"], **extra}
    cmd = [sys.executable, CLIENT, cluster["address"], str(len(cluster["workers"]))]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(f"no result (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")


def assert_every_worker_got_the_same_gpu(got: dict, workers: dict[str, str]) -> None:
    assert got["by_uuid"], "the client pickles Devices by ordinal: gpu_serde is not installed there"
    assert set(got["workers"]) == set(workers)
    for name, cvd in workers.items():
        mine = [e for e in cvd.split(",") if e]
        view = got["workers"][name]
        assert view["seen"] == mine  # a Dask worker's numbering is its CUDA_VISIBLE_DEVICES
        for uuid in got["host"]:
            if uuid in mine:
                assert view["got"][uuid] == [mine.index(uuid), uuid]
            else:
                assert view["got"][uuid] == ["DeviceNotVisibleError", uuid]


def test_a_client_preloaded_by_the_environment_variable(config_cluster):
    got = run_client(config_cluster, {"DASK_DISTRIBUTED__CLIENT__PRELOAD": PRELOAD})
    assert_every_worker_got_the_same_gpu(got, config_cluster["workers"])


def test_a_client_preloaded_by_the_yaml_file(config_cluster):
    got = run_client(config_cluster, config_cluster["yaml"])
    assert_every_worker_got_the_same_gpu(got, config_cluster["workers"])


def test_a_client_without_gpu_serde_is_refused_by_the_driverless_scheduler(config_cluster):
    got = run_client(config_cluster, {})  # no preload, no register(), no install()
    assert not got["by_uuid"]
    for view in got["workers"].values():
        for result in view["got"].values():  # loud, never another GPU
            assert result[0] == "RuntimeError"
            assert "Error during deserialization of the task graph" in result[1]


def doctor(address: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gpu_serde", "doctor", "--scheduler", address, "--json", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_the_doctor_sees_the_config_preloaded_scheduler_and_workers(config_cluster):
    done = doctor(config_cluster["address"], "--expect", "3")
    report = json.loads(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    roles = {p["role"]: p for p in report["processes"]}
    assert roles["scheduler"]["installed"]
    assert roles["scheduler"]["gpus"] == []  # it needs gpu_serde, not a GPU
    workers = [p for p in report["processes"] if p["role"] == "worker"]
    assert len(workers) == 3 and all(p["installed"] for p in workers)


def test_the_doctor_fails_when_fewer_workers_than_expected_join(config_cluster):
    done = doctor(config_cluster["address"], "--expect", "4", "--timeout", "3")
    assert done.returncode == 1
    assert json.loads(done.stdout)["problems"] == ["only 3 of 4 expected worker(s) answered"]


def where_is(device: object) -> tuple[int, str]:
    d = gpu_serde.resolve(device)
    return d.device_id, "GPU-" + d.uuid


def test_a_local_cluster_with_register_resolves_the_clients_devices(host_gpus):
    u = host_gpus
    cvd = f"{u[2]},{u[0]}"
    with (
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            host="127.0.0.1",
            dashboard_address="127.0.0.1:0",
            env={"CUDA_VISIBLE_DEVICES": cvd},
        ) as cluster,
        Client(cluster) as client,
    ):
        gpu_serde.dask.register(client)
        try:
            futures = [client.submit(where_is, Device(k), pure=False) for k in range(len(u))]
            assert futures[2].result(timeout=60) == (0, u[2])
            assert futures[0].result(timeout=60) == (1, u[0])
            with pytest.raises(gpu_serde.DeviceNotVisibleError) as info:
                futures[1].result(timeout=60)
            assert info.value.uuid == u[1]
        finally:
            gpu_serde.uninstall()


def test_the_doctor_fails_on_a_scheduler_without_workers():
    with LocalCluster(n_workers=0, host="127.0.0.1", dashboard_address="127.0.0.1:0") as cluster:
        done = doctor(cluster.scheduler_address, "--timeout", "5")
    assert done.returncode == 1
    assert "no worker answered" in json.loads(done.stdout)["problems"][0]
