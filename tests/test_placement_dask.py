"""Dask: ``gpu_serde.dask.on(dev)`` sends a task to a worker that sees the GPU, its owner first.

Four workers see four simulated GPUs rotated as dask-cuda does (each worker's device 0 is another
GPU: its owner), and a fifth sees none.
"""

import os
import time

import dask
import pytest
from cuda.core import Device
from distributed import Client, SpecCluster, get_worker
from doc_blocks import python_blocks, run_block

import gpu_serde
import gpu_serde.dask
from gpu_serde.format.device import encode_device
from gpu_serde.identity import uuid_bytes
from gpu_serde.routing import resource_name
from gpu_serde.testing import spec_cluster_options
from gpu_serde.wire import dev as rebuild_device

pytest.importorskip("markdown_it", reason="the docs extra reads the README's code blocks")

OTHER_HOST_GPU = "GPU-0badc0de-0000-4000-8000-000000000001"


def placeholder(uuid: str) -> gpu_serde.UnresolvedDevice:
    """A Device of GPU ``uuid`` as a process that cannot see it holds it."""
    payload = encode_device(uuid_bytes(uuid), False, 0, 1, "elsewhere", "NVIDIA H200")
    return gpu_serde.UnresolvedDevice(rebuild_device, payload, None)


def layout(uuids: list[str]) -> dict[str, str]:
    spec = {f"w{i}": ",".join(uuids[i:] + uuids[:i]) for i in range(len(uuids))}
    spec["blind"] = ""
    return spec


