"""Buffers by value: a host copy of a buffer's bytes, uploaded to a GPU of the receiver's.

GPU memory is mapped, not copied, on the host that exported it; beyond that host the bytes must
travel. A **host copy** (``gpu_serde.wire.hbuf``) carries the buffer's GPU (by UUID; none for
pinned host memory), its size and its bytes; reduce and rebuild side by side. The receiver
allocates from a pool of its own on the same GPU if it sees it, else on its own current device (a
Dask or Ray worker's device 0), and copies the bytes up. The Dask serializer
(:mod:`gpu_serde.dask.serializers`) sends it to a worker on another host; a portable buffer
(:mod:`gpu_serde.memory.portable`) carries one beside its zero-copy payload.

The bytes travel as a pickle-5 out-of-band buffer where the pickler takes one (a copy in-band
otherwise); the payload stays plain data (the rebuild accepts any contiguous bytes-like object).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from cuda.bindings import driver
from cuda.core import (
    Buffer,
    Device,
    DeviceMemoryResource,
    DeviceMemoryResourceOptions,
    PinnedMemoryResource,
    PinnedMemoryResourceOptions,
)

from gpu_serde import inventory as _inventory
from gpu_serde import wire
from gpu_serde.device import device_payload
from gpu_serde.errors import HandoffError, HostCopyError, PayloadError
from gpu_serde.format.device import VERSION, raw_uuid
from gpu_serde.format.memory import HostCopyPayload, decode_hbuf, validate_target
from gpu_serde.memory import driver as _driver

_lock = threading.Lock()
_pools: dict[int, Any] = {}  # device ordinal (-1: pinned host memory) -> the receiving pool
_counts = {"to_host": 0, "uploaded": 0}


def counts() -> dict[str, int]:
    """How many host copies this process made (``to_host``) and uploaded (``uploaded``)."""
    with _lock:
        return dict(_counts)


def _count(what: str) -> None:
    with _lock:
        _counts[what] += 1


def host_memory_available() -> int:
    """Bytes of host memory this process can still take: ``MemAvailable``, or less under a
    cgroup (v2) memory limit."""
    available = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    with contextlib.suppress(OSError, ValueError):
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                available = min(available, int(limit) - int(f.read()))
    return max(available, 0)


def _is_host_memory(buf: Buffer) -> bool:
    return bool(buf.is_host_accessible) and int(buf.device_id) < 0


def to_host(buf: Buffer) -> memoryview:
    """Copy ``buf``'s bytes into new host memory, after the work queued on its device.

    Raises:
        HostCopyError: the copy does not fit in this host's available memory, or the driver
            refused it.
        HandoffError: the buffer is closed or empty.
    """
    size = int(buf.size)
    if not buf.handle or size <= 0:
        raise HandoffError("a closed or empty Buffer cannot be sent: send it before closing it")
    free = host_memory_available()
    if size > free:
        raise HostCopyError(
            f"copying a Buffer of {size} bytes to host memory, to send it to another host, needs "
            f"{size} bytes; this host has {free} available. Send smaller buffers, or run the "
            "consumer on the exporter's host, where the buffer is mapped without a copy."
        )
    # NumPy's allocator (cuda.core depends on NumPy): a large array reuses memory a freed one
    # left mapped, where a fresh mapping would fault in every page during the copy
    host = np.empty(size, dtype=np.uint8)
    view = host.data  # a memoryview of the array: bytes, one dimension
    if _is_host_memory(buf):  # pinned host memory: the driver refuses copies into it
        ctypes.memmove(host.ctypes.data, int(buf.handle), size)
    else:
        with _driver.current(Device(int(buf.device_id))):
            _copied("cuCtxSynchronize", driver.cuCtxSynchronize())  # the writes queued on it
            _copied("cuMemcpyDtoH", driver.cuMemcpyDtoH(host, int(buf.handle), size))
    _count("to_host")
    return view


def _copied(call: str, result: tuple[Any, ...]) -> None:
    if result[0] != driver.CUresult.CUDA_SUCCESS:
        raise HostCopyError(f"{call} failed: {getattr(result[0], 'name', result[0])}")


def host_payload(buf: Buffer, data: Any) -> HostCopyPayload:
    """The host-copy payload of ``buf`` carrying ``data`` (its bytes)."""
    return HostCopyPayload(VERSION, device_of(buf), int(buf.size), data)


def device_of(buf: Buffer) -> bytes | None:
    """The device payload of ``buf``'s GPU, or None for pinned host memory."""
    return None if _is_host_memory(buf) else device_payload(Device(int(buf.device_id)))


def data(view: memoryview, protocol: int) -> Any:
    """The bytes as the pickler should carry them: out-of-band under protocol 5, else in-band."""
    return pickle.PickleBuffer(view) if protocol >= 5 else view.tobytes()


def reduce_by_value(buf: Buffer, protocol: int = 5) -> tuple[Any, ...]:
    """``(gpu_serde.wire.hbuf, (payload,))``: ``buf`` as a host copy of its bytes.

    Raises:
        HostCopyError, HandoffError: as :func:`to_host`.
    """
    return (wire.hbuf, (host_payload(buf, data(to_host(buf), protocol)).wire(),))


