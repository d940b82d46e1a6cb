"""``VirtualMemoryResource``, its options and its buffers across processes, by GPU UUID.

cuda.core 1.2 pickles these with ordinals (the device and every peer), and has no inter-process
path for VMM buffers. Here the device and the peers travel as device payloads (rebuilt on the
receiver's own ordinals), and a buffer travels as a POSIX descriptor of its physical allocation
(``cuMemExportToShareableHandle``), served by the exporter's broker and mapped by the receiver
with the access the options ask for. As for pools, the exporter keeps the buffer alive until its
importers have released it (or it exits); failures while rebuilding give placeholders.
"""

from __future__ import annotations

import contextlib
import enum
import operator
import os
from typing import Any

from cuda.bindings import driver
from cuda.core import Buffer, Device, VirtualMemoryResource, VirtualMemoryResourceOptions
from cuda.core import typing as cctyping

from gpu_serde import fdshare, memory, wire
from gpu_serde import inventory as _inventory
from gpu_serde.errors import HandoffError, NotIPCEnabledError, PayloadError
from gpu_serde.payload import MAX_PEERS, VERSION, decode_device, validate_options

#: Option fields sent as the string values of cuda.core's enums (or None), in payload order.
ENUM_FIELDS = {
    "allocation_type": "VirtualMemoryAllocationType",
    "location_type": "VirtualMemoryLocationType",
    "handle_type": "VirtualMemoryHandleType",
    "granularity": "VirtualMemoryGranularityType",
    "self_access": "VirtualMemoryAccessType",
    "peer_access": "VirtualMemoryAccessType",
}
_POSIX_FD = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_ACCESS = {
    "rw": driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    "r": driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ,
}


def _plain(field: str, value: object) -> str | None:
    if value is None or isinstance(value, str):  # cuda.core's enums are StrEnums
        return value.value if isinstance(value, enum.Enum) else value
    raise TypeError(f"VirtualMemoryResourceOptions.{field} must be a string, an enum or None")


def _peer_payload(peer: object) -> bytes:
    from gpu_serde.reducers import device_payload

    try:
        return device_payload(Device(int(peer)))  # type: ignore[call-overload]
    except Exception as exc:
        raise ValueError(
            f"VirtualMemoryResourceOptions.peers names {peer!r}, which is not a device of this "
            f"process: {_inventory.inventory().describe()}"
        ) from exc


def options_payload(opts: VirtualMemoryResourceOptions) -> tuple:
    """The plain-data payload of ``opts``: enum fields as strings, peers as device payloads.

    A one-shot iterator in ``opts.peers`` (a generator) is replaced by the tuple it gave, in the
    sender's object too, so the sender's own later allocations still grant those peers.

    Raises:
        ValueError: a peer is not a device of this process, or a value cannot be sent.
        TypeError: an enum field is not a string, an enum or None.
    """
    peers = opts.peers
    if iter(peers) is peers:
        peers = opts.peers = tuple(peers)
    peers = tuple(peers)
    if len(peers) > MAX_PEERS:
        raise ValueError(f"VirtualMemoryResourceOptions.peers: at most {MAX_PEERS} peers")
    plain = {f: _plain(f, getattr(opts, f)) for f in ENUM_FIELDS}
    hint = None if opts.addr_hint is None else operator.index(opts.addr_hint)
    align = operator.index(opts.addr_align) if opts.addr_align else None  # 0: the granularity
    p = (
        VERSION,
        plain["allocation_type"],
        plain["location_type"],
        plain["handle_type"],
        plain["granularity"],
        bool(opts.gpu_direct_rdma),
        hint,
        align,
        tuple(_peer_payload(x) for x in peers),
        plain["self_access"],
        plain["peer_access"],
    )
    try:
        return validate_options(p)  # what a receiver would refuse fails here, at the sender
    except PayloadError as exc:
        raise ValueError(f"these VirtualMemoryResourceOptions cannot be sent: {exc}") from None


def reduce_options(opts: VirtualMemoryResourceOptions) -> tuple:
    """Reducer for ``VirtualMemoryResourceOptions``: ``(gpu_serde.wire.vmo, (payload,))``.

    Raises:
        ValueError, TypeError: as :func:`options_payload`.
    """
    return (wire.vmo, (options_payload(opts),))


def resource_payload(mr: VirtualMemoryResource) -> tuple:
    """``(1, device payload or None for host memory, options payload)``.

    Raises:
        ValueError, TypeError: as :func:`options_payload`.
    """
    from gpu_serde.reducers import device_payload

    dev = device_payload(Device(mr.device.device_id)) if mr.device is not None else None
    return (VERSION, dev, options_payload(mr.config))


def reduce_resource(mr: VirtualMemoryResource) -> tuple:
    """Reducer for ``VirtualMemoryResource``: ``(gpu_serde.wire.vmm, (payload,))``.

    Raises:
        ValueError, TypeError: as :func:`options_payload`.
    """
    return (wire.vmm, (resource_payload(mr),))


