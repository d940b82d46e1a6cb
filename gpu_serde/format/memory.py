"""Memory payloads: pools, buffers and VMM resources, as plain tuples on the wire.

On the wire each is a plain ``tuple`` (never a nested pickle, never a named tuple, whose class a
pickle would have to name); each decodes, once validated, into the named tuple below. The fields,
in wire order::

    pool     (1, device payload | None (pinned host pool), boot_id, broker address, token, pool id)
    buffer   (1, pool, IPC descriptor (64 bytes), size, token)
    options  (1, allocation_type, location_type, handle_type, granularity, gpu_direct_rdma,
              addr_hint, addr_align, peers (device payloads), self_access, peer_access)
    vmm      (1, device payload | None (host memory), options)
    vbuf     (1, vmm, boot_id, broker address, hold token, size, descriptor token)
    region   (1, device payload, boot_id, broker address, descriptor token, region id, size,
              IPC event handle (64 bytes))                 an ArenaMemoryResource (wire.arena)
    abuf     (1, region, offset, size, hold token)          one of its buffers (wire.abuf)
    hbuf     (1, device payload | None (pinned host memory), size, bytes (any contiguous
              bytes-like object of that size: a pickle-5 out-of-band buffer arrives as one))
    pbuf     (1, zero-copy kind ("buf", "vbuf", "abuf") | None, its payload | None, hbuf payload)
    unsent   (1, what (str), error type name (str), message (str)): an object its sender could
              not send, as a Dask serializer reports it (text of at most 4000 characters each)

Each kind is one named tuple whose ``wire()`` is the encoder, followed by its ``decode_*``: both
ways side by side, and the one place that builds these tuples. Every decoder raises
:class:`~gpu_serde.PayloadError` for anything else. Sizes and offsets stay under :data:`MAX_SIZE`.

A sent block's hold names the block it was issued for (:func:`block_digest`): a buffer payload's
:attr:`~BufferPayload.block` is what the exporter's broker compares before it counts an acquire, so
that a payload cannot borrow another block's hold. A pool's or region's
:attr:`~PoolPayload.identity` is what the broker answers with the descriptor, so that a payload
cannot claim another pool or region, or another size, for a real descriptor.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

from gpu_serde.format.device import VERSION, fail, fields, validate_device

ADDRESS_MAX = 100
IPC_DESCRIPTOR_BYTES = 64  # cuMemPoolExportPointer's opaque data: the driver reads all 64
IPC_EVENT_BYTES = 64  # cuIpcGetEventHandle's opaque data (CUipcEventHandle)
MAX_SIZE = 1 << 62  #: no size or offset on the wire is this large
TEXT_MAX = 4000  #: the longest text an unsent payload carries
MAX_PEERS = 64
ZERO_COPY_KINDS = ("buf", "vbuf", "abuf")  # what a portable buffer's zero-copy part may be
_OPTION_TEXT = 32  # longest enum value accepted in VMM options
_WORD = range(1, _OPTION_TEXT + 1)


def block_digest(*fields: bytes | int) -> bytes:
    """16 bytes that name one exported block or descriptor by its fields (ids, sizes, offsets):
    what an acquire or a fetch is checked against at the exporter's broker."""
    h = hashlib.blake2b(digest_size=16)
    for f in fields:
        h.update(f if isinstance(f, bytes) else f.to_bytes(8, "little"))
        h.update(b"\0")
    return h.digest()


def pool_identity(pool: bytes, device: bytes | None, boot: bytes) -> bytes:
    """What a pool's descriptor is offered as: its pool id, GPU (device payload; none for pinned
    host memory) and host."""
    return block_digest(b"pool", pool, device or b"", boot)


def region_identity(region: bytes, size: int, device: bytes, boot: bytes, event: bytes) -> bytes:
    """What an arena region's descriptor is offered as: every field of its payload but the
    broker's address and the token (which the broker checks by itself)."""
    return block_digest(b"region", region, size, device, boot, event)


def _size(value: object) -> bool:
    return type(value) is int and 0 < value < MAX_SIZE


