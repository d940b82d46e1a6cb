"""Ray: ``gpu_serde.ray.on(dev)`` runs a task or actor on the node that has the GPU, seeing it.

Two worker nodes on loopback, each given two simulated GPUs in its own order; node ``a`` also
declares a resource per GPU (for ``exclusive=True``). The head node gives Ray no GPU, yet its
workers see all four (the test host's), as a head on a GPU host does.
"""

import os
import sys

import pytest
import ray
import ray.cloudpickle
from cuda.core import Device
from doc_blocks import python_blocks, run_block
from ray.cluster_utils import Cluster

import gpu_serde
import gpu_serde.ray
from gpu_serde.format.device import encode_device
from gpu_serde.identity import uuid_bytes
from gpu_serde.routing import resource_name
from gpu_serde.testing import ray_node_options
from gpu_serde.wire import dev as rebuild_device

# a cluster of four Ray nodes, and doc blocks that start Ray drivers: the fast loop leaves them out
pytestmark = pytest.mark.slow

pytest.importorskip("markdown_it", reason="the docs extra reads the README's code blocks")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

MiB = 1024 * 1024
OTHER_HOST_GPU = "GPU-0badc0de-0000-4000-8000-000000000001"


def placeholder(uuid: str) -> gpu_serde.UnresolvedDevice:
    """A Device of GPU ``uuid`` as a process that cannot see it holds it."""
    payload = encode_device(uuid_bytes(uuid), False, 0, 1, "elsewhere", "NVIDIA H200")
    return gpu_serde.UnresolvedDevice(rebuild_device, payload, None)


@pytest.fixture(scope="module")
def cluster(simulated_gpus):
    g = [x.uuid for x in simulated_gpus]
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "num_gpus": 0, "object_store_memory": 80 * MiB},
    )
    nodes = {"a": [g[1], g[0]], "b": [g[2], g[3]]}
    for name, order in nodes.items():
        declared = {resource_name(u): 1 for u in order} if name == "a" else {}
        c.add_node(
            num_cpus=2,
            resources={f"node_{name}": 100, **declared},
            object_store_memory=80 * MiB,
            **ray_node_options(order),
        )
    gpu_serde.ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    ids = {
        name: next(n["NodeID"] for n in ray.nodes() if f"node_{name}" in n["Resources"])
        for name in nodes
    }
    yield {"order": nodes, "ids": ids, "address": c.address, "uuids": g}
    ray.shutdown()
    c.shutdown()
    gpu_serde.uninstall()


def node_of(cluster, uuid: str) -> str:
    return next(cluster["ids"][n] for n, order in cluster["order"].items() if uuid in order)


@ray.remote(max_retries=0)
def where(device) -> tuple:
    d = gpu_serde.resolve(device)
    seen = [v.uuid for v in gpu_serde.visible_devices()]
    node = ray.get_runtime_context().get_node_id()
    return (node, os.environ.get("CUDA_VISIBLE_DEVICES"), seen, d.device_id, d.uuid)


@ray.remote(num_gpus=1)
class Holder:
    def __init__(self, device):
        self.device = gpu_serde.resolve(device)

    def report(self) -> tuple:
        node = ray.get_runtime_context().get_node_id()
        mine = Device(0)
        return (node, self.device.device_id, self.device.uuid, mine.uuid)


@pytest.mark.parametrize("k", range(4))
def test_five_routed_tasks_per_gpu_run_on_its_node_seeing_only_it(cluster, k):
    uuid = cluster["uuids"][k]
    dev = Device(k)
    refs = [where.options(**gpu_serde.ray.on(dev)).remote(dev) for _ in range(5)]
    for got in ray.get(refs):
        assert got == (node_of(cluster, uuid), uuid, [uuid], 0, uuid[4:])


def test_a_routed_actor_declared_with_num_gpus_gets_its_gpu_on_its_node(cluster):
    for k in (0, 3):
        uuid = cluster["uuids"][k]
        actor = Holder.options(**gpu_serde.ray.on(Device(k))).remote(Device(k))
        try:
            assert ray.get(actor.report.remote()) == (node_of(cluster, uuid), 0, uuid[4:], uuid[4:])
        finally:
            ray.kill(actor)


