"""GPU memory across processes: IPC-enabled ``DeviceMemoryResource`` and ``PinnedMemoryResource``
pools and their buffers.

A pool travels as its device's UUID (none for a pinned host pool), the exporting host's kernel
``boot_id`` and a token for the exporter's descriptor broker (:mod:`gpu_serde.fdshare`); the
receiver checks the host, resolves the device, fetches the pool's descriptor and imports the pool
once per process. A buffer travels as
its pool plus cuda.core's 64-byte IPC descriptor and a token under which the exporter keeps the
buffer alive until its importers have released it (or the exporter exits).

Failures while rebuilding never raise (a raising reconstructor kills a Dask worker): they give an
:class:`~gpu_serde.UnresolvedObject` placeholder that raises the typed error when used (or, under
``install(strict=True)``, raise at once).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing.util
import os
import queue
import threading
import time
import uuid as _uuid
import weakref

from cuda.bindings import driver
from cuda.core import (
    Buffer,
    Device,
    DeviceMemoryResource,
    EventOptions,
    MemoryResource,
    PinnedMemoryResource,
    Stream,
    VirtualMemoryResource,
)

from gpu_serde import fdshare, wire
from gpu_serde import inventory as _inventory
from gpu_serde.errors import (
    DeviceNotVisibleError,
    HandoffError,
    NotIPCEnabledError,
    OtherHostError,
)
from gpu_serde.payload import decode_device

#: Seconds the exporter still keeps a buffer after its last importer released it, so that a hop
#: (a Dask scheduler, a Ray task passing it on) that imported and dropped it does not free it
#: under the next importer. Set it before the first export.
RELEASE_GRACE_S = float(os.environ.get("GPU_SERDE_RELEASE_GRACE_S", "5"))

_lock = threading.RLock()
_exported: dict[bytes, tuple] = {}  # pool uuid -> payload, for pools this process exports
_exported_pools: dict[bytes, Pool] = {}
_imported: dict[bytes, Pool] = {}  # pool uuid -> the pool imported here
_origin: dict[int, tuple] = {}  # id(imported pool) -> its payload; id(imported buffer) -> reduction
_sent: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # buffer -> its payload (one hold)


Pool = DeviceMemoryResource | PinnedMemoryResource
_FIX = {
    DeviceMemoryResource: "DeviceMemoryResource(device, DeviceMemoryResourceOptions("
    "ipc_enabled=True, max_size=...))",
    PinnedMemoryResource: "PinnedMemoryResource(PinnedMemoryResourceOptions(ipc_enabled=True, "
    "max_size=...))",
}


def _boot_id() -> bytes:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return _uuid.UUID(f.read().strip()).bytes


BOOT_ID = _boot_id()


def _pool_payload(mr: Pool) -> tuple:
    origin = _origin.get(id(mr))
    if origin is not None:
        return origin  # an imported pool travels on as it came
    kind = next((k for k in _FIX if isinstance(mr, k)), None)
    if kind is None or not mr.is_ipc_enabled:
        raise NotIPCEnabledError(
            f"{mr!r} cannot be sent to another process: "
            + (
                f"its pool is not IPC-enabled. Create it with {_FIX[kind]}"
                if kind in _FIX
                else "only IPC-enabled DeviceMemoryResource and PinnedMemoryResource pools (and "
                "VirtualMemoryResource, by its settings) can"
            )
        )
    pool = mr.uuid.bytes
    with _lock:
        p = _exported.get(pool)
        if p is None:
            from gpu_serde.reducers import device_payload

            is_device = kind is DeviceMemoryResource
            dev_payload = device_payload(Device(mr.device_id)) if is_device else None
            token = fdshare.broker().offer(int(mr.allocation_handle))
            p = (1, dev_payload, BOOT_ID, fdshare.broker().address, token, pool)
            _exported[pool], _exported_pools[pool] = p, mr
    return p


def reduce_pool(mr: Pool) -> tuple:
    """Reducer for ``DeviceMemoryResource`` and ``PinnedMemoryResource``:
    ``(gpu_serde.wire.pool, (payload,))``.

    Raises:
        NotIPCEnabledError: the pool is not IPC-enabled.
    """
    return (wire.pool, (_pool_payload(mr),))


def _import_pool(p: tuple) -> Pool:
    """Import (once per process) the pool a validated payload names, or raise why not."""
    with _lock:  # one import per pool, also when threads race
        return _import_pool_locked(p)


def _check_host(boot: bytes, what: str) -> None:
    if boot != BOOT_ID:
        raise OtherHostError(
            f"{what} reached host {_inventory.inventory().host!r}, another host: GPU memory "
            "crosses processes only on the host that exported it. Copy it to host memory first, "
            "or run this work on that host."
        )


def any_device() -> Device:
    """This thread's current Device, or the first visible one, for work that needs a context but
    no particular GPU (pinned host memory).

    Raises:
        HandoffError: this process sees no GPU.
    """
    inv = _inventory.inventory()
    if not inv.devices:
        raise HandoffError(
            "host memory (a pinned pool, or a VirtualMemoryResource of host memory) needs a CUDA "
            f"device in the receiving process to map it, and this process sees none: "
            f"{inv.describe()}"
        )
    return Device()


def _import_pool_locked(p: tuple) -> Pool:
    _, dev_payload, boot, address, token, pool = p
    home = _exported_pools.get(pool)
    if home is not None:
        return home  # back in the exporting process: the original pool
    mr = _imported.get(pool)
    if mr is not None:
        return mr
    if dev_payload is None:  # a pinned host pool
        _check_host(boot, "Pinned host memory")
        dev = any_device()
    else:
        d = decode_device(dev_payload)
        _check_host(boot, f"GPU memory from host {d.host!r} (pid {d.pid}, GPU {d.canonical_uuid})")
        inv = _inventory.inventory()
        ordinal = inv.by_uuid.get(d.uuid)
        if ordinal is None:
            raise wire.not_visible_error(d, inv)
        dev = Device(ordinal)
    fd = fdshare.fetch(address, token)
    try:
        dev.set_current()
        if dev_payload is None:
            mr = PinnedMemoryResource.from_allocation_handle(fd)
        else:
            mr = DeviceMemoryResource.from_allocation_handle(dev, fd)
    except Exception as exc:
        raise HandoffError(f"importing the memory pool failed: {exc}") from exc
    finally:
        os.close(fd)
    _imported[pool] = mr
    _origin[id(mr)] = p
    return mr


def rebuild_pool(p: tuple) -> Pool | wire.UnresolvedObject:
    """Reconstructor body of :func:`gpu_serde.wire.pool` (payload already validated)."""
    try:
        return _import_pool(p)
    except (HandoffError, DeviceNotVisibleError) as exc:
        if wire.strict:
            raise
        kind = "DeviceMemoryResource" if p[1] is not None else "PinnedMemoryResource"
        return wire.UnresolvedObject(kind, wire.pool, p, exc)


def _let_go(buf: Buffer) -> None:
    """Runs in the broker's release thread when the last importer released ``buf``."""
    # freeing needs a context in this thread: the buffer's device's, or any for pinned memory
    (Device(buf.device_id) if buf.device_id >= 0 else Device()).set_current()


