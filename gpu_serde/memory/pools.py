"""IPC-enabled ``DeviceMemoryResource`` and ``PinnedMemoryResource`` pools and their buffers,
reduce and rebuild side by side.

A pool travels as its device's UUID (none for a pinned host pool), the exporting host's kernel
``boot_id`` and a token for the exporter's descriptor broker (:mod:`gpu_serde.memory.broker`); the
receiver checks the host, resolves the device, fetches the pool's descriptor and imports the pool
once per process. A buffer travels as its pool plus cuda.core's 64-byte IPC descriptor and a token
under which the exporter keeps the buffer alive until its importers have released it (or the
exporter exits): the lifetime protocol of :mod:`gpu_serde.memory.lifetime`. A pool is imported
once per exporter and descriptor in a process, whatever pool id a payload claims (the broker
checks the claim). Failures while rebuilding become placeholders (:mod:`gpu_serde.placeholders`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from cuda.core import Buffer, Device, DeviceMemoryResource, PinnedMemoryResource

from gpu_serde import compat, wire
from gpu_serde.device import device_payload
from gpu_serde.errors import HandoffError, NotIPCEnabledError
from gpu_serde.format.device import VERSION
from gpu_serde.format.memory import (
    BufferPayload,
    PoolPayload,
    decode_buffer,
    decode_pool,
    pool_identity,
)
from gpu_serde.hostid import host_id
from gpu_serde.memory import broker as _broker
from gpu_serde.memory import driver as _driver
from gpu_serde.memory import lifetime
from gpu_serde.memory.lifetime import Import, Imported

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
#: (broker address, descriptor token) -> the pool imported here and the payload it was imported
#: for (checked by the exporter's broker): one import per real descriptor, whatever a payload claims
_imported: dict[tuple[str, bytes], tuple[Pool, object]] = {}
_importing: dict[tuple[str, bytes], threading.Lock] = {}  # a lock per descriptor being imported


_left_by_fork: list[Any] = []


def _forget_after_fork() -> None:
    """A forked child imports afresh (CUDA does not survive a fork, and a receive there says so):
    its parent's imported pools are kept, never freed (freeing calls the driver, which a forked
    child must not do before it execs), and still travel on as they came
    (:mod:`~gpu_serde.memory.lifetime` forwards them), as a parent's arena regions do; a lock
    another thread held at the fork is not waited for."""
    global _importing
    _left_by_fork.append(dict(_imported))
    _imported.clear()
    _importing = {}


os.register_at_fork(after_in_child=_forget_after_fork)


def pool_payload(mr: Pool) -> tuple[Any, ...]:
    """The wire payload of an IPC-enabled pool (an imported one travels on as it came); the
    same tuple every time.

    Raises:
        NotIPCEnabledError: the pool is not IPC-enabled (or closed), or not a pool gpu_serde
            sends.
        HandoffError: this process was forked from the pool's (:func:`lifetime.not_forked`).
    """
    origin = lifetime.forwarded(mr)
    if origin is not None:
        return origin[1][0]  # type: ignore[no-any-return]
    lifetime.not_forked(type(mr).__name__)
    kind = next((k for k in _FIX if isinstance(mr, k)), None)
    if kind is not None and getattr(mr, "is_closed", False):  # it reads as not IPC-enabled
        raise NotIPCEnabledError(  # the same type: a live buffer of it still goes by value
            f"this {type(mr).__name__} is closed: a closed pool cannot be sent (send it before "
            "closing it, and keep it open while what was sent from it is in use)"
        )
    if kind is None or not mr.is_ipc_enabled:
        raise NotIPCEnabledError(
            f"this {type(mr).__name__} cannot be sent to another process: "
            + (
                f"its pool is not IPC-enabled. Create it with {_FIX[kind]}"
                if kind is not None
                else "only IPC-enabled DeviceMemoryResource and PinnedMemoryResource pools (and "
                "VirtualMemoryResource, by its settings) can"
            )
        )
    pool = mr.uuid.bytes
    with lifetime.lock:
        sent = _exported.get(pool)
        if sent is None:
            dev = device_payload(Device(mr.device_id)) if kind is DeviceMemoryResource else None
            b = _broker.broker()
            token = b.offer(int(mr.allocation_handle), pool_identity(pool, dev, host_id()))
            p = PoolPayload(VERSION, dev, host_id(), b.address, token, pool)
            sent = _exported[pool] = (p, p.wire())
            _exported_pools[pool] = mr
    return sent[1]


def reduce_pool(mr: Pool) -> tuple[Any, ...]:
    """Reducer for ``DeviceMemoryResource`` and ``PinnedMemoryResource``:
    ``(gpu_serde.wire.pool, (payload,))``.

    Raises:
        NotIPCEnabledError: the pool is not IPC-enabled, or closed.
    """
    origin = lifetime.forwarded(mr)
    if origin is not None:
        return origin
    return (wire.pool, (pool_payload(mr),))


def import_pool(p: PoolPayload, wire_payload: object) -> Pool:
    """The pool that payload ``p`` names: imported here once per exporter and descriptor (also
    when threads race), or the original back in its exporter.

    Raises:
        OtherHostError, DeviceNotVisibleError, ExporterGoneError, TokenRefusedError,
        HandoffError: why it cannot be imported here (TokenRefusedError also for a payload that
        names another pool than its descriptor's).
    """
    key = (p.address, p.token)
    with lifetime.lock:
        home = _exported_pools.get(p.pool) if _broker.is_own(p.address) else None
        if home is not None:
            return home  # back in the exporting process: the original pool
        importing = _importing.setdefault(key, threading.Lock())
    with importing:  # one import per descriptor; others wait for it, nothing else does
        try:
            return _import_once(p, wire_payload, key)
        finally:
            with lifetime.lock:
                if key not in _imported:  # failed: nothing kept for a token that did not work
                    _importing.pop(key, None)


def _import_once(p: PoolPayload, wire_payload: object, key: tuple[str, bytes]) -> Pool:
    known = _imported.get(key)
    if known is not None:
        if known[1] != wire_payload:
            raise HandoffError(
                "this payload names a pool other than the one imported here for its descriptor "
                "token: refused (a forged or corrupted payload)"
            )
        return known[0]
    if p.device is None:  # a pinned host pool
        lifetime.check_host(p.boot, "Pinned host memory")
        dev = _driver.any_device()
    else:
        dev = Device(lifetime.local_ordinal(p.device, p.boot, "GPU memory"))
    fd = _broker.fetch(p.address, p.token, p.identity)
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
        raise HandoffError(
            f"importing the memory pool failed: {exc} (did its exporter close the pool after "
            "sending it? A pool must stay open while what was sent from it is in use)"
        ) from exc
    with lifetime.lock:
        _imported[key] = (mr, wire_payload)
        lifetime.remember(mr, (wire.pool, (wire_payload,)))
    return mr


def rebuild_pool(payload: object) -> Pool:
    """Rebuild body of :func:`gpu_serde.wire.pool`.

    Raises:
        PayloadError: malformed; and as :func:`import_pool`.
    """
    return import_pool(decode_pool(payload), payload)


def pool_kind(payload: object) -> str:
    """What a pool payload is, for messages: a device or a pinned pool."""
    return "PinnedMemoryResource" if decode_pool(payload).device is None else "DeviceMemoryResource"


def reduce_buffer(buf: Buffer, mr: Pool) -> tuple[Any, ...]:
    """Reducer body for a buffer of an IPC-enabled pool: ``(gpu_serde.wire.buf, (payload,))``;
    keeps ``buf`` alive for its importers.

    Raises:
        NotIPCEnabledError: its pool is not IPC-enabled.
        HandoffError: it is closed (closing a pool's buffer frees its memory).
    """
    pool = pool_payload(mr)

    def make() -> tuple[bytes, tuple[Any, ...]]:
        reserved, size = buf.ipc_descriptor.__reduce__()[1]
        p = BufferPayload(VERSION, decode_pool(pool), bytes(reserved), int(size), b"")
        token = lifetime.hold(buf, p.block, lifetime.let_go_in_context)
        return token, p._replace(token=token).wire()

    return lifetime.send(buf, wire.buf, make, survives_close=False)


class ImportedMemory(Imported):
    """The memory resource of a buffer received from another process's pool
    (``buf.memory_resource`` on the receiver).

    It reads like the imported pool (:attr:`pool`, ``device_id``, accessibility) and cannot
    allocate. Freeing the buffer tells the exporter, which may then free and reuse the memory
    (:class:`~gpu_serde.memory.lifetime.Imported` says when). The driver keeps the mapping
    cached, so a later buffer in the same pool memory maps at almost no cost.
    """

    refusal = (
        "a buffer received from another process cannot allocate more memory: allocate "
        "from the pool in the exporting process and send the buffer"
    )

    def __init__(self, owner: Buffer, pool: Pool, device: int, hold: Import) -> None:
        super().__init__(hold, device)
        self._owner: Buffer | None = owner
        self.pool = pool  #: the imported pool the buffer was mapped from

    def _free(self, ptr: int, size: int, stream: Any) -> None:
        owner = self._owner
        if owner is not None and owner.handle:
            owner.close(stream)
        self._owner = None

    @property
    def device_id(self) -> int:
        return int(self.pool.device_id)

    @property
    def is_device_accessible(self) -> bool:
        return bool(self.pool.is_device_accessible)

    @property
    def is_host_accessible(self) -> bool:
        return bool(self.pool.is_host_accessible)

    def __repr__(self) -> str:
        return f"<ImportedMemory of {self.pool!r}>"


def rebuild_buffer(payload: object) -> Buffer:
    """Rebuild body of :func:`gpu_serde.wire.buf`: the exporter's buffer mapped here without a
    copy, or the original back in its exporter.

    Raises:
        PayloadError: malformed; and as :func:`import_pool`, or ``HandoffError`` when the mapping
        fails.
    """
    p = decode_buffer(payload)
    mr = import_pool(p.pool, payload[1])  # type: ignore[index]  # a tuple: decode_buffer checked
    if mr is _exported_pools.get(p.pool.pool):
        held = _broker.broker().peek(p.token, p.block)
        if held is not None:
            return lifetime.back_home(held)  # back in the exporter: the original
    dev = Device(mr.device_id) if mr.device_id >= 0 else _driver.any_device()
    with Import(p.pool.address, p.token, p.block, dev.device_id) as hold:
        try:
            dev.set_current()
            desc = compat.ipc_buffer_descriptor(p.reserved, p.size)
            owner = Buffer.from_ipc_descriptor(mr, desc, stream=dev.default_stream)
        except Exception as exc:
            raise HandoffError(
                f"mapping the exported buffer failed: {exc}. If its sender closed it (or let "
                "it be collected) before this process mapped it, its memory is gone: a pool's "
                "buffer is freed by close, whatever was sent. Keep it open until its receivers "
                "have it, or allocate what you send from an ArenaMemoryResource (a sent block "
                "stays until its receivers let go)"
            ) from exc
        imported = ImportedMemory(owner, mr, dev.device_id, hold)
        buf = imported.hand_out(Buffer.from_handle(int(owner.handle), p.size, mr=imported))
        hold.keep(buf, (wire.buf, (payload,)))
    return buf