def _enum(field: str, value: str | None) -> Any:
    if value is None:
        return None
    kind = getattr(cctyping, ENUM_FIELDS[field], None)
    if kind is None:  # pragma: no cover - a cuda.core without these enums takes the strings
        return value
    try:
        return kind(value)
    except ValueError:
        raise PayloadError(
            f"VirtualMemoryResourceOptions.{field}={value!r} is not known to this process's "
            f"cuda.core: install the same cuda-core version on every process"
        ) from None


def rebuild_options(p: tuple, *, visible_peers_only: bool = False) -> VirtualMemoryResourceOptions:
    """Options on this process's ordinals (payload already validated); ``visible_peers_only``
    drops the peers this process cannot see instead of raising.

    Raises:
        DeviceNotVisibleError: a peer GPU is not visible here (the message names it).
        PayloadError: an option value this cuda.core does not know.
    """
    inv = _inventory.cached or _inventory.inventory()
    peers = []
    for dp in p[8]:
        ordinal = inv.by_uuid.get(dp[1:17])
        if ordinal is None and visible_peers_only:
            continue
        if ordinal is None:
            raise wire.not_visible_error(
                decode_device(dp), inv, what="Peer GPU (VirtualMemoryResourceOptions.peers)"
            )
        peers.append(ordinal)
    names = ("allocation_type", "location_type", "handle_type", "granularity")
    fields = {f: _enum(f, v) for f, v in zip(names, p[1:5], strict=True)}
    return VirtualMemoryResourceOptions(
        **fields,
        gpu_direct_rdma=p[5],
        addr_hint=p[6],
        addr_align=p[7],
        peers=tuple(peers),
        self_access=_enum("self_access", p[9]),
        peer_access=_enum("peer_access", p[10]),
    )


def rebuild_resource(p: tuple, *, visible_peers_only: bool = False) -> VirtualMemoryResource:
    """A ``VirtualMemoryResource`` on this process's ordinal of the same GPU (payload validated);
    ``visible_peers_only`` as for :func:`rebuild_options`.

    Raises:
        DeviceNotVisibleError: its GPU, or a peer, is not visible here.
        HandoffError: host memory, and this process sees no GPU.
        PayloadError: an option value this cuda.core does not know.
    """
    _, dev_payload, opts = p
    if dev_payload is None:  # host memory: any device carries the context
        dev = memory.any_device()
    else:
        inv = _inventory.cached or _inventory.inventory()
        ordinal = inv.by_uuid.get(dev_payload[1:17])
        if ordinal is None:
            raise wire.not_visible_error(decode_device(dev_payload), inv)
        dev = Device(ordinal)
    return VirtualMemoryResource(dev, rebuild_options(opts, visible_peers_only=visible_peers_only))


def _check(call: str, result: tuple) -> Any:
    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        raise HandoffError(f"{call} failed: {getattr(err, 'name', err)}")
    return result[1] if len(result) > 1 else None


def _export(ptr: int) -> int:
    handle = _check("cuMemRetainAllocationHandle", driver.cuMemRetainAllocationHandle(ptr))
    try:
        return int(
            _check(
                "cuMemExportToShareableHandle",
                driver.cuMemExportToShareableHandle(handle, _POSIX_FD, 0),
            )
        )
    finally:
        driver.cuMemRelease(handle)


def _let_go(fd_token: bytes, buf: Buffer) -> None:
    fdshare.broker().revoke(fd_token)
    memory._let_go(buf)


def _check_whole(ptr: int, size: int) -> None:
    """One physical allocation must back the whole buffer (not so after ``modify_allocation``)."""
    first = _check("cuMemRetainAllocationHandle", driver.cuMemRetainAllocationHandle(ptr))
    try:
        last = _check(
            "cuMemRetainAllocationHandle", driver.cuMemRetainAllocationHandle(ptr + size - 1)
        )
        driver.cuMemRelease(last)
    finally:
        driver.cuMemRelease(first)
    if int(first) != int(last):
        raise NotIPCEnabledError(
            "this VirtualMemoryResource buffer spans several physical allocations (it was grown "
            "with modify_allocation): gpu_serde sends buffers backed by one allocation"
        )


@contextlib.contextmanager
def _context(dev: Device):
    """Make ``dev`` current for the block, then restore the thread's previous context."""
    prev = driver.cuCtxGetCurrent()[1]
    dev.set_current()
    try:
        yield
    finally:
        driver.cuCtxSetCurrent(prev)


