"""The docker compose file for GPU hosts is valid (``docker-compose config``) and says what it
should. No Docker engine runs here: the stack itself was not started in CI."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

COMPOSE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "docker", "compose.yaml")


@pytest.fixture(scope="module")
def config() -> dict:
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.fail("docker-compose is not installed (Debian: apt-get install docker-compose)")
    done = subprocess.run(
        [tool, "-f", COMPOSE, "config"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def test_compose_file_validates_with_every_service(config):
    assert set(config["services"]) == {
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


def test_each_gpu_worker_sees_the_gpus_in_a_different_order(config):
    services = config["services"]
    for engine in ("ray", "dask"):
        orders = [
            services[f"{engine}-worker-{i}"]["environment"]["CUDA_VISIBLE_DEVICES"] for i in (1, 2)
        ]
        assert orders == ["0,1", "1,0"]
        for i in (1, 2):
            devices = services[f"{engine}-worker-{i}"]["deploy"]["resources"]["reservations"][
                "devices"
            ]
            assert devices[0]["driver"] == "nvidia"
        assert services[f"{engine}-worker-blind"]["environment"]["CUDA_VISIBLE_DEVICES"] == ""


def test_the_runner_runs_the_same_scenario_suite(config):
    runner = config["services"]["test-runner"]
    command = runner["command"]
    text = " ".join(command) if isinstance(command, list) else command
    assert "integration/test_cli_scenarios.py" in text
    assert runner["environment"]["GPU_SERDE_DASK_SCHEDULER"] == "tcp://dask-scheduler:8786"
