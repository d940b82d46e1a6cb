"""Scenarios on clusters started with the engines' own CLIs: every worker that can see a GPU gets
it at its own ordinal with the same UUID; a worker that cannot raises the typed error and keeps
serving; Devices come back to the driver; the doctor reports each worker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from cuda.core import Device

import gpu_serde
from gpu_serde.tools import doctor

pytestmark = pytest.mark.slow  # the fast loop (scripts/test-fast) leaves these out


def device_for(uuid: str) -> Device:
    return Device(next(d.ordinal for d in gpu_serde.visible_devices() if d.uuid == uuid))


# --- Ray -----------------------------------------------------------------------------------


def ray_views(ray, nodes) -> dict[str, tuple[int, list[str], str]]:
    """node id -> (GPU count, the GPUs a task given all of them sees, custom name)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(max_retries=0)(doctor.probe)
    views = {}
    for n in nodes:
        gpus = int(n["Resources"].get("GPU", 0))
        where = NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        seen = ray.get(
            probe.options(num_gpus=gpus, scheduling_strategy=where).remote(), timeout=120
        )
        views[n["NodeID"]] = (gpus, [u for _, u in seen["gpus"]], where)
    return views


def test_ray_every_node_resolves_each_device_by_uuid(ray_cluster, host_gpus):
    ray, nodes = ray_cluster
    locate = ray.remote(max_retries=0)(doctor.locate)
    checked = set()
    for gpus, seen, where in ray_views(ray, nodes).values():
        for uuid in host_gpus:
            ref = locate.options(num_gpus=gpus, scheduling_strategy=where).remote(device_for(uuid))
            if uuid in seen:
                assert ray.get(ref, timeout=120) == (seen.index(uuid), uuid)
                checked.add(uuid)
            else:
                with pytest.raises(gpu_serde.DeviceNotVisibleError) as info:
                    ray.get(ref, timeout=120)
                assert info.value.uuid == uuid
    assert checked == set(host_gpus)  # every GPU was resolved where it is visible


def test_ray_a_blind_node_raises_and_keeps_serving(ray_cluster, host_gpus):
    ray, nodes = ray_cluster
    views = ray_views(ray, nodes)
    blind = [where for gpus, seen, where in views.values() if not seen]
    assert blind, "the layout has a node without GPUs"
    locate = ray.remote(max_retries=0)(doctor.locate)
    with pytest.raises(gpu_serde.DeviceNotVisibleError):
        ray.get(
            locate.options(scheduling_strategy=blind[0]).remote(device_for(host_gpus[0])),
            timeout=120,
        )

    def pid() -> int:
        return os.getpid()

    alive = ray.remote(pid).options(scheduling_strategy=blind[0]).remote()
    assert ray.get(alive, timeout=60) > 0


def test_ray_a_device_made_on_a_node_resolves_in_the_driver(ray_cluster):
    ray, nodes = ray_cluster

    def first():
        return Device(0)

    make = ray.remote(max_retries=0)(first)
    for gpus, seen, where in ray_views(ray, nodes).values():
        if seen:
            got = ray.get(
                make.options(num_gpus=gpus, scheduling_strategy=where).remote(), timeout=120
            )
            assert "GPU-" + got.uuid == seen[0]


def test_ray_doctor_reports_every_node(ray_address, host_gpus):
    address, ip, _ = ray_address
    cmd = [sys.executable, "-m", "gpu_serde", "doctor", "--ray", address]
    cmd += ["--node-ip-address", ip] if ip else []
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    for uuid in host_gpus:
        assert uuid in done.stdout, done.stdout + done.stderr
    assert "NOT set up" not in done.stdout
    if ip and not os.environ.get("GPU_SERDE_RAY_ADDRESS"):  # our own layout: nothing to flag
        assert done.returncode == 0 and "0 process(es) with problems: OK" in done.stdout, (
            done.stdout
        )


# --- Dask ----------------------------------------------------------------------------------


def dask_views(client) -> dict[str, list[str]]:
    return {a: [u for _, u in r["gpus"]] for a, r in client.run(doctor.probe).items()}


def test_dask_every_worker_resolves_each_device_by_uuid(dask_client, host_gpus):
    checked = set()
    for address, seen in dask_views(dask_client).items():
        for uuid in host_gpus:
            fut = dask_client.submit(doctor.locate, device_for(uuid), workers=[address], pure=False)
            if uuid in seen:
                assert fut.result(timeout=120) == (seen.index(uuid), uuid)
                checked.add(uuid)
            else:
                with pytest.raises(gpu_serde.DeviceNotVisibleError):
                    fut.result(timeout=120)
    assert checked == set(host_gpus)


def test_dask_a_blind_worker_raises_and_keeps_its_address(dask_client, host_gpus):
    blind = [a for a, seen in dask_views(dask_client).items() if not seen]
    assert blind
    fut = dask_client.submit(doctor.locate, device_for(host_gpus[0]), workers=blind, pure=False)
    with pytest.raises(gpu_serde.DeviceNotVisibleError):
        fut.result(timeout=120)
    assert dask_client.submit(os.getpid, workers=blind, pure=False).result(timeout=60) > 0
    assert blind[0] in dask_client.scheduler_info(n_workers=-1)["workers"]


def test_dask_doctor_reports_every_worker_and_flags_nothing(dask_client, dask_address, host_gpus):
    address, expected = dask_address
    survey = doctor.survey_dask(address, expect=expected)
    text = doctor.render(survey)
    reports = survey.workers
    assert len(reports) == expected
    for uuid in host_gpus:
        assert uuid in text
    assert all(r.installed for r in reports)
    if not os.environ.get("GPU_SERDE_DASK_SCHEDULER"):  # our layout: distinct device 0s
        assert "0 process(es) with problems: OK" in text, text
