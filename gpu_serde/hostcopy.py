"""Buffers by value: a host copy of a buffer's bytes, uploaded to a GPU of the receiver's.

GPU memory is mapped, not copied, on the host that exported it; beyond that host the bytes must
travel. Two payload kinds carry them, reduce and rebuild side by side:

- **host copy** (``gpu_serde.wire.hbuf``): the buffer's GPU (by UUID; none for pinned host
  memory), its size and its bytes. The receiver allocates from a pool of its own on the same GPU
  if it sees it, else on its own current device (a Dask or Ray worker's device 0), and copies the
  bytes up. The Dask serializer (:mod:`gpu_serde.dask_transfer`) sends it to a worker on another
  host.
- **portable** (``gpu_serde.wire.pbuf``): the zero-copy payload (pool, VMM or arena buffer) and a
  host copy. The receiver maps the memory on the exporter's host and uploads the copy elsewhere
  (also where mapping fails: the exporter is gone, the GPU is not visible). :func:`portable` makes
  one; Ray (tasks, actors, ``ray.put``) and Dask carry it as they carry any pickle, the copy in
  their own bulk path (pickle protocol 5 out-of-band buffers: Ray's object store, Dask's frames).

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
    MemoryResource,
    PinnedMemoryResource,
    PinnedMemoryResourceOptions,
    Stream,
)

from gpu_serde import handled, handoff, wire
from gpu_serde import inventory as _inventory
from gpu_serde.device import device_payload
from gpu_serde.errors import (
    DeviceNotVisibleError,
    ExporterGoneError,
    HandoffError,
    HostCopyError,
    NotIPCEnabledError,
    OtherHostError,
    PayloadError,
    TokenRefusedError,
)
from gpu_serde.memory_payload import (
    HostCopyPayload,
    decode_hbuf,
    decode_pbuf,
    decode_unsent,
    validate_target,
)
from gpu_serde.payload import VERSION, decode_device
from gpu_serde.placeholders import body, define
from gpu_serde.text import quoted, safe

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
        with handoff.current(Device(int(buf.device_id))):
            _driver("cuCtxSynchronize", driver.cuCtxSynchronize())  # the writes queued on it
            _driver("cuMemcpyDtoH", driver.cuMemcpyDtoH(host, int(buf.handle), size))
    _count("to_host")
    return view


def _driver(call: str, result: tuple[Any, ...]) -> None:
    if result[0] != driver.CUresult.CUDA_SUCCESS:
        raise HostCopyError(f"{call} failed: {getattr(result[0], 'name', result[0])}")


def host_payload(buf: Buffer, data: Any) -> tuple[Any, ...]:
    """The host-copy payload of ``buf`` carrying ``data`` (its bytes)."""
    return (VERSION, device_of(buf), int(buf.size), data)


def device_of(buf: Buffer) -> bytes | None:
    """The device payload of ``buf``'s GPU, or None for pinned host memory."""
    return None if _is_host_memory(buf) else device_payload(Device(int(buf.device_id)))


def _data(view: memoryview, protocol: int) -> Any:
    """The bytes as the pickler should carry them: out-of-band under protocol 5, else in-band."""
    return pickle.PickleBuffer(view) if protocol >= 5 else view.tobytes()