def reduce_buffer(buf: Buffer, mr: VirtualMemoryResource) -> tuple:
    """Reducer body for a buffer of a ``VirtualMemoryResource``:
    ``(gpu_serde.wire.vbuf, (payload,))``; keeps ``buf`` alive for its importers.

    Raises:
        NotIPCEnabledError: the resource does not export POSIX descriptors, allocates host
            memory, or the buffer spans several physical allocations.
        ValueError: its options cannot be sent (see :func:`options_payload`).
        HandoffError: the driver refused to export the allocation.
    """
    if _plain("handle_type", mr.config.handle_type) != "posix_fd" or mr.device is None:
        raise NotIPCEnabledError(
            f"{buf!r} cannot be sent to another process without a copy: gpu_serde sends "
            "VirtualMemoryResource buffers of device memory with handle_type='posix_fd' (the "
            "default); this resource has "
            f"handle_type={_plain('handle_type', mr.config.handle_type)!r}, "
            f"location_type={_plain('location_type', mr.config.location_type)!r}"
        )
    b = fdshare.broker()
    with memory._lock:
        sent = memory._sent.get(buf)
        if sent is None or b.peek(sent[4]) is not buf:  # first time, or let go since
            res = resource_payload(mr)  # before anything is offered: it may raise
            ptr = int(buf.handle)
            with _context(mr.device):
                _check_whole(ptr, buf.size)
                fd = _export(ptr)
            try:
                fd_token = b.offer(fd)
            finally:
                os.close(fd)
            try:
                hold = b.hold(buf, lambda obj: _let_go(fd_token, obj), grace=memory.RELEASE_GRACE_S)
            except Exception:
                b.revoke(fd_token)
                raise
            sent = (VERSION, res, memory.BOOT_ID, b.address, hold, buf.size, fd_token)
            memory._sent[buf] = sent
    return (wire.vbuf, (sent,))


def _access(mr: VirtualMemoryResource) -> list:
    descs = []
    owner = _ACCESS.get(_plain("self_access", mr.config.self_access))
    peer = _ACCESS.get(_plain("peer_access", mr.config.peer_access))
    targets = [(mr.device.device_id, owner)] + [(int(x), peer) for x in mr.config.peers]
    for ordinal, flags in targets:
        if flags:
            d = driver.CUmemAccessDesc()
            d.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            d.location.id = ordinal
            d.flags = flags
            descs.append(d)
    return descs


def _map(fd: int, size: int, mr: VirtualMemoryResource) -> int:
    """Import the allocation behind ``fd`` and map it here with ``mr``'s access; the mapping
    keeps it alive (``mr.deallocate`` unmaps and frees the address range)."""
    handle = _check(
        "cuMemImportFromShareableHandle", driver.cuMemImportFromShareableHandle(fd, _POSIX_FD)
    )
    try:
        ptr = _check("cuMemAddressReserve", driver.cuMemAddressReserve(size, 0, 0, 0))
        try:
            _check("cuMemMap", driver.cuMemMap(ptr, size, 0, handle, 0))
            descs = _access(mr)
            if descs:
                try:
                    _check("cuMemSetAccess", driver.cuMemSetAccess(ptr, size, descs, len(descs)))
                except Exception:
                    driver.cuMemUnmap(ptr, size)
                    raise
        except Exception:
            driver.cuMemAddressFree(ptr, size)
            raise
    finally:
        driver.cuMemRelease(handle)
    return int(ptr)


def rebuild_buffer(p: tuple) -> Buffer:
    """The exporter's VMM buffer mapped here without a copy (payload already validated). Peers
    this process cannot see are left out of the mapping's access (they are not in this process).

    Raises:
        OtherHostError, ExporterGoneError, TokenRefusedError, HandoffError,
        DeviceNotVisibleError: why it could not be mapped.
    """
    _, res, boot, address, hold, size, fd_token = p
    d = decode_device(res[1])
    memory._check_host(
        boot, f"GPU memory from host {d.host!r} (pid {d.pid}, GPU {d.canonical_uuid})"
    )
    if fdshare.is_own(address):
        held = fdshare.broker().peek(hold)
        if held is not None:
            return held  # back in the exporting process: the original buffer
    mr = rebuild_resource(res, visible_peers_only=True)
    fdshare.acquire(address, hold)
    ptr = None
    try:
        mr.device.set_current()
        fd = fdshare.fetch(address, fd_token)
        try:
            ptr = _map(fd, size, mr)
        finally:
            os.close(fd)
        buf = Buffer.from_handle(ptr=ptr, size=size, mr=mr)
    except Exception as exc:
        if ptr is not None:  # mapped, but not wrapped: undo the mapping here
            driver.cuMemUnmap(ptr, size)
            driver.cuMemAddressFree(ptr, size)
        with contextlib.suppress(Exception):
            fdshare.release(address, hold)
        if isinstance(exc, HandoffError) and type(exc) is not HandoffError:
            raise  # a typed kind (ExporterGoneError, TokenRefusedError): as it is
        raise HandoffError(f"mapping the exported VMM buffer failed: {exc}") from exc
    memory.track_import(buf, (wire.vbuf, (p,)), address, hold, mr.device.device_id)
    return buf
