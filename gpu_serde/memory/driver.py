"""The driver calls that memory hand-offs make, in one place: errors, contexts, VMM allocations
(make, export, import, map, unmap), and the events that order a hand-off.

A VMM allocation (``cuMemCreate`` with a POSIX-descriptor handle) is what an
:class:`~gpu_serde.ArenaMemoryResource` region is, and what a ``VirtualMemoryResource`` buffer is
backed by: both export a descriptor (:func:`export_here`), and an importer maps it
(:func:`import_and_map`: ``cuMemImportFromShareableHandle``, ``cuMemAddressReserve``,
``cuMemMap``, ``cuMemSetAccess``).

Calls that take an ``ordinal`` push the device's primary context for their duration
(:func:`context`) and give the thread's own back: they run in the user's threads, the broker's and
during garbage collection.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from typing import Any

from cuda.bindings import driver
from cuda.core import Device

from gpu_serde import inventory as _inventory
from gpu_serde.errors import HandoffError
from gpu_serde.format.memory import IPC_EVENT_BYTES

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
# re-entrant: a collection inside the first retain may free a received buffer on this thread,
# whose free enters context() again
_contexts_lock = threading.RLock()


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
                retained = check("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(dev))
                # (a free re-entering here may have retained it first: one more retain, for good)
                ctx = _contexts.setdefault(ordinal, retained)
    check("cuCtxPushCurrent", driver.cuCtxPushCurrent(ctx))
    try:
        yield
    finally:
        driver.cuCtxPopCurrent()


def synchronize(ordinal: int) -> None:
    """Wait until device ``ordinal``'s work in this process is done.

    Raises:
        HandoffError: the driver refused.
    """
    with context(ordinal):
        check("cuCtxSynchronize", driver.cuCtxSynchronize())


@contextlib.contextmanager
def current(dev: Device) -> Iterator[None]:
    """Make ``dev`` current for the block (cuda.core's way), then restore the thread's previous
    context."""
    prev = driver.cuCtxGetCurrent()[1]
    dev.set_current()
    try:
        yield
    finally:
        driver.cuCtxSetCurrent(prev)


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


def _prop(ordinal: int) -> Any:
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = _POSIX_FD
    return prop


#: Access flags by the names VMM options use.
ACCESS = {
    "rw": driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    "r": driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ,
}


def access(targets: list[tuple[int, Any]]) -> list[Any]:
    """``cuMemSetAccess`` descriptors granting each ``(device ordinal, flags)``."""
    descs = []
    for ordinal, flags in targets:
        d = driver.CUmemAccessDesc()
        d.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        d.location.id = ordinal
        d.flags = flags
        descs.append(d)
    return descs


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


def map_handle(handle: Any, size: int, descs: list[Any]) -> int:
    """Reserve an address range, map ``handle`` there and grant the access ``descs`` say (none:
    no access is set); the mapping holds the memory (the caller releases its handle). In the
    current context.

    Raises:
        HandoffError: the driver refused (the address range is freed again).
    """
    ptr = check("cuMemAddressReserve", driver.cuMemAddressReserve(size, 0, 0, 0))
    try:
        check("cuMemMap", driver.cuMemMap(ptr, size, 0, handle, 0))
        if descs:
            try:
                check("cuMemSetAccess", driver.cuMemSetAccess(ptr, size, descs, len(descs)))
            except Exception:
                driver.cuMemUnmap(ptr, size)
                raise
    except Exception:
        driver.cuMemAddressFree(ptr, size)
        raise
    return int(ptr)


def import_and_map(fd: int, size: int, descs: list[Any]) -> int:
    """Import the allocation behind descriptor ``fd`` (the caller closes it) and map it here with
    the access ``descs`` say; in the current context. Undo with :func:`unmap_here`.

    Raises:
        HandoffError: the driver refused.
    """
    handle = check(
        "cuMemImportFromShareableHandle", driver.cuMemImportFromShareableHandle(fd, _POSIX_FD)
    )
    try:
        return map_handle(handle, size, descs)
    finally:
        driver.cuMemRelease(handle)  # the mapping keeps the memory


def create(ordinal: int, size: int) -> int:
    """Make a region of ``size`` bytes (a multiple of :func:`granularity`) on device ``ordinal``,
    exportable as a POSIX descriptor; returns its address here.

    Raises:
        HandoffError: the driver refused (its error named: CUDA_ERROR_OUT_OF_MEMORY, ...).
    """
    with context(ordinal):
        handle = check("cuMemCreate", driver.cuMemCreate(size, _prop(ordinal), 0))
        try:
            flags = ACCESS["rw"]
            return map_handle(handle, size, access([(ordinal, flags)]))
        finally:
            driver.cuMemRelease(handle)  # the mapping keeps the memory


def memory(ordinal: int) -> tuple[int, int] | None:
    """Device ``ordinal``'s free and total memory in bytes (``cuMemGetInfo``), or None when the
    driver cannot say. Never raises."""
    try:
        with context(ordinal):
            err, free, total = driver.cuMemGetInfo()
    except Exception:
        return None
    return (int(free), int(total)) if err == _SUCCESS else None


def unmap(ordinal: int, base: int, size: int) -> None:
    """Unmap a region here and free its address range (its memory goes once no process maps it
    and no descriptor of it is open). Never raises."""
    with contextlib.suppress(Exception), context(ordinal):
        unmap_here(base, size)


def unmap_here(base: int, size: int) -> None:
    """Unmap ``size`` bytes at ``base`` and free the address range, in the current context.
    Never raises."""
    with contextlib.suppress(Exception):
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


#: The legacy default stream's handle: what torch and CuPy call stream 0, and cuda.core's
#: default stream (unless cuda-bindings runs with per-thread default streams).
LEGACY_STREAM = int(driver.CU_STREAM_LEGACY)


def raw_stream(handle: int) -> int:
    """``handle`` (torch's or CuPy's) as the driver reads it in whichever mode cuda-bindings
    runs: their 0, the null stream, is the legacy default stream (in cuda-bindings' per-thread
    mode a 0 would be the thread's own default stream)."""
    return LEGACY_STREAM if handle == 0 else handle


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


def idle(stream: int) -> bool:
    """True when all the work queued on ``stream`` (a raw handle; the caller's context is
    current) has completed; False when some has not, or the driver cannot say."""
    return bool(driver.cuStreamQuery(stream)[0] == _SUCCESS)


def wait(event: Any) -> None:
    """Block until ``event`` has completed.

    Raises:
        HandoffError: the driver refused (the exporter's context is gone, ...).
    """
    check("cuEventSynchronize", driver.cuEventSynchronize(event))


def done(event: Any) -> bool:
    """True when ``event`` has completed (or was never recorded)."""
    return bool(driver.cuEventQuery(event)[0] != _NOT_READY)


def destroy(ordinal: int, events: list[Any]) -> None:
    """Wait for and destroy ``events``. Never raises."""
    with contextlib.suppress(Exception), context(ordinal):
        for event in events:
            driver.cuEventSynchronize(event)
            driver.cuEventDestroy(event)


def open_ipc_event(handle_bytes: bytes) -> Any:
    """Open an exporter's inter-process event from its ``cuIpcGetEventHandle`` bytes, in the
    current context.

    Raises:
        HandoffError: the driver refused.
    """
    h = driver.CUipcEventHandle()
    ctypes.memmove(h.getPtr(), handle_bytes, IPC_EVENT_BYTES)
    return check("cuIpcOpenEventHandle", driver.cuIpcOpenEventHandle(h))


_left_by_fork: list[dict[int, Any]] = []


def _forget_after_fork() -> None:
    """A forked child has none of its parent's contexts (CUDA does not survive a fork): kept,
    never released (that calls the driver, which a forked child must not do before it execs)."""
    global _contexts_lock
    _left_by_fork.append(dict(_contexts))
    _contexts.clear()
    _contexts_lock = threading.RLock()


os.register_at_fork(after_in_child=_forget_after_fork)
