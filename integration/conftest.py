"""The CLI-cluster scenario suite: clusters started by ``ray start`` and ``dask scheduler/worker``.

By default it starts its own clusters on loopback over four simulated GPUs (or the real GPUs where
a driver is present). Given ``GPU_SERDE_RAY_ADDRESS`` and ``GPU_SERDE_DASK_SCHEDULER`` (as the
docker compose test-runner does), it runs the same scenarios against those clusters instead
(``GPU_SERDE_RAY_NODE_IP``: the address of the runner's own raylet there).
"""

from __future__ import annotations

import os
import time

import pytest

import gpu_serde
from gpu_serde.testing.clusters import RAY_IP, dask_cli_cluster, ray_cli_cluster

# A local ray.init() of Ray 2.60 would write ~/.ray/auth_token (tests/conftest.py says why not).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def host_gpus(request) -> list[str]:
    """The GPU UUIDs of this host in host order (the test process sees them all)."""
    from gpu_serde import testing
    from gpu_serde.inventory import inventory

    if not testing.real_driver_present():
        request.getfixturevalue("simulated_gpus")
    inv = inventory()
    assert inv.devices, f"the scenario suite needs GPUs, real or simulated: {inv.describe()}"
    return [d.uuid for d in inv.devices]


def layout(uuids: list[str]) -> dict[str, str]:
    """Worker name -> CUDA_VISIBLE_DEVICES: halves in reversed order, plus a worker with none."""
    half = max(1, len(uuids) // 2)
    groups = {"a": uuids[:half][::-1], "b": uuids[half:][::-1]}
    spec = {name: ",".join(g) for name, g in groups.items() if g}
    spec["blind"] = ""
    return spec


@pytest.fixture(scope="module")
def ray_address(host_gpus):
    external = os.environ.get("GPU_SERDE_RAY_ADDRESS")
    if external:  # GPU_SERDE_RAY_NODE_IP: the address of this host's own raylet, if not the default
        ip = os.environ.get("GPU_SERDE_RAY_NODE_IP") or None
        yield external, ip, int(os.environ.get("GPU_SERDE_RAY_NODES", "1"))
        return
    nodes = layout(host_gpus)
    with ray_cli_cluster(nodes) as address:
        yield address, RAY_IP, len(nodes) + 1  # and the head


@pytest.fixture(scope="module")
def dask_address(host_gpus):
    external = os.environ.get("GPU_SERDE_DASK_SCHEDULER")
    if external:
        yield external, int(os.environ.get("GPU_SERDE_DASK_WORKERS", "1"))
        return
    scheduler_env = {k: v for k, v in os.environ.items() if k != "GPU_SERDE_SIM_GPUS"}
    scheduler_env["LD_LIBRARY_PATH"] = ":".join(
        p for p in scheduler_env.get("LD_LIBRARY_PATH", "").split(":") if "simdriver-" not in p
    )
    workers = layout(host_gpus)
    with dask_cli_cluster(workers, scheduler_env=scheduler_env) as address:
        yield address, len(workers)


@pytest.fixture(scope="module")
def ray_cluster(ray_address):
    """``(ray, alive nodes)``: this process is the Ray driver of ``ray_address``'s cluster, with
    gpu_serde installed, once every expected node has joined."""
    import ray

    import gpu_serde.ray

    address, ip, expected = ray_address
    extra = {"_node_ip_address": ip} if ip else {}
    gpu_serde.ray.init(address=address, log_to_driver=False, **extra)
    deadline = time.monotonic() + 120
    while len(nodes := [n for n in ray.nodes() if n["Alive"]]) < expected:
        assert time.monotonic() < deadline, f"only {len(nodes)} of {expected} Ray nodes joined"
        time.sleep(0.5)
    yield ray, nodes
    ray.shutdown()
    gpu_serde.uninstall()


@pytest.fixture(scope="module")
def dask_client(dask_address, host_gpus):
    """A Dask client of ``dask_address``'s cluster, once every expected worker has joined."""
    from distributed import Client

    address, expected = dask_address
    client = Client(address, timeout=60)
    gpu_serde.install()  # the workers and scheduler have it through --preload
    client.wait_for_workers(expected, timeout=120)
    yield client
    client.close()
    gpu_serde.uninstall()
