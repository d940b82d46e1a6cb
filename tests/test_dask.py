"""Dask: every worker resolves a Device to the same physical GPU, whatever its local numbering.

Four workers see four simulated GPUs rotated as dask-cuda does (``visible[i:] + visible[:i]``, so
each worker's ordinal 0 is another GPU), and a fifth worker sees none. Each scenario runs on a
cluster built in Python (``SpecCluster`` + ``register(client)``) and on one started with the CLIs
(``dask scheduler`` without any CUDA driver, ``dask worker --preload gpu_serde.dask``).
"""

import contextlib
import os

import dask
import dask.bag as db
import pytest
from cuda.core import Device
from distributed import Client, SpecCluster

import gpu_serde
import gpu_serde.dask
from gpu_serde import UnresolvedDevice
from gpu_serde.device import reduce_device
from gpu_serde.testing import spec_cluster_options
from gpu_serde.testing.clusters import dask_cli_cluster
from helpers import env_without_driver

HERE = os.path.dirname(os.path.abspath(__file__))


def with_tests_importable(env: dict[str, str]) -> dict[str, str]:
    """CLI-started processes import this module's task functions, as users deploy their code."""
    return dict(env, PYTHONPATH=os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH")) if p))


def rotations(uuids: list[str]) -> dict[str, str]:
    spec = {f"w{i}": ",".join(uuids[i:] + uuids[:i]) for i in range(len(uuids))}
    spec["blind"] = ""
    return spec


def spec_cluster(env_by_name: dict[str, str]):
    cluster = SpecCluster(**spec_cluster_options(env_by_name))
    client = Client(cluster)
    gpu_serde.dask.register(client)
    return client, cluster.close


@contextlib.contextmanager
def cli_cluster(env_by_name: dict[str, str]):
    """`dask scheduler` (no CUDA driver) and `dask worker --preload gpu_serde.dask` processes."""
    env = with_tests_importable(dict(os.environ))
    with dask_cli_cluster(
        env_by_name, env=env, scheduler_env=with_tests_importable(env_without_driver())
    ) as address:
        client = Client(address, timeout=60)
        gpu_serde.install()
        try:
            yield client
        finally:
            client.close()


@pytest.fixture(scope="module", params=["python", pytest.param("cli", marks=pytest.mark.slow)])
def dask_cluster(request, simulated_gpus):
    uuids = [g.uuid for g in simulated_gpus]
    env = rotations(uuids)
    with contextlib.ExitStack() as stack:
        if request.param == "python":
            client, close = spec_cluster(env)
            stack.callback(close)
        else:
            client = stack.enter_context(cli_cluster(env))
        stack.callback(gpu_serde.uninstall)
        client.wait_for_workers(len(env), timeout=120)
        info = client.scheduler_info(n_workers=-1)["workers"]
        by_name = {w["name"]: addr for addr, w in info.items()}
        yield client, by_name, uuids


def where(device) -> tuple:
    d = gpu_serde.resolve(device)
    return (d.device_id, d.uuid)


def local_ordinal(worker: str, uuid: str, uuids: list[str]) -> int:
    i = int(worker[1:])
    return (uuids[i:] + uuids[:i]).index(uuid)


def test_each_rotated_worker_gets_the_same_gpu_at_its_own_ordinal(dask_cluster):
    client, workers, uuids = dask_cluster
    for name in ("w0", "w1", "w2", "w3"):
        devices = [Device(k) for k in range(4)]
        futures = client.map(where, devices, workers=[workers[name]], pure=False)
        got = client.gather(futures)
        assert got == [(local_ordinal(name, u, uuids), u[4:]) for u in uuids]


def test_a_worker_that_cannot_see_the_gpu_raises_and_keeps_serving(dask_cluster):
    client, workers, uuids = dask_cluster
    blind = workers["blind"]
    bad = client.submit(where, Device(1), workers=[blind], pure=False)
    fine = client.submit(where, Device(1), workers=[workers["w1"]], pure=False)
    with pytest.raises(gpu_serde.DeviceNotVisibleError) as info:
        bad.result(timeout=60)
    assert info.value.uuid == uuids[1]
    assert "CUDA_VISIBLE_DEVICES is empty" in str(info.value)
    assert "dask worker" in str(info.value)
    assert fine.result(timeout=60) == (0, uuids[1][4:])
    nxt = client.submit(os.getpid, workers=[blind], pure=False)
    assert isinstance(nxt.result(timeout=60), int)
    assert blind in client.scheduler_info(n_workers=-1)["workers"]  # same address: no restart


def test_a_result_device_resolves_on_the_client(dask_cluster):
    client, workers, uuids = dask_cluster

    def first_gpu():
        return Device(0)

    fut = client.submit(first_gpu, workers=[workers["w2"]], pure=False)
    dev = fut.result(timeout=60)
    assert isinstance(dev, Device)
    assert dev.uuid == uuids[2][4:]
    assert dev.device_id == 2  # the client sees the host's GPUs in host order


def test_worker_to_worker_transfer_keeps_the_uuid(dask_cluster):
    client, workers, uuids = dask_cluster

    def first_gpu():
        return Device(0)

    made = client.submit(first_gpu, workers=[workers["w1"]], pure=False)  # uuids[1]
    moved = client.submit(where, made, workers=[workers["w3"]], pure=False)
    assert moved.result(timeout=60) == (local_ordinal("w3", uuids[1], uuids), uuids[1][4:])


def test_scatter_delayed_bags_and_run_keep_the_uuid(dask_cluster):
    client, workers, uuids = dask_cluster
    w2 = workers["w2"]
    [scattered] = client.scatter([Device(3)], workers=[w2])
    got = client.submit(where, scattered, workers=[w2], pure=False).result(timeout=60)
    assert got == (local_ordinal("w2", uuids[3], uuids), uuids[3][4:])

    lazy = dask.delayed(where)(Device(0))
    assert client.compute(lazy, workers=[workers["w3"]]).result(timeout=60) == (
        local_ordinal("w3", uuids[0], uuids),
        uuids[0][4:],
    )

    bag = db.from_sequence([Device(0), Device(1)], npartitions=1).map(where)
    assert client.compute(bag, workers=[workers["w1"]]).result(timeout=60) == [
        (local_ordinal("w1", uuids[k], uuids), uuids[k][4:]) for k in (0, 1)
    ]

    ran = client.run(where, Device(2), on_error="return")
    for address, result in ran.items():
        name = next(n for n, a in workers.items() if a == address)
        if name == "blind":
            assert isinstance(result, gpu_serde.DeviceNotVisibleError)
        else:
            assert result == (local_ordinal(name, uuids[2], uuids), uuids[2][4:])


def test_devices_tokenize_by_uuid(simulated_gpus):
    gpu_serde.install()
    try:
        _, (payload,) = reduce_device(Device(1))
        stranger = UnresolvedDevice(
            gpu_serde.wire.dev, payload, None
        )  # the same GPU, as a CPU-only process holds it
        assert dask.base.tokenize(Device(1)) == dask.base.tokenize(stranger)
        assert dask.base.tokenize(Device(1)) != dask.base.tokenize(Device(2))
    finally:
        gpu_serde.uninstall()


def test_a_buffer_tokenizes_as_itself_not_as_the_address_it_was_given(simulated_gpus):
    from cuda.core import DeviceMemoryResource, DeviceMemoryResourceOptions

    d = Device(1)
    d.set_current()
    pool = DeviceMemoryResource(d, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=1 << 24))
    first = pool.allocate(1 << 20, stream=d.default_stream)
    address, token = int(first.handle), dask.base.tokenize(first)
    assert dask.base.tokenize(first) == token  # the same buffer: the same key (scatter's hash)
    first.close()
    d.default_stream.sync()
    second = pool.allocate(1 << 20, stream=d.default_stream)
    assert int(second.handle) == address  # the pool hands the address out again
    assert dask.base.tokenize(second) != token  # a scattered key is not the earlier buffer's
    second.close()