def reduce_buffer(buf: Buffer) -> tuple:
    """Reducer for ``Buffer``: ``(gpu_serde.wire.buf, (payload,))``; keeps ``buf`` alive for its
    importers.

    Raises:
        HandoffError: the buffer is closed.
        NotIPCEnabledError: the buffer does not come from an IPC-enabled pool
            (``DeviceMemoryResource``, ``PinnedMemoryResource``) or a ``VirtualMemoryResource``
            that exports POSIX descriptors.
    """
    if not buf.handle:  # a received one would forward a token its exporter may have let go
        raise HandoffError(
            "this Buffer is closed: a closed buffer cannot be sent; send it before you close it"
        )
    origin = _origin.get(id(buf))
    if origin is not None:
        return origin
    mr = buf.memory_resource
    if isinstance(mr, VirtualMemoryResource):
        from gpu_serde import vmm

        return vmm.reduce_buffer(buf, mr)
    if not isinstance(mr, (DeviceMemoryResource, PinnedMemoryResource)):
        raise NotIPCEnabledError(
            f"{buf!r} cannot be sent to another process without a copy: only buffers allocated "
            "from an IPC-enabled DeviceMemoryResource or PinnedMemoryResource (or a "
            "VirtualMemoryResource) can"
        )
    pool = _pool_payload(mr)
    b = fdshare.broker()
    with _lock:
        sent = _sent.get(buf)
        if sent is None or b.peek(sent[4]) is not buf:  # first time, or let go since
            reserved, size = buf.ipc_descriptor.__reduce__()[1]
            token = b.hold(buf, _let_go, grace=RELEASE_GRACE_S)
            sent = _sent[buf] = (1, pool, bytes(reserved), int(size), token)
    return (wire.buf, (sent,))


