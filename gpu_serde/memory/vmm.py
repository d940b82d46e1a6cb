"""``VirtualMemoryResource``, its options and its buffers across processes, by GPU UUID.

cuda.core 1.2 pickles these with ordinals (the device and every peer), and has no inter-process
path for VMM buffers. Here the device and the peers travel as device payloads (rebuilt on the
receiver's own ordinals), and a buffer travels as a POSIX descriptor of its physical allocation
(``cuMemExportToShareableHandle``), served by the exporter's broker and mapped by the receiver
with the access the options ask for. As for pools, the exporter keeps the buffer alive until its
importers have released it (or it exits): the lifetime protocol of :mod:`gpu_serde.memory.lifetime`.
Failures while rebuilding give placeholders (:mod:`gpu_serde.placeholders`). Reduce and rebuild of
each type sit side by side.
"""

from __future__ import annotations

import enum
import functools
import operator
import os
from typing import Any

from cuda.bindings import driver
from cuda.core import Buffer, Device, VirtualMemoryResource, VirtualMemoryResourceOptions
from cuda.core import typing as cctyping

from gpu_serde import inventory as _inventory
from gpu_serde import wire
from gpu_serde.device import device_payload
from gpu_serde.errors import HandoffError, NotIPCEnabledError, PayloadError
from gpu_serde.format.device import VERSION, decode_device, raw_uuid
from gpu_serde.format.memory import (
    MAX_PEERS,
    OptionsPayload,
    VbufPayload,
    VmmPayload,
    decode_options,
    decode_vbuf,
    decode_vmm,
)
from gpu_serde.hostid import host_id
from gpu_serde.memory import broker as _broker
from gpu_serde.memory import driver as _driver
from gpu_serde.memory import lifetime
from gpu_serde.memory.driver import check, export_here
from gpu_serde.memory.lifetime import Import, Imported
from gpu_serde.placeholders import not_visible_error
from gpu_serde.text import safe

#: Option fields sent as the string values of cuda.core's enums (or None), in payload order.
ENUM_FIELDS = {
    "allocation_type": "VirtualMemoryAllocationType",
    "location_type": "VirtualMemoryLocationType",
    "handle_type": "VirtualMemoryHandleType",
    "granularity": "VirtualMemoryGranularityType",
    "self_access": "VirtualMemoryAccessType",
    "peer_access": "VirtualMemoryAccessType",
}


def _plain(field: str, value: object) -> str | None:
    if value is None or isinstance(value, str):  # cuda.core's enums are StrEnums
        return value.value if isinstance(value, enum.Enum) else value
    raise TypeError(f"VirtualMemoryResourceOptions.{field} must be a string, an enum or None")


def _peer_payload(peer: object) -> bytes:
    try:
        return device_payload(Device(int(peer)))  # type: ignore[call-overload]
    except Exception as exc:
        raise ValueError(
            f"VirtualMemoryResourceOptions.peers names {peer!r}, which is not a device of this "
            f"process: {_inventory.inventory().describe()}"
        ) from exc


def options_payload(opts: VirtualMemoryResourceOptions) -> OptionsPayload:
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
    p = OptionsPayload(
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
        return decode_options(p.wire())  # what a receiver would refuse fails here, at the sender
    except PayloadError as exc:
        raise ValueError(f"these VirtualMemoryResourceOptions cannot be sent: {exc}") from None


def reduce_options(opts: VirtualMemoryResourceOptions) -> tuple[Any, ...]:
    """Reducer for ``VirtualMemoryResourceOptions``: ``(gpu_serde.wire.vmo, (payload,))``.

    Raises:
        ValueError, TypeError: as :func:`options_payload`.
    """
    return (wire.vmo, (options_payload(opts).wire(),))


def resource_payload(mr: VirtualMemoryResource) -> VmmPayload:
    """A ``VirtualMemoryResource``: its device (None for host memory) and options.

    Raises:
        ValueError, TypeError: as :func:`options_payload`.
    """
    dev = device_payload(Device(mr.device.device_id)) if mr.device is not None else None
    return VmmPayload(VERSION, dev, options_payload(mr.config))


def reduce_resource(mr: VirtualMemoryResource) -> tuple[Any, ...]:
    """Reducer for ``VirtualMemoryResource``: ``(gpu_serde.wire.vmm, (payload,))``.

    Raises:
        ValueError, TypeError: as :func:`options_payload`.
    """
    return (wire.vmm, (resource_payload(mr).wire(),))


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
            f"VirtualMemoryResourceOptions.{field}={safe(value)!r} is not known to this "
            "process's cuda.core: install the same cuda-core version on every process"
        ) from None


