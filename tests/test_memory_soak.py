"""Soak: many buffer hand-offs through multiprocessing, Ray and Dask leave nothing behind.

Each hand-off allocates a small buffer from an IPC pool, writes its number into it, sends it, and
the receiver reads the number back with ``cuMemcpyDtoH`` and drops the buffer; the sender drops
its own first. After a warm-up, the resident memory and the open descriptors of the sender and the
receiver stay flat, and at the end the sender's broker holds nothing and the pool is empty.

``GPU_SERDE_SOAK_HANDOFFS`` sets how many hand-offs each engine makes (default: 10,000 through
multiprocessing and Ray, 2,000 through Dask: see DEFAULTS); each test prints its time per 1,000.
Runs on simulated GPUs (CPU tier) and on the real GPU (``-m gpu``).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import time

import pytest
from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions
from memtier import dask_on, held, ray_on, short_release_grace, wait_until

import gpu_serde

pytestmark = pytest.mark.slow  # the fast loop (scripts/test-fast) leaves these out

#: Hand-offs per engine. Dask makes 2,000: its LocalCluster scheduler runs in the sender's process
#: and grows by itself about 2 KB per task, plain ints too (8 MiB over 4,000 int tasks, distributed
#: 2026.8, measured 2026-12-03), so 10,000 Dask hand-offs would measure Dask's bookkeeping against
#: RSS_SLACK, not gpu_serde. GPU_SERDE_SOAK_HANDOFFS sets a count for every engine.
DEFAULTS = {"multiprocessing": 10_000, "ray": 10_000, "dask": 2_000}


def handoffs(engine: str) -> int:
    return int(os.environ.get("GPU_SERDE_SOAK_HANDOFFS", DEFAULTS[engine]))


SIZE = 64 << 10
RSS_SLACK = 24 << 20  # bytes a process may grow after the warm-up (allocator noise, not a leak)
FD_SLACK = (
    8  # descriptors an engine may open after the warm-up (its sockets), far below one per 100
)


def footprint(pid: int) -> tuple[int, int]:
    """(resident bytes, open descriptors) of a process on this host."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def read_number(buf) -> tuple[int, int]:
    """Runs in the receiver: the number in the buffer's first word, and the receiver's pid."""
    from cuda.bindings import driver

    buf = gpu_serde.resolve(buf)
    Device(buf.device_id).set_current()
    word = bytearray(4)  # not a 1-element array: cuda-bindings 13.4 reads that as a scalar pointer
    (err,) = driver.cuMemcpyDtoH(word, int(buf.handle), 4)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpyDtoH: {err!r}")
    return int.from_bytes(word, "little"), os.getpid()


def serve_numbers(inbox, outbox) -> None:
    while (buf := inbox.get(timeout=120)) is not None:
        outbox.put(read_number(buf))
        del buf


def used(mr) -> int:
    """Bytes allocated from a pool or an ArenaMemoryResource."""
    if isinstance(mr, gpu_serde.ArenaMemoryResource):
        return mr.size - mr.free_bytes
    return int(mr.attributes.used_mem_current)