# Releases: a buffer's free (or finalizer) only puts on a queue (it may run inside garbage
# collection, in any thread, so it takes no lock and does no I/O); one worker thread waits for the
# free to complete and tells the exporters.
_releases: queue.SimpleQueue = queue.SimpleQueue()
_live: dict[int, tuple[str, bytes, int]] = {}  # id(imported buffer) -> (address, token, device)
_sending = threading.Lock()  # held by the worker while it tells one exporter


_WHOLE_DEVICE = "device"  # release after the whole device is idle (the free is queued)


def _tell(event: object, address: str, token: bytes, device: int) -> None:
    """Tell the exporter once this process's free of the buffer has completed on the GPU (CUDA's
    rule for imported pool memory: the importer's free completes before the exporter's)."""
    try:
        if event is None:
            # a finalizer ran just before its Buffer queued the free: let that happen
            time.sleep(0.01)
        if event is None or event is _WHOLE_DEVICE:
            raise LookupError  # no stream says when the work on it is done: the whole device
        event.sync()  # the event follows the free on the stream that was named
    except Exception:
        with contextlib.suppress(Exception):
            Device(device).set_current()
            Device(device).sync()
    fdshare.release(address, token)


#: Seconds without a release after which an importer unmaps the memory it has freed. The driver
#: unmaps freed imported memory lazily, at this process's next synchronisation (any stream): until
#: then, a buffer sent again from the same pool memory maps at no cost; after it, the unmapping
#: would fall on the user's next synchronisation, so the release thread does it in the background
#: on a stream of its own (which waits for no one's work).
UNMAP_AFTER_S = 0.05
_unmap_streams: dict[int, object] = {}  # device ordinal -> the release thread's idle stream


def _unmap(devices: set[int]) -> None:
    for ordinal in devices:
        with contextlib.suppress(Exception):
            Device(ordinal).set_current()
            stream = _unmap_streams.get(ordinal)
            if stream is None:
                stream = _unmap_streams[ordinal] = Device(ordinal).create_stream()
            stream.sync()  # nothing runs on it: it only lets the driver unmap what was freed


def _release_worker() -> None:
    freed: set[int] = set()  # devices with freed imported memory the driver may still map
    while True:
        try:
            item = _releases.get(timeout=UNMAP_AFTER_S if freed else None)
        except queue.Empty:
            _unmap(freed)
            freed.clear()
            continue
        with _sending, contextlib.suppress(Exception):  # a dead worker would stop all releases
            _tell(*item)
        if item[0] is not None and item[0] is not _WHOLE_DEVICE and item[3] >= 0:
            freed.add(item[3])


def _start_release_worker() -> None:
    threading.Thread(target=_release_worker, name="gpu_serde-release", daemon=True).start()


_start_release_worker()


def _forget(key: int, release: bool = True) -> None:
    _origin.pop(key, None)
    if release:
        _queue_release(key, None)


def _queue_release(key: int, event: object) -> None:
    item = _live.pop(key, None)
    if item is not None:
        _releases.put((event, *item))


def _release_all_at_exit() -> None:
    """An importer that exits tells the exporters about everything it held or had released."""
    got = _sending.acquire(timeout=2)  # let a release in flight finish
    try:
        _flush_all()
    finally:
        if got:
            _sending.release()


def _flush_all() -> None:
    items = []
    while _live:  # popitem: a free in another thread cannot queue an entry taken here too
        with contextlib.suppress(KeyError):
            items.append((None, *_live.popitem()[1]))
    while True:
        try:
            items.append(_releases.get_nowait())
        except queue.Empty:
            break
    for event, address, token, _ in items:
        with contextlib.suppress(Exception):
            if event is not None and event is not _WHOLE_DEVICE:
                event.sync()  # a buffer closed on a stream just before exit
        with contextlib.suppress(Exception):
            fdshare.release(address, token, timeout=0.5)