class PoolPayload(NamedTuple):
    """An IPC-enabled pool: its GPU (None: pinned host memory), host, broker and ids."""

    version: int
    device: bytes | None
    boot: bytes
    address: str
    token: bytes
    pool: bytes

    def wire(self) -> tuple[Any, ...]:
        """The plain tuple that travels."""
        return tuple(self)

    @property
    def identity(self) -> bytes:
        """What the exporter's broker answers with this pool's descriptor."""
        return pool_identity(self.pool, self.device, self.boot)


class BufferPayload(NamedTuple):
    """A buffer of an IPC-enabled pool: the pool, cuda.core's 64 exported bytes, size, hold."""

    version: int
    pool: PoolPayload
    reserved: bytes
    size: int
    token: bytes

    def wire(self) -> tuple[Any, ...]:
        """The plain tuple that travels."""
        return (self.version, self.pool.wire(), self.reserved, self.size, self.token)

    @property
    def block(self) -> bytes:
        """The block its hold was issued for: the pool, the exported bytes, the size."""
        return block_digest(b"buf", self.pool.pool, self.reserved, self.size)


class OptionsPayload(NamedTuple):
    """``VirtualMemoryResourceOptions``: enum fields as strings (or None), peers by UUID."""

    version: int
    allocation_type: str | None
    location_type: str | None
    handle_type: str | None
    granularity: str | None
    gpu_direct_rdma: bool
    addr_hint: int | None
    addr_align: int | None
    peers: tuple[bytes, ...]
    self_access: str | None
    peer_access: str | None

    def wire(self) -> tuple[Any, ...]:
        """The plain tuple that travels."""
        return tuple(self)


class VmmPayload(NamedTuple):
    """A ``VirtualMemoryResource``: its GPU (None: host memory) and its options."""

    version: int
    device: bytes | None
    options: OptionsPayload

    def wire(self) -> tuple[Any, ...]:
        """The plain tuple that travels."""
        return (self.version, self.device, self.options.wire())


class VbufPayload(NamedTuple):
    """A ``VirtualMemoryResource`` buffer: its resource, host, broker, tokens and size."""

    version: int
    resource: VmmPayload
    boot: bytes
    address: str
    hold: bytes
    size: int
    fd_token: bytes

    def wire(self) -> tuple[Any, ...]:
        """The plain tuple that travels."""
        return (
            self.version,
            self.resource.wire(),
            self.boot,
            self.address,
            self.hold,
            self.size,
            self.fd_token,
        )

    @property
    def block(self) -> bytes:
        """The block its hold was issued for: its descriptor's token and size."""
        return block_digest(b"vbuf", self.fd_token, self.size)

    @property
    def identity(self) -> bytes:
        """What the exporter's broker answers with the buffer's descriptor."""
        return block_digest(b"vbuf-fd", self.resource.device or b"", self.boot, self.size)


class RegionPayload(NamedTuple):
    """An :class:`~gpu_serde.ArenaMemoryResource`'s region: its GPU, host, broker, the token for
    its descriptor, its id and size, and its IPC event (the sender's work before a hand-off)."""

    version: int
    device: bytes
    boot: bytes
    address: str
    token: bytes
    region: bytes
    size: int
    event: bytes

    def wire(self) -> tuple[Any, ...]:
        """The plain tuple that travels."""
        return tuple(self)

    @property
    def identity(self) -> bytes:
        """What the exporter's broker answers with the region's descriptor: its id and size."""
        return region_identity(self.region, self.size, self.device, self.boot, self.event)


class AbufPayload(NamedTuple):
    """A buffer of an arena: its region, where it lies in it, and the token that holds it."""

    version: int
    region: RegionPayload
    offset: int
    size: int
    hold: bytes

    def wire(self) -> tuple[Any, ...]:
        """The plain tuple that travels."""
        return (self.version, self.region.wire(), self.offset, self.size, self.hold)

    @property
    def block(self) -> bytes:
        """The block its hold was issued for: its region, offset and size."""
        return block_digest(b"abuf", self.region.region, self.offset, self.size)


def _id16(value: object) -> bool:
    return type(value) is bytes and len(value) == 16


def validate_exporter(boot: object, address: object, p: object) -> None:
    """Check the exporter's host (``boot_id``) and broker address fields of payload ``p``.

    Raises:
        PayloadError: either is malformed.
    """
    if not _id16(boot):
        raise fail("the host's boot id must be 16 bytes", p)
    if (
        type(address) is not str
        or not address.startswith("@")
        or not address.isascii()
        or not address.isprintable()
        or len(address) > ADDRESS_MAX
    ):
        raise fail("the broker address must be '@name' (printable ASCII, at most 100 chars)", p)