class Soak:
    """Counts hand-offs, samples both sides after the warm-up and at the end, and times them."""

    def __init__(self, pool, engine: str) -> None:
        self.pool = pool
        self.count = handoffs(engine)
        self.stream = Device(pool.device_id).default_stream
        self.marks: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {}
        self.receiver = 0

    def buffer(self, i: int):
        from cuda.bindings import driver

        buf = self.allocate()
        (err,) = driver.cuMemsetD32Async(int(buf.handle), i, SIZE // 4, int(self.stream.handle))
        assert err == driver.CUresult.CUDA_SUCCESS
        self.stream.sync()
        return buf

    def allocate(self):
        """A new buffer. Sent memory comes back only once its receiver let go of it (an
        arena's block after a grace too): a sender that outruns that (an H100 through
        multiprocessing: 1,024 arena blocks in under 0.5 s; a 2-CPU VM once, from a pool)
        waits for room, as a real sender must: an arena raises ArenaFullError, a pool at its
        max_size CUDA_ERROR_OUT_OF_MEMORY. A leak still fails: nothing comes back within the
        deadline, and the end checks that nothing is left."""
        deadline = time.monotonic() + 30
        while True:
            try:
                return self.pool.allocate(SIZE, stream=self.stream)
            except Exception as exc:
                full = isinstance(exc, gpu_serde.ArenaFullError) or "OUT_OF_MEMORY" in str(exc)
                if not full or time.monotonic() > deadline:
                    raise
                time.sleep(0.001)

    def mark(self, name: str) -> None:
        self.marks[name] = (footprint(os.getpid()), footprint(self.receiver))

    def run(self, send) -> float:
        """Call ``send(buffer)`` -> (number, receiver pid) for each hand-off; seconds per 1,000."""
        started, holds, warmup = 0.0, held(), max(self.count // 10, 1)
        for i in range(self.count):
            if i == warmup:
                self.mark("warm")
                started = time.monotonic()
            number, self.receiver = send(self.buffer(i))
            assert number == i
        per_1000 = (time.monotonic() - started) / max(self.count - warmup, 1) * 1000
        # every hold this soak made is let go (holds left by earlier tests may go meanwhile)
        assert wait_until(lambda: held() <= holds, 30)
        gc.collect()
        assert wait_until(lambda: used(self.pool) == 0, 30), used(self.pool)
        self.mark("end")
        print(f"\n{self.count} hand-offs: {per_1000:.2f} s per 1,000 after the warm-up")
        return per_1000

    def growth(self) -> dict[str, tuple[int, int]]:
        """(RSS growth, descriptor growth) of each side from the warm-up to the end."""
        (sw, rw), (se, re) = self.marks["warm"], self.marks["end"]
        return {
            "sender": (se[0] - sw[0], se[1] - sw[1]),
            "receiver": (re[0] - rw[0], re[1] - rw[1]),
        }


def assert_flat(soak: Soak) -> None:
    print(f"growth after the warm-up (RSS bytes, descriptors): {soak.growth()}")
    for side, (rss, fds) in soak.growth().items():
        assert rss <= RSS_SLACK, f"{side} RSS grew {rss >> 20} MiB"
        assert fds <= FD_SLACK, f"{side} opened {fds} more descriptors"


@pytest.fixture
def pool(tier, monkeypatch):
    gpu_serde.install()
    short_release_grace(monkeypatch)
    d = Device(tier.ordinal)
    d.set_current()
    mr = DeviceMemoryResource(d, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=64 << 20))
    yield mr
    mr.close()
    gpu_serde.uninstall()


@pytest.fixture
def arena(tier, monkeypatch):
    gpu_serde.install()
    short_release_grace(monkeypatch)
    d = Device(tier.ordinal)
    d.set_current()
    yield gpu_serde.ArenaMemoryResource(d, 64 << 20)
    gpu_serde.uninstall()


@pytest.mark.parametrize("kind", ["pool", "arena"])
def test_multiprocessing_handoffs_leave_nothing_behind(kind, request, tier, monkeypatch):
    soak = Soak(request.getfixturevalue(kind), "multiprocessing")  # CUDA starts here first
    ctx = multiprocessing.get_context("spawn")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", tier.uuid)
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=serve_numbers, args=(inbox, outbox))
    child.start()

    def send(buf):
        inbox.put(buf)
        del buf
        return outbox.get(timeout=60)

    try:
        soak.run(send)
    finally:
        inbox.put(None)
        child.join(60)
    assert_flat(soak)


def test_ray_handoffs_leave_nothing_behind(pool, tier):
    with ray_on(tier, __name__, num_cpus=2) as ray:

        @ray.remote(num_gpus=1)
        class Receiver:
            def read(self, buf):
                return read_number(buf)

        receiver = Receiver.remote()
        soak = Soak(pool, "ray")
        soak.run(lambda buf: ray.get(receiver.read.remote(buf), timeout=60))
        assert_flat(soak)


def test_dask_handoffs_leave_nothing_behind(pool, tier):
    with dask_on(tier) as client:  # the scheduler's log of messages is off: it would keep buffers
        soak = Soak(pool, "dask")
        soak.run(lambda buf: client.submit(read_number, buf, pure=False).result(timeout=60))
        assert_flat(soak)
