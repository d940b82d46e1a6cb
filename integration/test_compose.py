"""The docker compose files are valid and say what they should: the CPU profile (compose.yaml, run
by scripts/test-docker) and the GPU profile (plus compose.gpu.yaml, not run here). Both keep to
the network rules: the host's network only, no published ports, loopback addresses only.

Validity is checked in Python, without docker: each file, and the files merged as compose merges
them, against the compose specification's JSON schema (the copy that check-jsonschema ships, in
the ``test`` extra)."""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import sys

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


def valid(paths: list[str]) -> None:
    """Each file matches the compose specification's schema."""
    cmd = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec"]
    done = subprocess.run([*cmd, *paths], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def merge(base: object, override: object) -> object:
    """Compose's merge of a later file into an earlier one, for what these files hold: mappings
    merge key by key (``environment`` and ``deploy`` too), anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {k: merge(base[k], v) if k in base else v for k, v in {**base, **override}.items()}
    return override


def compose_config(files: list[str], tmp_dir: str) -> dict:
    """The files' configuration as compose reads it: YAML anchors and ``<<`` merges resolved, later
    files merged over earlier ones, extension fields (``x-...``) left out; every file and the
    result checked against the compose specification's schema."""
    valid(files)
    merged: object = {}
    for path in files:
        with open(path) as f:
            merged = merge(merged, yaml.safe_load(f))
    assert isinstance(merged, dict)
    config = {k: v for k, v in merged.items() if not k.startswith("x-")}
    result = os.path.join(tmp_dir, "merged.yaml")
    with open(result, "w") as f:
        yaml.safe_dump(config, f)
    valid([result])
    return config


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def config(request, tmp_path_factory) -> dict:
    return compose_config(CPU if request.param == "cpu" else GPU, tmp_path_factory.mktemp("c"))


@pytest.fixture(scope="module")
def cpu(tmp_path_factory) -> dict:
    return compose_config(CPU, tmp_path_factory.mktemp("cpu"))


@pytest.fixture(scope="module")
def gpu(tmp_path_factory) -> dict:
    return compose_config(GPU, tmp_path_factory.mktemp("gpu"))


def test_a_file_that_breaks_the_compose_schema_is_refused(tmp_path):
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  a:\n    image: x\n    network_mode: host\n    netwrok: y\n")
    with pytest.raises(AssertionError, match="netwrok"):
        valid([str(bad)])


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