def decode_pool(p: object) -> PoolPayload:
    """Validate a pool payload and return it as a :class:`PoolPayload`.

    Raises:
        PayloadError: anything but a well-formed pool payload of this version.
    """
    _, dev, boot, address, token, pool = fields("pool", p, 6)
    if dev is not None:
        validate_device(dev)
    validate_exporter(boot, address, p)
    if not _id16(token) or not _id16(pool):
        raise fail("the token and the pool id must be 16 bytes each", p)
    return PoolPayload(VERSION, dev, boot, address, token, pool)


def decode_buffer(p: object) -> BufferPayload:
    """Validate a buffer payload and return it as a :class:`BufferPayload`.

    Raises:
        PayloadError: anything but a well-formed buffer payload of this version.
    """
    _, pool, reserved, size, token = fields("buffer", p, 5)
    pool_p = decode_pool(pool)
    if type(reserved) is not bytes or len(reserved) != IPC_DESCRIPTOR_BYTES:
        raise fail(f"the IPC descriptor must be {IPC_DESCRIPTOR_BYTES} bytes", p)
    if not _size(size):
        raise fail("the size must be a positive int", p)
    if not _id16(token):
        raise fail("the token must be 16 bytes", p)
    return BufferPayload(VERSION, pool_p, reserved, size, token)


def _word(value: object) -> bool:
    return value is None or (
        type(value) is str
        and value.isascii()
        and value.isprintable()
        and 0 < len(value) <= _OPTION_TEXT
    )


def _address_int(value: object, low: int) -> bool:
    return value is None or (type(value) is int and low <= value < 1 << 64)


def decode_options(p: object) -> OptionsPayload:
    """Validate a ``VirtualMemoryResourceOptions`` payload: enum fields as short strings or None,
    peers a tuple of device payloads.

    Raises:
        PayloadError: anything else.
    """
    _, *words, rdma, hint, align, peers, own, peer = fields("VirtualMemoryResourceOptions", p, 11)
    if not all(_word(w) for w in (*words, own, peer)):
        raise fail(f"option values must be strings of at most {_OPTION_TEXT} characters", p)
    if type(rdma) is not bool or not _address_int(hint, 0) or not _address_int(align, 1):
        raise fail("gpu_direct_rdma must be a bool, addr_hint and addr_align ints or None", p)
    if type(peers) is not tuple or len(peers) > MAX_PEERS:
        raise fail(f"peers must be a tuple of at most {MAX_PEERS} device payloads", p)
    for d in peers:
        validate_device(d)
    alloc, location, handle, granularity = words
    return OptionsPayload(
        VERSION, alloc, location, handle, granularity, rdma, hint, align, peers, own, peer
    )


def decode_vmm(p: object) -> VmmPayload:
    """Validate a ``VirtualMemoryResource`` payload.

    Raises:
        PayloadError: anything else.
    """
    _, dev, options = fields("VirtualMemoryResource", p, 3)
    if dev is not None:
        validate_device(dev)
    return VmmPayload(VERSION, dev, decode_options(options))


def decode_vbuf(p: object) -> VbufPayload:
    """Validate a VMM buffer payload.

    Raises:
        PayloadError: anything else, or a resource that names no device.
    """
    _, res, boot, address, hold, size, fd_token = fields("VMM buffer", p, 7)
    resource = decode_vmm(res)
    if resource.device is None:
        raise fail("a VMM buffer payload names its device", p)
    validate_exporter(boot, address, p)
    if not _size(size):
        raise fail("the size must be a positive int", p)
    if not _id16(hold) or not _id16(fd_token):
        raise fail("the tokens must be 16 bytes each", p)
    return VbufPayload(VERSION, resource, boot, address, hold, size, fd_token)


def decode_region(p: object) -> RegionPayload:
    """Validate an arena's region payload (what :func:`gpu_serde.wire.arena` carries).

    Raises:
        PayloadError: anything but a well-formed region payload of this version.
    """
    _, dev, boot, address, token, region, size, event = fields("arena region", p, 8)
    validate_device(dev)
    validate_exporter(boot, address, p)
    if not _id16(token) or not _id16(region):
        raise fail("the token and the region id must be 16 bytes each", p)
    if not _size(size):
        raise fail("the region size must be a positive int", p)
    if type(event) is not bytes or len(event) != IPC_EVENT_BYTES:
        raise fail(f"the IPC event handle must be {IPC_EVENT_BYTES} bytes", p)
    return RegionPayload(VERSION, dev, boot, address, token, region, size, event)


