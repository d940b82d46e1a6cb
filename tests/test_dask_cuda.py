"""dask-cuda on simulated GPUs: `dask cuda worker` and `LocalCUDACluster` find the GPUs through the
stand-in NVML, start one worker per GPU with ``CUDA_VISIBLE_DEVICES`` rotated, and each worker
resolves a client's Device as the same GPU.

dask-cuda pins its own distributed, so this module runs in its own venv (scripts/test-matrix makes
``.venv-dask-cuda``); elsewhere it is skipped.
"""

import contextlib
import os
import shutil
import tempfile

import pytest

dask_cuda = pytest.importorskip("dask_cuda", reason="runs in scripts/test-matrix's dask-cuda venv")

from cuda.core import Device  # noqa: E402
from distributed import Client  # noqa: E402

import gpu_serde  # noqa: E402
import gpu_serde.dask  # noqa: E402
from gpu_serde.testing import child_env  # noqa: E402
from gpu_serde.testing.clusters import Processes, cli, free_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def where(device) -> tuple:
    """On a worker: the GPU a Device resolved to, and the worker's CUDA_VISIBLE_DEVICES."""
    d = gpu_serde.resolve(device)
    return d.uuid, d.device_id, os.environ.get("CUDA_VISIBLE_DEVICES")


def rotated(entries: list[str]) -> set[str]:
    """What dask-cuda gives its workers: ``visible[i:] + visible[:i]``."""
    return {",".join(entries[i:] + entries[:i]) for i in range(len(entries))}


def host_uuid(entry: str, uuids: list[str]) -> str:
    """The GPU a CUDA_VISIBLE_DEVICES entry (a host ordinal or a UUID) names."""
    return uuids[int(entry)] if entry.isdigit() else entry


@contextlib.contextmanager
def dask_cuda_worker(env: dict[str, str]):
    """`dask scheduler --preload gpu_serde.dask` and one `dask cuda worker --preload gpu_serde.dask`."""
    env = dict(env, PYTHONPATH=os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH")) if p))
    tmp = tempfile.mkdtemp(prefix="gsdc-", dir="/tmp")
    procs = Processes(marker=tmp)  # every process started here names tmp on its command line
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    common = ["--preload", "gpu_serde.dask", "--no-dashboard", "--dashboard-address", "127.0.0.1:0"]
    try:
        scheduler = [cli("dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port)]
        procs.start(
            [*scheduler, *common, "--scheduler-file", f"{tmp}/scheduler.json"],
            env,
            f"{tmp}/scheduler.log",
        )
        worker = [cli("dask"), "cuda", "worker", address, "--host", "127.0.0.1", "--nthreads", "1"]
        procs.start(
            [*worker, *common, "--local-directory", tmp],
            env,
            f"{tmp}/worker.log",
        )
        yield address
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)


NAMED = [("dask cuda worker", "three GPUs named"), ("LocalCUDACluster", "three GPUs named")]
EVERY = [("dask cuda worker", "all GPUs"), ("LocalCUDACluster", "all GPUs"), *NAMED]


def clusters(which: list[tuple[str, str]]) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("cuda_cluster", which, indirect=True, ids=" / ".join)


@pytest.fixture(scope="module")
def cuda_cluster(request, simulated_gpus):
    """A dask-cuda cluster on a host with four GPUs. With CUDA_VISIBLE_DEVICES unset dask-cuda counts
    the GPUs through NVML and gives workers host ordinals; otherwise it rotates the three UUIDs."""
    uuids = [g.uuid for g in simulated_gpus]
    how, which = request.param
    named = [uuids[2], uuids[0], uuids[3]] if which == "three GPUs named" else None
    visible = named or [str(i) for i in range(len(uuids))]
    with contextlib.ExitStack() as stack:
        if how == "dask cuda worker":
            address = stack.enter_context(dask_cuda_worker(child_env(simulated_gpus, named)))
            client = stack.enter_context(Client(address, timeout=60))
            gpu_serde.install()
        else:
            cluster = stack.enter_context(
                dask_cuda.LocalCUDACluster(
                    CUDA_VISIBLE_DEVICES=named,
                    host="127.0.0.1",
                    threads_per_worker=1,
                    dashboard_address=None,
                )
            )
            client = stack.enter_context(Client(cluster))
            gpu_serde.dask.register(client)
        stack.callback(gpu_serde.uninstall)
        client.wait_for_workers(len(visible), timeout=120)
        yield client, uuids, visible


@clusters(EVERY)
def test_dask_cuda_starts_one_worker_per_visible_gpu_with_rotated_devices(cuda_cluster):
    client, _, visible = cuda_cluster
    seen = client.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"])
    assert set(seen.values()) == rotated(visible)


@clusters(EVERY)
def test_every_worker_resolves_a_client_device_as_the_same_gpu(cuda_cluster):
    client, uuids, _ = cuda_cluster
    target = uuids[3]  # the client's Device(3); each worker numbers it differently
    for address in client.scheduler_info()["workers"]:
        uuid, ordinal, cvd = client.submit(where, Device(3), workers=[address], pure=False).result(
            timeout=60
        )
        local = [host_uuid(e, uuids) for e in cvd.split(",")]
        assert (uuid, ordinal) == (target[4:], local.index(target))


@clusters(NAMED)
def test_a_gpu_outside_cuda_visible_devices_raises_device_not_visible(cuda_cluster):
    client, uuids, _ = cuda_cluster
    future = client.submit(where, Device(1), pure=False)  # uuids[1] is on no worker
    with pytest.raises(gpu_serde.DeviceNotVisibleError) as info:
        future.result(timeout=60)
    assert info.value.uuid == uuids[1]
