"""The lifetime of memory that crosses processes survives crashes and lies (gpu_serde.memory.lifetime),
on simulated GPUs (CPU tier) and on the real GPU (``pytest -m gpu``), for pool and arena memory:

- a hold belongs to the process that acquired it: when that process is killed (a child, a Dask
  worker, a Ray actor), its holds come back within the grace period plus a small bound;
- only that process can release it: a release from any other process changes nothing;
- a hold names its block: a payload that borrows another block's hold is refused;
- a region or pool is mapped at most once per exporter and descriptor in a process, whatever id a
  payload claims;
- a sender never fails: a buffer closed after ``client.submit`` still reaches its task, and one
  closed and let go before a recomputation reaches it as a typed error; no worker dies, every future
  settles.

Each test ends with the exporter's memory back (the pool empty, or the arena's every byte free), its
broker holding nothing, and its descriptors where they started.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions
from memtier import (
    check,
    check_kept,
    child,
    dask_on,
    drop,
    fill,
    held_from,
    holders,
    keep,
    open_fds,
    ray_get,
    ray_on,
    regions_mapped,
    short_release_grace,
    wait_until,
)

import gpu_serde
from gpu_serde import ArenaMemoryResource

GRACE = 0.5  # the exporters' grace period in these tests
BOUND = 10.0  # what "back within the grace period plus a small bound" waits at most


class Exporter:
    """This process as an exporter of ``kind`` memory ("pool" or "arena") on the tier's GPU."""

    def __init__(self, kind: str, tier) -> None:
        self.kind, self.tier = kind, tier
        self.dev = Device(tier.ordinal)
        self.dev.set_current()
        if kind == "pool":
            options = DeviceMemoryResourceOptions(ipc_enabled=True, max_size=8 * tier.size)
            self.mr = DeviceMemoryResource(self.dev, options)
        else:
            self.mr = ArenaMemoryResource(self.dev, 4 * tier.size)
        # the broker first (it starts on first use: its own descriptors are not the test's)
        self.served = broker_descriptors()
        self.fds = open_fds()

    def allocate(self, size: int):
        buf = self.mr.allocate(size, stream=self.dev.default_stream)
        fill(buf)
        self.dev.default_stream.sync()
        return buf

    def in_use(self) -> int:
        if self.kind == "pool":
            return int(self.mr.attributes.used_mem_current)
        return self.mr.size - self.mr.free_bytes

    def all_back(self) -> bool:
        """Every byte back in the pool or arena, and the broker holding none of its buffers."""
        return self.in_use() == 0 and held_from(self.mr) == 0

    def __repr__(self) -> str:  # what a failed assertion shows
        import gc

        from cuda.core import Buffer

        alive = [o for o in gc.get_objects() if isinstance(o, Buffer) and _of(o, self.mr)]
        referrers = [type(r).__name__ for o in alive for r in gc.get_referrers(o)]
        return (
            f"<{self.kind} exporter: {self.in_use()} bytes in use, {held_from(self.mr)} held, "
            f"holders {holders()}, {len(alive)} buffers alive, referred to by {referrers}>"
        )

    def descriptors_back(self, slack: int = 6) -> bool:
        """This process's descriptors where they started, but for a few kept connections."""
        return wait_until(lambda: open_fds() <= self.fds + slack)

    def broker_descriptors_back(self, importers: int) -> bool:
        """The descriptors this process's broker serves where they started (but for the one an
        export adds), and at most one connection per live importing process: a killed one's is
        closed (a Dask cluster's own sockets, which come and go with its workers, are not
        counted)."""
        served, conns = self.served

        def back() -> bool:
            now_served, now_conns = broker_descriptors()
            return now_served <= served + 1 and now_conns <= conns + importers

        return wait_until(back)


def broker_descriptors() -> tuple[int, int]:
    """This process's broker's descriptors: those it serves, and its live connections."""
    from gpu_serde.memory.broker import broker

    b = broker()
    with b._lock:
        return len(b._fds), len(b._conns)


def _of(buf, mr) -> bool:
    try:
        return buf.memory_resource is mr
    except Exception:
        return False


@pytest.fixture(scope="module")
def dask_client(tier):
    """Two workers that see the tier's GPU, shared by this module's Dask tests (each leaves both
    alive)."""
    gpu_serde.visible_devices()  # this process's view, before the workers' is set
    with dask_on(tier, n_workers=2) as client:
        yield client


@pytest.fixture(scope="module")
def ray_session(tier):
    gpu_serde.visible_devices()
    with ray_on(tier, __name__) as ray:
        yield ray


