"""ArenaMemoryResource: its buffers cross processes as offsets in one region that each receiver
maps once; on simulated GPUs (CPU tier, 4 MiB buffers) and on the real GPU (``pytest -m gpu``,
1 GiB buffers).

Each receiver has another CUDA_VISIBLE_DEVICES (the GPU's UUID) and reads every word of the
pattern back with ``cuMemcpyDtoH``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import time

import pytest
from cuda.core import Device
from memtier import (
    KEPT,
    check,
    child,
    dask_on,
    drop,
    fill,
    keep,
    killed_exporter_payload,
    ray_on,
    regions_mapped,
    short_release_grace,
    wait_until,
)

import gpu_serde
from gpu_serde import ArenaFullError, ArenaMemoryResource


def check_all(bufs) -> dict:
    """Job: check each buffer; how many regions this process has mapped."""
    got = [check(b) for b in bufs]
    return {"ok": [g["ok"] for g in got], "maps": regions_mapped()}


def describe_arena(mr) -> dict:
    """Job: what a received ArenaMemoryResource is here."""
    mr = gpu_serde.resolve(mr)
    try:
        mr.allocate(1 << 20)
        refuses = False
    except TypeError:
        refuses = True
    return {
        "type": type(mr).__name__,
        "device": mr.device_id,
        "size": mr.size,
        "refuses to allocate": refuses,
        "again": pickle.loads(pickle.dumps(mr)) is mr,  # one per region and process
    }


def send_back(buf) -> bytes:
    """Job: pickle a received buffer to send it on."""
    return pickle.dumps(gpu_serde.resolve(buf))


@pytest.fixture
def gpu(tier, monkeypatch):
    # this process's view of its GPUs (with its CUDA_VISIBLE_DEVICES) is taken once: take it
    # before a test sets a child's CUDA_VISIBLE_DEVICES in the environment
    gpu_serde.visible_devices()
    gpu_serde.install()
    short_release_grace(monkeypatch)  # these tests wait for blocks to be let go
    dev = Device(tier.ordinal)
    dev.set_current()
    yield dev
    gpu_serde.uninstall()


def test_an_arena_buffer_reaches_a_child_with_other_cuda_visible_devices(gpu, tier, monkeypatch):
    arena = ArenaMemoryResource(gpu, tier.size)
    buf = arena.allocate(tier.size)
    fill(buf)
    with child(monkeypatch, tier.uuid) as c:
        got = c.run(check, buf)
    assert got["ok"] and got["size"] == tier.size and got["pid"] != os.getpid()
    assert got["device"] == 0  # the child's ordinal of the same GPU


def test_a_child_maps_the_region_once_for_all_its_buffers(gpu, tier, monkeypatch):
    arena = ArenaMemoryResource(gpu, tier.size)
    bufs = [arena.allocate(tier.size // 4) for _ in range(4)]
    for buf in bufs:
        fill(buf)
    with child(monkeypatch, tier.uuid) as c:
        first = c.run(check_all, bufs[:3])
        later = c.run(check_all, bufs[3:])
    assert first == {"ok": [True] * 3, "maps": 1}
    assert later == {"ok": [True], "maps": 1}  # a later buffer maps nothing


def test_a_buffer_allocated_on_a_stream_of_its_own_reaches_a_child(gpu, tier, monkeypatch):
    arena = ArenaMemoryResource(gpu, tier.size)
    stream = gpu.create_stream()
    buf = arena.allocate(tier.size // 2, stream=stream)  # its hand-offs are ordered on it
    fill(buf)
    with child(monkeypatch, tier.uuid) as c:
        got = c.run(check, buf)
    assert got["ok"] and got["size"] == tier.size // 2


@pytest.mark.parametrize(
    ("device", "size", "says"),
    [
        ("GPU-x", 1 << 20, "a cuda.core Device or this process's ordinal, not str"),
        (True, 1 << 20, "not bool"),
        (0, 1.5, "size=...\\): an int, not float"),
    ],
)
def test_a_wrong_argument_says_what_it_takes(installed, device, size, says):
    with pytest.raises(TypeError, match=says):
        ArenaMemoryResource(device, size)


@pytest.mark.parametrize(
    ("size", "says"),
    [(-1, "must be positive"), (2**62, "larger than any"), (2**70, "larger than any")],
)
def test_a_size_no_gpu_could_have_is_a_value_error(installed, size, says):
    with pytest.raises(ValueError, match=says):
        ArenaMemoryResource(0, size)


def test_a_full_arena_raises_arena_full_error_that_says_how_big_to_make_it(gpu, tier):
    arena = ArenaMemoryResource(gpu, tier.size)
    kept = arena.allocate(tier.size // 2)
    with pytest.raises(ArenaFullError) as info:
        arena.allocate(tier.size)
    e = info.value
    assert isinstance(e, MemoryError) and isinstance(e, gpu_serde.HandoffError)
    assert (e.requested, e.free, e.largest, e.size) == (
        tier.size,
        arena.size - tier.size // 2,
        arena.size - tier.size // 2,
        arena.size,
    )
    assert e.uuid == tier.uuid and e.suggested >= arena.size + tier.size
    assert f"ArenaMemoryResource(device, size={e.suggested})" in str(e)
    assert tier.uuid in str(e) and f"{tier.size:,} bytes" in str(e)
    kept.close()


@pytest.mark.xfail(
    sys.version_info < (3, 12),
    strict=False,
    reason="cuda.core 1.2.0 to 1.2.2 on Python 3.10 and 3.11: Buffers of a Python MemoryResource dropped "
    "while an exception propagates (a list comprehension that fails part-way) lose the exception "
    "(SystemError: error return without exception set), and all but the first are never "
    "deallocated. Python 3.12 passes",
)
def test_a_full_arena_in_a_comprehension_raises_arena_full_error_and_keeps_no_block(gpu, tier):
    arena = ArenaMemoryResource(gpu, tier.size)
    n = 3 * tier.size // 2  # the region holds two of them
    with pytest.raises(ArenaFullError):
        [arena.allocate(n // 3) for _ in range(4)]  # the third one fails

    def whole_region_free() -> bool:
        try:
            arena.allocate(tier.size).close()
        except ArenaFullError:
            return False
        return True

    assert wait_until(whole_region_free)


@pytest.mark.parametrize("size", [1 << 50, 10 << 40])
def test_an_arena_larger_than_the_gpu_says_what_the_gpu_has(gpu, tier, size):
    with pytest.raises(gpu_serde.HandoffError) as info:
        ArenaMemoryResource(gpu, size)
    says = str(info.value)
    assert "CUDA_ERROR_OUT_OF_MEMORY" in says and "the GPU has" in says and "free of" in says


def test_a_buffer_larger_than_the_gpu_says_so_and_suggests_no_size(gpu, tier):
    arena = ArenaMemoryResource(gpu, 4 << 20)
    with pytest.raises(ArenaFullError) as info:
        arena.allocate(1 << 60)
    assert "more than the GPU's whole memory" in str(info.value)
    assert info.value.suggested == 0 and info.value.requested == 1 << 60


def test_allocate_checks_its_stream_before_it_looks_for_room(gpu, tier):
    arena = ArenaMemoryResource(gpu, 2 << 20)
    kept = arena.allocate(2 << 20)  # full
    with pytest.raises(TypeError, match=r"a cuda\.core Stream or None, not str"):
        arena.allocate(1024, stream="x")
    kept.close()


def test_allocate_refuses_a_stream_of_another_device(installed):
    Device(0).set_current()
    other = Device(0).create_stream()
    Device(1).set_current()
    arena = ArenaMemoryResource(Device(1), 2 << 20)
    with pytest.raises(ValueError, match=r"a stream of device 0, but this arena's memory is on"):
        arena.allocate(1024, stream=other)
    assert arena.free_bytes == arena.size  # nothing taken
    arena.allocate(1024, stream=Device(1).create_stream()).close()


def test_a_full_arena_says_when_its_blocks_wait_for_payloads_no_process_has_received(gpu, tier):
    arena = ArenaMemoryResource(gpu, 4 << 20)
    for _ in range(4):
        buf = arena.allocate(1 << 20)
        pickle.dumps(buf)  # sent, and never received (a Ray reference dropped unread)
        buf.close()
    with pytest.raises(ArenaFullError) as info:
        arena.allocate(1 << 20)
    assert info.value.held == 4 << 20
    message = str(info.value)
    assert "4.0 MiB (4,194,304 bytes) of it are buffers sent (or sent again)" in message
    assert "Receive what you send" in message
    assert "GPU_SERDE_RELEASE_GRACE_S" not in message  # no grace brings these back


def test_deallocate_refuses_a_pointer_it_did_not_hand_out_or_freed_already(gpu, tier):
    arena = ArenaMemoryResource(gpu, tier.size)
    buf = arena.allocate(tier.size // 2)
    where = int(buf.handle)
    for wrong in (12345, where + 4096, where + arena.size):
        with pytest.raises(ValueError, match="not a block this arena handed out"):
            arena.deallocate(wrong, 16)
    buf.close()
    with pytest.raises(ValueError, match="freed already"):
        arena.deallocate(where, tier.size // 2)  # a second free of what close freed
    assert wait_until(lambda: arena.free_bytes == arena.size)  # counted once
    a, b = arena.allocate(tier.size // 2), arena.allocate(tier.size // 2)  # still whole
    assert int(a.handle) != int(b.handle)
    a.close()
    b.close()


def whole_again(arena):
    """The whole arena as one buffer, once its block comes back (polled; fails after
    ``wait_until``'s timeout)."""
    again: list = []

    def reused() -> bool:
        with contextlib.suppress(ArenaFullError):
            again.append(arena.allocate(arena.size))
        return bool(again)

    assert wait_until(reused), "the block never came back"
    return again[0]


def test_a_block_an_importer_holds_is_reused_only_after_it_closed_it(gpu, tier, monkeypatch):
    arena = ArenaMemoryResource(gpu, tier.size)
    buf = arena.allocate(arena.size)
    fill(buf)
    where = int(buf.handle)
    with child(monkeypatch, tier.uuid) as c:
        assert c.run(keep, buf)["ok"]
        buf.close()  # the sender is done with it; the child is not
        assert (arena.free_bytes, arena.held_bytes) == (0, arena.size)  # what the child holds
        with pytest.raises(ArenaFullError) as info:
            arena.allocate(arena.size)  # the block is not handed out while the child holds it
        assert info.value.held == arena.size
        assert "GPU_SERDE_RELEASE_GRACE_S" in str(info.value)  # why it may outlast the close
        assert "send one buffer again" in str(info.value)  # and what a sending loop can do
        assert c.run(drop, None)  # the child closes it (and lives on)
        again = whole_again(arena)
    assert int(again.handle) == where
    assert arena.held_bytes == 0  # let go: allocated again, and held for no one


def test_an_arena_reaches_a_child_as_an_imported_arena_that_cannot_allocate(gpu, tier, monkeypatch):
    arena = ArenaMemoryResource(gpu, tier.size)
    with child(monkeypatch, tier.uuid) as c:
        got = c.run(describe_arena, arena)
    assert got == {
        "type": "ImportedArena",
        "device": 0,
        "size": arena.size,
        "refuses to allocate": True,
        "again": True,
    }


def test_a_received_buffer_sent_back_is_the_exporters_own(gpu, tier, monkeypatch):
    arena = ArenaMemoryResource(gpu, tier.size)
    buf = arena.allocate(tier.size // 2)
    with child(monkeypatch, tier.uuid) as c:
        back = c.run(send_back, buf)
    assert pickle.loads(back) is buf  # it travelled on as it came


def test_an_arena_and_its_buffers_come_back_to_their_exporter_as_its_own(gpu, tier):
    arena = ArenaMemoryResource(gpu, tier.size)
    buf = arena.allocate(tier.size // 2)
    assert pickle.loads(pickle.dumps(buf)) is buf
    assert pickle.loads(pickle.dumps(arena)) is arena


DROP_AN_ARENA_NEVER_SENT = """
import gc, time, gpu_serde
from cuda.core import Device
from gpu_serde.memory.broker import server
d = Device(0)
d.set_current()
arena = gpu_serde.ArenaMemoryResource(d, 1 << 22)
arena.allocate(4096).close()
del arena
gc.collect()
time.sleep(0.5)  # the closer frees the region
print(server._broker is None, flush=True)
"""


def test_an_arena_never_sent_is_freed_without_starting_a_broker(gpu, tier):
    """Dropping an arena that never left its process opens no socket and starts no thread
    beyond the arena's own closer."""
    import subprocess
    import sys

    env = dict(os.environ, CUDA_VISIBLE_DEVICES=tier.uuid)
    done = subprocess.run(
        [sys.executable, "-c", DROP_AN_ARENA_NEVER_SENT],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.stdout.strip() == "True", done.stderr[-2000:]


def test_memory_from_another_host_is_the_typed_error(gpu, tier, monkeypatch):
    arena = ArenaMemoryResource(gpu, tier.size)
    buf = arena.allocate(tier.size // 2)
    with child(monkeypatch, tier.uuid, GPU_SERDE_HOST_ID="another-host") as c:
        got = c.run(check, buf)
    assert got["error"] == "OtherHostError" and "another host" in got["message"]


def test_a_killed_exporter_gives_exporter_gone_error_that_says_what_to_do(gpu, tier):
    got = pickle.loads(killed_exporter_payload(tier, "arena"))  # never raises: the error waits
    with pytest.raises(gpu_serde.ExporterGoneError) as info:
        gpu_serde.resolve(got)
    assert "killed" in str(info.value) and "keep the sender alive" in str(info.value).lower()


@pytest.fixture(scope="module")
def ray_session(tier):
    with ray_on(tier, __name__, num_cpus=2) as ray:
        yield ray


def test_a_ray_actor_receives_arena_buffers_and_maps_the_region_once(ray_session, gpu, tier):
    ray = ray_session

    @ray.remote(num_gpus=0.5)
    class Consumer:
        def check(self, bufs):
            return check_all(bufs)

    arena = ArenaMemoryResource(gpu, tier.size)
    bufs = [arena.allocate(tier.size // 2) for _ in range(2)]
    for buf in bufs:
        fill(buf)
    consumer = Consumer.remote()
    got = [ray.get(consumer.check.remote([b]), timeout=300) for b in bufs]
    ray.kill(consumer)
    assert got == [{"ok": [True], "maps": 1}, {"ok": [True], "maps": 1}]


def test_a_dask_worker_receives_an_arena_buffer(gpu, tier):
    arena = ArenaMemoryResource(gpu, tier.size)
    buf = arena.allocate(tier.size)
    fill(buf)
    with dask_on(tier) as client:
        got = client.submit(check, buf, pure=False).result(timeout=300)
    assert got["ok"] and got["size"] == tier.size and got["pid"] != os.getpid()
    assert got["device"] == 0


# ---- the real GPU only: the receiver's work sees the sender's queued work -------------------

SPIN = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(100000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""


def spin(dev, stream, ns: int) -> None:
    """Queue a kernel on ``stream`` that keeps the GPU busy for ``ns`` nanoseconds (CuPy)."""
    import cupy
    import numpy as np

    cupy.cuda.Device(dev.device_id).use()
    with cupy.cuda.ExternalStream(int(stream.handle), dev.device_id):
        cupy.RawKernel(SPIN, "spin")((1,), (1,), (np.uint64(ns),))


def read_on_own_stream(buf) -> dict:
    """Job: copy the buffer to the host on a stream of this process's own; what it read."""
    import numpy as np
    from cuda.bindings import driver

    buf = gpu_serde.resolve(buf)
    dev = Device(buf.device_id)
    dev.set_current()
    stream = dev.create_stream()
    host = np.empty(buf.size // 4, dtype=np.uint32)
    (err,) = driver.cuMemcpyDtoHAsync(host, int(buf.handle), buf.size, int(stream.handle))
    assert err == driver.CUresult.CUDA_SUCCESS, err
    stream.sync()
    return {"first": int(host[0]), "every word the same": bool((host == host[0]).all())}


@pytest.fixture
def real_installed(real_gpu):
    gpu_serde.visible_devices()  # as in `gpu`
    gpu_serde.install()
    yield real_gpu
    gpu_serde.uninstall()


@pytest.mark.gpu
def test_the_receiver_sees_what_the_sender_queued_on_its_stream_before_sending(
    real_installed, monkeypatch
):
    from cuda.bindings import driver

    real_gpu = real_installed
    gib = 1 << 30
    dev = Device(len(real_gpu) - 1)
    dev.set_current()
    arena = ArenaMemoryResource(dev, gib)
    stream = dev.create_stream()
    buf = arena.allocate(gib, stream=stream)
    (err,) = driver.cuMemsetD32Async(int(buf.handle), 1, gib // 4, int(stream.handle))
    stream.sync()  # what the memory held before
    with child(monkeypatch, real_gpu[-1].uuid) as c:
        c.run(check_all, [])  # the child is up and has started CUDA
        spin(dev, stream, 2_000_000_000)  # 2 s
        (err,) = driver.cuMemsetD32Async(int(buf.handle), 0xABCD, gib // 4, int(stream.handle))
        assert err == driver.CUresult.CUDA_SUCCESS
        # the test means something only if the write is still queued when the buffer is sent
        assert driver.cuStreamQuery(stream.handle)[0] == driver.CUresult.CUDA_ERROR_NOT_READY
        got = c.run(read_on_own_stream, buf)  # no synchronisation before sending
    assert got == {"first": 0xABCD, "every word the same": True}


@pytest.mark.gpu
def test_a_block_freed_on_a_busy_stream_is_handed_out_only_after_that_streams_work(real_gpu):
    import numpy as np
    from cuda.bindings import driver

    gib = 1 << 30
    dev = Device(len(real_gpu) - 1)
    dev.set_current()
    arena = ArenaMemoryResource(dev, gib)
    busy, other = dev.create_stream(), dev.create_stream()
    a = arena.allocate(gib, stream=busy)
    where = int(a.handle)
    spin(dev, busy, 2_000_000_000)  # 2 s, then a write that is still queued when `a` is freed
    (err,) = driver.cuMemsetD32Async(where, 1, gib // 4, int(busy.handle))
    assert err == driver.CUresult.CUDA_SUCCESS
    a.close()  # freed on `busy`, behind its work
    b = arena.allocate(gib, stream=other)  # the same block: only once `busy` is done
    assert int(b.handle) == where
    (err,) = driver.cuMemsetD32Async(where, 2, gib // 4, int(other.handle))
    other.sync()
    busy.sync()
    host = np.empty(gib // 4, dtype=np.uint32)
    assert driver.cuMemcpyDtoH(host, where, gib)[0] == driver.CUresult.CUDA_SUCCESS
    assert (host == 2).all()  # the old stream's write did not land on the new buffer


def close_behind_work(buf) -> dict:
    """Job: queue 2 s of work, then a write of 1s to the buffer, on a stream of this process's
    own, and close the buffer on that stream while the write is still queued."""
    from cuda.bindings import driver

    buf = gpu_serde.resolve(buf)
    dev = Device(buf.device_id)
    dev.set_current()
    busy = dev.create_stream()
    spin(dev, busy, 2_000_000_000)
    (err,) = driver.cuMemsetD32Async(int(buf.handle), 1, buf.size // 4, int(busy.handle))
    assert err == driver.CUresult.CUDA_SUCCESS
    queued = driver.cuStreamQuery(busy.handle)[0] == driver.CUresult.CUDA_ERROR_NOT_READY
    buf.close(busy)
    return {"queued at the close": queued}


@pytest.mark.gpu
def test_a_received_buffer_closed_on_a_busy_stream_comes_back_only_after_that_streams_work(
    real_installed, monkeypatch
):
    import numpy as np
    from cuda.bindings import driver

    real_gpu = real_installed
    short_release_grace(monkeypatch, 0.0)
    gib = 1 << 30
    dev = Device(len(real_gpu) - 1)
    dev.set_current()
    arena = ArenaMemoryResource(dev, gib)
    buf = arena.allocate(gib)
    where = int(buf.handle)
    with child(monkeypatch, real_gpu[-1].uuid) as c:
        got = c.run(close_behind_work, buf)
        closed = time.monotonic()
        buf.close()
        assert got == {"queued at the close": True}  # else the test means nothing
        other = dev.create_stream()
        while True:  # the same block: it comes back once the child's stream is done
            try:
                b = arena.allocate(gib, stream=other)
                break
            except ArenaFullError:
                assert time.monotonic() - closed < 20, "the block never came back"
                time.sleep(0.01)
        assert int(b.handle) == where
        (err,) = driver.cuMemsetD32Async(where, 2, gib // 4, int(other.handle))
        assert err == driver.CUresult.CUDA_SUCCESS
        other.sync()
        time.sleep(max(0.0, closed + 3.0 - time.monotonic()))  # the child's write has landed
        host = np.empty(gib // 4, dtype=np.uint32)
        assert driver.cuMemcpyDtoH(host, where, gib)[0] == driver.CUresult.CUDA_SUCCESS
        assert (host == 2).all()  # it landed before the block came back, not on the new buffer
        b.close()


WORK_MS = 800  # the simulated work a memset stands for in the next test's child


def close_behind_simulated_work(buf) -> dict:
    """Job: queue a memset on a stream of this process's own (GPU_SERDE_SIM_WORK_MS makes it
    simulated work in flight) and close the buffer on that stream while it is."""
    from cuda.bindings import driver

    buf = gpu_serde.resolve(buf)
    dev = Device(buf.device_id)
    dev.set_current()
    busy = dev.create_stream()
    began = time.monotonic()
    (err,) = driver.cuMemsetD32Async(int(buf.handle), 1, buf.size // 4, int(busy.handle))
    assert err == driver.CUresult.CUDA_SUCCESS, err
    queued = driver.cuStreamQuery(busy.handle)[0] == driver.CUresult.CUDA_ERROR_NOT_READY
    buf.close(busy)
    return {"queued at the close": queued, "began": began}


def back_after_simulated_work(installed, monkeypatch, job, pieces: int, pickled: bool) -> dict:
    """Run ``job`` in a child (its simulated work lasting WORK_MS) on an arena of this process
    cut into ``pieces`` buffers (the buffer itself for one, else their pickles); close them here
    and wait until the whole arena is back: the job's answer, with when that was (``back``)."""
    short_release_grace(monkeypatch, 0.0)
    gpus = installed
    dev = Device(len(gpus) - 1)
    dev.set_current()
    arena = ArenaMemoryResource(dev, 4 << 20)
    bufs = [arena.allocate(arena.size // pieces) for _ in range(pieces)]
    arg = [pickle.dumps(b) for b in bufs] if pickled else bufs[0]
    with child(monkeypatch, gpus[-1].uuid, GPU_SERDE_SIM_WORK_MS=str(WORK_MS)) as c:
        got = c.run(job, arg)
        for buf in bufs:
            buf.close()
        again = whole_again(arena)  # every block back: the whole arena in one piece
        got["back"] = time.monotonic()  # one clock for both processes (CLOCK_MONOTONIC)
    again.close()
    return got


def test_a_buffer_closed_behind_simulated_work_comes_back_only_once_that_work_is_done(
    installed, monkeypatch
):
    # the CPU tier's walk of the busy-stream close: the close records an event and the release
    # waits for it (the real GPU tier checks the bytes with a kernel instead)
    got = back_after_simulated_work(installed, monkeypatch, close_behind_simulated_work, 1, False)
    assert got["queued at the close"]  # else the test means nothing
    assert got["back"] >= got["began"] + WORK_MS / 1e3  # not before the child's stream was done


def drop_one_then_one_behind_simulated_work(blobs) -> dict:
    """Job: receive two buffers (this process holds the only references), let the first be
    collected, then queue simulated work (GPU_SERDE_SIM_WORK_MS) over the second on a stream of
    this process's own and let it be collected while that work is in flight: collected, neither
    is closed, so nobody says which stream used it last."""
    import gc

    from cuda.bindings import driver

    first, second = (pickle.loads(b) for b in blobs)
    dev = Device(second.device_id)
    dev.set_current()
    busy = KEPT["stream"] = dev.create_stream()  # kept: its work stays queued
    del first
    gc.collect()  # its release is queued: the whole device is idle now
    began = time.monotonic()
    (err,) = driver.cuMemsetD32Async(int(second.handle), 1, second.size // 4, int(busy.handle))
    assert err == driver.CUresult.CUDA_SUCCESS, err
    queued = driver.cuStreamQuery(busy.handle)[0] == driver.CUresult.CUDA_ERROR_NOT_READY
    del second
    gc.collect()
    return {"queued at the drop": queued, "began": began}


def test_a_collected_buffer_comes_back_only_once_work_queued_on_any_stream_is_done(
    installed, monkeypatch
):
    # the CPU tier's walk of a collected (not closed) buffer's release: it waits for the whole
    # device, so work queued over it on a stream of the receiver's own is done first, even right
    # after another buffer's release found the device idle
    job = drop_one_then_one_behind_simulated_work
    got = back_after_simulated_work(installed, monkeypatch, job, 2, True)
    assert got["queued at the drop"]  # else the test means nothing
    assert got["back"] >= got["began"] + WORK_MS / 1e3  # not before the child's stream was done


def send_behind_simulated_work(_) -> dict:
    """Job: a sender whose buffer has simulated work queued on its stream (GPU_SERDE_SIM_WORK_MS),
    sent back while that work is in flight; the arena and the buffer stay here until ``drop``."""
    from cuda.bindings import driver

    dev = Device(0)
    dev.set_current()
    stream = dev.create_stream()
    arena = KEPT["arena"] = ArenaMemoryResource(dev, 4 << 20)
    buf = KEPT["buf"] = arena.allocate(arena.size, stream=stream)
    began = time.monotonic()
    (err,) = driver.cuMemsetD32Async(int(buf.handle), 3, buf.size // 4, int(stream.handle))
    assert err == driver.CUresult.CUDA_SUCCESS, err
    queued = driver.cuStreamQuery(stream.handle)[0] == driver.CUresult.CUDA_ERROR_NOT_READY
    return {"queued at the send": queued, "began": began, "buf": buf}


def test_a_receiver_has_the_buffer_only_once_the_senders_simulated_work_is_done(
    installed, monkeypatch
):
    # the CPU tier's walk of the receiver's wait for its sender's event: an event opened from
    # another process is busy while the sender's is (the real GPU tier checks bytes instead)
    gpus = installed
    with child(monkeypatch, gpus[-1].uuid, GPU_SERDE_SIM_WORK_MS=str(WORK_MS)) as c:
        got = c.run(send_behind_simulated_work, None)  # unpickled here: the hand-off
        received = time.monotonic()  # one clock for both processes (CLOCK_MONOTONIC)
        assert got["queued at the send"]  # else the test means nothing
        assert received >= got["began"] + WORK_MS / 1e3  # not before the sender's stream was done
        got["buf"].close()
        assert c.run(drop, None) is True