def test_a_device_returned_by_a_routed_task_routes_back_to_its_gpu(cluster):
    uuid = cluster["uuids"][2]

    @ray.remote(max_retries=0)
    def make():
        return Device(0)

    made = ray.get(make.options(**gpu_serde.ray.on(Device(2))).remote())
    assert made.uuid == uuid[4:]
    assert ray.get(where.options(**gpu_serde.ray.on(made)).remote(made))[1] == uuid


def test_on_overrides_num_gpus_and_refuses_a_second_one(cluster):
    options = gpu_serde.ray.on(Device(1))
    assert options["num_gpus"] == 0
    with pytest.raises(TypeError):
        where.options(**options, num_gpus=1)


def test_on_merges_a_runtime_env_and_refuses_another_gpu_in_it(cluster):
    uuid = cluster["uuids"][1]
    options = gpu_serde.ray.on(Device(1), runtime_env={"env_vars": {"MINE": "1"}})
    assert options["runtime_env"]["env_vars"]["MINE"] == "1"
    assert options["runtime_env"]["env_vars"]["CUDA_VISIBLE_DEVICES"] == uuid
    with pytest.raises(gpu_serde.PlacementError, match="CUDA_VISIBLE_DEVICES"):
        gpu_serde.ray.on(Device(1), runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": "0"}})


def test_nodes_from_the_testing_helper_count_their_gpus_for_ray(cluster):
    gpus = {n["NodeID"]: n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"]}
    assert [gpus[cluster["ids"][name]] for name in ("a", "b")] == [2, 2]


def test_exclusive_holds_the_gpus_resource_where_the_node_declares_it(cluster):
    uuid = cluster["uuids"][0]  # node a declares one resource per GPU
    options = gpu_serde.ray.on(Device(0), exclusive=True)
    assert options["resources"] == {f"gpu_serde:{uuid}": 1}
    assert ray.get(where.options(**options).remote(Device(0)))[1] == uuid


def test_exclusive_raises_where_the_node_declares_no_resource_for_the_gpu(cluster):
    with pytest.raises(gpu_serde.PlacementError, match="declares no resource named"):
        gpu_serde.ray.on(Device(2), exclusive=True)  # node b declares none


def test_a_gpu_no_node_sees_raises_at_on_naming_every_node(cluster):
    stranger = placeholder(OTHER_HOST_GPU)
    with pytest.raises(gpu_serde.DeviceNotVisibleError) as info:
        gpu_serde.ray.on(stranger)
    assert info.value.uuid == OTHER_HOST_GPU
    text = str(info.value)
    for node_id in cluster["ids"].values():
        assert f"node {node_id[:12]}" in text
    assert ", ".join(cluster["order"]["b"]) in text


@pytest.mark.parametrize("bad", [1, "cuda:1", None])
def test_anything_else_is_a_type_error(cluster, bad):
    with pytest.raises(TypeError, match="on\\(\\) takes"):
        gpu_serde.ray.on(bad)


def test_a_gpu_named_by_its_uuid_routes_as_its_device_does(cluster):
    uuid = cluster["uuids"][2]
    options, by_device = gpu_serde.ray.on(uuid), gpu_serde.ray.on(Device(2))
    assert options["runtime_env"] == by_device["runtime_env"]
    assert options["scheduling_strategy"].node_id == by_device["scheduling_strategy"].node_id
    assert ray.get(where.options(**options).remote(Device(2)))[1] == uuid
    with pytest.raises(ValueError, match="which is not a GPU UUID"):
        gpu_serde.ray.on("GPU-0")


def ray_env(cluster) -> dict[str, str]:
    return dict(os.environ, RAY_ADDRESS=cluster["address"])


def test_the_readme_ray_example_runs_as_written_on_a_cluster_of_nodes(cluster):
    # tests/test_doc_blocks.py runs it on a local cluster of its own; here the GPU is on a node
    # of a cluster whose head has none
    [code] = python_blocks("README.md", "gpu_serde.ray.on")
    out = run_block(code, ray_env(cluster))
    assert out.strip().splitlines()[-1] == f"task:   GPU 0 {cluster['uuids'][1][4:]}"


def test_the_ray_quick_start_runs_as_written(cluster):
    [code] = python_blocks("docs/quickstart-ray.md", "gpu_serde.ray.on")
    out = run_block(code, ray_env(cluster))
    assert out.strip().splitlines()[-1] == repr((0, cluster["uuids"][1][4:]))