def _receiving_pool(ordinal: int) -> Any:
    """This process's pool for buffers that arrive by value on device ``ordinal`` (-1: pinned host
    memory); IPC-enabled, so that they can be sent on without a copy on this host."""
    with _lock:
        pool = _pools.get(ordinal)
        if pool is None:
            if ordinal < 0:
                pool = PinnedMemoryResource(PinnedMemoryResourceOptions(ipc_enabled=True))
            else:
                pool = DeviceMemoryResource(
                    Device(ordinal), DeviceMemoryResourceOptions(ipc_enabled=True)
                )
            _pools[ordinal] = pool
        return pool


_left_by_fork: list[dict[int, Any]] = []


def _forget_after_fork() -> None:
    """A forked child uses none of its parent's pools, and must not free them either: freeing
    calls the driver, which a forked child must not do before it execs (it can hang there, as
    under Ray, whose ``preexec_fn`` runs these hooks). They are kept, never used."""
    _left_by_fork.append(dict(_pools))
    _pools.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _target(p: HostCopyPayload) -> Device:
    """The device a host copy lands on: the same GPU if visible here, else this thread's current
    device (a worker's own GPU)."""
    if p.device is not None:
        ordinal = _inventory.local_ordinal(raw_uuid(p.device))
        if ordinal is not None:
            return Device(ordinal)
    return _driver.any_device()


def _new_buffer(
    dev: Device, size: int, host: bool, copy: Callable[[Buffer, Any], None], what: str
) -> Buffer:
    """A buffer of ``size`` bytes from this process's receiving pool on ``dev`` (pinned host
    memory when ``host``), filled by ``copy(buffer, stream)`` and complete on return; ``dev`` is
    left current in the calling thread, as for a mapped buffer.

    Raises:
        HandoffError: the allocation or the copy failed (the message has the driver's error).
    """
    try:
        dev.set_current()
        stream = dev.default_stream
        buf = _receiving_pool(-1 if host else dev.device_id).allocate(size, stream=stream)
        copy(buf, stream)
        stream.sync()  # the bytes are there before anyone can use the buffer
    except Exception as exc:
        where = "pinned host memory" if host else f"GPU {dev.device_id}"
        raise HandoffError(
            f"a Buffer of {size} bytes sent {what} could not be put in {where} here: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    _count("uploaded")
    return buf


def upload(p: HostCopyPayload) -> Buffer:
    """A new buffer, from this process's receiving pool, holding the payload's bytes; its device
    is left current in the calling thread.

    Raises:
        HandoffError: this process sees no GPU, or the allocation or the copy failed (the
            message has the driver's error).
    """
    src = memoryview(p.data).cast("B")  # decode_hbuf checked: contiguous, ``size`` bytes

    def to_host_memory(buf: Buffer, stream: Any) -> None:
        stream.sync()  # the allocation is stream-ordered; the copy below is not
        memoryview((ctypes.c_char * p.size).from_address(int(buf.handle))).cast("B")[:] = src

    def to_device(buf: Buffer, stream: Any) -> None:
        _copied(
            "cuMemcpyHtoDAsync",
            driver.cuMemcpyHtoDAsync(int(buf.handle), src, p.size, int(stream.handle)),
        )

    host = p.device is None
    copy = to_host_memory if host else to_device
    return _new_buffer(_target(p), p.size, host, copy, "by value")


def from_device(device: object, size: object, interface: object) -> Buffer:
    """A new buffer, from this process's receiving pool, with a copy of the device memory that
    ``interface`` (a ``__cuda_array_interface__`` of ``size`` bytes) describes; ``device`` is the
    sender's device payload (the same GPU is used if visible here); left current like
    :func:`upload`'s.

    Raises:
        PayloadError: ``size``, ``device`` or ``interface`` is malformed.
        HandoffError: as :func:`upload`.
    """
    dev_p, n = validate_target(device, size)
    try:
        ptr = int(interface["data"][0])  # type: ignore[index]
        shape = tuple(interface["shape"])  # type: ignore[index]
        ok = interface["typestr"] in ("|u1", "|i1", "|b1") and shape == (n,)  # type: ignore[index]
    except Exception:
        ok = False
    if not ok:
        raise PayloadError(f"a device frame of gpu_serde is {n} bytes, one a byte ('|u1')")

    def from_frame(buf: Buffer, stream: Any) -> None:
        _copied("cuMemcpyAsync", driver.cuMemcpyAsync(int(buf.handle), ptr, n, int(stream.handle)))

    dev = _target(HostCopyPayload(VERSION, dev_p, n, b""))
    return _new_buffer(dev, n, False, from_frame, "as a device frame")


def rebuild_host_copy(payload: object) -> Buffer:
    """Rebuild body of :func:`gpu_serde.wire.hbuf`: the bytes in a new buffer here.

    Raises:
        PayloadError: malformed; HandoffError: as :func:`upload`.
    """
    return upload(decode_hbuf(payload))
