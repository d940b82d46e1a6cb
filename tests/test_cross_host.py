"""Buffers reach workers on other hosts: mapped on their exporter's host, by value beyond it.

"Other hosts" on one machine: a worker started with ``GPU_SERDE_HOST_ID=<label>`` has another host
identity (gpu_serde.hostid), so GPU memory reaches it as it would reach another machine. The Dask
cluster has workers ``a1`` and ``a2`` on this host (the test process's) and ``b1`` on host
``hostb``. Each receiver reads every word of the pattern back, and says whether the buffer came
mapped (its resource is the exporter's pool, imported) or by value (uploaded to its own pool).
Simulated GPUs with 4 MiB buffers on the CPU tier, 1 GiB on the real GPU (``-m gpu``).
"""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions
from memtier import check, fill

import gpu_serde
from gpu_serde.testing import child_env, spec_cluster_options


def received(buf) -> dict:
    """Runs in the receiver: the pattern check, and how the buffer came (mapped or uploaded)."""
    from gpu_serde.memory import bycopy as hostcopy

    got = check(buf)
    resource = type(gpu_serde.resolve(buf).memory_resource).__name__
    uploaded = hostcopy.counts()["uploaded"]
    # mapped: ImportedMemory (a pool's), ImportedArenaMemory (an arena's)
    return {**got, "mapped": resource.startswith("Imported"), "uploaded": uploaded}


def make(size: int):
    """Runs in the exporter: a filled buffer from a pool it keeps (and the pool, kept alive)."""
    import builtins

    d = Device(0)
    d.set_current()
    pools = builtins.__dict__.setdefault("_test_pools", [])
    mr = DeviceMemoryResource(d, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=4 * size))
    pools.append(mr)
    buf = mr.allocate(size, stream=d.default_stream)
    fill(buf)
    return buf


def make_in_arena(size: int):
    """Runs in the exporter: a filled buffer from an ArenaMemoryResource it keeps."""
    import builtins

    d = Device(0)
    d.set_current()
    arenas = builtins.__dict__.setdefault("_test_arenas", [])
    if not arenas:
        arenas.append(gpu_serde.ArenaMemoryResource(d, 8 * size))
    buf = arenas[0].allocate(size, stream=d.default_stream)
    fill(buf)
    return buf


def exporter_counts() -> dict:
    """Runs in the exporter: host copies it made and buffers its broker holds for importers."""
    from gpu_serde.memory import broker
    from gpu_serde.memory import bycopy as hostcopy

    return {"to_host": hostcopy.counts()["to_host"], "held": broker.broker().held()}


@pytest.fixture(scope="module")
def dask_hosts(tier):
    from distributed import Client, SpecCluster

    import gpu_serde.dask

    layout = {name: tier.uuid for name in ("a1", "a2", "b1")}
    options = spec_cluster_options(layout, hosts={"b1": "hostb"})
    with SpecCluster(**options) as cluster, Client(cluster) as client:
        gpu_serde.dask.register(client)
        client.wait_for_workers(3, timeout=120)
        info = client.scheduler_info(n_workers=-1)["workers"]
        yield client, {w["name"]: address for address, w in info.items()}


def one_result(client, by, exporter: str, consumer: str, size: int):
    made = client.submit(make, size, workers=[by[exporter]], pure=False)
    before = client.run(exporter_counts, workers=[by[exporter]])[by[exporter]]
    got = client.submit(received, made, workers=[by[consumer]], pure=False).result(timeout=300)
    after = client.run(exporter_counts, workers=[by[exporter]])[by[exporter]]
    return got, before, after


def test_a_result_consumed_on_another_host_arrives_by_value_with_every_byte(dask_hosts, tier):
    client, by = dask_hosts
    got, before, after = one_result(client, by, "a1", "b1", tier.size)
    assert got["ok"] and got["size"] == tier.size
    assert not got["mapped"] and got["uploaded"] >= 1
    assert after["to_host"] == before["to_host"] + 1


