"""Every documented way of starting a Ray driver installs gpu_serde in it, on a ``ray start`` cluster.

One cluster for the module: ``ray start --head`` with the dashboard (the job server) on 127.0.0.2,
and two worker nodes that number the simulated GPUs differently from the driver (``a``: GPUs 2,0;
``b``: GPUs 3,1; no GPU on two nodes, which the doctor would flag). Each route runs the same
driver script (``ray_route_driver.py``) as a user would: the driver's Device reaches every node as
the same GPU (UUID checked on the worker), and a node that cannot see it raises
``DeviceNotVisibleError``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from gpu_serde.ray import ENV_HOOK, HOOK
from gpu_serde.testing.clusters import RAY_IP, cli, free_port, ray_cli_cluster

pytestmark = pytest.mark.slow  # the fast loop (scripts/test-fast) leaves these out

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_route_driver.py")


def ray_env() -> dict[str, str]:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # the drivers join a `ray start` cluster
    return env


# The job server is part of Ray's dashboard, which needs `ray[default]` (aiohttp and more).
JOBS = importlib.util.find_spec("aiohttp") is not None


@pytest.fixture(scope="module")
def cluster(host_gpus):
    u = host_gpus
    # each node lacks two of the GPUs, and numbers one of its own unlike the driver whatever
    # order Ray lists them in for a task (GPU 2 on a, GPU 3 on b: ordinal 0 or 1 there)
    nodes = {"a": f"{u[2]},{u[0]}", "b": f"{u[3]},{u[1]}"}
    dashboard = free_port(RAY_IP) if JOBS else None
    with ray_cli_cluster(nodes, dashboard_port=dashboard) as address:
        yield {"gcs": address, "jobs": f"http://{RAY_IP}:{dashboard}", "nodes": nodes}


def result_of(done: subprocess.CompletedProcess) -> dict:
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(f"no result (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")


def run_script(cluster: dict, mode: str, **env: str) -> subprocess.CompletedProcess:
    """The driver as a script on the head's host: ``python ray_route_driver.py MODE``."""
    env = dict(
        ray_env(), GPU_SERDE_TEST_RAY_ADDRESS=cluster["gcs"], GPU_SERDE_TEST_NODE_IP=RAY_IP, **env
    )
    return subprocess.run(
        [sys.executable, DRIVER, mode], env=env, capture_output=True, text=True, timeout=300
    )


def submit(cluster: dict, mode: str, runtime_env: dict, **env: str) -> subprocess.CompletedProcess:
    """The driver as a job: ``ray job submit --runtime-env-json ... -- python ray_route_driver.py``."""
    if not JOBS:
        pytest.skip("`ray job submit` needs the job server: pip install 'ray[default]'")
    cmd = [cli("ray"), "job", "submit", "--address", cluster["jobs"]]
    cmd += ["--runtime-env-json", json.dumps(runtime_env), "--", sys.executable, DRIVER, mode]
    return subprocess.run(cmd, env=ray_env(), capture_output=True, text=True, timeout=300)


def assert_every_node_got_the_same_gpu(got: dict, cluster: dict) -> None:
    assert got["by_uuid"], "the driver pickles Devices by ordinal: gpu_serde is not installed there"
    assert set(got["nodes"]) == set(cluster["nodes"])
    for name, cvd in cluster["nodes"].items():
        mine = [e for e in cvd.split(",") if e]
        view = got["nodes"][name]
        assert sorted(view["seen"]) == sorted(mine)  # a task given all the node's GPUs
        for uuid in got["host"]:
            if uuid in mine:  # same GPU, at this worker's own ordinal
                assert view["got"][uuid] == [view["seen"].index(uuid), uuid]
            else:
                assert view["got"][uuid] == ["DeviceNotVisibleError", uuid]


def test_a_script_that_calls_gpu_serde_ray_init(cluster):
    done = run_script(cluster, "init")
    assert_every_node_got_the_same_gpu(result_of(done), cluster)


