"""Scenarios that only the docker cluster can show: each worker is another container (its own
mount namespace) that sees the same GPUs in its own order, a Device sent from the test-runner's
container arrives in each as the same GPU (the UUID is checked there) at that container's ordinal,
and a container that sees no GPU raises the typed error.

Run by the compose test-runner (``GPU_SERDE_IN_DOCKER=1``, see integration/docker/compose.yaml),
after integration/test_cli_scenarios.py; skipped elsewhere.
"""

from __future__ import annotations

import os

import pytest

import gpu_serde
from gpu_serde.tools import doctor

pytestmark = [
    pytest.mark.skipif(
        not os.environ.get("GPU_SERDE_IN_DOCKER"),
        reason="needs the docker cluster (scripts/test-docker)",
    ),
    pytest.mark.slow,
]


def container() -> int:
    """This process's mount namespace: one per container."""
    return os.stat("/proc/self/ns/mnt").st_ino


def worker_side():
    """``(container, arrive, arrive_blind)`` to run in the workers: nested, so that Ray and Dask
    pickle them by value (the workers cannot import this test module)."""

    def container() -> int:
        return os.stat("/proc/self/ns/mnt").st_ino

    def arrive(*devices):
        return container(), [doctor.locate(d) for d in devices]

    def arrive_blind(device):
        try:
            doctor.locate(device)
        except gpu_serde.DeviceNotVisibleError as exc:  # typed, and catchable in the worker
            return container(), exc.uuid
        return container(), None

    return container, arrive, arrive_blind


def device_for(uuid: str):
    from cuda.core import Device

    return Device(next(d.ordinal for d in gpu_serde.visible_devices() if d.uuid == uuid))


def check_arrivals(
    arrivals: dict[str, tuple[int, list]], host_gpus: list[str], sent: list[int], *, fixed: bool
) -> None:
    """``arrivals``: worker -> (its container, [(ordinal, uuid) it resolved per host GPU]);
    ``sent``: the sender's ordinals of those GPUs; ``fixed``: each worker's GPU order is its
    container's own (Dask), not one its engine assigns per task (Ray)."""
    assert len(arrivals) >= 2, arrivals
    containers = {c for c, _ in arrivals.values()}
    assert len(containers) == len(arrivals)  # one container each
    assert container() not in containers  # and none of them the test-runner's
    for i, uuid in enumerate(host_gpus):
        assert {got[i][1] for _, got in arrivals.values()} == {uuid}  # the same GPU everywhere
    # a worker numbers the GPUs otherwise than the sender: the UUID, not the ordinal, found them
    # (not each worker: a Ray task's CUDA_VISIBLE_DEVICES is the order Ray assigns its GPUs in,
    # which may be the same on two nodes, or, in principle, the sender's)
    assert any([o for o, _ in got] != sent for _, got in arrivals.values())
    if fixed:  # and each container numbers them its own way
        assert len({tuple(o for o, _ in got) for _, got in arrivals.values()}) == len(arrivals)


# --- Ray -----------------------------------------------------------------------------------


def ray_nodes(ray_cluster, gpus: bool):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    _, nodes = ray_cluster
    return {
        n["NodeManagerAddress"]: (
            int(n["Resources"].get("GPU", 0)),
            NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
        )
        for n in nodes
        if (n["Resources"].get("GPU", 0) > 0) == gpus
    }


def test_ray_a_device_reaches_each_gpu_container_as_the_same_gpu(ray_cluster, host_gpus):
    ray, _ = ray_cluster
    task = ray.remote(max_retries=0)(worker_side()[1])
    devices = [device_for(u) for u in host_gpus]
    arrivals = {
        ip: ray.get(
            task.options(num_gpus=n, scheduling_strategy=where).remote(*devices), timeout=120
        )
        for ip, (n, where) in ray_nodes(ray_cluster, gpus=True).items()
    }
    check_arrivals(arrivals, host_gpus, [d.device_id for d in devices], fixed=False)


def test_ray_the_blind_container_raises_device_not_visible(ray_cluster, host_gpus):
    ray, _ = ray_cluster
    probe = ray.remote(max_retries=0)(doctor.probe)
    task = ray.remote(max_retries=0)(worker_side()[2])
    blind = [  # the nodes whose tasks see no GPU (a num_gpus=0 task elsewhere is not masked)
        where
        for _, where in ray_nodes(ray_cluster, gpus=False).values()
        if not ray.get(probe.options(scheduling_strategy=where).remote(), timeout=120)["gpus"]
    ]
    assert blind
    for where in blind:
        ran_in, uuid = ray.get(
            task.options(scheduling_strategy=where).remote(device_for(host_gpus[0])), timeout=120
        )
        assert uuid == host_gpus[0]
        assert ran_in != container()


# --- Dask ----------------------------------------------------------------------------------


def dask_workers(client, gpus: bool) -> list[str]:
    views = client.run(doctor.probe)
    return [a for a, r in views.items() if bool(r["gpus"]) == gpus]


def test_dask_a_device_reaches_each_gpu_container_as_the_same_gpu(dask_client, host_gpus):
    arrive = worker_side()[1]
    devices = [device_for(u) for u in host_gpus]
    arrivals = {
        a: dask_client.submit(arrive, *devices, workers=[a], pure=False).result(timeout=120)
        for a in dask_workers(dask_client, gpus=True)
    }
    check_arrivals(arrivals, host_gpus, [d.device_id for d in devices], fixed=True)


def test_dask_the_blind_container_raises_device_not_visible(dask_client, host_gpus):
    (blind,) = dask_workers(dask_client, gpus=False)
    fut = dask_client.submit(doctor.locate, device_for(host_gpus[0]), workers=[blind], pure=False)
    with pytest.raises(gpu_serde.DeviceNotVisibleError) as info:
        fut.result(timeout=120)
    assert info.value.uuid == host_gpus[0]
    assert dask_client.run(worker_side()[0], workers=[blind])[blind] != container()
