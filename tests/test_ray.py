"""Ray: a Device keeps its GPU across tasks, actors, nodes and the object store.

Two worker nodes on loopback, each given two simulated GPUs in its own order (UUID form), as a
raylet does for a multi-GPU host; the driver sees all four GPUs in the host's order.
"""

import os
import sys
from dataclasses import dataclass

import pytest
import ray
import ray.cloudpickle
from cuda.core import Device
from ray.cluster_utils import Cluster

import gpu_serde
import gpu_serde.ray

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

MiB = 1024 * 1024


@dataclass
class Job:
    """A user's task input that carries a Device inside."""

    name: str
    device: object


@pytest.fixture(scope="module")
def cluster(simulated_gpus):
    g = simulated_gpus
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "num_gpus": 0,
            "object_store_memory": 80 * MiB,
        },
    )
    nodes = {
        "a": [g[1].uuid, g[0].uuid],
        "b": [g[3].uuid, g[2].uuid],
    }
    for name, order in nodes.items():
        c.add_node(
            num_cpus=4,
            num_gpus=2,
            resources={f"node_{name}": 100},
            object_store_memory=80 * MiB,
            env_vars={"CUDA_VISIBLE_DEVICES": ",".join(order)},
        )
    assert c.address.startswith("127.0.0.1:")  # loopback only (see conftest.py)
    gpu_serde.ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    yield nodes
    ray.shutdown()
    c.shutdown()
    gpu_serde.uninstall()


def on(node: str) -> dict:
    return {"resources": {f"node_{node}": 1}}


@ray.remote(max_retries=0)
def where_is(device) -> tuple:
    d = gpu_serde.resolve(device)
    assert gpu_serde.visible_devices()[d.device_id].uuid[4:] == d.uuid
    return (d.device_id, d.uuid, os.environ.get("CUDA_VISIBLE_DEVICES"))


@ray.remote(max_retries=0)
def visible() -> list:
    return [d.uuid for d in gpu_serde.visible_devices()]


@ray.remote(num_gpus=1)
class GPUActor:
    def __init__(self, device=None):
        self.received = device  # resolved on use, so a constructor never fails for it

    def gpu(self) -> str:
        """The GPU Ray assigned to this actor (a reused worker's CUDA may see more)."""
        (assigned,) = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
        return assigned

    def my_device(self):
        mine = self.gpu()
        return Device(next(d.ordinal for d in gpu_serde.visible_devices() if d.uuid == mine))

    def use(self, device) -> str:
        d = gpu_serde.resolve(device)
        assert gpu_serde.visible_devices()[d.device_id].uuid[4:] == d.uuid
        return d.uuid

    def pid(self) -> int:
        return os.getpid()

    def constructed_with(self):
        return gpu_serde.resolve(self.received).uuid


def bare(uuid: str) -> str:
    return uuid[4:]


def driver_device(uuid: str) -> Device:
    ordinal = next(d.ordinal for d in gpu_serde.visible_devices() if d.uuid == uuid)
    return Device(ordinal)


@pytest.mark.parametrize("node", ["a", "b"])
def test_a_task_given_both_gpus_of_a_node_gets_each_device_at_its_own_ordinal(cluster, node):
    order = cluster[node]
    # A runtime_env of its own gives the task a fresh worker pool (Ray keys workers by it), so no
    # worker whose CUDA was initialised under a one-GPU assignment is reused here.
    fresh = {"env_vars": {"GPU_SERDE_TEST_POOL": f"both-{node}"}}
    ordinals = set()
    for uuid in order:
        task = where_is.options(num_gpus=2, runtime_env=fresh, **on(node))
        ordinal, got, cvd = ray.get(task.remote(driver_device(uuid)))
        assert got == bare(uuid)  # where_is also checked the ordinal against the task's own view
        assert sorted(cvd.split(",")) == sorted(order)  # Ray may list the node's GPUs in any order
        ordinals.add(ordinal)
    assert ordinals == {0, 1}  # each GPU at its own local ordinal


@ray.remote(max_retries=0)
def vmm_where(obj) -> list:
    mr = gpu_serde.resolve(obj)
    devices = [mr.device, *(Device(int(p)) for p in mr.config.peers)]
    return [[d.device_id, d.uuid] for d in devices]


