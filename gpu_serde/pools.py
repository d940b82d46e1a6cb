"""IPC-enabled ``DeviceMemoryResource`` and ``PinnedMemoryResource`` pools and their buffers,
reduce and rebuild side by side.

A pool travels as its device's UUID (none for a pinned host pool), the exporting host's kernel
``boot_id`` and a token for the exporter's descriptor broker (:mod:`gpu_serde.broker`); the
receiver checks the host, resolves the device, fetches the pool's descriptor and imports the pool
once per process. A buffer travels as its pool plus cuda.core's 64-byte IPC descriptor and a token
under which the exporter keeps the buffer alive until its importers have released it (or the
exporter exits). Failures while rebuilding become placeholders (:mod:`gpu_serde.placeholders`).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any

from cuda.bindings import driver
from cuda.core import (
    Buffer,
    Device,
    DeviceMemoryResource,
    EventOptions,
    MemoryResource,
    PinnedMemoryResource,
    Stream,
)

from gpu_serde import broker as _broker
from gpu_serde import compat, handoff, wire
from gpu_serde import inventory as _inventory
from gpu_serde.device import device_payload
from gpu_serde.errors import HandoffError, NotIPCEnabledError
from gpu_serde.hostid import host_id
from gpu_serde.memory_payload import BufferPayload, PoolPayload, decode_buffer, decode_pool
from gpu_serde.payload import VERSION, decode_device
from gpu_serde.placeholders import define, not_visible_error
from gpu_serde.text import quoted

Pool = Any  # DeviceMemoryResource | PinnedMemoryResource (cuda.core has no types: see compat)
_FIX = {
    DeviceMemoryResource: "DeviceMemoryResource(device, DeviceMemoryResourceOptions("
    "ipc_enabled=True, max_size=...))",
    PinnedMemoryResource: "PinnedMemoryResource(PinnedMemoryResourceOptions(ipc_enabled=True, "
    "max_size=...))",
}
#: pool uuid -> its payload and the one wire tuple of it, for pools this process exports (one
#: tuple: a pickle of a pool and its buffers holds it once, as release 0.1.0 wrote it)
_exported: dict[bytes, tuple[PoolPayload, tuple[Any, ...]]] = {}
_exported_pools: dict[bytes, Pool] = {}
_imported: dict[bytes, Pool] = {}  # pool uuid -> the pool imported here


def pool_payload(mr: Pool) -> tuple[Any, ...]:
    """The wire payload of an IPC-enabled pool (an imported one travels on as it came); the
    same tuple every time.

    Raises:
        NotIPCEnabledError: the pool is not IPC-enabled, or not a pool gpu_serde sends.
    """
    origin = handoff.forwarded(mr)
    if origin is not None:
        return origin[1][0]  # type: ignore[no-any-return]
    kind = next((k for k in _FIX if isinstance(mr, k)), None)
    if kind is None or not mr.is_ipc_enabled:
        raise NotIPCEnabledError(
            f"{mr!r} cannot be sent to another process: "
            + (
                f"its pool is not IPC-enabled. Create it with {_FIX[kind]}"
                if kind is not None
                else "only IPC-enabled DeviceMemoryResource and PinnedMemoryResource pools (and "
                "VirtualMemoryResource, by its settings) can"
            )
        )
    pool = mr.uuid.bytes
    with handoff.lock:
        sent = _exported.get(pool)
        if sent is None:
            dev = device_payload(Device(mr.device_id)) if kind is DeviceMemoryResource else None
            b = _broker.broker()
            token = b.offer(int(mr.allocation_handle))
            p = PoolPayload(VERSION, dev, host_id(), b.address, token, pool)
            sent = _exported[pool] = (p, p.wire())
            _exported_pools[pool] = mr
    return sent[1]


def reduce_pool(mr: Pool) -> tuple[Any, ...]:
    """Reducer for ``DeviceMemoryResource`` and ``PinnedMemoryResource``:
    ``(gpu_serde.wire.pool, (payload,))``.

    Raises:
        NotIPCEnabledError: the pool is not IPC-enabled.
    """
    origin = handoff.forwarded(mr)
    return origin if origin is not None else (wire.pool, (pool_payload(mr),))


def import_pool(p: PoolPayload, wire_payload: object) -> Pool:
    """The pool that payload ``p`` names: imported here once per process (also when threads
    race), or the original back in its exporter.

    Raises:
        OtherHostError, DeviceNotVisibleError, ExporterGoneError, TokenRefusedError,
        HandoffError: why it cannot be imported here.
    """
    with handoff.lock:
        home = _exported_pools.get(p.pool)
        if home is not None:
            return home  # back in the exporting process: the original pool
        mr = _imported.get(p.pool)
        if mr is not None:
            return mr
        if p.device is None:  # a pinned host pool
            handoff.check_host(p.boot, "Pinned host memory")
            dev = handoff.any_device()
        else:
            d = decode_device(p.device)
            where = f"host {quoted(d.host)} (pid {d.pid}, GPU {d.canonical_uuid})"
            handoff.check_host(p.boot, f"GPU memory from {where}")
            ordinal = _inventory.local_ordinal(d.uuid)
            if ordinal is None:
                raise not_visible_error(d, _inventory.inventory())
            dev = Device(ordinal)
        fd = _broker.fetch(p.address, p.token)
        try:
            handle = compat.allocation_handle(fd, p.pool)  # owns fd from here on
        except Exception:
            os.close(fd)
            raise
        try:
            dev.set_current()
            if p.device is None:
                mr = PinnedMemoryResource.from_allocation_handle(handle)
            else:
                mr = DeviceMemoryResource.from_allocation_handle(dev, handle)
        except Exception as exc:
            with contextlib.suppress(Exception):
                handle.close()
            raise HandoffError(f"importing the memory pool failed: {exc}") from exc
        _imported[p.pool] = mr
        handoff.remember(mr, (wire.pool, (wire_payload,)))
        return mr


def rebuild_pool(payload: object) -> Pool:
    """Rebuild body of :func:`gpu_serde.wire.pool`.

    Raises:
        PayloadError: malformed; and as :func:`import_pool`.
    """
    return import_pool(decode_pool(payload), payload)


def _pool_kind(payload: object) -> str:
    return "PinnedMemoryResource" if decode_pool(payload).device is None else "DeviceMemoryResource"


define(wire.pool, "memory pool", rebuild_pool, describe=_pool_kind)


def reduce_buffer(buf: Buffer, mr: Pool) -> tuple[Any, ...]:
    """Reducer body for a buffer of an IPC-enabled pool: ``(gpu_serde.wire.buf, (payload,))``;
    keeps ``buf`` alive for its importers.

    Raises:
        NotIPCEnabledError: its pool is not IPC-enabled.
    """
    pool = pool_payload(mr)

    def make() -> tuple[bytes, tuple[Any, ...]]:
        reserved, size = buf.ipc_descriptor.__reduce__()[1]
        token = _broker.broker().hold(buf, handoff.let_go, grace=handoff.RELEASE_GRACE_S)
        return token, (VERSION, pool, bytes(reserved), int(size), token)  # BufferPayload's form

    return (wire.buf, (handoff.sent_payload(buf, make),))


class ImportedMemory(MemoryResource):
    """The memory resource of a buffer received from another process's pool
    (``buf.memory_resource`` on the receiver).

    It reads like the imported pool (:attr:`pool`, ``device_id``, accessibility) and cannot
    allocate. Freeing the buffer tells the exporter, which may then free and reuse the memory:

    - ``buf.close(stream)`` (or ``buf.close()``: the device's default stream) frees the mapping on
      that stream, and the exporter is told once an event after the free has completed. Work on
      the buffer must be ordered before that stream, as for any cuda.core buffer. The driver keeps
      the mapping cached, so a later buffer in the same pool memory maps at almost no cost.
    - A buffer collected without ``close`` is freed on the default stream, and the exporter is
      told only once the whole device is idle (nobody said which stream used it last).
    """

    def __init__(self, owner: Buffer, pool: Pool, device: int, key: int) -> None:
        self._owner: Buffer | None = owner
        self._device = device
        self._key = key
        self._user: weakref.ref[Any] | None = None  # the Buffer handed out, once made
        self.pool = pool  #: the imported pool the buffer was mapped from

    def allocate(self, size: int, stream: Stream | None = None) -> Buffer:
        """Refused: imported memory belongs to the exporter.

        Raises:
            TypeError: always; allocate in the exporting process, from its pool.
        """
        raise TypeError(
            "a buffer received from another process cannot allocate more memory: allocate "
            "from the pool in the exporting process and send the buffer"
        )

    def deallocate(self, ptr: int, size: int, stream: Stream | None = None) -> None:
        """Free the mapping on ``stream`` (else the device's default stream) and queue the
        exporter's release. Never raises (it may run during garbage collection, in any thread).
        """
        owner, self._owner = self._owner, None
        if owner is None:
            return
        # during collection the Buffer's weak references are already dead: an explicit close
        # keeps it alive
        closed = self._user is not None and self._user() is not None
        event: object = handoff.WHOLE_DEVICE
        with contextlib.suppress(Exception):
            prev = driver.cuCtxGetCurrent()[1]
            try:
                dev = Device(self._device)
                dev.set_current()
                try:
                    s = stream if stream is not None else dev.default_stream
                    owner.close(s)
                    if closed and isinstance(s, Stream):
                        event = s.record(options=EventOptions(blocking_sync=True))
                except Exception:
                    if owner.handle:  # not freed yet: free it on the default stream
                        owner.close(dev.default_stream)
            finally:
                driver.cuCtxSetCurrent(prev)
        handoff.queue_release(self._key, event)

    @property
    def device_id(self) -> int:
        return int(self.pool.device_id)

    @property
    def is_device_accessible(self) -> bool:
        return bool(self.pool.is_device_accessible)

    @property
    def is_host_accessible(self) -> bool:
        return bool(self.pool.is_host_accessible)

    @property
    def is_mapped(self) -> bool:
        """True: the memory is mapped from another process."""
        return True

    def __repr__(self) -> str:
        return f"<ImportedMemory of {self.pool!r}>"


def _map(p: BufferPayload, mr: Pool, key: int) -> Buffer:
    """Map the exporter's buffer from imported pool ``mr`` (its hold is acquired as ``key``)."""
    imported = None
    try:
        dev = Device(mr.device_id) if mr.device_id >= 0 else handoff.any_device()
        dev.set_current()
        desc = compat.ipc_buffer_descriptor(p.reserved, p.size)
        owner = Buffer.from_ipc_descriptor(mr, desc, stream=dev.default_stream)
        handoff.hold_import(key, p.pool.address, p.token, dev.device_id)
        imported = ImportedMemory(owner, mr, dev.device_id, key)
        buf = Buffer.from_handle(int(owner.handle), p.size, mr=imported)
        imported._user = weakref.ref(buf)
        return buf
    except Exception as exc:
        if imported is not None:
            imported.deallocate(0, p.size)  # frees the mapping, queues the release
        else:
            handoff.drop_import(key)
            _broker.release(p.pool.address, p.token)
        raise HandoffError(f"mapping the exported buffer failed: {exc}") from exc


def rebuild_buffer(payload: object) -> Buffer:
    """Rebuild body of :func:`gpu_serde.wire.buf`: the exporter's buffer mapped here without a
    copy, or the original back in its exporter.

    Raises:
        PayloadError: malformed; and as :func:`import_pool`, or ``HandoffError`` when the mapping
        fails.
    """
    p = decode_buffer(payload)
    mr = import_pool(p.pool, payload[1])  # type: ignore[index]  # a tuple: decode_buffer checked
    with handoff.lock:
        home = p.pool.pool in _exported_pools
    held = _broker.broker().peek(p.token) if home else None
    if held is not None:
        return held  # back in the exporting process: the original buffer
    handoff.start_release_thread()
    _broker.acquire(p.pool.address, p.token)
    key = handoff.new_key()
    handoff.hold_import(key, p.pool.address, p.token, -1)
    buf = _map(p, mr, key)
    handoff.track_import(buf, (wire.buf, (payload,)), key)
    return buf


define(wire.buf, "Buffer", rebuild_buffer)
