"""GPU tier: GPU memory crosses processes without a copy (``pytest -m gpu``; fails without a GPU).

A 1 GiB buffer filled with a known pattern goes to a multiprocessing child with another
CUDA_VISIBLE_DEVICES, from a Ray actor to a Ray task, and from one Dask worker to another; each
receiver checks every word on the GPU (CuPy through DLPack).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import time

import pytest
from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions

import gpu_serde
from gpu_serde import handoff

pytestmark = pytest.mark.gpu
GiB = 1 << 30


def _ray_by_value() -> None:
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers lack tests/


def fill(buf) -> None:
    import cupy as cp

    words = cp.from_dlpack(buf).view(cp.uint32)
    words[:] = cp.arange(words.size, dtype=cp.uint32)
    cp.cuda.runtime.deviceSynchronize()


def check(buf) -> dict:
    """Runs in the receiver: is every word of the pattern there, on the GPU?"""
    import cupy as cp

    import gpu_serde

    buf = gpu_serde.resolve(buf)
    words = cp.from_dlpack(buf).view(cp.uint32)
    ok = bool((words == cp.arange(words.size, dtype=cp.uint32)).all())
    pool = getattr(buf.memory_resource, "pool", buf.memory_resource)
    return {
        "ok": ok,
        "size": buf.size,
        "pid": os.getpid(),
        "device": buf.device_id,
        "pool uuid": str(pool.uuid),
    }


def check_in_queue(inbox, outbox) -> None:
    outbox.put(check(inbox.get(timeout=120)))


def close_on_own_stream(inbox, outbox) -> None:
    """Runs in the receiver: use the buffer on a stream of its own, close it on that stream, try
    to send it on, and keep the closed object until told to exit."""
    import cupy as cp

    from gpu_serde.errors import HandoffError

    gpu_serde.install()

    buf = inbox.get(timeout=120)
    stream = Device(buf.device_id).create_stream()
    with cp.cuda.ExternalStream(int(stream.handle)):
        words = cp.from_dlpack(buf).view(cp.uint32)
        total = int(words[:1024].sum())  # waits for the read
    del words
    mr = buf.memory_resource
    mapped = (mr.is_mapped, buf.is_mapped)  # docs/memory.md: read the resource's
    buf.close(stream)  # the free follows the work on that stream
    try:
        pickle.dumps(buf)
        forwarded = "sent"
    except HandoffError as exc:
        forwarded = "refused: closed" if "is closed" in str(exc) else f"refused: {exc}"
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
def pool(real_gpu):
    gpu_serde.install()
    handoff.RELEASE_GRACE_S = 0.5  # this test waits for the pool to be let go
    d = Device(0)
    d.set_current()
    mr = DeviceMemoryResource(d, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=8 * GiB))
    yield mr
    gpu_serde.uninstall()


def wait_for_used(mr, expected: int, timeout: float = 15) -> int:
    deadline = time.monotonic() + timeout
    while mr.attributes.used_mem_current != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return mr.attributes.used_mem_current


def test_a_pool_that_is_not_ipc_enabled_fails_at_pickling(real_gpu):
    gpu_serde.install()
    d = Device(0)
    d.set_current()
    plain = DeviceMemoryResource(d)
    with pytest.raises(gpu_serde.NotIPCEnabledError, match="ipc_enabled=True"):
        pickle.dumps(plain)


def test_a_gib_reaches_a_child_with_other_cuda_visible_devices_and_is_let_go(
    pool, real_gpu, monkeypatch
):
    baseline = pool.attributes.used_mem_current
    buf = pool.allocate(GiB, stream=Device(0).default_stream)
    fill(buf)
    ctx = multiprocessing.get_context("spawn")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", real_gpu[0].uuid)  # the UUID form, not "0"
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=check_in_queue, args=(inbox, outbox))
    child.start()
    inbox.put(buf)
    del buf  # the sender drops its own reference before the receiver reads
    got = outbox.get(timeout=120)
    child.join(60)
    assert got["ok"] and got["size"] == GiB and got["pid"] != os.getpid()
    assert wait_for_used(pool, baseline) == baseline  # every importer released: memory returns


def test_a_killed_exporter_gives_the_typed_error(real_gpu):
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
    started = time.monotonic()
    got = pickle.loads(blob)
    assert time.monotonic() - started < 1.0
    with pytest.raises(gpu_serde.ExporterGoneError):
        gpu_serde.resolve(got)


def test_a_ray_actor_hands_a_gib_to_a_task(pool, real_gpu):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    import gpu_serde.ray

    _ray_by_value()
    gpu_serde.ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote(num_gpus=0.5)
        class Producer:
            def make(self):
                from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions

                d = Device(0)
                d.set_current()
                self.mr = DeviceMemoryResource(
                    d, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=2 * GiB)
                )
                buf = self.mr.allocate(GiB, stream=d.default_stream)
                fill(buf)
                return buf  # pickled here, in the actor; the actor keeps it for its importers

        consume = ray.remote(num_gpus=0.5)(check)
        producer = Producer.remote()
        got = ray.get(consume.remote(producer.make.remote()), timeout=300)
        assert got["ok"] and got["size"] == GiB
    finally:
        ray.shutdown()


def test_a_dask_worker_hands_a_gib_to_another(pool, real_gpu):
    from distributed import Client, Nanny, Scheduler, SpecCluster

    import gpu_serde.dask

    uuid = real_gpu[0].uuid
    workers = {
        name: {
            "cls": Nanny,
            "options": {"nthreads": 1, "host": "127.0.0.1", "env": {"CUDA_VISIBLE_DEVICES": cvd}},
        }
        for name, cvd in {"a": uuid, "b": uuid}.items()
    }
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": ":0"}}

    def make():
        from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions

        d = Device(0)
        d.set_current()
        mr = DeviceMemoryResource(
            d, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=2 * GiB)
        )
        buf = mr.allocate(GiB, stream=d.default_stream)
        fill(buf)
        return buf

    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        gpu_serde.dask.register(client)
        client.wait_for_workers(2, timeout=120)
        by_name = {w["name"]: a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        made = client.submit(make, workers=[by_name["a"]], pure=False)
        got = client.submit(check, made, workers=[by_name["b"]], pure=False).result(timeout=300)
        assert got["ok"] and got["size"] == GiB


def test_a_receiver_closing_a_buffer_on_its_stream_releases_it_and_cannot_send_it_on(
    pool, real_gpu
):
    baseline = pool.attributes.used_mem_current
    buf = pool.allocate(GiB, stream=Device(0).default_stream)
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
        assert wait_for_used(pool, baseline) == baseline
        assert child.is_alive()
    finally:
        inbox.put("done")
        child.join(60)


def test_a_received_pool_keeps_the_senders_pool_uuid_as_cuda_cores_own_path_does(pool, real_gpu):
    buf = pool.allocate(1 << 20, stream=Device(0).default_stream)
    fill(buf)
    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=check_in_queue, args=(inbox, outbox))
    child.start()
    inbox.put(buf)
    got = outbox.get(timeout=120)
    child.join(60)
    assert got["ok"] and got["pool uuid"] == str(pool.uuid) != "None"
