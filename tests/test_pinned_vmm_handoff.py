"""GPU tier: pinned host pools and VirtualMemoryResource buffers cross processes without a copy,
and a VirtualMemoryResource lands on the receiver's ordinal of the same GPU (``pytest -m gpu``).

Each receiver has another CUDA_VISIBLE_DEVICES (the GPU's UUID) and checks every word of the
pattern: pinned memory on the host, VMM memory on the GPU (CuPy through DLPack).
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import pickle
import time

import numpy as np
import pytest
from cuda.core import (
    Device,
    PinnedMemoryResource,
    PinnedMemoryResourceOptions,
    VirtualMemoryResource,
    VirtualMemoryResourceOptions,
)

import gpu_serde
from gpu_serde import memory
from gpu_serde.fdshare import broker

pytestmark = pytest.mark.gpu
MiB, GiB = 1 << 20, 1 << 30


def host_words(buf) -> np.ndarray:
    """The uint32 words of a host-accessible buffer (pinned memory), as a NumPy view."""
    return np.ctypeslib.as_array((ctypes.c_uint32 * (buf.size // 4)).from_address(int(buf.handle)))


def check_pinned(buf) -> dict:
    import gpu_serde

    buf = gpu_serde.resolve(buf)
    words = host_words(buf)
    ok = bool((words == np.arange(words.size, dtype=np.uint32)).all())
    return {"ok": ok, "size": buf.size, "pid": os.getpid(), "host": buf.is_host_accessible}


def check_on_gpu(buf) -> dict:
    import cupy as cp

    import gpu_serde

    buf = gpu_serde.resolve(buf)
    words = cp.from_dlpack(buf).view(cp.uint32)
    ok = bool((words == cp.arange(words.size, dtype=cp.uint32)).all())
    return {"ok": ok, "size": buf.size, "pid": os.getpid(), "device": buf.device_id}


def describe_resource(mr) -> dict:
    """Runs in the receiver: where the VirtualMemoryResource landed, and that it allocates."""
    import gpu_serde

    mr = gpu_serde.resolve(mr)
    mr.device.set_current()  # as for any cuda.core resource, before allocating
    buf = mr.allocate(4 * MiB)
    buf.close()
    return {
        "device": mr.device.device_id,
        "uuid": mr.device.uuid,
        "peers": [int(p) for p in mr.config.peers],
    }


def serve(inbox, outbox) -> None:
    """A long-lived receiver: runs each job, then drops what it received."""
    while (item := inbox.get(timeout=120)) is not None:
        job, arg = item
        outbox.put(job(arg))
        del item, arg
        gc.collect()


def in_child(job, holder: list, uuid: str, monkeypatch, then=None) -> tuple[dict, object]:
    """Run ``job`` on the object in ``holder`` in a spawned child that sees the GPU by UUID; the
    caller keeps no reference (the queue's is the last one). ``then()`` runs while the child is
    still alive, after it has dropped the object."""
    ctx = multiprocessing.get_context("spawn")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", uuid)  # the UUID form, not "0"
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=serve, args=(inbox, outbox))
    child.start()
    try:
        inbox.put((job, holder.pop()))
        got = outbox.get(timeout=60)
        after = then() if then else None
    finally:
        inbox.put(None)
        child.join(60)
    return got, after


@pytest.fixture
def installed(real_gpu, monkeypatch):
    gpu_serde.install()
    monkeypatch.setattr(memory, "RELEASE_GRACE_S", 0.5)
    Device(0).set_current()
    yield real_gpu
    gpu_serde.uninstall()


def wait_until(predicate, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.1)
    return predicate()


def test_pinned_host_memory_reaches_a_child_and_is_let_go(installed, monkeypatch):
    mr = PinnedMemoryResource(PinnedMemoryResourceOptions(ipc_enabled=True, max_size=GiB))
    baseline = mr.attributes.used_mem_current
    buf = mr.allocate(256 * MiB, stream=Device(0).default_stream)
    Device(0).sync()
    host_words(buf)[:] = np.arange(buf.size // 4, dtype=np.uint32)
    holder = [buf]
    del buf  # the sender drops its own reference before the receiver reads
    got, freed = in_child(
        check_pinned,
        holder,
        installed[0].uuid,
        monkeypatch,
        then=lambda: wait_until(lambda: mr.attributes.used_mem_current == baseline),
    )
    assert got["ok"] and got["size"] == 256 * MiB and got["host"] and got["pid"] != os.getpid()
    assert freed  # the receiver dropped it (and is still running): the memory is back


def test_a_pinned_pool_that_is_not_ipc_enabled_fails_at_pickling(installed):
    with pytest.raises(gpu_serde.NotIPCEnabledError, match=r"PinnedMemoryResourceOptions\(ipc"):
        pickle.dumps(PinnedMemoryResource(PinnedMemoryResourceOptions(max_size=64 * MiB)))


def test_a_vmm_gib_reaches_a_child_and_is_let_go(installed, monkeypatch):
    import cupy as cp

    mr = VirtualMemoryResource(Device(0), VirtualMemoryResourceOptions())
    buf = mr.allocate(GiB)
    words = cp.from_dlpack(buf).view(cp.uint32)
    words[:] = cp.arange(words.size, dtype=cp.uint32)
    cp.cuda.runtime.deviceSynchronize()
    del words
    held, served = broker().held(), len(broker())
    holder = [buf]
    del buf  # the sender drops its own reference before the receiver reads
    got, released = in_child(
        check_on_gpu,
        holder,
        installed[0].uuid,
        monkeypatch,
        then=lambda: wait_until(lambda: broker().held() == held and len(broker()) == served),
    )
    assert got["ok"] and got["size"] == GiB and got["pid"] != os.getpid()
    assert released  # the receiver dropped it (still running): hold and descriptor let go


def test_a_vmm_resource_lands_on_the_receivers_ordinal_with_its_peers(installed, monkeypatch):
    mr = VirtualMemoryResource(Device(0), VirtualMemoryResourceOptions(peers=(d for d in [0])))
    assert b"gpu_serde.wire" in pickle.dumps(mr)  # by UUID (one GPU: the ordinals agree anyway)
    got, _ = in_child(describe_resource, [mr], installed[0].uuid, monkeypatch)
    assert got == {"device": 0, "uuid": Device(0).uuid, "peers": [0]}


def test_a_host_memory_vmm_buffer_fails_at_pickling_with_the_reason(installed):
    mr = VirtualMemoryResource(Device(0), VirtualMemoryResourceOptions(handle_type=None))
    buf = mr.allocate(2 * MiB)
    with pytest.raises(gpu_serde.NotIPCEnabledError, match="this resource has handle_type=None"):
        pickle.dumps(buf)
    buf.close()


def test_a_dask_worker_receives_pinned_and_vmm_buffers(installed):
    from distributed import Client, LocalCluster

    import gpu_serde.dask

    pinned = PinnedMemoryResource(PinnedMemoryResourceOptions(ipc_enabled=True, max_size=GiB))
    pbuf = pinned.allocate(64 * MiB, stream=Device(0).default_stream)
    Device(0).sync()
    host_words(pbuf)[:] = np.arange(pbuf.size // 4, dtype=np.uint32)
    vbuf = VirtualMemoryResource(Device(0)).allocate(64 * MiB)
    import cupy as cp

    cp.from_dlpack(vbuf).view(cp.uint32)[:] = cp.arange(vbuf.size // 4, dtype=cp.uint32)
    cp.cuda.runtime.deviceSynchronize()
    env = {"CUDA_VISIBLE_DEVICES": installed[0].uuid}
    with (
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            host="127.0.0.1",
            dashboard_address=":0",
            env=env,
        ) as cluster,
        Client(cluster) as client,
    ):
        gpu_serde.dask.register(client)
        got_p = client.submit(check_pinned, pbuf, pure=False).result(timeout=120)
        got_v = client.submit(check_on_gpu, vbuf, pure=False).result(timeout=120)
    assert got_p["ok"] and got_p["size"] == 64 * MiB and got_p["pid"] != os.getpid()
    assert got_v["ok"] and got_v["size"] == 64 * MiB and got_v["pid"] != os.getpid()


def test_pinned_and_vmm_buffers_that_come_back_are_the_exporters_own(installed):
    pinned = PinnedMemoryResource(PinnedMemoryResourceOptions(ipc_enabled=True, max_size=GiB))
    pbuf = pinned.allocate(MiB, stream=Device(0).default_stream)
    vbuf = VirtualMemoryResource(Device(0)).allocate(2 * MiB)
    assert pickle.loads(pickle.dumps(pbuf)) is pbuf
    assert pickle.loads(pickle.dumps(vbuf)) is vbuf
    assert pickle.loads(pickle.dumps(pinned)) is pinned