def test_a_result_consumed_on_its_exporters_host_arrives_mapped_without_a_copy(dask_hosts, tier):
    client, by = dask_hosts
    got, before, after = one_result(client, by, "a1", "a2", tier.size)
    assert got["ok"] and got["mapped"] and got["uploaded"] == 0
    assert after["to_host"] == before["to_host"]  # no copy was made
    assert after["held"] == before["held"] + 1  # the exporter holds it for the importer


def test_an_arena_buffer_reaches_another_host_by_value_and_its_own_mapped(dask_hosts, tier):
    client, by = dask_hosts
    made = client.submit(make_in_arena, tier.size, workers=[by["a1"]], pure=False)
    here = client.submit(received, made, workers=[by["a2"]], pure=False).result(timeout=300)
    there = client.submit(received, made, workers=[by["b1"]], pure=False).result(timeout=300)
    assert there["ok"] and not there["mapped"]
    assert here["ok"] and here["mapped"]


def test_a_buffer_scattered_to_another_host_arrives_by_value(dask_hosts, tier, pool_here):
    client, by = dask_hosts
    buf = pool_here.allocate(tier.size, stream=Device(tier.ordinal).default_stream)
    fill(buf)
    [future] = client.scatter([buf], workers=[by["b1"]], direct=True)
    got = client.submit(received, future, workers=[by["b1"]], pure=False).result(timeout=300)
    assert got["ok"] and not got["mapped"]


def test_a_buffer_scattered_to_its_host_arrives_mapped(dask_hosts, tier, pool_here):
    client, by = dask_hosts
    buf = pool_here.allocate(tier.size, stream=Device(tier.ordinal).default_stream)
    fill(buf)
    [future] = client.scatter([buf], workers=[by["a2"]], direct=True)
    got = client.submit(received, future, workers=[by["a2"]], pure=False).result(timeout=300)
    assert got["ok"] and got["mapped"] and got["uploaded"] == 0


def test_a_buffer_scattered_through_the_scheduler_reaches_another_host(dask_hosts, tier, pool_here):
    client, by = dask_hosts
    buf = pool_here.allocate(tier.size, stream=Device(tier.ordinal).default_stream)
    fill(buf)
    [future] = client.scatter([buf], workers=[by["b1"]])  # the scheduler forwards the bytes
    got = client.submit(received, future, workers=[by["b1"]], pure=False).result(timeout=300)
    assert got["ok"] and not got["mapped"]


def test_a_result_from_another_host_reaches_the_client_with_every_byte(dask_hosts, tier):
    client, by = dask_hosts
    made = client.submit(make, tier.size, workers=[by["b1"]], pure=False)
    got = received(made.result(timeout=300))
    assert got["ok"] and not got["mapped"]


def test_a_buffer_too_large_for_host_memory_gives_the_typed_error_where_it_is_used(
    dask_hosts, tier
):
    client, by = dask_hosts

    def limit(available):
        from gpu_serde.memory import bycopy as hostcopy

        if available is None:
            hostcopy.host_memory_available = hostcopy.__dict__["_measured"]
        else:
            hostcopy.__dict__.setdefault("_measured", hostcopy.host_memory_available)
            hostcopy.host_memory_available = lambda: available

    made = client.submit(make, tier.size, workers=[by["a1"]], pure=False)
    made.result(timeout=300)
    client.run(limit, 1000, workers=[by["a1"]])
    try:
        used = client.submit(received, made, workers=[by["b1"]], pure=False)
        with pytest.raises(gpu_serde.HostCopyError, match="1000 available"):
            used.result(timeout=300)
    finally:
        client.run(limit, None, workers=[by["a1"]])
    got, _, _ = one_result(client, by, "a1", "b1", tier.size)  # both workers serve on
    assert got["ok"]