def test_a_vmm_resource_and_its_peers_reach_a_task_by_uuid(cluster):
    from cuda.core import VirtualMemoryResource, VirtualMemoryResourceOptions

    order = cluster["b"]
    fresh = {"env_vars": {"GPU_SERDE_TEST_POOL": "vmm-b"}}
    options = VirtualMemoryResourceOptions(peers=(driver_device(order[1]),))
    mr = VirtualMemoryResource(driver_device(order[0]), options)
    task = vmm_where.options(num_gpus=2, runtime_env=fresh, **on("b"))
    got = ray.get(task.remote(mr))
    assert [uuid for _, uuid in got] == [bare(order[0]), bare(order[1])]  # as seen in the task
    assert sorted(ordinal for ordinal, _ in got) == [0, 1]


def test_the_worker_hook_leaves_gpu_assignment_to_ray(cluster):
    @ray.remote(num_gpus=1, max_retries=0)
    def what_cuda_sees() -> tuple:
        from gpu_serde.registry import is_installed

        hooked = is_installed()  # nothing was unpickled yet: only the hook can have installed it
        return (
            hooked,
            os.environ["CUDA_VISIBLE_DEVICES"],
            [d.uuid for d in gpu_serde.visible_devices()],
        )

    # A per-task runtime_env of its own: a new worker, which still inherits the job's hook.
    fresh = {"env_vars": {"GPU_SERDE_TEST_POOL": "hook"}}
    hooked, assigned, seen = ray.get(what_cuda_sees.options(runtime_env=fresh, **on("a")).remote())
    assert hooked
    assert seen == [assigned]  # CUDA was not initialised before Ray chose this task's GPU


def test_num_gpus_1_tasks_receive_the_gpu_with_the_same_uuid(cluster):
    resolved = 0
    for node, order in cluster.items():
        for uuid in order:
            for _ in range(4):
                ref = where_is.options(num_gpus=1, **on(node)).remote(driver_device(uuid))
                try:
                    ordinal, got, _ = ray.get(ref)
                except gpu_serde.DeviceNotVisibleError as exc:
                    # Ray gave this task the node's other GPU: the error says which was meant.
                    assert exc.uuid == uuid
                    assert uuid not in [v.uuid for v in exc.visible]
                    continue
                # Ray may reuse a worker whose CUDA was initialised under an earlier assignment
                # (FACTS: CUDA reads CUDA_VISIBLE_DEVICES once): the ordinal is that process's,
                # the GPU is the same physical one.
                assert got == bare(uuid)
                assert ordinal in (0, 1)
                resolved += 1
    assert resolved  # Ray gave some task the GPU it was sent (odds of never: 2**-16)


def test_actors_receive_the_same_gpu_in_constructor_and_methods(cluster):
    actors = {
        node: [GPUActor.options(**on(node)).remote() for _ in order]
        for node, order in cluster.items()
    }
    for node, group in actors.items():
        held = ray.get([a.gpu.remote() for a in group])
        assert sorted(held) == sorted(cluster[node])
        for actor, uuid in zip(group, held, strict=True):
            assert ray.get(actor.use.remote(driver_device(uuid))) == bare(uuid)
    for group in actors.values():
        for a in group:
            ray.kill(a)
    wanted = cluster["a"][0]
    pair = [GPUActor.options(**on("a")).remote(driver_device(wanted)) for _ in range(2)]
    try:
        held = ray.get([a.gpu.remote() for a in pair])
        holder = pair[held.index(wanted)]  # Ray gave node a's two GPUs to the two actors
        assert ray.get(holder.constructed_with.remote()) == bare(wanted)
    finally:
        for a in pair:
            ray.kill(a)


def test_a_gpu_the_actor_was_not_given_raises_a_catchable_error_and_the_worker_survives(cluster):
    actor = GPUActor.options(**on("b")).remote()
    try:
        mine = ray.get(actor.gpu.remote())
        pid = ray.get(actor.pid.remote())
        other = next(u for u in cluster["a"])
        with pytest.raises(gpu_serde.DeviceNotVisibleError) as info:
            ray.get(actor.use.remote(driver_device(other)))
        assert info.value.uuid == other
        assert other in str(info.value) and mine in str(info.value)
        assert "ray worker" in str(info.value)
        assert ray.get(actor.pid.remote()) == pid  # same process, no restart
        assert ray.get(actor.use.remote(driver_device(mine))) == bare(mine)
    finally:
        ray.kill(actor)


