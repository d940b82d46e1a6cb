"""The real-GPU tier of ``on()``: a routed Dask task and a routed Ray task use the real GPU.

Fails, never skips, without a real GPU (``pytest -m gpu``). The routed task proves it holds the
device by making it current and allocating on it.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
from cuda.core import Device, DeviceMemoryResource

import gpu_serde
from gpu_serde.testing import spec_cluster_options

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def installed(real_gpu):
    gpu_serde.install()
    yield real_gpu
    gpu_serde.uninstall()


def use(device) -> tuple:
    """In a routed task: allocate on the received Device, then say where it ran."""
    d = gpu_serde.resolve(device)
    d.set_current()
    d.allocate(1 << 20, stream=d.default_stream).close()
    return d.device_id, d.uuid, os.environ.get("CUDA_VISIBLE_DEVICES")


def test_a_routed_dask_task_uses_the_real_gpu_on_its_owner(installed):
    from distributed import Client, SpecCluster, get_worker

    import gpu_serde.dask

    Device(0).set_current()  # the pool below needs a current context
    uuid = installed[0].uuid
    layout = {"gpu": uuid, "blind": ""}
    with SpecCluster(**spec_cluster_options(layout)) as cluster, Client(cluster) as client:
        gpu_serde.dask.register(client)
        client.wait_for_workers(len(layout), timeout=120)
        deadline = time.monotonic() + 60  # a worker that joined after register() publishes after
        while time.monotonic() < deadline and "resources" not in gpu_serde.dask.on(Device(0)):
            time.sleep(0.2)
        where = gpu_serde.dask.on(Device(0))
        assert where == {"resources": {f"gpu_serde:{uuid}": 1}}
        pool = DeviceMemoryResource(Device(0))
        buf = pool.allocate(1 << 20, stream=Device(0).default_stream)
        assert gpu_serde.dask.on(pool) == gpu_serde.dask.on([buf, Device(0)]) == where
        buf.close()

        def routed(device):
            return (get_worker().name, *use(device))

        got = client.gather(client.map(routed, [Device(0)] * 4, pure=False, **where))
        assert got == [("gpu", 0, uuid[4:], uuid)] * 4


def test_a_routed_ray_task_and_actor_use_the_real_gpu_on_its_node(installed):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    import ray.cloudpickle
    from ray.cluster_utils import Cluster

    import gpu_serde.ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # `use` travels by value

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
        gpu_node = next(n["NodeID"] for n in ray.nodes() if "gpu_node" in n["Resources"])

        @ray.remote(num_gpus=1, max_retries=0)
        def routed(device):
            return (ray.get_runtime_context().get_node_id(), *use(device))

        @ray.remote(num_gpus=1)
        class Holder:
            def run(self, device):
                return (ray.get_runtime_context().get_node_id(), *use(device))

        where = gpu_serde.ray.on(Device(0))
        got = ray.get([routed.options(**where).remote(Device(0)) for _ in range(4)])
        assert got == [(gpu_node, 0, uuid[4:], uuid)] * 4
        actor = Holder.options(**where).remote()
        assert ray.get(actor.run.remote(Device(0))) == (gpu_node, 0, uuid[4:], uuid)
        ray.kill(actor)
    finally:
        ray.shutdown()
        c.shutdown()
