"""What the memory hand-off tests share on both tiers: the tier, the byte pattern, gpu_serde internals.

The CPU tier runs them on the simulated driver (small buffers), the GPU tier (``-m gpu``) on the
real one (1 GiB). Senders write the pattern with ``cuMemcpyHtoD`` and receivers read it back with
``cuMemcpyDtoH``: driver calls that mean the same on both.

The only gpu_serde internals the memory tests reach are here (re-point them when the core moves):
``gpu_serde.handoff.RELEASE_GRACE_S``, ``gpu_serde.memory.broker.broker`` and ``gpu_serde.regions.maps``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

MiB, GiB = 1 << 20, 1 << 30


@dataclass(frozen=True)
class Tier:
    """Where the memory tests run: ``"sim"`` or ``"real"``, the GPUs there and a buffer size."""

    name: str
    gpus: list
    size: int

    @property
    def ordinal(self) -> int:
        """The GPU the tests allocate on: the last one, so a child that sees only it renumbers it."""
        return len(self.gpus) - 1

    @property
    def uuid(self) -> str:
        """That GPU's ``GPU-...`` UUID (what a child's ``CUDA_VISIBLE_DEVICES`` names)."""
        return self.gpus[-1].uuid


def make_tier(request: pytest.FixtureRequest) -> Tier:
    """The tier for ``request.param`` (``"sim"`` or ``"real"``)."""
    if request.param == "real":
        return Tier("real", request.getfixturevalue("real_gpu"), GiB)
    return Tier("sim", request.getfixturevalue("simulated_gpus"), 4 * MiB)


def ray_by_value(*modules: str) -> None:
    """Ray workers lack tests/ on sys.path: ship these modules' functions by value."""
    import ray.cloudpickle

    for name in ("memtier", *modules):
        ray.cloudpickle.register_pickle_by_value(sys.modules[name])


def _checked(call: str, result: tuple) -> None:
    from cuda.bindings import driver

    if result[0] != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{call} failed: {result[0]!r}")