def test_an_actor_returns_its_device_to_the_driver_and_to_another_task(cluster):
    actor = GPUActor.options(**on("a")).remote()
    try:
        uuid = ray.get(actor.gpu.remote())
        ref = actor.my_device.remote()
        at_driver = ray.get(ref)
        assert isinstance(at_driver, Device)
        assert at_driver.uuid == bare(uuid)
        # worker -> worker through the ObjectRef; a num_gpus=0 task sees every GPU of its node
        fresh = {"env_vars": {"GPU_SERDE_TEST_POOL": "returned"}}  # sees all of node a's GPUs
        _, got, _ = ray.get(where_is.options(runtime_env=fresh, **on("a")).remote(ref))
        assert got == bare(uuid)
    finally:
        ray.kill(actor)


def test_nested_containers_and_ray_put_keep_each_gpu(cluster):
    order_b = cluster["b"]

    @ray.remote(max_retries=0)
    def describe(obj) -> dict:
        def one(d):
            return "missing" if isinstance(d, gpu_serde.UnresolvedDevice) else (d.device_id, d.uuid)

        return {
            "list": [one(d) for d in obj["list"]],
            "tuple": one(obj["nested"][0][0]),
            "job": one(obj["job"].device),
        }

    payload = {
        "list": [driver_device(order_b[1]), driver_device(cluster["a"][0])],
        "nested": ((driver_device(order_b[0]),),),
        "job": Job("train", driver_device(order_b[1])),
    }
    expected = {
        "list": [(1, bare(order_b[1])), "missing"],
        "tuple": (0, bare(order_b[0])),
        "job": (1, bare(order_b[1])),
    }
    # a num_gpus=0 task sees every GPU of its node; its own pool avoids reused one-GPU workers
    task = describe.options(runtime_env={"env_vars": {"GPU_SERDE_TEST_POOL": "nested"}}, **on("b"))
    assert ray.get(task.remote(payload)) == expected
    assert ray.get(task.remote(ray.put(payload))) == expected
    assert ray.get(ray.put(payload))["job"].device is payload["job"].device


def test_runtime_env_merges_the_hook_and_refuses_to_replace_another():
    env = gpu_serde.ray.runtime_env({"env_vars": {"A": "1"}})
    assert env == {
        "env_vars": {"A": "1"},
        "worker_process_setup_hook": "gpu_serde.ray.setup_worker",
    }
    assert gpu_serde.ray.runtime_env(env) == env
    with pytest.raises(ValueError, match="setup_worker"):
        gpu_serde.ray.runtime_env({"worker_process_setup_hook": "mine.hook"})
    with pytest.raises(TypeError):
        gpu_serde.ray.runtime_env(["not", "a", "dict"])


CPU_ONLY_DRIVER = """
import ray, gpu_serde, gpu_serde.ray
from cuda.core import Device
gpu_serde.ray.init(address=ADDRESS, include_dashboard=False, log_to_driver=False)

@ray.remote(num_gpus=1, resources={"node_b": 1})
class Holder:
    def device(self):
        import os
        mine = os.environ["CUDA_VISIBLE_DEVICES"]
        return Device(next(d.ordinal for d in gpu_serde.visible_devices() if d.uuid == mine)), mine

@ray.remote(resources={"node_b": 1})
def where_is(device):
    return gpu_serde.resolve(device).uuid

h = Holder.remote()
dev, mine = ray.get(h.device.remote())
try:
    gpu_serde.resolve(dev)
    here = "resolved"
except gpu_serde.DeviceNotVisibleError as exc:
    here = exc.uuid
report(here=here, mine=mine, there=ray.get(where_is.remote(dev)), repr=repr(dev))
"""


def test_a_driver_without_any_cuda_driver_forwards_devices_untouched(cluster):
    from helpers import env_without_driver, run_child

    code = f"ADDRESS = {ray.get_runtime_context().gcs_address!r}\n" + CPU_ONLY_DRIVER
    got = run_child(code, env_without_driver(), timeout=120)
    assert got["here"] == got["mine"]  # the driver holds a placeholder naming the actor's GPU
    assert got["mine"] in cluster["b"]
    assert got["there"] == bare(got["mine"])  # and a task on the GPU's node resolves it
    assert "not visible" in got["repr"]