def test_a_script_with_ray_runtime_env_hook_and_a_plain_ray_init(cluster):
    done = run_script(cluster, "plain", RAY_RUNTIME_ENV_HOOK=ENV_HOOK)
    assert_every_node_got_the_same_gpu(result_of(done), cluster)


def test_a_submitted_job_with_the_env_hook_in_env_vars_and_a_plain_ray_init(cluster):
    env = {"worker_process_setup_hook": HOOK, "env_vars": {"RAY_RUNTIME_ENV_HOOK": ENV_HOOK}}
    done = submit(cluster, "plain", env)
    assert_every_node_got_the_same_gpu(result_of(done), cluster)


def test_a_submitted_job_with_the_worker_hook_whose_script_calls_gpu_serde_ray_init(cluster):
    done = submit(cluster, "init", {"worker_process_setup_hook": HOOK})
    assert "Failed to merge" not in done.stdout + done.stderr
    assert_every_node_got_the_same_gpu(result_of(done), cluster)


def test_a_submitted_job_whose_driver_is_not_installed_is_warned_by_its_workers(cluster):
    # only the driver's GPU 0 (the job's env_vars reach its driver): an ordinal every node has,
    # so no task fails to unpickle
    env = {"worker_process_setup_hook": HOOK, "env_vars": {"GPU_SERDE_TEST_ORDINALS": "0"}}
    done = submit(cluster, "plain", env)
    got = result_of(done)
    assert not got["by_uuid"]  # nothing of gpu_serde ran in this driver
    # the driver's GPU 0 is not on node b, yet a task there gets b's own ordinal 0: another GPU
    b = got["nodes"]["b"]
    assert b["got"][got["host"][0]] == [0, b["seen"][0]]
    assert b["seen"][0] != got["host"][0]
    assert "this job's driver did not install gpu_serde" in done.stdout
    assert ENV_HOOK in done.stdout  # and the warning says how to fix it


def doctor(cluster: dict, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gpu_serde", "doctor", "--ray", cluster["gcs"]]
    cmd += ["--node-ip-address", RAY_IP, "--json", *args]
    return subprocess.run(cmd, env=ray_env(), capture_output=True, text=True, timeout=300)


def test_the_doctor_waits_for_the_expected_nodes_and_passes(cluster):
    done = doctor(cluster, "--expect", str(len(cluster["nodes"]) + 1))  # and the head
    report = json.loads(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["ok"] and not report["problems"]
    workers = [p for p in report["processes"] if p["role"] == "worker"]
    assert len(workers) == len(cluster["nodes"]) + 1
    assert all(p["installed"] for p in workers)


def test_the_doctor_fails_when_fewer_nodes_than_expected_join(cluster):
    done = doctor(cluster, "--expect", "9", "--timeout", "3")
    report = json.loads(done.stdout)
    assert done.returncode == 1
    assert report["problems"] == [
        f"only {len(cluster['nodes']) + 1} of 9 expected node(s) answered"
    ]


@pytest.mark.gpu
def test_gpu_a_ray_start_node_counts_the_real_gpus_and_the_hooked_driver_sends_them_by_uuid():
    """GPU tier: a ``ray start`` node left to count the GPUs itself (NVML), and a driver with a
    plain ``ray.init()`` installed by ``RAY_RUNTIME_ENV_HOOK``. Fails (never skips) without a
    real GPU."""
    import gpu_serde
    from gpu_serde import testing

    host = [d.uuid for d in gpu_serde.visible_devices()]
    if not testing.real_driver_present() or not host:
        pytest.fail(f"the gpu tier needs a real GPU; this process sees {host}")
    with ray_cli_cluster({"gpu": None, "blind": ""}) as address:
        done = run_script({"gcs": address}, "plain", RAY_RUNTIME_ENV_HOOK=ENV_HOOK)
    got = result_of(done)
    assert got["host"] == host
    assert got["nodes"]["gpu"]["gpus"] == len(host)  # Ray found every real GPU by itself
    assert_every_node_got_the_same_gpu(got, {"nodes": {"gpu": ",".join(host), "blind": ""}})