def local_options(
    p: OptionsPayload, *, visible_peers_only: bool = False
) -> VirtualMemoryResourceOptions:
    """Options on this process's ordinals; ``visible_peers_only`` drops the peers this process
    cannot see instead of raising.

    Raises:
        DeviceNotVisibleError: a peer GPU is not visible here (the message names it).
        PayloadError: an option value this cuda.core does not know.
    """
    peers = []
    for dp in p.peers:
        ordinal = _inventory.local_ordinal(raw_uuid(dp))
        if ordinal is None and visible_peers_only:
            continue
        if ordinal is None:
            raise not_visible_error(
                decode_device(dp),
                _inventory.inventory(),
                what="Peer GPU (VirtualMemoryResourceOptions.peers)",
            )
        peers.append(ordinal)
    return VirtualMemoryResourceOptions(
        allocation_type=_enum("allocation_type", p.allocation_type),
        location_type=_enum("location_type", p.location_type),
        handle_type=_enum("handle_type", p.handle_type),
        granularity=_enum("granularity", p.granularity),
        gpu_direct_rdma=p.gpu_direct_rdma,
        addr_hint=p.addr_hint,
        addr_align=p.addr_align,
        peers=tuple(peers),
        self_access=_enum("self_access", p.self_access),
        peer_access=_enum("peer_access", p.peer_access),
    )


def rebuild_options(payload: object) -> VirtualMemoryResourceOptions:
    """Rebuild body of :func:`gpu_serde.wire.vmo`.

    Raises:
        PayloadError, DeviceNotVisibleError: as :func:`local_options`, or malformed.
    """
    return local_options(decode_options(payload))


def local_resource(p: VmmPayload, *, visible_peers_only: bool = False) -> VirtualMemoryResource:
    """A ``VirtualMemoryResource`` on this process's ordinal of the same GPU;
    ``visible_peers_only`` as for :func:`local_options`.

    Raises:
        DeviceNotVisibleError: its GPU, or a peer, is not visible here.
        HandoffError: host memory, and this process sees no GPU.
        PayloadError: an option value this cuda.core does not know.
    """
    if p.device is None:  # host memory: any device carries the context
        dev = _driver.any_device()
    else:
        ordinal = _inventory.local_ordinal(raw_uuid(p.device))
        if ordinal is None:
            raise not_visible_error(decode_device(p.device), _inventory.inventory())
        dev = Device(ordinal)
    return VirtualMemoryResource(
        dev, local_options(p.options, visible_peers_only=visible_peers_only)
    )


def rebuild_resource(payload: object) -> VirtualMemoryResource:
    """Rebuild body of :func:`gpu_serde.wire.vmm`.

    Raises:
        PayloadError, DeviceNotVisibleError, HandoffError: as :func:`local_resource`.
    """
    return local_resource(decode_vmm(payload))


def _let_go(fd_token: bytes, buf: Buffer) -> None:
    _broker.broker().revoke(fd_token)
    lifetime.let_go_in_context(buf)


