"""Arena regions at the driver level: the VMM calls that make, export, map and free a region, the
IPC event that orders a hand-off, and each importing process's cache of the regions it mapped.

A region is one physical allocation (``cuMemCreate``, with a POSIX-descriptor handle) mapped at one
address range. Its exporter (:class:`~gpu_serde.ArenaMemoryResource`) makes it once, exports its
descriptor once (served by the exporter's broker) and sub-allocates it; every importing process
maps it once (:func:`attach`: ``cuMemImportFromShareableHandle``, ``cuMemAddressReserve``,
``cuMemMap``, ``cuMemSetAccess`` for its own device) and keeps the mapping for its life, so a
hand-off afterwards is an offset, with no driver call that grows with its size.

Every call takes the device's primary context for its duration (:func:`context`) and gives the
thread's own back: these run in the user's threads, the broker's and during garbage collection.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cuda.bindings import driver

from gpu_serde import broker as _broker
from gpu_serde import handoff
from gpu_serde import inventory as _inventory
from gpu_serde.errors import HandoffError
from gpu_serde.memory_payload import IPC_EVENT_BYTES, RegionPayload
from gpu_serde.payload import decode_device
from gpu_serde.placeholders import not_visible_error
from gpu_serde.text import quoted

_POSIX_FD = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_SUCCESS = driver.CUresult.CUDA_SUCCESS
_NOT_READY = driver.CUresult.CUDA_ERROR_NOT_READY
_IPC_EVENT = (
    driver.CUevent_flags.CU_EVENT_INTERPROCESS | driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
)
_PLAIN_EVENT = driver.CUevent_flags.CU_EVENT_DISABLE_TIMING


def check(call: str, result: tuple[Any, ...]) -> Any:
    """The value of a driver call's ``(CUresult, value...)``, or a :class:`HandoffError` that
    names the call and the error."""
    err = result[0]
    if err != _SUCCESS:
        raise HandoffError(f"{call} failed: {getattr(err, 'name', err)}")
    return result[1] if len(result) > 1 else None


_contexts: dict[int, Any] = {}  # device ordinal -> its primary context, retained for good
_contexts_lock = threading.Lock()


@contextlib.contextmanager
def context(ordinal: int) -> Iterator[None]:
    """Make device ``ordinal``'s primary context current for the block (pushed, then popped: the
    thread's own context is left as it was)."""
    ctx = _contexts.get(ordinal)
    if ctx is None:
        with _contexts_lock:
            ctx = _contexts.get(ordinal)
            if ctx is None:
                dev = check("cuDeviceGet", driver.cuDeviceGet(ordinal))
                ctx = _contexts[ordinal] = check(
                    "cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(dev)
                )
    check("cuCtxPushCurrent", driver.cuCtxPushCurrent(ctx))
    try:
        yield
    finally:
        driver.cuCtxPopCurrent()


def _prop(ordinal: int) -> Any:
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = _POSIX_FD
    return prop


def _access(ordinal: int) -> list[Any]:
    d = driver.CUmemAccessDesc()
    d.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    d.location.id = ordinal
    d.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return [d]


def granularity(ordinal: int) -> int:
    """The driver's recommended granularity for a region on device ``ordinal`` (2 MiB on an
    H200): a region's size is a multiple of it."""
    flag = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    with context(ordinal):
        return int(
            check(
                "cuMemGetAllocationGranularity",
                driver.cuMemGetAllocationGranularity(_prop(ordinal), flag),
            )
        )


def _map(handle: Any, size: int, ordinal: int) -> int:
    """Reserve an address range, map ``handle`` there and grant device ``ordinal`` access; the
    mapping holds the memory (the caller releases its handle)."""
    ptr = check("cuMemAddressReserve", driver.cuMemAddressReserve(size, 0, 0, 0))
    try:
        check("cuMemMap", driver.cuMemMap(ptr, size, 0, handle, 0))
        try:
            descs = _access(ordinal)
            check("cuMemSetAccess", driver.cuMemSetAccess(ptr, size, descs, len(descs)))
        except Exception:
            driver.cuMemUnmap(ptr, size)
            raise
    except Exception:
        driver.cuMemAddressFree(ptr, size)
        raise
    return int(ptr)


def create(ordinal: int, size: int) -> int:
    """Make a region of ``size`` bytes (a multiple of :func:`granularity`) on device ``ordinal``,
    exportable as a POSIX descriptor; returns its address here.

    Raises:
        HandoffError: the driver refused (its error named: CUDA_ERROR_OUT_OF_MEMORY, ...).
    """
    with context(ordinal):
        handle = check("cuMemCreate", driver.cuMemCreate(size, _prop(ordinal), 0))
        try:
            return _map(handle, size, ordinal)
        finally:
            driver.cuMemRelease(handle)  # the mapping keeps the memory


def unmap(ordinal: int, base: int, size: int) -> None:
    """Unmap a region here and free its address range (its memory goes once no process maps it
    and no descriptor of it is open). Never raises."""
    with contextlib.suppress(Exception), context(ordinal):
        driver.cuMemUnmap(base, size)
        driver.cuMemAddressFree(base, size)


def export(ordinal: int, base: int) -> int:
    """A POSIX descriptor of the region mapped at ``base`` (the caller closes it).

    Raises:
        HandoffError: the driver refused.
    """
    with context(ordinal):
        return export_here(base)


def export_here(ptr: int) -> int:
    """A POSIX descriptor of the physical allocation mapped at ``ptr``, in the current context
    (the caller closes it).

    Raises:
        HandoffError: the driver refused.
    """
    handle = check("cuMemRetainAllocationHandle", driver.cuMemRetainAllocationHandle(ptr))
    try:
        return int(
            check(
                "cuMemExportToShareableHandle",
                driver.cuMemExportToShareableHandle(handle, _POSIX_FD, 0),
            )
        )
    finally:
        driver.cuMemRelease(handle)


