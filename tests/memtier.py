"""What the memory hand-off tests share on both tiers: the tier, the byte pattern, gpu_serde internals.

The CPU tier runs them on the simulated driver (small buffers), the GPU tier (``-m gpu``) on the
real one (1 GiB). Senders write the pattern with ``cuMemcpyHtoD`` and receivers read it back with
``cuMemcpyDtoH``: driver calls that mean the same on both.

The only gpu_serde internals the memory tests reach are here (re-point them when the core moves):
``gpu_serde.handoff.RELEASE_GRACE_S``, ``gpu_serde.memory.broker.broker`` and ``gpu_serde.regions.maps``.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

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


def short_release_grace(monkeypatch: pytest.MonkeyPatch, seconds: float = 0.5) -> None:
    """Let imported pools go ``seconds`` after their last buffer (tests wait for it)."""
    from gpu_serde.memory import lifetime as handoff

    monkeypatch.setattr(handoff, "RELEASE_GRACE_S", seconds)


def regions_mapped() -> int:
    """How many arena regions this process has mapped (each one once)."""
    from gpu_serde.memory.arena import importer as regions

    return regions.maps