def decode_abuf(p: object) -> AbufPayload:
    """Validate an arena buffer's payload (what :func:`gpu_serde.wire.abuf` carries).

    Raises:
        PayloadError: anything else, or a buffer that does not lie inside its region.
    """
    _, region, offset, size, hold = fields("arena buffer", p, 5)
    r = decode_region(region)
    if type(offset) is not int or type(size) is not int or offset < 0 or size <= 0:
        raise fail("the offset must be an int >= 0 and the size a positive int", p)
    if offset + size > r.size:
        raise fail("the buffer does not lie inside its region", p)
    if not _id16(hold):
        raise fail("the hold token must be 16 bytes", p)
    return AbufPayload(VERSION, r, offset, size, hold)


class HostCopyPayload(NamedTuple):
    """A buffer sent by value: its GPU (None: pinned host memory), size and bytes."""

    version: int
    device: bytes | None
    size: int
    data: Any

    def wire(self) -> tuple[Any, ...]:
        """The plain tuple that travels."""
        return tuple(self)


class PortablePayload(NamedTuple):
    """A portable buffer: the zero-copy payload (kind and payload, or None) and a host copy."""

    version: int
    kind: str | None
    inner: Any
    copy: HostCopyPayload

    def wire(self) -> tuple[Any, ...]:
        """The plain tuple that travels."""
        return (self.version, self.kind, self.inner, self.copy.wire())


def validate_target(dev: object, size: object, p: object = None) -> tuple[bytes | None, int]:
    """Check a copy's device payload (or None: pinned host memory) and size; return them.

    Raises:
        PayloadError: either is malformed.
    """
    if dev is not None:
        validate_device(dev)
    if not _size(size):
        raise fail("the size must be a positive int", (dev, size) if p is None else p)
    return dev, size  # type: ignore[return-value]


def decode_hbuf(p: object) -> HostCopyPayload:
    """Validate a host-copy payload.

    Raises:
        PayloadError: anything but a well-formed host copy of this version, or bytes that are
            not a contiguous buffer of the stated size.
    """
    _, dev, size, data = fields("host copy", p, 4)
    validate_target(dev, size, p)
    try:
        with memoryview(data) as view:
            ok = view.c_contiguous and view.nbytes == size
    except Exception:
        ok = False
    if not ok:
        raise fail(f"the data must be a contiguous bytes-like object of {size} bytes", p)
    return HostCopyPayload(VERSION, dev, size, data)


def decode_pbuf(p: object) -> PortablePayload:
    """Validate a portable-buffer payload. Its copy must be well formed; its zero-copy part is
    checked when it is rebuilt, and one of a kind this gpu_serde does not know (a later
    release's), or a kind without its payload, reads as none: the copy is used.

    Raises:
        PayloadError: anything else.
    """
    _, kind, inner, copy = fields("portable buffer", p, 4)
    if kind not in ZERO_COPY_KINDS or inner is None:
        kind, inner = None, None
    return PortablePayload(VERSION, kind, inner, decode_hbuf(copy))


class UnsentPayload(NamedTuple):
    """What the sender could not send, and why (the typed error's name and message)."""

    version: int
    what: str
    error: str
    message: str

    def wire(self) -> tuple[Any, ...]:
        """The plain tuple that travels (each text cut to :data:`TEXT_MAX` characters)."""
        return (self.version, self.what[:TEXT_MAX], self.error[:TEXT_MAX], self.message[:TEXT_MAX])


def decode_unsent(p: object) -> UnsentPayload:
    """Validate an unsent-object payload.

    Raises:
        PayloadError: anything else.
    """
    _, what, error, message = fields("unsent object", p, 4)
    if not all(type(t) is str and len(t) <= TEXT_MAX for t in (what, error, message)):
        raise fail(
            f"an unsent object payload holds three strings of at most {TEXT_MAX} characters", p
        )
    return UnsentPayload(VERSION, what, error, message)