def pattern(size: int) -> np.ndarray:
    """The words every test writes: 0, 1, 2, ... as uint32."""
    return np.arange(size // 4, dtype=np.uint32)


def fill(buf) -> None:
    """Write the pattern into device memory with cuMemcpyHtoD, into pinned host memory directly
    (the real driver refuses cuMemcpyHtoD to a pinned pool's memory: CUDA_ERROR_INVALID_VALUE)."""
    from cuda.bindings import driver

    if buf.is_host_accessible:
        host_words(buf)[:] = pattern(buf.size)
        return
    _checked("cuMemcpyHtoD", driver.cuMemcpyHtoD(int(buf.handle), pattern(buf.size), buf.size))


def host_words(buf) -> np.ndarray:
    """The uint32 words of a host-accessible buffer (pinned memory), as a NumPy view."""
    return np.ctypeslib.as_array((ctypes.c_uint32 * (buf.size // 4)).from_address(int(buf.handle)))


def pattern_is_there(buf) -> bool:
    """Read the buffer back with cuMemcpyDtoH: is every word of the pattern there?

    The copy needs a current context in this thread (as on a real GPU): this makes the buffer's
    device current (any device for pinned memory).
    """
    from cuda.bindings import driver
    from cuda.core import Device

    if buf.is_host_accessible:
        return bool((host_words(buf) == pattern(buf.size)).all())
    Device(max(buf.device_id, 0)).set_current()
    out = np.empty(buf.size // 4, dtype=np.uint32)
    _checked("cuMemcpyDtoH", driver.cuMemcpyDtoH(out, int(buf.handle), buf.size))
    return bool((out == pattern(buf.size)).all())


def check(buf) -> dict:
    """Runs in the receiver: resolve what arrived and check every word of the pattern."""
    import gpu_serde

    buf = gpu_serde.resolve(buf)
    return {
        "ok": pattern_is_there(buf),
        "size": buf.size,
        "pid": os.getpid(),
        "device": buf.device_id,
        "host": buf.is_host_accessible,
        "pool uuid": str(
            getattr(getattr(buf.memory_resource, "pool", buf.memory_resource), "uuid", None)
        ),
    }


def exit_crashes_at_teardown() -> bool:
    """cuda-core 1.2.0's CUDA 12 build (with cuda-bindings 12.x; the version matrix's low leg)
    crashes at interpreter exit in a process that made a device current: a thread-local destructor
    calls the driver after the interpreter is gone (SIGSEGV, seen with a bare
    ``Device(0).set_current()`` and no gpu_serde; docs/versions.md)."""
    from importlib import metadata

    try:
        core, bindings = metadata.version("cuda-core"), metadata.version("cuda-bindings")
    except metadata.PackageNotFoundError:
        return False
    return core == "1.2.0" and bindings.startswith("12.")


def exited_cleanly(code: int | None) -> bool:
    """A child that used CUDA ended with status 0 (where :func:`exit_crashes_at_teardown`, the
    status says nothing about gpu_serde: any status after the child's work was done)."""
    return code == 0 or (code is not None and exit_crashes_at_teardown())


def wait_until(predicate: Callable[[], bool], timeout: float = 15) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


# ---- gpu_serde internals (one place) ----
def held() -> int:
    """How many exported objects this process's broker keeps alive for importers."""
    from gpu_serde.memory.broker import broker

    return broker().held()


def served() -> int:
    """How many descriptors this process's broker serves."""
    from gpu_serde.memory.broker import broker

    return len(broker())


def held_from(mr) -> int:
    """How many buffers of memory resource ``mr`` this process's broker keeps for importers."""
    from gpu_serde.memory.broker import broker

    b = broker()
    with b._lock:
        objs = [h.obj for h in b._holds.values()]
    return sum(getattr(o, "memory_resource", None) is mr for o in objs)


def holders() -> dict[int, int]:
    """This process's broker's live holds, by the pid of the process that took them."""
    from gpu_serde.memory.broker import broker

    return broker().holders()


def short_release_grace(monkeypatch: pytest.MonkeyPatch, seconds: float = 0.5) -> None:
    """Let exported buffers go ``seconds`` after their last importer (tests wait for it)."""
    from gpu_serde.memory import lifetime

    monkeypatch.setattr(lifetime, "RELEASE_GRACE_S", seconds)


def regions_mapped() -> int:
    """How many arena regions this process has mapped (each one once)."""
    from gpu_serde.memory.arena import importer

    return importer.maps


def open_fds(pid: int | str = "self") -> int:
    """How many descriptors a process of this host has open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


# ---- the processes that receive: a spawned child, a Ray session, a Dask cluster ----
KEPT: dict = {}  # what a child keeps between jobs


def serve(inbox, outbox) -> None:
    """A long-lived receiver: runs each job on its argument and answers (an exception by name)."""
    import gpu_serde

    gpu_serde.install()
    while (item := inbox.get(timeout=300)) is not None:
        job, arg = item
        try:
            outbox.put(job(arg))
        except Exception as exc:
            outbox.put({"error": type(exc).__name__, "message": str(exc)})
        del item, arg
        gc.collect()


@dataclass
class Child:
    """A spawned receiver: ``run(job, arg)`` sends a job and waits for its answer."""

    process: multiprocessing.process.BaseProcess
    inbox: object
    outbox: object

    def run(self, job: Callable, arg: object) -> object:
        self.inbox.put((job, arg))  # type: ignore[attr-defined]
        return self.outbox.get(timeout=300)  # type: ignore[attr-defined]

    @property
    def pid(self) -> int:
        return int(self.process.pid)


@contextlib.contextmanager
def child(monkeypatch: pytest.MonkeyPatch, uuid: str, **env: str) -> Iterator[Child]:
    """A spawned receiver that sees only the GPU ``uuid`` (its ordinal 0), stopped (or killed)
    on exit."""
    ctx = multiprocessing.get_context("spawn")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", uuid)  # the UUID form, not "0"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    inbox, outbox = ctx.Queue(), ctx.Queue()
    process = ctx.Process(target=serve, args=(inbox, outbox))
    process.start()
    try:
        yield Child(process, inbox, outbox)
    finally:
        if process.is_alive():
            inbox.put(None)
            process.join(60)
        if process.is_alive():
            process.kill()
            process.join(10)
        for q in (inbox, outbox):  # their pipes, not left open for the next test to count
            q.cancel_join_thread()
            q.close()
        process.close()


def keep(buf) -> dict:
    """Job: check the buffer and keep it until ``drop``."""
    import gpu_serde

    KEPT["buf"] = gpu_serde.resolve(buf)
    return check(KEPT["buf"])


def check_kept(_) -> dict:
    """Job: check the buffer ``keep`` kept, again."""
    return check(KEPT["buf"])


def drop(_) -> bool:
    """Job: close the kept buffer (on the device's default stream)."""
    KEPT.pop("buf").close()
    return True


@contextlib.contextmanager
def ray_on(tier: Tier, module: str, num_cpus: int = 4) -> Iterator[object]:
    """A local Ray session whose one GPU is the tier's, gpu_serde in the driver and workers, the
    test ``module``'s functions shipped by value."""
    import ray

    import gpu_serde.ray

    ray_by_value(module)
    with pytest.MonkeyPatch.context() as mp:
        # the node's one GPU is the tier's (the raylet hands this entry to GPU workers as is)
        mp.setenv("CUDA_VISIBLE_DEVICES", tier.uuid)
        gpu_serde.ray.init(
            address="local",
            num_cpus=num_cpus,
            num_gpus=1,
            include_dashboard=False,
            log_to_driver=False,
        )
    try:
        yield ray
    finally:
        ray.shutdown()


def ray_get(refs: Any, timeout: float = 120) -> Any:
    """``ray.get(refs)`` within ``timeout`` (below pytest's own), failing with what the cluster
    had free: a task that never started (its GPU share still taken) reads apart from one that
    hung."""
    import ray

    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise AssertionError(
            f"no result within {timeout} s; resources free {ray.available_resources()} of "
            f"{ray.cluster_resources()}"
        ) from None


@contextlib.contextmanager
def dask_on(tier: Tier, n_workers: int = 1) -> Iterator[object]:
    """A LocalCluster (Nanny workers, one thread each) whose workers see only the tier's GPU, with
    gpu_serde registered; yields its Client. The scheduler runs in this process: its log of recent
    messages would keep every buffer sent alive, so it is off (docs/memory.md)."""
    import dask
    from distributed import Client, LocalCluster

    import gpu_serde.dask

    with (
        dask.config.set({"distributed.admin.low-level-log-length": 0}),
        LocalCluster(
            n_workers=n_workers,
            threads_per_worker=1,
            host="127.0.0.1",
            dashboard_address="127.0.0.1:0",
            env={"CUDA_VISIBLE_DEVICES": tier.uuid},
        ) as cluster,
        Client(cluster) as client,
    ):
        gpu_serde.dask.register(client)
        yield client


EXPORT_AND_WAIT = """
import pickle, sys, gpu_serde
from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions
gpu_serde.install(); d = Device(0); d.set_current()
if sys.argv[1] == "arena":
    mr = gpu_serde.ArenaMemoryResource(d, 4 << 20)
else:
    mr = DeviceMemoryResource(d, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=4 << 20))
print(pickle.dumps(mr.allocate(1 << 20, stream=d.default_stream)).hex(), flush=True)
sys.stdin.read()
"""


def send_arena_buffer(size: int, blobs) -> None:
    """A multiprocessing child's job: allocate an arena buffer, fill it with the pattern, send it
    (its pickle, in hex, on ``blobs``), and end."""
    import pickle

    from cuda.core import Device

    import gpu_serde

    gpu_serde.install()
    d = Device(0)
    d.set_current()
    buf = gpu_serde.ArenaMemoryResource(d, 2 * size).allocate(size, stream=d.default_stream)
    fill(buf)
    blobs.put(pickle.dumps(buf).hex())


def killed_exporter_payload(tier: Tier, kind: str = "pool") -> bytes:
    """A pickled buffer (``kind``: "pool" or "arena") whose exporting process was then killed."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=tier.uuid)
    exporter = subprocess.Popen(
        [sys.executable, "-c", EXPORT_AND_WAIT, kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    blob = bytes.fromhex(exporter.stdout.readline().strip())  # type: ignore[union-attr]
    exporter.kill()
    exporter.wait(30)
    return blob