def vmm_where(obj) -> list:
    """On a worker: the received VirtualMemoryResource's device and peers as (ordinal, UUID)."""
    mr = gpu_serde.resolve(obj)
    devices = [mr.device, *(Device(int(p)) for p in mr.config.peers)]
    return [[d.device_id, d.uuid] for d in devices]


def test_a_vmm_resource_reaches_rotated_workers_with_device_and_peers_by_uuid(dask_cluster):
    from cuda.core import VirtualMemoryResource, VirtualMemoryResourceOptions

    client, workers, uuids = dask_cluster
    mr = VirtualMemoryResource(Device(2), VirtualMemoryResourceOptions(peers=(0, 3)))
    for name in ("w1", "w3"):
        got = client.submit(vmm_where, mr, workers=[workers[name]], pure=False).result(timeout=60)
        assert got == [[local_ordinal(name, uuids[k], uuids), uuids[k][4:]] for k in (2, 0, 3)]
    blind = client.submit(vmm_where, mr, workers=[workers["blind"]], pure=False)
    with pytest.raises(gpu_serde.DeviceNotVisibleError) as info:
        blind.result(timeout=60)
    assert info.value.uuid == uuids[2]


# --- a bad payload reaches the caller as a PayloadError, and the cluster keeps serving ---------