def reduce_by_value(buf: Buffer, protocol: int = 5) -> tuple[Any, ...]:
    """``(gpu_serde.wire.hbuf, (payload,))``: ``buf`` as a host copy of its bytes.

    Raises:
        HostCopyError, HandoffError: as :func:`to_host`.
    """
    return (wire.hbuf, (host_payload(buf, _data(to_host(buf), protocol)),))


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
        ordinal = _inventory.local_ordinal(p.device[1:17])
        if ordinal is not None:
            return Device(ordinal)
    return handoff.any_device()


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
        _driver(
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
        _driver("cuMemcpyAsync", driver.cuMemcpyAsync(int(buf.handle), ptr, n, int(stream.handle)))

    dev = _target(HostCopyPayload(VERSION, dev_p, n, b""))
    return _new_buffer(dev, n, False, from_frame, "as a device frame")


def rebuild_host_copy(payload: object) -> Buffer:
    """Rebuild body of :func:`gpu_serde.wire.hbuf`: the bytes in a new buffer here.

    Raises:
        PayloadError: malformed; HandoffError: as :func:`upload`.
    """
    return upload(decode_hbuf(payload))


define(wire.hbuf, "Buffer (a host copy)", rebuild_host_copy)


class PortableBuffer:
    """A ``Buffer`` wrapped to travel anywhere: made by :func:`portable`.

    Pickled, it carries the zero-copy payload (when the buffer's memory can be shared) and a copy
    of the bytes, taken at pickling, after the work queued on the buffer's device. The receiver
    gets a ``Buffer``: the exporter's memory, mapped, on the exporter's host; a new buffer with the
    copy on a GPU of its own elsewhere (the same GPU if it sees it), also where mapping fails.
    In the sending process it is only a wrapper: :attr:`buffer` is the buffer.
    """

    __slots__ = ("buffer",)

    def __init__(self, buffer: Buffer) -> None:
        if not isinstance(buffer, Buffer):
            raise TypeError(
                f"gpu_serde.portable() takes a cuda.core Buffer, not {type(buffer).__name__}"
            )
        self.buffer = buffer  #: the wrapped buffer

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return (wire.pbuf, (portable_payload(self.buffer, int(protocol)),))

    def __repr__(self) -> str:
        return f"<PortableBuffer of {self.buffer!r}>"


def portable(buf: Buffer) -> PortableBuffer:
    """Wrap ``buf`` so that it reaches a process on any host: mapped without a copy on the
    exporter's host, as a copy of its bytes elsewhere.

    Use it where the receiver's host is not known when the buffer is pickled: a Ray task argument,
    ``ray.put``, a Dask task argument, a ``multiprocessing`` queue to a process that may be in
    another container. Every pickle of it copies the bytes to host memory (once per pickle), and
    the engine carries the copy in its own bulk path (Ray's object store, Dask's frames). The
    receiver gets a ``Buffer``. Dask sends buffers that are task results or scattered data by
    value to other hosts by itself: they need no wrapper.

    Args:
        buf: a cuda.core ``Buffer`` of device memory (any memory resource) or pinned host memory.

    Returns:
        A :class:`PortableBuffer` (pickle it; it is not a ``Buffer`` in the sending process).

    Raises:
        TypeError: ``buf`` is not a ``Buffer``.
        HostCopyError: (at pickling) the copy does not fit in this host's available memory.
        HandoffError: (at pickling) the buffer is closed.
    """
    return PortableBuffer(buf)


def portable_payload(buf: Buffer, protocol: int = 5) -> tuple[Any, ...]:
    """The payload of :func:`portable`: ``(1, kind, zero-copy payload, host copy)``; kind and its
    payload are None for memory that cannot be shared without a copy.

    Raises:
        HostCopyError, HandoffError: as :func:`to_host`.
    """
    kind, inner = None, None
    try:
        reduction = handled.reduce_buffer(buf)
    except NotIPCEnabledError:
        pass  # only the copy travels
    else:
        kind, inner = reduction[0].__name__, reduction[1][0]
    return (VERSION, kind, inner, host_payload(buf, _data(to_host(buf), protocol)))


class Alias(MemoryResource):
    """The memory resource of a portable buffer that came back to its exporter: a second
    ``Buffer`` over the exporter's own buffer (kept alive while the alias lives), which travels
    on as the portable payload it came as. It cannot allocate; freeing it frees nothing."""

    def __init__(self, owner: Buffer) -> None:
        self._owner: Buffer | None = owner
        self.device_id_ = int(owner.device_id)
        self.owner_resource = owner.memory_resource  #: the exporter's memory resource

    def allocate(self, size: int, stream: Stream | None = None) -> Buffer:
        """Refused: allocate from the exporter's own memory resource.

        Raises:
            TypeError: always.
        """
        raise TypeError("an alias of a buffer cannot allocate: allocate from its pool")

    def deallocate(self, ptr: int, size: int, stream: Stream | None = None) -> None:
        """Let go of the exporter's buffer (its memory stays the exporter's)."""
        self._owner = None

    @property
    def device_id(self) -> int:
        return self.device_id_

    @property
    def is_device_accessible(self) -> bool:
        return bool(self.owner_resource.is_device_accessible)

    @property
    def is_host_accessible(self) -> bool:
        return bool(self.owner_resource.is_host_accessible)


def rebuild_portable(payload: object) -> Buffer:
    """Rebuild body of :func:`gpu_serde.wire.pbuf`: mapped when this process can map it, else the
    copy uploaded. Either way the buffer travels on as the same portable payload (a hop that
    passes it on, such as Dask's scheduler, keeps it portable).

    Raises:
        PayloadError: malformed; HandoffError: as :func:`upload`.
    """
    p = decode_pbuf(payload)
    got = None
    if p.kind is not None:
        # another host, the exporter gone, a refused token, a GPU not seen here: the copy
        with contextlib.suppress(HandoffError, DeviceNotVisibleError):
            got = body(getattr(wire, p.kind))(p.inner)
        if got is not None and handoff.forwarded(got) is None:  # the exporter's own buffer
            got = Buffer.from_handle(int(got.handle), int(got.size), mr=Alias(got))
    if got is None:
        got = upload(p.copy)
    handoff.forward_as(got, (wire.pbuf, (payload,)))
    return got


def _portable_kind(payload: object) -> str:
    d = decode_pbuf(payload).copy.device
    gpu = decode_device(d).canonical_uuid if d is not None else "pinned host memory"
    return f"portable Buffer ({quoted(gpu)})"


define(wire.pbuf, "portable Buffer", rebuild_portable, describe=_portable_kind)


_UNSENT_ERRORS: dict[str, type[HandoffError]] = {
    cls.__name__: cls
    for cls in (
        HandoffError,
        HostCopyError,
        NotIPCEnabledError,
        OtherHostError,
        ExporterGoneError,
        TokenRefusedError,
    )
}


def unsent(what: str, error: Exception) -> tuple[Any, ...]:
    """``(gpu_serde.wire.unsent, (payload,))``: ``what`` could not be sent, for ``error`` (a
    typed error keeps its type at the receiver; any other is a ``HandoffError`` there)."""
    kind = type(error).__name__ if type(error).__name__ in _UNSENT_ERRORS else "HandoffError"
    message = f"{type(error).__name__}: {error}" if kind == "HandoffError" else str(error)
    return (wire.unsent, ((VERSION, what[:4000], kind, message[:4000]),))


def rebuild_unsent(payload: object) -> None:
    """Rebuild body of :func:`gpu_serde.wire.unsent`: always raises the sender's error.

    Raises:
        HandoffError: of the sender's type (:class:`~gpu_serde.HostCopyError`, ...), saying that
            the sender could not send it and why; PayloadError: malformed.
    """
    p = decode_unsent(payload)
    cls = _UNSENT_ERRORS.get(p.error, HandoffError)
    raise cls(f"the sender could not send this {safe(p.what)}: {safe(p.message)}")


define(wire.unsent, "unsent object", rebuild_unsent)