# --- a bad payload reaches the caller as a PayloadError, and the worker keeps serving ---------

BAD = {
    "malformed": ("dev", (b"\x01truncated",), "truncated"),
    "wrong-arity": ("pool", (b"one", b"two"), "takes one payload, got 2"),
    "future-version": ("buf", ((9, "fields of a newer gpu_serde"),), "version 9"),
}


def bad_object(name: str, args: tuple):
    """A placeholder that pickles as ``gpu_serde.wire.<name>(*args)``."""
    return gpu_serde.UnresolvedObject("test", getattr(gpu_serde.wire, name), args, RuntimeError())


@ray.remote(num_cpus=0)
def make_bad(name: str, args: tuple):
    return bad_object(name, args)


@ray.remote(num_cpus=0)
def use(obj) -> object:
    return gpu_serde.resolve(obj)


@ray.remote(num_cpus=0)
def ping() -> int:
    return 1


@pytest.fixture(params=sorted(BAD))
def bad(request):
    return BAD[request.param]


def test_a_bad_payload_as_a_task_argument_raises_a_catchable_payload_error(cluster, bad):
    name, args, says = bad
    with pytest.raises(gpu_serde.PayloadError, match=says):
        ray.get(use.options(**on("a")).remote(bad_object(name, args)), timeout=60)
    assert ray.get(ping.options(**on("a")).remote(), timeout=60) == 1


def test_a_bad_payload_put_in_the_object_store_raises_where_it_is_used(cluster, bad):
    name, args, says = bad
    ref = ray.put(bad_object(name, args))
    with pytest.raises(gpu_serde.PayloadError, match=says):
        gpu_serde.resolve(ray.get(ref, timeout=60))
    with pytest.raises(gpu_serde.PayloadError, match=says):
        ray.get(use.options(**on("b")).remote(ref), timeout=60)
    assert ray.get(ping.options(**on("b")).remote(), timeout=60) == 1


def test_a_bad_payload_returned_by_a_task_reaches_the_driver_as_a_placeholder(cluster, bad):
    name, args, says = bad
    got = ray.get(make_bad.options(**on("a")).remote(name, args), timeout=60)
    with pytest.raises(gpu_serde.PayloadError, match=says):
        gpu_serde.resolve(got)


def test_a_bad_result_passed_on_to_another_task_raises_a_catchable_payload_error(cluster, bad):
    name, args, says = bad
    made = make_bad.options(**on("a")).remote(name, args)
    with pytest.raises(gpu_serde.PayloadError, match=says):
        ray.get(use.options(**on("b")).remote(made), timeout=60)
    assert ray.get(ping.options(**on("b")).remote(), timeout=60) == 1


@pytest.mark.parametrize("value", ["1", "true", "True"])
def test_rays_own_tensor_pickling_is_said_where_gpu_serde_installs(monkeypatch, value):
    """RAY_ENABLE_ZERO_COPY_TORCH_TENSORS makes Ray pickle torch tensors ahead of gpu_serde, and
    rebuild CUDA ones by ordinal: the driver and every worker say so when they install."""
    import logging

    from gpu_serde.ray import setup

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    monkeypatch.setenv("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", value)
    setup.logger.addHandler(handler)
    try:
        assert setup.warn_if_ray_pickles_tensors()
    finally:
        setup.logger.removeHandler(handler)
    assert (
        len(said) == 1 and "by ordinal, possibly another GPU" in said[0] and "share(x)" in said[0]
    )
    monkeypatch.setenv("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "0")
    assert not setup.warn_if_ray_pickles_tensors()


def test_init_with_an_address_where_nothing_listens_says_so(monkeypatch):
    import gpu_serde.ray.setup
    from gpu_serde.testing.clusters import free_port

    monkeypatch.setattr(gpu_serde.ray.setup, "CONNECT_WAIT_S", 1.0)  # a head still starting: 30 s
    address = f"127.0.0.1:{free_port()}"  # ray.init would retry for minutes
    was = ray.is_initialized()  # (an earlier test's local cluster may be up in this process)
    with pytest.raises(ConnectionError, match=r"within 1 s \(Connection refused\)"):
        gpu_serde.ray.init(address=address)
    assert ray.is_initialized() == was  # nothing was started