BAD = {
    "malformed": ("dev", (b"\x01truncated",), "truncated"),
    "wrong-arity": ("pool", (b"one", b"two"), "takes one payload, got 2"),
    "future-version": ("buf", ((9, "fields of a newer gpu_serde"),), "version 9"),
}


def bad_object(name: str, args: tuple):
    """A placeholder that pickles as ``gpu_serde.wire.<name>(*args)``: what a malformed,
    wrong-arity or newer pickle from elsewhere carries (built wherever this runs)."""
    return gpu_serde.UnresolvedObject("test", getattr(gpu_serde.wire, name), args, RuntimeError())


def use(obj) -> object:
    return gpu_serde.resolve(obj)


def assert_still_serving(client, workers) -> None:
    futures = [client.submit(lambda: 1, workers=[a], pure=False) for a in workers.values()]
    assert client.gather(futures) == [1] * len(workers)


@pytest.fixture(params=sorted(BAD))
def bad(request):
    name, args, says = BAD[request.param]
    return bad_object(name, args), (name, args), says


def test_a_bad_payload_as_a_task_argument_errs_the_future_with_payload_error(dask_cluster, bad):
    client, workers, _ = dask_cluster
    obj, _, says = bad
    future = client.submit(use, obj, workers=[workers["w0"]], pure=False)
    with pytest.raises(gpu_serde.PayloadError, match=says):
        future.result(timeout=30)
    assert_still_serving(client, workers)


def test_a_bad_payload_scattered_to_a_worker_errs_the_task_that_uses_it(dask_cluster, bad):
    client, workers, _ = dask_cluster
    obj, _, says = bad
    [scattered] = client.scatter([obj], workers=[workers["w1"]])
    future = client.submit(use, scattered, workers=[workers["w1"]], pure=False)
    with pytest.raises(gpu_serde.PayloadError, match=says):
        future.result(timeout=30)
    assert_still_serving(client, workers)


def test_a_bad_payload_returned_by_a_task_reaches_the_client_as_a_placeholder(dask_cluster, bad):
    client, workers, _ = dask_cluster
    _, (name, args), says = bad
    got = client.submit(bad_object, name, args, workers=[workers["w2"]], pure=False)
    with pytest.raises(gpu_serde.PayloadError, match=says):
        gpu_serde.resolve(got.result(timeout=30))
    assert_still_serving(client, workers)