def _check_whole(ptr: int, size: int) -> None:
    """One physical allocation must back the whole buffer (not so after ``modify_allocation``)."""
    first = check("cuMemRetainAllocationHandle", driver.cuMemRetainAllocationHandle(ptr))
    try:
        last = check(
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


def reduce_buffer(buf: Buffer, mr: VirtualMemoryResource) -> tuple[Any, ...]:
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

    def make() -> tuple[bytes, tuple[Any, ...]]:
        b = _broker.broker()
        res = resource_payload(mr)  # before anything is offered: it may raise
        ptr = int(buf.handle)
        with _driver.current(mr.device):
            _check_whole(ptr, buf.size)
            fd = export_here(ptr)
        p = VbufPayload(VERSION, res, host_id(), b.address, b"", buf.size, b"")
        try:
            # the descriptor keeps the allocation: a keeper may serve it after this process
            # exits, once the GPU's work on it is done
            ready = functools.partial(_driver.synchronize, mr.device.device_id)
            fd_token = b.offer(fd, p.identity, keep=ready)
        finally:
            os.close(fd)
        p = p._replace(fd_token=fd_token)
        try:
            hold = lifetime.hold(buf, p.block, lambda obj: _let_go(fd_token, obj), needs=fd_token)
        except Exception:
            b.revoke(fd_token)
            raise
        return hold, p._replace(hold=hold).wire()

    # closed, it is still mapped in its importers and served by its descriptor while held
    return lifetime.send(buf, wire.vbuf, make, survives_close=True)


def _access(mr: VirtualMemoryResource) -> list[Any]:
    owner = _driver.ACCESS.get(_plain("self_access", mr.config.self_access) or "")
    peer = _driver.ACCESS.get(_plain("peer_access", mr.config.peer_access) or "")
    targets = [(mr.device.device_id, owner)] + [(int(x), peer) for x in mr.config.peers]
    return _driver.access([(ordinal, flags) for ordinal, flags in targets if flags])


class ImportedVmm(Imported):
    """The memory resource of a ``VirtualMemoryResource`` buffer received from another process
    (``buf.memory_resource`` on the receiver): the exporter's allocation mapped here, with the
    access its options grant. :attr:`resource` is this process's resource with the same settings
    (it allocates here). Closing the buffer unmaps it and tells the exporter
    (:class:`~gpu_serde.memory.lifetime.Imported` says when)."""

    refusal = (
        "a VirtualMemoryResource buffer received from another process cannot allocate: "
        "allocate from its .resource (this process's own) or in the exporting process"
    )

    def __init__(self, resource: VirtualMemoryResource, hold: Import) -> None:
        super().__init__(hold, resource.device.device_id)
        self.resource = resource  #: a VirtualMemoryResource with the same settings, here

    def _free(self, ptr: int, size: int, stream: Any) -> None:
        _driver.unmap_here(ptr, size)  # as cuda.core's own VirtualMemoryResource frees

    def __repr__(self) -> str:
        return f"<ImportedVmm of {self.resource!r}>"


def rebuild_buffer(payload: object) -> Buffer:
    """Rebuild body of :func:`gpu_serde.wire.vbuf`: the exporter's VMM buffer mapped here without
    a copy. Peers this process cannot see are left out of the mapping's access (they are not in
    this process).

    Raises:
        PayloadError, OtherHostError, ExporterGoneError, TokenRefusedError, HandoffError,
        DeviceNotVisibleError: why it could not be mapped.
    """
    p = decode_vbuf(payload)
    assert p.resource.device is not None  # decode_vbuf checked it
    lifetime.local_ordinal(p.resource.device, p.boot, "GPU memory")
    if _broker.is_own(p.address):
        held = _broker.broker().peek(p.hold, p.block)
        if held is not None:
            return lifetime.back_home(held)  # back in the exporter: the original
    mr = local_resource(p.resource, visible_peers_only=True)
    with Import(p.address, p.hold, p.block, mr.device.device_id) as hold:
        try:
            mr.device.set_current()  # left current, as for every mapped buffer
            fd = _broker.fetch(p.address, p.fd_token, p.identity)
            try:
                ptr = _driver.import_and_map(fd, p.size, _access(mr))
            finally:
                os.close(fd)
        except HandoffError as exc:
            if type(exc) is not HandoffError:
                raise  # a typed kind (ExporterGoneError, TokenRefusedError): as it is
            raise HandoffError(f"mapping the exported VMM buffer failed: {exc}") from exc
        imported = ImportedVmm(mr, hold)
        try:
            buf = imported.hand_out(Buffer.from_handle(ptr=ptr, size=p.size, mr=imported))
        except Exception:
            _driver.unmap_here(ptr, p.size)
            raise
        hold.keep(buf, (wire.vbuf, (payload,)))
    return buf
