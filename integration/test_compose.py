"""The docker compose files are valid (``docker-compose config``) and say what they should: the CPU
profile (compose.yaml, run by scripts/test-docker) and the GPU profile (plus compose.gpu.yaml, not
run here). Both keep to the network rules: the host's network only, no published ports, loopback
addresses only."""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess

import pytest
import yaml

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "docker")
CPU = [os.path.join(HERE, "compose.yaml")]
GPU = [*CPU, os.path.join(HERE, "compose.gpu.yaml")]
SERVICES = {
    "ray-head",
    "ray-worker-1",
    "ray-worker-2",
    "ray-worker-blind",
    "dask-scheduler",
    "dask-worker-1",
    "dask-worker-2",
    "dask-worker-blind",
    "test-runner",
}
WORKERS = [f"{e}-worker-{i}" for e in ("ray", "dask") for i in (1, 2)]
BLIND = ["ray-worker-blind", "dask-worker-blind"]


def compose_config(files: list[str]) -> dict:
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.fail("docker-compose is not installed (Debian: apt-get install docker-compose)")
    args = [a for f in files for a in ("-f", f)]
    done = subprocess.run([tool, *args, "config"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def config(request) -> dict:
    return compose_config(CPU if request.param == "cpu" else GPU)


@pytest.fixture(scope="module")
def cpu() -> dict:
    return compose_config(CPU)


@pytest.fixture(scope="module")
def gpu() -> dict:
    return compose_config(GPU)


def env(service: dict) -> dict:
    return service.get("environment") or {}


def command(service: dict) -> str:
    cmd = service.get("command", "")
    return " ".join(cmd) if isinstance(cmd, list) else cmd


def test_compose_file_validates_with_every_service(config):
    assert set(config["services"]) == SERVICES


def test_every_service_uses_the_host_network_and_publishes_no_port(config):
    for name, service in config["services"].items():
        assert service.get("network_mode") == "host", name
        for key in ("networks", "ports", "expose", "links"):
            assert key not in service, f"{name}: {key}"
    assert not config.get("networks"), "the files name no network"


@pytest.mark.parametrize("path", GPU, ids=os.path.basename)
def test_the_files_as_written_name_no_network_and_no_port(path):
    with open(path) as f:
        raw = yaml.safe_load(f)

    def keys(node):
        if isinstance(node, dict):
            for k, v in node.items():
                yield k
                yield from keys(v)
        elif isinstance(node, list):
            for v in node:
                yield from keys(v)

    assert not {"networks", "ports", "expose", "links"} & set(keys(raw))
    for name, service in raw["services"].items():
        mode = service.get("network_mode")
        assert mode in (None, "host"), name  # None: an override of a host-network service


def test_every_address_a_service_names_is_loopback(config):
    for name, service in config["services"].items():
        text = command(service) + " " + " ".join(str(v) for v in env(service).values())
        for test in service.get("healthcheck", {}).get("test", []):
            text += " " + test
        addresses = re.findall(r"\b\d{1,3}(?:\.\d{1,3}){3}\b", text)
        assert addresses, name
        for a in addresses:
            assert ipaddress.ip_address(a).is_loopback, f"{name}: {a}"
        assert "0.0.0.0" not in text and "localhost" not in text, name


def test_cpu_each_worker_sees_the_same_simulated_gpus_in_its_own_order(cpu):
    services = cpu["services"]
    orders = [env(services[w])["CUDA_VISIBLE_DEVICES"] for w in WORKERS]
    assert len(set(orders)) == len(orders)  # a different order in each container
    for order in orders:
        assert sorted(order.split(",")) == ["0", "1", "2", "3"]
    for name in BLIND:
        assert env(services[name])["CUDA_VISIBLE_DEVICES"] == ""
    for name, service in services.items():
        assert "deploy" not in service, name  # no GPU from the host
        if name != "dask-scheduler":
            assert env(service)["SIMULATED_GPUS"] == "4", name
    assert "CUDA_VISIBLE_DEVICES" not in env(services["test-runner"])  # it sees them all


def test_gpu_each_worker_gets_real_gpus_in_its_own_order(gpu):
    services = gpu["services"]
    for engine in ("ray", "dask"):
        orders = [env(services[f"{engine}-worker-{i}"])["CUDA_VISIBLE_DEVICES"] for i in (1, 2)]
        assert orders == ["0,1", "1,0"]
    for name in [*WORKERS, "test-runner"]:
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia", name
    for name in BLIND:
        assert "deploy" not in services[name] and env(services[name])["CUDA_VISIBLE_DEVICES"] == ""
    for name, service in services.items():
        assert env(service).get("SIMULATED_GPUS", "0") == "0", name
        assert service.get("pid") == "host" and service.get("ipc") == "host", name
    for name in ("ray-worker-1", "ray-worker-2"):
        assert "--num-gpus=2" in command(services[name])


def test_the_runner_runs_the_scenario_suites_against_the_clusters(config):
    services = config["services"]
    runner = services["test-runner"]
    text = command(runner)
    assert "integration/test_cli_scenarios.py" in text
    assert "integration/test_docker_cluster.py" in text
    scheduler = command(services["dask-scheduler"])
    host = re.search(r"--host (\S+)", scheduler).group(1)
    port = re.search(r"--port (\d+)", scheduler).group(1)
    assert env(runner)["GPU_SERDE_DASK_SCHEDULER"] == f"tcp://{host}:{port}"
    head = command(services["ray-head"])
    ip = re.search(r"--node-ip-address=(\S+)", head).group(1)
    port = re.search(r"--port=(\d+)", head).group(1)
    assert env(runner)["GPU_SERDE_RAY_ADDRESS"] == f"{ip}:{port}"
    assert set(runner["depends_on"]) == set(WORKERS + BLIND)


def test_no_two_services_share_a_listening_address(config):
    listening = {}
    for name, service in config["services"].items():
        text = command(service)
        for ip in re.findall(r"--(?:node-ip-address=|host )(\S+)", text):
            assert ip not in listening, f"{name} and {listening[ip]} both use {ip}"
            listening[ip] = name
    assert len(listening) == len(SERVICES)