# ---- events ----
def ipc_event(ordinal: int) -> tuple[Any, bytes]:
    """A new inter-process event on device ``ordinal`` and its ``cuIpcGetEventHandle`` bytes.

    Raises:
        HandoffError: the driver refused.
    """
    with context(ordinal):
        event = check("cuEventCreate", driver.cuEventCreate(_IPC_EVENT))
        try:
            handle = check("cuIpcGetEventHandle", driver.cuIpcGetEventHandle(event))
        except Exception:
            driver.cuEventDestroy(event)
            raise
    return event, ctypes.string_at(handle.getPtr(), IPC_EVENT_BYTES)


def plain_event(ordinal: int) -> Any:
    """A new event without timing on device ``ordinal`` (the caller's context must be current)."""
    return check("cuEventCreate", driver.cuEventCreate(_PLAIN_EVENT))


def record_after(event: Any, stream: int) -> None:
    """Record ``event`` on ``stream`` (a raw handle; the caller's context is current) so that it
    also follows whatever it followed before: if its last recording (maybe on another stream) is
    not done yet, the stream waits for it first. Waiting for the event then means waiting for
    every piece of work it was ever recorded after, whichever stream it ran on."""
    if driver.cuEventQuery(event)[0] == _NOT_READY:
        check("cuStreamWaitEvent", driver.cuStreamWaitEvent(stream, event, 0))
    check("cuEventRecord", driver.cuEventRecord(event, stream))


def done(event: Any) -> bool:
    """True when ``event`` has completed (or was never recorded)."""
    return bool(driver.cuEventQuery(event)[0] != _NOT_READY)


def destroy(ordinal: int, events: list[Any]) -> None:
    """Wait for and destroy ``events``. Never raises."""
    with contextlib.suppress(Exception), context(ordinal):
        for event in events:
            driver.cuEventSynchronize(event)
            driver.cuEventDestroy(event)


# ---- the importer's side: each region mapped once per process ----
@dataclass(frozen=True)
class Region:
    """A region mapped in this process: where, on which of this process's devices, and the
    exporter's event (opened here) that a hand-off waits for."""

    id: bytes
    wire: tuple[Any, ...]  #: the region payload it was mapped for
    base: int
    size: int
    ordinal: int
    event: Any

    def wait(self) -> None:
        """Block until the exporter's work before its latest hand-off from this region is done.

        Raises:
            HandoffError: the driver refused (the exporter's context is gone, ...).
        """
        check("cuEventSynchronize", driver.cuEventSynchronize(self.event))


_attached: dict[bytes, Region] = {}  # region id -> the region mapped here
_lock = threading.Lock()
maps = 0  #: how many regions this process has mapped (each once): tests read it


def attach(p: RegionPayload, wire: tuple[Any, ...]) -> Region:
    """The region that ``p`` names, mapped in this process: the first time (per region and
    process) after the host check, the device by UUID, the descriptor from the exporter's broker,
    the mapping and the opening of its event; every later time from the cache.

    Raises:
        OtherHostError, DeviceNotVisibleError, ExporterGoneError, TokenRefusedError: as for a
            pool; HandoffError: the driver refused to import, map or open, or another region
            claims the same id.
    """
    global maps
    region = _attached.get(p.region)
    if region is None:
        with _lock:
            region = _attached.get(p.region)
            if region is None:
                region = _attached[p.region] = _map_region(p, wire)
                maps += 1
    if region.wire != wire:
        raise HandoffError(
            "this arena payload names a region this process mapped from another exporter: "
            "refused (a forged or corrupted payload)"
        )
    return region


def _map_region(p: RegionPayload, wire: tuple[Any, ...]) -> Region:
    d = decode_device(p.device)
    where = f"host {quoted(d.host)} (pid {d.pid}, GPU {d.canonical_uuid})"
    handoff.check_host(p.boot, f"GPU memory (an ArenaMemoryResource) from {where}")
    ordinal = _inventory.local_ordinal(d.uuid)
    if ordinal is None:
        raise not_visible_error(d, _inventory.inventory())
    fd = _broker.fetch(p.address, p.token)
    try:
        with context(ordinal):
            handle = check(
                "cuMemImportFromShareableHandle",
                driver.cuMemImportFromShareableHandle(fd, _POSIX_FD),
            )
            try:
                base = _map(handle, p.size, ordinal)
            finally:
                driver.cuMemRelease(handle)
            try:
                h = driver.CUipcEventHandle()
                ctypes.memmove(h.getPtr(), p.event, IPC_EVENT_BYTES)
                event = check("cuIpcOpenEventHandle", driver.cuIpcOpenEventHandle(h))
            except Exception:
                unmap(ordinal, base, p.size)
                raise
    finally:
        os.close(fd)
    return Region(p.region, wire, base, p.size, ordinal, event)


def attached() -> int:
    """How many regions are mapped in this process."""
    return len(_attached)


_left_by_fork: list[tuple[dict[Any, Any], dict[Any, Any]]] = []


def _forget_after_fork() -> None:
    """A forked child maps nothing of its parent's (CUDA does not survive a fork)."""
    global _lock, _contexts_lock, maps
    # kept, never freed: freeing calls the driver, which a forked child must not do before it
    # execs (it can hang there, as under Ray, whose preexec_fn runs these hooks)
    _left_by_fork.append((dict(_attached), dict(_contexts)))
    _attached.clear()
    _contexts.clear()
    _lock, _contexts_lock, maps = threading.Lock(), threading.Lock(), 0


os.register_at_fork(after_in_child=_forget_after_fork)
