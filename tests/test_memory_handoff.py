"""GPU memory crosses processes without a copy, on simulated GPUs (CPU tier) and on the real GPU
(``pytest -m gpu``, where each test fails rather than skips without a GPU).

A buffer filled with a known pattern (1 GiB on the real GPU, 4 MiB simulated) goes to a
multiprocessing child with another CUDA_VISIBLE_DEVICES, from a Ray actor to a Ray task, from the
driver to a Ray actor, and from one Dask worker to another; each receiver reads every word back
with ``cuMemcpyDtoH`` (or cuda.core's ``Buffer.copy_to``).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys

import pytest
from cuda.core import (
    Device,
    DeviceMemoryResource,
    DeviceMemoryResourceOptions,
    PinnedMemoryResource,
    PinnedMemoryResourceOptions,
    VirtualMemoryResource,
)
from memtier import (
    check,
    child,
    exited_cleanly,
    fill,
    host_words,
    ray_by_value,
    ray_get,
    short_release_grace,
    wait_until,
)

import gpu_serde


def check_in_queue(inbox, outbox) -> None:
    outbox.put(check(inbox.get(timeout=120)))


def describe_pool_in_queue(inbox, outbox) -> None:
    mr = gpu_serde.resolve(inbox.get(timeout=120))
    outbox.put({"type": type(mr).__name__, "device": mr.device_id, "mapped": mr.is_mapped})


def close_on_own_stream(inbox, outbox) -> None:
    """Runs in the receiver: copy the buffer out on a stream of its own with cuda.core, close it
    on that stream, try to send it on, and keep the closed object until told to exit."""
    from cuda.core import LegacyPinnedMemoryResource

    from gpu_serde.errors import HandoffError

    gpu_serde.install()

    buf = inbox.get(timeout=120)
    dev = Device(buf.device_id)
    dev.set_current()
    stream = dev.create_stream()
    host = LegacyPinnedMemoryResource().allocate(buf.size, stream=stream)
    buf.copy_to(host, stream=stream)
    stream.sync()
    total = int(host_words(host)[:1024].sum())
    host.close()
    mr = buf.memory_resource
    mapped = (mr.is_mapped, buf.is_mapped)  # docs/memory.md: read the resource's
    buf.close(stream)  # the free follows the work on that stream
    try:  # sending never fails: what arrives raises why it could not be sent
        gpu_serde.resolve(pickle.loads(pickle.dumps(buf)))
        forwarded = "sent"
    except HandoffError as exc:
        forwarded = "refused: closed" if "closed here" in str(exc) else f"refused: {exc}"
    outbox.put(
        {
            "total": total,
            "resource": type(mr).__name__,
            "pool": type(mr.pool).__name__,
            "mapped (resource, buffer)": mapped,
            "forwarded": forwarded,
        }
    )
    inbox.get(timeout=120)  # the closed Buffer object lives until the test is done


@pytest.fixture(scope="module")
def pool(tier):
    gpu_serde.install()
    with pytest.MonkeyPatch.context() as mp:
        short_release_grace(mp)  # these tests wait for the pool to be let go
        d = Device(tier.ordinal)
        d.set_current()
        mr = DeviceMemoryResource(
            d, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=8 * tier.size)
        )
        yield mr
    mr.close()
    gpu_serde.uninstall()


def used_returns_to(mr, expected: int) -> bool:
    return wait_until(lambda: mr.attributes.used_mem_current == expected)


def test_a_pool_that_is_not_ipc_enabled_fails_at_pickling(tier):
    gpu_serde.install()
    d = Device(tier.ordinal)
    d.set_current()
    plain = DeviceMemoryResource(d)
    with pytest.raises(gpu_serde.NotIPCEnabledError, match="ipc_enabled=True"):
        pickle.dumps(plain)


def test_a_closed_pool_fails_at_pickling_saying_it_is_closed(tier):
    gpu_serde.install()
    d = Device(tier.ordinal)
    d.set_current()
    closed = DeviceMemoryResource(d, DeviceMemoryResourceOptions(ipc_enabled=True))
    closed.close()
    with pytest.raises(gpu_serde.NotIPCEnabledError, match="is closed: a closed pool cannot"):
        pickle.dumps(closed)


def test_a_live_buffer_of_a_closed_pool_still_goes_to_dask_by_value(tier):
    """Closing a pool leaves its live buffers' memory; the Dask serializer's fallback for a pool
    it cannot send (a copy) still takes them."""
    from gpu_serde.dask.serializers import serialize_buffer

    gpu_serde.install()
    d = Device(tier.ordinal)
    d.set_current()
    mr = DeviceMemoryResource(d, DeviceMemoryResourceOptions(ipc_enabled=True))
    buf = mr.allocate(1024, stream=d.default_stream)
    mr.close()
    try:
        header, _ = serialize_buffer(buf, None)
        assert header["sent"] == "copy"
    finally:
        buf.close()


def test_a_buffer_reaches_a_child_with_other_cuda_visible_devices_and_is_let_go(
    pool, tier, monkeypatch
):
    baseline = pool.attributes.used_mem_current
    buf = pool.allocate(tier.size, stream=Device(tier.ordinal).default_stream)
    fill(buf)
    ctx = multiprocessing.get_context("spawn")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", tier.uuid)  # the UUID form: ordinal 0 there
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=check_in_queue, args=(inbox, outbox))
    child.start()
    inbox.put(buf)
    del buf  # the sender drops its own reference before the receiver reads
    got = outbox.get(timeout=120)
    child.join(60)
    assert got["ok"] and got["size"] == tier.size and got["pid"] != os.getpid()
    assert got["device"] == 0  # the child's ordinal of the same GPU
    assert used_returns_to(pool, baseline)  # every importer released: memory returns
    assert exited_cleanly(child.exitcode)


@pytest.mark.slow  # a soak: ten children in a row
def test_children_that_exit_right_after_reading_let_every_buffer_go(pool, tier, monkeypatch):
    """The receiver's free is told from a background thread: an exit right after it must neither
    lose that release (the exporter's memory would stay held) nor crash the child at teardown
    (seen on Python 3.13, in about one exit out of four before the exit waited for the thread)."""
    ctx = multiprocessing.get_context("spawn")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", tier.uuid)
    outcomes = []
    for _ in range(10):
        baseline = pool.attributes.used_mem_current
        buf = pool.allocate(tier.size, stream=Device(tier.ordinal).default_stream)
        fill(buf)
        inbox, outbox = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=check_in_queue, args=(inbox, outbox))
        child.start()
        inbox.put(buf)
        del buf
        got = outbox.get(timeout=120)
        child.join(60)
        outcomes.append(
            (got["ok"], exited_cleanly(child.exitcode), used_returns_to(pool, baseline))
        )
    assert outcomes == [(True, True, True)] * 10  # bytes right, clean exit, memory returned


def test_a_received_pool_keeps_the_senders_pool_uuid_as_cuda_cores_own_path_does(pool, tier):
    buf = pool.allocate(tier.size, stream=Device(tier.ordinal).default_stream)
    fill(buf)
    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=check_in_queue, args=(inbox, outbox))
    child.start()
    inbox.put(buf)
    got = outbox.get(timeout=120)
    child.join(60)
    assert got["ok"] and got["pool uuid"] == str(pool.uuid) != "None"


def test_a_pool_reaches_a_child_mapped_on_its_ordinal_of_the_gpu(pool, tier, monkeypatch):
    ctx = multiprocessing.get_context("spawn")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", tier.uuid)
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=describe_pool_in_queue, args=(inbox, outbox))
    child.start()
    inbox.put(pool)
    got = outbox.get(timeout=120)
    child.join(60)
    assert got == {"type": "DeviceMemoryResource", "device": 0, "mapped": True}


def test_a_killed_exporter_gives_the_typed_error(tier):
    code = (
        "import pickle, sys, gpu_serde\n"
        "from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions\n"
        "gpu_serde.install(); d = Device(0); d.set_current()\n"
        "mr = DeviceMemoryResource(d, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=1 << 26))\n"
        "buf = mr.allocate(1 << 20, stream=d.default_stream)\n"
        "print(pickle.dumps(buf).hex(), flush=True)\n"
        "sys.stdin.read()\n"
    )
    exporter = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    blob = bytes.fromhex(exporter.stdout.readline().strip())
    exporter.kill()
    exporter.wait(30)
    gpu_serde.install()
    got = pickle.loads(blob)  # never raises: the error waits for use
    with pytest.raises(gpu_serde.ExporterGoneError):
        gpu_serde.resolve(got)


@pytest.fixture(scope="module")
def ray_session(tier):
    import ray

    import gpu_serde.ray

    ray_by_value(__name__)
    with pytest.MonkeyPatch.context() as mp:
        # the node's one GPU is the tier's (the raylet hands this entry to GPU workers as is)
        mp.setenv("CUDA_VISIBLE_DEVICES", tier.uuid)
        gpu_serde.ray.init(
            address="local", num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False
        )
    yield ray
    ray.shutdown()


def make_in_actor(size: int):
    """A Ray actor class (built here so the test module ships by value) that allocates and keeps
    an IPC pool, and returns filled buffers from it."""
    import ray

    @ray.remote(num_gpus=0.5)
    class Producer:
        def make(self):
            d = Device(0)
            d.set_current()
            if not hasattr(self, "mr"):
                self.mr = DeviceMemoryResource(
                    d, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=2 * size)
                )
            buf = self.mr.allocate(size, stream=d.default_stream)
            fill(buf)
            return buf  # pickled here, in the actor; the actor keeps it for its importers

    return Producer


def test_a_ray_actor_hands_a_buffer_to_a_task(ray_session, tier):
    ray = ray_session
    consume = ray.remote(num_gpus=0.5)(check)
    producer = make_in_actor(tier.size).remote()
    got = ray_get(consume.remote(producer.make.remote()))
    assert got["ok"] and got["size"] == tier.size


def test_the_driver_hands_a_buffer_to_a_ray_actor_and_gets_it_back(ray_session, pool, tier):
    ray = ray_session

    @ray.remote(num_gpus=0.5)
    class Consumer:
        def check(self, buf):
            return check(buf)

    baseline = pool.attributes.used_mem_current
    buf = pool.allocate(tier.size, stream=Device(tier.ordinal).default_stream)
    fill(buf)
    consumer = Consumer.remote()
    ref = consumer.check.remote(buf)
    del buf
    got = ray_get(ref)
    ray.kill(consumer)
    assert got["ok"] and got["size"] == tier.size
    assert used_returns_to(pool, baseline)


def test_pinned_and_vmm_buffers_reach_a_ray_task(ray_session, tier):
    ray = ray_session
    d = Device(tier.ordinal)
    d.set_current()
    pinned = PinnedMemoryResource(PinnedMemoryResourceOptions(ipc_enabled=True, max_size=tier.size))
    pbuf = pinned.allocate(tier.size // 4, stream=d.default_stream)
    vbuf = VirtualMemoryResource(d).allocate(tier.size)
    fill(pbuf)
    fill(vbuf)
    consume = ray.remote(num_gpus=0.5)(check)
    got_p, got_v = ray_get([consume.remote(pbuf), consume.remote(vbuf)])
    assert got_p["ok"] and got_p["host"] and got_p["size"] == tier.size // 4
    assert got_v["ok"] and not got_v["host"] and got_v["size"] == tier.size


def test_a_dask_worker_hands_a_buffer_to_another(tier):
    from distributed import Client, Nanny, Scheduler, SpecCluster

    import gpu_serde.dask

    size = tier.size
    workers = {
        name: {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                "host": "127.0.0.1",
                "env": {"CUDA_VISIBLE_DEVICES": tier.uuid},
            },
        }
        for name in ("a", "b")
    }
    scheduler = {
        "cls": Scheduler,
        "options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"},
    }

    def make():
        d = Device(0)
        d.set_current()
        mr = DeviceMemoryResource(
            d, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=2 * size)
        )
        buf = mr.allocate(size, stream=d.default_stream)
        fill(buf)
        return buf

    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        gpu_serde.dask.register(client)
        client.wait_for_workers(2, timeout=120)
        by_name = {w["name"]: a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        made = client.submit(make, workers=[by_name["a"]], pure=False)
        got = client.submit(check, made, workers=[by_name["b"]], pure=False).result(timeout=300)
        assert got["ok"] and got["size"] == size


def test_a_receiver_closing_a_buffer_on_its_stream_releases_it_and_cannot_send_it_on(pool, tier):
    baseline = pool.attributes.used_mem_current
    buf = pool.allocate(tier.size, stream=Device(tier.ordinal).default_stream)
    fill(buf)
    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=close_on_own_stream, args=(inbox, outbox))
    child.start()
    try:
        inbox.put(buf)
        del buf
        got = outbox.get(timeout=120)
        assert got == {
            "total": sum(range(1024)),
            "resource": "ImportedMemory",
            "pool": "DeviceMemoryResource",
            "mapped (resource, buffer)": (True, False),  # cuda.core 1.2's flag: its own import
            "forwarded": "refused: closed",  # its token may already be let go
        }
        # released on close, not at collection or exit: the child still holds the closed object
        assert used_returns_to(pool, baseline)
        assert child.is_alive()
    finally:
        inbox.put("done")
        child.join(60)


def receive_error(data: bytes) -> str:
    """Job: unpickle and use a buffer; the error it raised (its type and message)."""
    try:
        gpu_serde.resolve(pickle.loads(data))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_pool_buffer_closed_before_its_receiver_mapped_it_says_why_its_memory_is_gone(
    installed, monkeypatch
):
    gpus = installed
    d = Device(len(gpus) - 1)
    d.set_current()
    mr = DeviceMemoryResource(d, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=1 << 24))
    buf = mr.allocate(1 << 20, stream=d.default_stream)
    data = pickle.dumps(buf)
    buf.close()  # before the receiver maps it: a pool's buffer is freed whatever was sent
    with child(monkeypatch, gpus[-1].uuid) as c:
        said = c.run(receive_error, data)
    assert said.startswith("HandoffError: mapping the exported buffer failed")
    assert "a pool's buffer is freed by close" in said
    assert "ArenaMemoryResource" in said