@pytest.fixture(params=["pool", "arena"])
def exporter(request, tier, monkeypatch):
    gpu_serde.visible_devices()  # this process's view, before a child's CUDA_VISIBLE_DEVICES is set
    gpu_serde.install()
    short_release_grace(monkeypatch, GRACE)
    yield Exporter(request.param, tier)
    gpu_serde.uninstall()


def payload_of(buf) -> tuple:
    """The wire payload a buffer travels as: ``(wire name, payload)``."""
    from gpu_serde.memory import buffers

    fn, (payload,) = buffers.reduction(buf)
    return fn, payload


def token_of(buf) -> tuple[str, bytes]:
    """The broker address and hold token a buffer was sent with: a pool buffer's payload is
    (1, pool, IPC descriptor, size, hold), an arena buffer's (1, region, offset, size, hold), and
    the pool's or region's fourth field is the broker's address."""
    _, p = payload_of(buf)
    return p[1][3], p[4]


# ---- a hold belongs to the process that acquired it ----------------------------------------------


def test_a_killed_child_gives_its_holds_back(exporter, tier, monkeypatch):
    buf = exporter.allocate(tier.size)
    with child(monkeypatch, tier.uuid) as c:
        assert c.run(keep, buf)["ok"]
        assert wait_until(lambda: holders() == {c.pid: 1})  # its note is read in the background
        del buf  # the exporter drops its own: the child's hold keeps the memory
        assert exporter.in_use() > 0
        c.process.kill()  # SIGKILL: the child never says a word
        c.process.join(30)
        started = time.monotonic()
        assert wait_until(exporter.all_back, timeout=GRACE + BOUND)
        assert time.monotonic() - started < GRACE + BOUND
    assert holders() == {}
    assert exporter.descriptors_back()


FORGE_RELEASE = """
import sys
from gpu_serde.memory.broker import release
print(release(sys.argv[1], bytes.fromhex(sys.argv[2])), flush=True)
"""