def test_a_buffer_inside_a_task_argument_on_another_host_says_how_to_send_it(
    dask_hosts, tier, pool_here
):
    client, by = dask_hosts
    buf = pool_here.allocate(tier.size, stream=Device(tier.ordinal).default_stream)
    fill(buf)
    future = client.submit(received, buf, workers=[by["b1"]], pure=False)  # pickled in the graph
    with pytest.raises(gpu_serde.OtherHostError, match=r"gpu_serde\.portable\(buf\)"):
        future.result(timeout=300)


def test_a_portable_task_argument_reaches_another_host_by_value(dask_hosts, tier, pool_here):
    client, by = dask_hosts
    buf = pool_here.allocate(tier.size, stream=Device(tier.ordinal).default_stream)
    fill(buf)
    wrapped = gpu_serde.portable(buf)
    there = client.submit(received, wrapped, workers=[by["b1"]], pure=False).result(timeout=300)
    here = client.submit(received, wrapped, workers=[by["a2"]], pure=False).result(timeout=300)
    assert there["ok"] and not there["mapped"]
    assert here["ok"] and here["mapped"]


@pytest.fixture(scope="module")
def pool_here(tier):
    gpu_serde.install()
    d = Device(tier.ordinal)
    d.set_current()
    mr = DeviceMemoryResource(
        d, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=16 * tier.size)
    )
    yield mr
    gpu_serde.uninstall()


RECEIVE = """
import os, pickle, sys
sys.path[:0] = {path!r}
from memtier import check
import gpu_serde
buf = pickle.loads(sys.stdin.buffer.read())
got = check(buf)
print(got["ok"], type(gpu_serde.resolve(buf).memory_resource).__name__, flush=True)
os._exit(0)  # EXIT_NOTE
"""

EXPORT = """
import os, pickle, sys
sys.path[:0] = {path!r}
from memtier import fill
from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions
import gpu_serde
gpu_serde.install()
d = Device(0)
d.set_current()
mr = DeviceMemoryResource(d, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=2 * {size}))
buf = mr.allocate({size}, stream=d.default_stream)
fill(buf)
sys.stdout.buffer.write(pickle.dumps(gpu_serde.portable(buf), protocol=5))
sys.stdout.flush()
os._exit(0)  # EXIT_NOTE
"""


# EXIT_NOTE: the children end with os._exit, after their work and their output: cuda-core 1.2.0's
# CUDA 12 build crashes at interpreter exit (SIGSEGV in a thread-local destructor that calls the
# driver after the interpreter is gone; seen with Python 3.10 and cuda-bindings 12.9, the version
# matrix's low leg, with a bare `Device(0).set_current()` and no gpu_serde at all).


def child_environment(tier, label: str | None) -> dict[str, str]:
    import os

    env = child_env(tier.gpus, tier.uuid) if tier.name == "sim" else dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = tier.uuid
    env.pop("GPU_SERDE_HOST_ID", None)
    if label:
        env["GPU_SERDE_HOST_ID"] = label
    return env