def _after_fork_in_child() -> None:
    """A forked child holds none of its parent's imports: it must neither release them at exit
    nor lose its own releases (the worker thread did not survive the fork)."""
    global _sending, _lock
    _live.clear()
    _origin.clear()
    _unmap_streams.clear()
    with contextlib.suppress(queue.Empty):
        while True:
            _releases.get_nowait()
    _sending, _lock = threading.Lock(), threading.RLock()
    _start_release_worker()
    multiprocessing.util.Finalize(None, _release_all_at_exit, exitpriority=100)


class _AfterFork:
    """multiprocessing clears its exit finalizers in a child it forks, after ``os.fork``'s
    hooks; this re-registers ours afterwards (``register_after_fork`` runs later)."""


_after_fork_key = _AfterFork()
atexit.register(_release_all_at_exit)
multiprocessing.util.Finalize(None, _release_all_at_exit, exitpriority=100)  # mp children
multiprocessing.util.register_after_fork(
    _after_fork_key,
    lambda _: multiprocessing.util.Finalize(None, _release_all_at_exit, exitpriority=100),
)
os.register_at_fork(after_in_child=_after_fork_in_child)


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
        self._user: weakref.ref | None = None  # the Buffer handed out, once made
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
        event: object = _WHOLE_DEVICE
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
        _queue_release(self._key, event)

    @property
    def device_id(self) -> int:
        return self.pool.device_id

    @property
    def is_device_accessible(self) -> bool:
        return self.pool.is_device_accessible

    @property
    def is_host_accessible(self) -> bool:
        return self.pool.is_host_accessible

    @property
    def is_mapped(self) -> bool:
        """True: the memory is mapped from another process."""
        return True

    def __repr__(self) -> str:
        return f"<ImportedMemory of {self.pool!r}>"


def rebuild_buffer(p: tuple) -> Buffer | wire.UnresolvedObject:
    """Reconstructor body of :func:`gpu_serde.wire.buf` (payload already validated)."""
    _, pool_payload, reserved, size, token = p
    address = pool_payload[3]
    try:
        mr = _import_pool(pool_payload)
        with _lock:
            home = pool_payload[5] in _exported_pools
        held = fdshare.broker().peek(token) if home else None
        if held is not None:
            return held  # back in the exporting process: the original buffer
        fdshare.acquire(address, token)
        key = -next(_keys)  # negative: never an id(), the keys of VMM imports in _live
        _live[key] = (address, token, -1)
        imported = None
        try:
            from cuda.core._memory._ipc import IPCBufferDescriptor  # not public in cuda.core 1.2

            dev = Device(mr.device_id) if mr.device_id >= 0 else any_device()
            dev.set_current()
            desc = IPCBufferDescriptor._init(reserved, size)
            owner = Buffer.from_ipc_descriptor(mr, desc, stream=dev.default_stream)
            _live[key] = (address, token, dev.device_id)
            imported = ImportedMemory(owner, mr, dev.device_id, key)
            buf = Buffer.from_handle(int(owner.handle), size, mr=imported)
            imported._user = weakref.ref(buf)
        except Exception as exc:
            if imported is not None:
                imported.deallocate(0, size)  # frees the mapping, queues the release
            else:
                _live.pop(key, None)
                fdshare.release(address, token)
            raise HandoffError(f"mapping the exported buffer failed: {exc}") from exc
    except (HandoffError, DeviceNotVisibleError) as exc:
        if wire.strict:
            raise
        return wire.UnresolvedObject("Buffer", wire.buf, p, exc)
    _origin[id(buf)] = (wire.buf, (p,))
    weakref.finalize(buf, _forget, id(buf), False)  # ImportedMemory releases it
    return buf


_keys = itertools.count(1)  # keys of imported pool buffers (ImportedMemory) in _live


def track_import(buf: Buffer, reduced: tuple, address: str, token: bytes, device: int) -> None:
    """Remember an imported buffer: it is forwarded as it came (``reduced``), and its exporter is
    told (``token``) once it is collected or this process exits."""
    _origin[id(buf)] = reduced
    _live[id(buf)] = (address, token, device)
    weakref.finalize(buf, _forget, id(buf))