def test_a_release_from_a_process_that_never_acquired_changes_nothing(exporter, tier, monkeypatch):
    buf = exporter.allocate(tier.size)
    address, token = token_of(buf)
    with child(monkeypatch, tier.uuid) as c:
        assert c.run(keep, buf)["ok"]
        forged = subprocess.run(  # a process that saw the payload, as a Dask scheduler does
            [sys.executable, "-c", FORGE_RELEASE, address, token.hex()],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert forged.stdout.strip() == "False"
        from gpu_serde.memory.broker import release

        assert not release(address, token)  # nor this process's, which never acquired it
        del buf
        time.sleep(GRACE * 2)  # what a counted release would have let go by now
        assert exporter.in_use() > 0 and holders() == {c.pid: 1}
        if exporter.kind == "arena":
            with pytest.raises(gpu_serde.ArenaFullError):  # the block is not handed out again
                exporter.mr.allocate(exporter.mr.size)
        assert c.run(check_kept, None)["ok"]  # every byte still the sender's
        assert c.run(drop, None)
        assert wait_until(exporter.all_back, timeout=GRACE + BOUND)
    assert exporter.descriptors_back()


# ---- a hold names its block; a region or pool is mapped once per descriptor -----------------------


def borrow(payload_a: tuple, payload_b: tuple) -> tuple:
    """Payload ``b`` carrying ``a``'s hold token (both of one kind)."""
    return (*payload_b[:4], payload_a[4])


def test_a_payload_that_borrows_another_blocks_hold_is_refused(exporter, tier, monkeypatch):
    a, b = exporter.allocate(tier.size // 2), exporter.allocate(tier.size // 2)
    fn, pa = payload_of(a)
    _, pb = payload_of(b)
    forged = pickle.dumps(_Call(fn, borrow(pa, pb)))
    with child(monkeypatch, tier.uuid) as c:
        got = c.run(check, _Blob(forged))  # the child unpickles the forgery itself
        assert got["error"] == "TokenRefusedError" and "another block" in got["message"]
        assert c.run(check, b)["ok"]  # b's own payload still works
        assert c.run(check, a)["ok"]  # and a's (a hold never acquired is kept till exit)
    del a, b
    assert wait_until(exporter.all_back, timeout=GRACE + BOUND)


class _Call:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


class _Blob:
    """A pickle the child loads itself (a payload made by hand, as a forger would)."""

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def __reduce__(self):
        return (pickle.loads, (self.blob,))


def forged_ids(payload: tuple, n: int) -> list[bytes]:
    """``n`` pickles of ``payload`` whose pool or region claims another id, the token real."""
    out = []
    for i in range(n):
        inner = list(payload[1])
        inner[5] = os.urandom(16) if i % 2 else bytes([i % 256]) * 16  # the pool or region id
        out.append(pickle.dumps(_Call(_wire_of(payload), (payload[0], tuple(inner), *payload[2:]))))
    return out


def _wire_of(payload: tuple):
    return gpu_serde.wire.abuf if len(payload[1]) == 8 else gpu_serde.wire.buf


def load_all(blobs: list[bytes]) -> dict:
    """Job: load each pickle and use what came; the typed errors seen, the regions mapped and the
    descriptors open here."""
    import collections

    errors: collections.Counter = collections.Counter()
    for blob in blobs:
        try:
            got = gpu_serde.resolve(pickle.loads(blob))
            errors["ok"] += 1
            got.close()
        except gpu_serde.HandoffError as exc:
            errors[type(exc).__name__] += 1
    return {"errors": dict(errors), "maps": regions_mapped(), "fds": open_fds()}


def test_forged_ids_map_each_region_or_pool_at_most_once(exporter, tier, monkeypatch):
    buf = exporter.allocate(tier.size // 2)
    _, p = payload_of(buf)
    with child(monkeypatch, tier.uuid) as c:
        before = c.run(load_all, forged_ids(p, 100))  # forged before anything was mapped
        real = c.run(load_all, [pickle.dumps(buf)])  # (the first mapping makes a context too)
        after = c.run(load_all, forged_ids(p, 100))  # and after
        again = c.run(load_all, forged_ids(p, 100))
    assert before["errors"] == {"TokenRefusedError": 100}  # the broker refuses the claimed ids
    assert real["errors"] == {"ok": 1}
    assert after["errors"] == again["errors"] == {"HandoffError": 100}  # the claim does not match
    assert after["maps"] == again["maps"] == (1 if exporter.kind == "arena" else 0)
    assert again["fds"] <= after["fds"] <= real["fds"] + 2  # nothing mapped, nothing kept
    del buf
    assert wait_until(exporter.all_back, timeout=GRACE + BOUND), exporter


# ---- a sender never fails; a killed worker or actor gives its holds back -----------------------------


def check_slowly(buf) -> dict:
    """Task: hold the buffer a moment, then check it."""
    time.sleep(0.05)
    return check(buf)


def settle(futures, timeout: float = 300) -> dict:
    """Wait until every future is done; how many finished and how many erred. A result lost
    with a killed worker ("lost": the scheduler computes it again) is waited for too."""
    from distributed import wait

    deadline = time.monotonic() + timeout
    while True:
        wait(futures, timeout=max(1.0, deadline - time.monotonic()))
        statuses = [f.status for f in futures]
        if "lost" not in statuses or time.monotonic() > deadline:
            return {s: statuses.count(s) for s in set(statuses)}
        time.sleep(0.1)


def check_after(buf, _gate) -> dict:
    """Task: check the buffer once ``_gate`` (a dependency) is done."""
    return check(buf)


def test_a_buffer_closed_while_the_scheduler_holds_its_task_reaches_it_or_its_error(
    exporter, tier, dask_client
):
    client = dask_client
    buf = exporter.allocate(tier.size)
    gate = client.submit(time.sleep, 2, pure=False)
    future = client.submit(check_after, buf, gate, pure=False)
    key = future.key
    # the scheduler (in this process: a LocalCluster) has the task's arguments, to send on
    # once the gate is done
    assert wait_until(lambda: client.run_on_scheduler(_has_task, key=key), timeout=60)
    buf.close()  # it will pickle the closed buffer again
    del buf
    settled = settle([future, gate])
    if exporter.kind == "arena":  # the block waits for its importers: the bytes arrive
        assert settled == {"finished": 2} and future.result()["ok"]
    else:  # closing a pool's buffer frees its memory: the task gets the reason, typed
        assert settled == {"finished": 1, "error": 1}
        assert isinstance(future.exception(), gpu_serde.HandoffError)
        assert "pool's buffer frees its memory" in str(future.exception())
    assert len(client.scheduler_info()["workers"]) == 2  # both alive
    del future, gate
    assert wait_until(exporter.all_back, timeout=GRACE + BOUND + 30), exporter


def _has_task(dask_scheduler, key) -> bool:
    return key in dask_scheduler.tasks


def test_a_buffer_dropped_or_closed_right_after_submit_reaches_its_task_or_its_error(
    exporter, tier, dask_client
):
    client = dask_client
    buf = exporter.allocate(tier.size)
    future = client.submit(check, buf, pure=False)
    if exporter.kind == "arena":  # an arena buffer may be closed once sent
        buf.close()  # before or after Dask pickled it: either way nothing is lost
    del buf  # the sender lets go of it at once (a pool's buffer must not be closed while sent)
    settled = settle([future])
    if settled == {"finished": 1}:  # pickled before the close (or never closed), and kept
        assert future.result()["ok"]
    else:  # closed before Dask pickled it: the task gets the reason, typed
        assert exporter.kind == "arena" and settled == {"error": 1}
        assert isinstance(future.exception(), gpu_serde.HandoffError)
        assert "closed by its exporter" in str(future.exception())
    assert len(client.scheduler_info()["workers"]) == 2  # both alive
    assert client.submit(os.getpid, pure=False).result(timeout=60) > 0  # the cluster serves
    del future
    assert wait_until(exporter.all_back, timeout=GRACE + BOUND + 30), exporter


def test_a_restart_after_close_recomputes_or_settles_with_a_typed_error(
    exporter, tier, dask_client
):
    client = dask_client
    buf = exporter.allocate(tier.size)
    future = client.submit(check, buf, pure=False)
    assert future.result(timeout=300)["ok"]
    buf.close()  # done with it: the result is in
    del buf
    workers = list(client.scheduler_info()["workers"])
    client.restart_workers(workers)  # routine: the result is lost, and recomputed
    settled = settle([future])
    # within the grace period the hold lasts and the recomputation reads the bytes (a closed
    # arena block waits for its importers); after it, the task gets the sender's typed error
    if settled == {"finished": 1}:
        assert future.result()["ok"]
    else:
        assert settled == {"error": 1}
        error = future.exception()
        assert isinstance(error, gpu_serde.HandoffError) and "closed" in str(error)
    assert wait_until(lambda: len(client.scheduler_info()["workers"]) == 2, timeout=60)
    assert client.submit(os.getpid, pure=False).result(timeout=60) > 0  # the cluster serves
    del future
    assert wait_until(exporter.all_back, timeout=GRACE + BOUND + 30), exporter


@pytest.mark.slow  # a soak: 100 hand-offs and a worker killed among them
def test_a_worker_killed_mid_run_with_100_handoffs_in_flight_loses_nothing(
    exporter, tier, dask_client
):
    client = dask_client
    bufs = [exporter.allocate(64 << 10) for _ in range(100)]
    futures = [client.submit(check_slowly, b, pure=False) for b in bufs]
    pids = client.run(os.getpid)
    victim = sorted(pids)[0]
    assert wait_until(lambda fs=futures: sum(f.done() for f in fs) >= 10, timeout=120)
    os.kill(pids[victim], signal.SIGKILL)  # in the middle of its share
    settled = settle(futures)
    assert sum(settled.values()) == 100 and set(settled) <= {"finished", "error"}
    assert all(f.result()["ok"] for f in futures if f.status == "finished")
    assert wait_until(lambda: len(client.scheduler_info()["workers"]) == 2, timeout=60)
    del futures
    for b in bufs:  # the sender is done with them (Dask's own state may still refer to one)
        b.close()
    del bufs
    assert wait_until(exporter.all_back, timeout=GRACE + BOUND + 30), exporter
    assert exporter.broker_descriptors_back(importers=2)  # the cluster's sockets come and go


def test_a_killed_ray_actor_gives_its_holds_back(exporter, tier, ray_session):
    ray = ray_session

    @ray.remote(num_gpus=0.5)
    class Holder:
        def keep(self, buf):
            self.buf = gpu_serde.resolve(buf)
            return {**check(self.buf), "pid": os.getpid()}

    holder = Holder.remote()
    buf = exporter.allocate(tier.size)
    got = ray_get(holder.keep.remote(buf))
    assert got["ok"] and wait_until(lambda: holders() == {got["pid"]: 1})
    del buf
    os.kill(got["pid"], signal.SIGKILL)
    assert wait_until(exporter.all_back, timeout=GRACE + BOUND)
    assert holders() == {}


def test_a_portable_buffer_that_cannot_be_copied_travels_as_the_reason(exporter, tier, monkeypatch):
    from gpu_serde.memory import bycopy

    buf = exporter.allocate(tier.size)
    with monkeypatch.context() as m:
        m.setattr(bycopy, "host_memory_available", lambda: 1000)  # host memory is "full"
        got = pickle.loads(pickle.dumps(gpu_serde.portable(buf)))  # the sender never fails
    with pytest.raises(gpu_serde.HostCopyError, match="1000 available"):
        gpu_serde.resolve(got)
    buf.close()
    got = pickle.loads(pickle.dumps(gpu_serde.portable(buf)))  # closed: no copy can be made
    with pytest.raises(gpu_serde.HandoffError, match="closed"):
        gpu_serde.resolve(got)


def keep_blob(blob: bytes) -> dict:
    """Job: unpickle a pickled buffer here, check it and keep it until ``drop``."""
    return keep(pickle.loads(blob))


def test_a_buffer_closed_after_sending_that_comes_back_to_its_exporter_is_a_typed_error(
    exporter, tier, monkeypatch
):
    """``ray.get`` of the exporter's own ``ray.put``, or a task scheduled where the buffer was made,
    hands the payload back to its exporter: a buffer closed there since is the typed error, never
    a Buffer at address 0. Another process still reads an arena buffer closed after it was sent."""
    buf = exporter.allocate(tier.size)
    blob = pickle.dumps(buf)
    buf.close()
    with pytest.raises(gpu_serde.HandoffError, match="closed it after sending it"):
        gpu_serde.resolve(pickle.loads(blob))
    if exporter.kind == "arena":  # the block waits for the payload's receivers
        with child(monkeypatch, tier.uuid) as c:
            assert c.run(keep_blob, blob)["ok"]
            assert c.run(drop, None)
    del buf, blob
    assert wait_until(exporter.all_back, timeout=GRACE + BOUND)


# ---- an exiting importer ---------------------------------------------------------------------------

READ_AFTER_GPU_SERDE_STOPPED = """
import atexit, pickle, sys, threading

def read_at_exit():  # registered before gpu_serde's own exit handler: runs after it
    from memtier import check
    buf = pickle.loads(bytes.fromhex(sys.argv[1]))
    print(check(buf)["ok"], flush=True)
    buf.close()  # its release is queued for no thread: the process's end gives the hold back
    print(sorted(t.name for t in threading.enumerate() if t.name.startswith("gpu_serde")), flush=True)

atexit.register(read_at_exit)
import gpu_serde.memory.lifetime, gpu_serde.memory.broker.client  # their exit handlers, after ours
gpu_serde.install()
"""


def test_a_buffer_read_after_gpu_serdes_exit_handler_starts_no_thread_and_its_hold_comes_back(
    exporter, tier
):
    """An exit handler of the user's that runs after gpu_serde's (an ``atexit`` registered
    earlier) may still receive a buffer: it reads right, and no release thread or note flusher
    starts again to call the driver while the interpreter is torn down; the hold comes back with
    the process."""
    buf = exporter.allocate(tier.size)
    blob = pickle.dumps(buf)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=tier.uuid)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", READ_AFTER_GPU_SERDE_STOPPED, blob.hex()],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    from memtier import exited_cleanly

    assert done.stdout.split("\n")[:2] == ["True", "[]"], done.stderr[-2000:]
    assert exited_cleanly(done.returncode), done.stderr[-2000:]
    del buf, blob
    assert wait_until(exporter.all_back, timeout=GRACE + BOUND)
    assert holders() == {}
    assert exporter.descriptors_back()


# ---- what runs during garbage collection ---------------------------------------------------------


def test_a_free_during_a_threads_first_retain_of_a_context_does_not_wait_for_itself(
    installed, monkeypatch
):
    """A received buffer's free may run inside any allocation (a collection), also while this
    very thread retains a device's context for the first time: it enters the same cache."""
    import threading

    from gpu_serde.memory import driver as _driver

    Device(0).set_current()  # CUDA started, as in any process that received a buffer
    monkeypatch.setattr(_driver, "_contexts", {})  # no context retained yet (one more, for good)
    done = []

    def free_inside_a_retain() -> None:
        with _driver._contexts_lock, _driver.context(0):  # (the free's own context)
            done.append(True)

    t = threading.Thread(target=free_inside_a_retain, daemon=True)
    t.start()
    t.join(30)
    assert done == [True]


def test_an_object_that_cannot_be_watched_is_not_forwarded_and_leaves_no_note():
    """Forwarding is noted only for an object whose end can be seen: a note under a reused
    address would send a new object as the old one's payload."""
    from gpu_serde.memory import lifetime

    class Unwatchable:
        __slots__ = ()

    obj = Unwatchable()
    with pytest.raises(TypeError):
        lifetime.forward_as(obj, ("a payload",))
    assert lifetime.forwarded(obj) is None