def run(code: str, tier, label: str | None = None, stdin: bytes = b"") -> bytes:
    done = subprocess.run(
        [sys.executable, "-c", code.format(path=sys.path[:4], size=tier.size)],
        input=stdin,
        env=child_environment(tier, label),
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return done.stdout


def test_a_portable_buffer_reaches_a_process_on_another_host_by_value(tier, pool_here):
    buf = pool_here.allocate(tier.size, stream=Device(tier.ordinal).default_stream)
    fill(buf)
    blob = pickle.dumps(gpu_serde.portable(buf), protocol=5)
    assert run(RECEIVE, tier, "hostb", blob).decode().split() == ["True", "DeviceMemoryResource"]


def test_a_portable_buffer_reaches_a_process_on_its_host_mapped(tier, pool_here):
    buf = pool_here.allocate(tier.size, stream=Device(tier.ordinal).default_stream)
    fill(buf)
    blob = pickle.dumps(gpu_serde.portable(buf), protocol=5)
    assert run(RECEIVE, tier, None, blob).decode().split() == ["True", "ImportedMemory"]


def test_a_portable_buffer_whose_exporter_is_gone_arrives_by_value(tier):
    blob = run(EXPORT, tier)  # the exporter has exited: its memory cannot be mapped any more
    assert run(RECEIVE, tier, None, blob).decode().split() == ["True", "DeviceMemoryResource"]


@pytest.fixture(scope="module")
def ray_hosts(tier):
    """A Ray cluster on two "hosts": the head node (this host) and node ``b`` (``hostb``)."""
    import ray
    from memtier import ray_by_value
    from ray.cluster_utils import Cluster

    import gpu_serde.ray

    ray_by_value(__name__)
    object_store = 4 * tier.size + (64 << 20)
    node = {"num_cpus": 2, "num_gpus": 1, "object_store_memory": object_store}
    env = {"CUDA_VISIBLE_DEVICES": tier.uuid}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", tier.uuid)
        c = Cluster(initialize_head=True, head_node_args={**node, "resources": {"host_a": 10}})
        c.add_node(**node, resources={"host_b": 10}, env_vars={**env, "GPU_SERDE_HOST_ID": "hostb"})
        gpu_serde.ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
    c.shutdown()


def on_host(name: str) -> dict:
    return {"resources": {f"host_{name}": 1}, "num_gpus": 0.5}


@pytest.mark.slow  # a cluster of two Ray nodes
def test_a_portable_buffer_reaches_a_ray_task_on_another_host_by_value(ray_hosts, tier, pool_here):
    ray = ray_hosts
    buf = pool_here.allocate(tier.size, stream=Device(tier.ordinal).default_stream)
    fill(buf)
    task = ray.remote(received)
    there = task.options(**on_host("b")).remote(gpu_serde.portable(buf))
    here = task.options(**on_host("a")).remote(gpu_serde.portable(buf))
    there, here = ray.get([there, here], timeout=300)
    assert there["ok"] and not there["mapped"] and there["size"] == tier.size
    assert here["ok"] and here["mapped"]


@pytest.mark.slow  # a cluster of two Ray nodes
def test_a_portable_buffer_put_in_the_object_store_reaches_another_host(ray_hosts, tier, pool_here):
    ray = ray_hosts
    buf = pool_here.allocate(tier.size, stream=Device(tier.ordinal).default_stream)
    fill(buf)
    ref = ray.put(gpu_serde.portable(buf))
    got = ray.get(ray.remote(received).options(**on_host("b")).remote(ref), timeout=300)
    assert got["ok"] and not got["mapped"]


@pytest.mark.slow  # a cluster of two Ray nodes
def test_a_ray_task_on_another_host_returns_a_portable_buffer_to_the_driver(ray_hosts, tier):
    ray = ray_hosts

    def make_portable(size):
        return gpu_serde.portable(make(size))

    ref = ray.remote(make_portable).options(**on_host("b")).remote(tier.size)
    got = received(ray.get(ref, timeout=300))
    assert got["ok"] and not got["mapped"]


@pytest.mark.slow  # a cluster of two Ray nodes
def test_a_plain_buffer_sent_to_another_ray_host_says_how_to_send_it(ray_hosts, tier, pool_here):
    ray = ray_hosts
    buf = pool_here.allocate(tier.size, stream=Device(tier.ordinal).default_stream)
    fill(buf)
    ref = ray.remote(received).options(**on_host("b"), max_retries=0).remote(buf)
    with pytest.raises(gpu_serde.OtherHostError, match=r"gpu_serde\.portable\(buf\)"):
        ray.get(ref, timeout=300)


def _rdt_supported() -> bool:
    from gpu_serde.ray import transport as ray_transport

    return ray_transport.supported()


rdt = pytest.mark.skipif(
    not _rdt_supported(), reason="Ray before 2.55 has no custom tensor transports"
)


def rdt_actors(ray, size: int):
    """A producer actor that returns buffers through gpu_serde's transport, and consumers."""
    import gpu_serde.ray

    @ray.remote(num_gpus=0.25, enable_tensor_transport=True)
    class Producer:
        @ray.method(tensor_transport=gpu_serde.ray.TRANSPORT)
        def make(self):
            return make(size)

    @ray.remote(num_gpus=0.25, enable_tensor_transport=True)
    class Consumer:
        def received(self, buf):
            return received(buf)

    return Producer, Consumer


@rdt
@pytest.mark.slow  # a cluster of two Ray nodes
def test_an_actor_hands_a_buffer_through_ray_direct_transport_to_another_host_by_value(
    ray_hosts, tier
):
    ray = ray_hosts
    producer_cls, consumer_cls = rdt_actors(ray, tier.size)
    producer = producer_cls.options(resources={"host_a": 1}).remote()
    there = consumer_cls.options(resources={"host_b": 1}).remote()
    here = consumer_cls.options(resources={"host_a": 1}).remote()
    ref = producer.make.remote()
    got_there, got_here = ray.get(
        [there.received.remote(ref), here.received.remote(ref)], timeout=300
    )
    assert got_there["ok"] and not got_there["mapped"] and got_there["size"] == tier.size
    assert got_here["ok"] and got_here["mapped"]


def test_under_the_cuda_family_a_buffer_travels_as_one_device_frame(tier, pool_here):
    from distributed.protocol import deserialize, serialize
    from memtier import pattern_is_there

    import gpu_serde.dask  # noqa: F401  (registers gpu_serde's serializers)

    buf = pool_here.allocate(tier.size, stream=Device(tier.ordinal).default_stream)
    fill(buf)
    header, frames = serialize(buf, serializers=["cuda"], on_error="raise")
    got = deserialize(header, frames, deserializers=["cuda"])
    assert [type(f).__name__ for f in frames] == ["DeviceFrame"]
    assert pattern_is_there(got) and int(got.handle) != int(buf.handle)


def test_pinned_memory_skips_the_cuda_family_for_the_dask_one(tier):
    from cuda.core import PinnedMemoryResource, PinnedMemoryResourceOptions
    from distributed.protocol import serialize

    import gpu_serde.dask

    gpu_serde.install()
    Device(tier.ordinal).set_current()
    pinned = PinnedMemoryResource(PinnedMemoryResourceOptions(ipc_enabled=True, max_size=1 << 22))
    buf = pinned.allocate(1 << 20, stream=Device(tier.ordinal).default_stream)
    header, _ = serialize(buf, serializers=["cuda", "dask"], on_error="raise")
    assert header["serializer"] == "dask"


@pytest.mark.parametrize(
    "header, frames",
    [
        ({"gpu_serde": 99, "sent": "ipc"}, [b""]),
        ({"gpu_serde": 1, "sent": "ipc"}, []),
        ({"gpu_serde": 1, "sent": "ipc"}, [b"not a pickle"]),
        ("\x1b[31mnot a dict\n", [b""]),
    ],
    ids=["another version", "no frames", "garbage", "hostile header"],
)
def test_malformed_dask_frames_give_a_placeholder_never_an_exception(installed, header, frames):
    from gpu_serde.dask.serializers import cuda_deserialize_buffer, deserialize_buffer

    for loads in (deserialize_buffer, cuda_deserialize_buffer):
        got = loads(header, frames)  # must not raise: Dask would lose the worker
        assert isinstance(got, gpu_serde.UnresolvedObject)
        with pytest.raises((gpu_serde.PayloadError, gpu_serde.HandoffError)) as caught:
            gpu_serde.resolve(got)
        assert "\n" not in str(caught.value) and "\x1b" not in str(caught.value)