def test_a_bad_result_fetched_by_another_worker_errs_the_dependent_future(dask_cluster, bad):
    client, workers, _ = dask_cluster
    _, (name, args), says = bad
    made = client.submit(bad_object, name, args, workers=[workers["w0"]], pure=False)
    future = client.submit(use, made, workers=[workers["w3"]], pure=False)
    with pytest.raises(gpu_serde.PayloadError, match=says):
        future.result(timeout=30)
    assert_still_serving(client, workers)


def test_a_bad_payload_from_client_run_reaches_the_client_as_a_placeholder(dask_cluster, bad):
    client, workers, _ = dask_cluster
    _, (name, args), says = bad
    got = client.run(bad_object, name, args, workers=[workers["w1"]])
    with pytest.raises(gpu_serde.PayloadError, match=says):
        gpu_serde.resolve(got[workers["w1"]])
    assert_still_serving(client, workers)


def _host_table(dask_scheduler) -> dict:
    return dict(dask_scheduler.task_metadata.get("gpu_serde-hosts", {}))


@pytest.mark.parametrize("start", ["python", pytest.param("cli", marks=pytest.mark.slow)])
def test_the_host_table_forgets_a_worker_that_is_killed(simulated_gpus, start):
    import signal
    import time

    env = {"a": simulated_gpus[0].uuid, "b": simulated_gpus[1].uuid}
    with contextlib.ExitStack() as stack:
        if start == "python":
            client, close = spec_cluster(env)
            stack.callback(close)
        else:
            client = stack.enter_context(cli_cluster(env))
        stack.callback(gpu_serde.uninstall)
        client.wait_for_workers(2, timeout=120)
        before = set(client.scheduler_info()["workers"])
        deadline = time.monotonic() + 30
        while (
            not before <= set(client.run_on_scheduler(_host_table)) and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert before <= set(client.run_on_scheduler(_host_table))
        victim = sorted(before)[0]
        os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            table, workers = (
                client.run_on_scheduler(_host_table),
                client.scheduler_info()["workers"],
            )
            if victim not in table and len(workers) == 2 and set(workers) <= set(table):
                break
            time.sleep(0.2)
        assert victim not in table  # gone with the worker: no entry, not a None
        assert set(workers) <= set(table) and len(workers) == 2  # its replacement joined
        assert all(isinstance(v, str) for v in table.values())


# ---- a `dask scheduler` that has a CUDA driver and sees the GPUs in another order ----
@pytest.fixture(scope="module")
def scheduler_with_gpus(simulated_gpus):
    """A CLI cluster whose scheduler preloads gpu_serde and sees every GPU, in reverse (its
    ordinal 0 is this process's last GPU), with a worker that sees them rotated by one and one
    that sees none."""
    uuids = [g.uuid for g in simulated_gpus]
    env = with_tests_importable(dict(os.environ))
    reverse = dict(env, CUDA_VISIBLE_DEVICES=",".join(reversed(uuids)))
    layout = {"w1": ",".join(uuids[1:] + uuids[:1]), "blind": ""}
    with dask_cli_cluster(layout, env=env, scheduler_env=reverse) as address:
        client = Client(address, timeout=60)
        try:
            client.wait_for_workers(2, timeout=120)
            info = client.scheduler_info(n_workers=-1)["workers"]
            yield client, {w["name"]: a for a, w in info.items()}, uuids
        finally:
            client.close()
            gpu_serde.uninstall()


def forwards_only(dask_scheduler) -> bool:
    from gpu_serde.registry import flags

    return flags.forward_only


def what_is_wrong(obj) -> str:
    try:
        gpu_serde.resolve(obj)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "nothing"


@pytest.mark.slow
def test_a_scheduler_that_sees_gpus_forwards_a_device_to_the_same_gpu(scheduler_with_gpus):
    client, workers, uuids = scheduler_with_gpus
    gpu_serde.install()
    assert client.run_on_scheduler(forwards_only) is True
    got = client.submit(where, Device(0), workers=[workers["w1"]], pure=False)
    assert got.result(timeout=60) == (local_ordinal("w1", uuids[0], uuids), uuids[0][4:])


@pytest.mark.slow
def test_a_scheduler_that_sees_gpus_passes_the_payload_on_as_the_client_made_it(
    scheduler_with_gpus,
):
    """The worker that sees no GPU reads who sent the Device: this process, not the scheduler
    (a scheduler that rebuilt it would have sent a payload of its own)."""
    client, workers, _ = scheduler_with_gpus
    gpu_serde.install()
    said = client.submit(what_is_wrong, Device(0), workers=[workers["blind"]], pure=False)
    assert f"pid {os.getpid()}, where it was CUDA device 0" in said.result(timeout=60)


@pytest.mark.slow
def test_a_device_sent_by_ordinal_through_a_scheduler_that_sees_gpus_is_a_typed_error(
    scheduler_with_gpus,
):
    """A client without gpu_serde pickles Device(0) by its ordinal; the scheduler, whose
    ordinal 0 is another GPU, does not make it that GPU: the worker's use raises why."""
    client, workers, _ = scheduler_with_gpus
    gpu_serde.uninstall()
    future = client.submit(where, Device(0), workers=[workers["w1"]], pure=False)
    with pytest.raises(gpu_serde.HandoffError, match=r"without gpu_serde.*register\(client\)"):
        future.result(timeout=60)
    assert_still_serving(client, workers)


def total(x) -> float:
    return float(x.detach().sum())


@pytest.mark.slow
def test_cpu_tensors_pass_a_forwarding_scheduler_as_torch_pickles_them(scheduler_with_gpus):
    torch = pytest.importorskip("torch", reason="needs torch")
    client, workers, _ = scheduler_with_gpus
    gpu_serde.uninstall()  # a plain client: torch's own pickle reaches the scheduler
    for x in (torch.arange(4.0), torch.nn.Parameter(torch.ones(3))):
        got = client.submit(total, x, workers=[workers["w1"]], pure=False).result(timeout=60)
        assert got == total(x)


def test_a_scheduler_in_the_clients_process_that_preloads_gpu_serde_does_not_only_forward(
    simulated_gpus,
):
    """Dask's configuration preloads gpu_serde into a LocalCluster-style scheduler, which runs
    in this (the client's) process: that process must go on rebuilding what it receives."""
    with dask.config.set({"distributed.scheduler.preload": ["gpu_serde.dask"]}):
        cluster = SpecCluster(**spec_cluster_options({"w0": simulated_gpus[1].uuid}))
    try:
        assert gpu_serde.inventory.role.startswith("dask scheduler")  # the preload ran here
        with Client(cluster) as client:
            gpu_serde.dask.register(client)
            assert client.run_on_scheduler(forwards_only) is False
            got = client.submit(lambda d: d, Device(1), pure=False).result(timeout=60)
            assert isinstance(got, Device) and got.device_id == 1
    finally:
        cluster.close()
        gpu_serde.uninstall()


@pytest.mark.slow
def test_options_that_name_no_gpu_pass_a_forwarding_scheduler_as_plain_data(scheduler_with_gpus):
    from cuda.core import VirtualMemoryResourceOptions

    client, workers, _ = scheduler_with_gpus
    gpu_serde.uninstall()  # a plain client: the dataclass's own pickle reaches the scheduler
    got = client.submit(type, VirtualMemoryResourceOptions(), workers=[workers["w1"]], pure=False)
    assert got.result(timeout=60) is VirtualMemoryResourceOptions


def test_only_the_dask_scheduler_command_makes_a_process_a_forwarder():
    """`dask scheduler` (and `python -m distributed.cli.dask_scheduler`, the same function)
    runs a scheduler alone; `dask spec` may run a worker beside it, and a process without a
    command (a LocalCluster's) runs a client."""
    import click
    from distributed.cli import dask_scheduler, dask_spec

    from gpu_serde.dask.plugin import _scheduler_alone

    assert not _scheduler_alone()
    with click.Context(dask_scheduler.main):
        assert _scheduler_alone()
    with click.Context(dask_spec.main):
        assert not _scheduler_alone()