@pytest.fixture(scope="module")
def dask_cluster(simulated_gpus):
    uuids = [g.uuid for g in simulated_gpus]
    env = layout(uuids)
    options = spec_cluster_options(env, nthreads=2)
    with SpecCluster(**options) as cluster, Client(cluster) as client:
        gpu_serde.dask.register(client)
        client.wait_for_workers(len(env), timeout=120)
        deadline = (
            time.monotonic() + 60
        )  # workers that joined after register() publish a moment later
        while time.monotonic() < deadline and len(owners(client)) < len(uuids):
            time.sleep(0.1)
        by_name = {w["name"]: a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        yield client, by_name, uuids, cluster.scheduler_address
    gpu_serde.uninstall()


def owners(client) -> dict[str, str]:
    """GPU UUID -> name of the worker that published it (its resource ``gpu_serde:GPU-...``)."""
    info = client.scheduler_info(n_workers=-1)["workers"]
    prefix = "gpu_serde:"
    return {
        r.removeprefix(prefix): w["name"]
        for w in info.values()
        for r in w["resources"]
        if r.startswith(prefix)
    }


def where(device) -> tuple:
    d = gpu_serde.resolve(device)
    return (get_worker().name, d.device_id, d.uuid)


def test_each_worker_publishes_its_device_0_as_a_resource(dask_cluster):
    client, _, uuids, _ = dask_cluster
    assert owners(client) == {u: f"w{i}" for i, u in enumerate(uuids)}


def test_the_one_resource_a_worker_gains_is_named_plainly_gpu_serdes(dask_cluster):
    client, _, uuids, _ = dask_cluster
    workers = client.scheduler_info(n_workers=-1)["workers"].values()
    resources = {w["name"]: w["resources"] for w in workers}
    assert resources == {
        **{f"w{i}": {f"gpu_serde:{u}": 1} for i, u in enumerate(uuids)},
        "blind": {},  # a worker that sees no GPU publishes nothing
    }


@pytest.mark.parametrize("k", range(4))
def test_twenty_routed_tasks_all_run_on_the_gpus_owner_and_resolve_it(dask_cluster, k):
    client, _, uuids, _ = dask_cluster
    dev = Device(k)
    futures = client.map(where, [dev] * 20, pure=False, **gpu_serde.dask.on(dev))
    assert client.gather(futures) == [(f"w{k}", 0, uuids[k][4:])] * 20


def test_a_routed_graph_runs_on_the_owner(dask_cluster):
    client, _, uuids, _ = dask_cluster
    dev = Device(3)
    lazy = dask.delayed(where)(dev)
    assert client.compute(lazy, **gpu_serde.dask.on(dev)).result(timeout=60) == (
        "w3",
        0,
        uuids[3][4:],
    )


def test_not_exclusive_restricts_to_the_owners_by_address(dask_cluster):
    client, by_name, _, _ = dask_cluster
    assert gpu_serde.dask.on(Device(2), client, exclusive=False) == {
        "workers": [by_name["w2"]],
        "allow_other_workers": False,
    }


async def _withdraw(dask_worker, uuid: str, amount: float) -> None:
    await dask_worker.set_resources(**{resource_name(uuid): amount})


def test_without_an_owner_twenty_tasks_run_on_workers_that_see_the_gpu(dask_cluster):
    client, by_name, uuids, _ = dask_cluster
    client.run(_withdraw, uuid=uuids[2], amount=0, workers=[by_name["w2"]])  # w2 stops owning it
    try:
        dev = Device(2)
        where_to = gpu_serde.dask.on(dev)
        assert sorted(where_to["workers"]) == sorted(by_name[f"w{i}"] for i in range(4))
        got = client.gather(client.map(where, [dev] * 20, pure=False, **where_to))
        for name, ordinal, uuid in got:
            assert uuid == uuids[2][4:]
            assert ordinal == layout(uuids)[name].split(",").index(uuids[2])
    finally:
        client.run(_withdraw, uuid=uuids[2], amount=1, workers=[by_name["w2"]])


def test_a_placeholder_routes_like_its_device(dask_cluster):
    client, _, uuids, _ = dask_cluster
    made = client.submit(lambda: Device(0), **gpu_serde.dask.on(Device(1)), pure=False)
    arrived = made.result(timeout=60)  # a Device the client can see: Device(1) here
    assert gpu_serde.dask.on(arrived) == {"resources": {resource_name(uuids[1]): 1}}
    stranger = placeholder(uuids[1])
    assert gpu_serde.dask.on(stranger) == {"resources": {resource_name(uuids[1]): 1}}


def test_a_memory_resource_routes_to_its_devices_owner(dask_cluster):
    from cuda.core import VirtualMemoryResource, VirtualMemoryResourceOptions

    _, _, uuids, _ = dask_cluster
    mr = VirtualMemoryResource(Device(2), VirtualMemoryResourceOptions(peers=(0,)))
    assert gpu_serde.dask.on(mr) == {"resources": {resource_name(uuids[2]): 1}}


def test_a_pool_and_its_buffer_route_to_their_devices_owner(dask_cluster):
    from cuda.core import DeviceMemoryResource

    _, _, uuids, _ = dask_cluster
    dev = Device(3)
    dev.set_current()
    pool = DeviceMemoryResource(dev)
    buf = pool.allocate(4096, stream=dev.default_stream)
    try:
        assert (
            gpu_serde.dask.on(pool)
            == gpu_serde.dask.on(buf)
            == {"resources": {resource_name(uuids[3]): 1}}
        )
    finally:
        buf.close()


def test_a_list_on_one_gpu_routes_and_one_on_two_gpus_raises(dask_cluster):
    _, _, uuids, _ = dask_cluster
    assert gpu_serde.dask.on([Device(1), (Device(1))]) == {
        "resources": {resource_name(uuids[1]): 1}
    }
    with pytest.raises(gpu_serde.PlacementError, match="2 different GPUs"):
        gpu_serde.dask.on([Device(0), Device(1)])
    with pytest.raises(gpu_serde.PlacementError, match="empty"):
        gpu_serde.dask.on([])


@pytest.mark.parametrize("bad", [1, "cuda:1", "1", None, object()])
def test_anything_else_is_a_type_error(dask_cluster, bad):
    with pytest.raises(TypeError, match="on\\(\\) takes"):
        gpu_serde.dask.on(bad)


def test_a_gpu_named_by_its_uuid_routes_to_its_owner_and_a_broken_uuid_says_so(dask_cluster):
    _, _, uuids, _ = dask_cluster
    want = {"resources": {resource_name(uuids[2]): 1}}
    for name in (uuids[2], uuids[2].lower(), f" {uuids[2]}", Device(2).uuid):  # bare hex too
        assert gpu_serde.dask.on(name) == want
    with pytest.raises(TypeError, match=r"names another GPU in each process"):
        gpu_serde.dask.on("cuda:1")
    with pytest.raises(ValueError, match=r"given .GPU-0., which is not a GPU UUID"):
        gpu_serde.dask.on("GPU-0")
    with pytest.raises(ValueError, match=r"without its 'GPU-' or 'MIG-' prefix, and this proc"):
        gpu_serde.dask.on(OTHER_HOST_GPU.removeprefix("GPU-"))  # bare hex of no GPU here


def test_routing_a_closed_buffer_is_a_value_error_that_says_what_to_route_by(simulated_gpus):
    import gpu_serde.ray

    dev = Device(0)
    dev.set_current()
    buf = dev.allocate(64, stream=dev.default_stream)
    buf.close()
    for on in (gpu_serde.dask.on, gpu_serde.ray.on):
        with pytest.raises(ValueError, match=r"a closed Buffer: .* route by its Device"):
            on(buf)


def test_a_gpu_no_worker_sees_raises_at_on_naming_every_worker(dask_cluster):
    client, by_name, uuids, _ = dask_cluster
    stranger = placeholder(OTHER_HOST_GPU)
    with pytest.raises(gpu_serde.DeviceNotVisibleError) as info:
        gpu_serde.dask.on(stranger, client)
    assert info.value.uuid == OTHER_HOST_GPU
    text = str(info.value)
    for name, address in by_name.items():
        assert f"worker {name!r} ({address})" in text
    assert f"0: {uuids[3]}" in text  # w3's device 0
    assert "no GPU (CUDA_VISIBLE_DEVICES is empty" in text  # the blind worker


def tensor_sent_from(uuid: str) -> object:
    """A CUDA tensor sent by value from the GPU ``uuid``, as this process receives it: a
    placeholder (that GPU is not visible here, or torch here has no CUDA)."""
    from gpu_serde.wire import tval

    meta = ("torch", "Tensor", "float32", 4, (4,), (1,), 0, False)
    dev = encode_device(uuid_bytes(uuid), False, 0, 1, "elsewhere", "NVIDIA H200")
    return tval((1, dev, meta, 0, 16, bytes(16)))


def test_a_tensor_placeholder_routes_to_the_gpu_it_was_sent_from(dask_cluster):
    pytest.importorskip("torch", reason="a tensor's placeholder is made where torch is")
    client, _, uuids, _ = dask_cluster
    arrived = tensor_sent_from(uuids[2])  # this process's torch has no CUDA: a placeholder
    assert isinstance(arrived, gpu_serde.UnresolvedObject)
    assert gpu_serde.dask.on(arrived, client) == {"resources": {resource_name(uuids[2]): 1}}


def test_a_tensor_from_a_gpu_no_worker_sees_raises_at_on_and_a_malformed_one_its_own_error(
    dask_cluster,
):
    from gpu_serde.wire import tval

    client, _, _, _ = dask_cluster
    stranger = tensor_sent_from(OTHER_HOST_GPU)
    assert isinstance(stranger, gpu_serde.UnresolvedObject)
    with pytest.raises(gpu_serde.DeviceNotVisibleError, match="no worker") as info:
        gpu_serde.dask.on(stranger, client)
    assert info.value.uuid == OTHER_HOST_GPU
    meta = ("torch", "Tensor", "float32", 4, (4,), (1,), 0, False)
    malformed = tval((1, b"hello", meta, 0, 0, b""))
    with pytest.raises(gpu_serde.PayloadError, match="not a device payload"):
        gpu_serde.dask.on(malformed, client)


def test_a_cpu_tensor_is_a_type_error_that_says_it_has_no_gpu(dask_cluster):
    torch = pytest.importorskip("torch", reason="a torch tensor")
    client, _, _, _ = dask_cluster
    with pytest.raises(TypeError, match="this Tensor is on cpu, not a CUDA GPU"):
        gpu_serde.dask.on(torch.ones(2), client)


NO_CLIENT = """
import gpu_serde.dask
from cuda.core import Device
try:
    gpu_serde.dask.on(Device(0))
except ValueError as exc:
    report(error=str(exc))
"""


def test_on_without_a_client_says_to_make_or_pass_one(sim_env):
    from helpers import run_child

    got = run_child(NO_CLIENT, sim_env())
    assert "create a distributed.Client first, or pass one as client=" in got["error"]


def test_the_dask_quick_start_runs_as_written_against_a_scheduler(dask_cluster):
    # tests/test_doc_blocks.py runs it on a local cluster of its own (the block starts one, on
    # loopback); here it joins the scheduler of workers that each own a GPU
    _, _, uuids, address = dask_cluster
    [code] = python_blocks("docs/quickstart-dask.md", "gpu_serde.dask.on")
    out = run_block(code, dict(os.environ, DASK_SCHEDULER_ADDRESS=address))
    assert out.strip() == repr((0, uuids[1][4:]))


def test_doctor_shows_which_worker_owns_which_gpu(dask_cluster):
    from gpu_serde.tools import doctor

    _, _, uuids, address = dask_cluster
    survey = doctor.survey_dask(address)
    reports = {r.name.split(" ")[0]: r for r in survey.workers}
    for i, uuid in enumerate(uuids):
        assert any(n.startswith(f"owns {uuid} (its device 0)") for n in reports[f"w{i}"].notes)
    assert not any("owns" in n for n in reports["blind"].notes)
    assert "gpu_serde.dask.on()" in doctor.render(survey)


def test_workers_started_with_the_preload_publish_before_they_register(simulated_gpus):
    from gpu_serde.testing.clusters import dask_cli_cluster

    uuids = [g.uuid for g in simulated_gpus]
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    )
    layout = {"solo": f"{uuids[2]},{uuids[0]}"}
    with dask_cli_cluster(layout, env=env) as address, Client(address, timeout=60) as client:
        client.wait_for_workers(1, timeout=120)
        assert owners(client) == {uuids[2]: "solo"}  # sent with its registration
        dev = Device(2)
        got = client.submit(where, dev, pure=False, **gpu_serde.dask.on(dev)).result(60)
        assert got == ("solo", 0, uuids[2][4:])
