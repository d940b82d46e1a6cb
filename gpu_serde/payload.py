"""Versioned plain-data payloads: what gpu_serde puts on the wire instead of an ordinal.

A device payload is one ``bytes`` object, never a nested pickle (little-endian)::

    offset  size  field
    0       1     version (1)
    1       16    GPU UUID, raw bytes
    17      1     flags: bit 0 = MIG instance; other bits must be 0
    18      2     the sender's ordinal for that GPU (uint16)
    20      4     the sender's pid (uint32)
    24      ...   the sender's host name, UTF-8, at most 255 bytes
            1     0x00
            ...   the device name, UTF-8, at most 255 bytes

Ordinal, pid, host and name say where the sender had the GPU; they appear only in error messages
(text is decoded with replacement characters, so odd bytes there cannot fail a receiver). The
decoder accepts exactly the versions it knows and raises :class:`~gpu_serde.PayloadError` for
anything else. One flat ``bytes`` keeps a payload small and quick to unpickle.
"""

from __future__ import annotations

import reprlib
import struct
from typing import NamedTuple

from gpu_serde.errors import PayloadError
from gpu_serde.identity import canonical_uuid

VERSION = 1
FLAG_MIG = 1
MAX_TEXT = 255
HEADER = struct.Struct("<B16sBHI")
MIN_SIZE = HEADER.size + 1
MAX_SIZE = HEADER.size + 2 * MAX_TEXT + 1


class DevicePayload(NamedTuple):
    """A decoded device payload (see the module docstring for the wire form)."""

    version: int
    uuid: bytes
    flags: int
    ordinal: int
    pid: int
    host: str
    name: str

    @property
    def canonical_uuid(self) -> str:
        """The UUID as ``GPU-...`` or ``MIG-...``."""
        return canonical_uuid(self.uuid, mig=bool(self.flags & FLAG_MIG))


def _text(value: str) -> bytes:
    data = value.replace("\0", "?").encode("utf-8", errors="replace")[:MAX_TEXT]
    return data.decode("utf-8", errors="ignore").encode()  # never cut a character in half


def encode_device(uuid: bytes, mig: bool, ordinal: int, pid: int, host: str, name: str) -> bytes:
    """Build the wire bytes for a device (arguments as in :class:`DevicePayload`).

    Raises:
        ValueError: ``uuid`` is not 16 bytes, or ``ordinal``/``pid`` do not fit their fields.
    """
    if len(uuid) != 16:
        raise ValueError("a GPU UUID is 16 bytes")
    head = HEADER.pack(VERSION, uuid, FLAG_MIG if mig else 0, ordinal, pid & 0xFFFFFFFF)
    return head + _text(host) + b"\0" + _text(name)


_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60
_short.maxlevel = 2


def _safe_repr(value: object) -> str:
    try:
        return _short.repr(value)
    except Exception:  # e.g. an int too long to print
        return f"<{type(value).__name__}>"


def _fail(what: str, payload: object) -> PayloadError:
    return PayloadError(f"invalid gpu_serde payload: {what} (got {_safe_repr(payload)})")


def validate_device(p: object) -> bytes:
    """Check device wire bytes and return them unchanged.

    Raises:
        PayloadError: not bytes, too short or too long, an unknown version or flag, or a host or
            name field out of bounds.
    """
    if type(p) is bytes and MIN_SIZE <= len(p) <= MAX_SIZE and p[0] == VERSION and p[17] <= 1:
        sep = p.find(b"\0", 24)
        if 24 <= sep <= 24 + MAX_TEXT and len(p) - sep - 1 <= MAX_TEXT:
            return p
    raise _explain(p)


def _explain(p: object) -> PayloadError:
    """Say what is wrong with a payload that failed :func:`validate_device`."""
    if not isinstance(p, bytes) or type(p) is not bytes:
        return _fail(f"expected bytes, not {type(p).__name__}", p)
    if len(p) == 0:
        return _fail("empty", p)
    if p[0] != VERSION:
        return _fail(
            f"version {p[0]} is not understood by this gpu_serde (it reads version {VERSION}); "
            "install the same gpu_serde version on every process of the cluster",
            p,
        )
    if len(p) < MIN_SIZE:
        return _fail(f"truncated: {len(p)} bytes, at least {MIN_SIZE} expected", p)
    if len(p) > MAX_SIZE:
        return _fail(f"{len(p)} bytes, at most {MAX_SIZE} allowed", p)
    if p[17] & ~FLAG_MIG:
        return _fail(f"unknown flags {p[17]:#x}", p)
    sep = p.find(b"\0", 24)
    if sep < 0:
        return _fail("no separator between host and device name", p)
    if sep - 24 > MAX_TEXT:
        return _fail(f"the host name is longer than {MAX_TEXT} bytes", p)
    return _fail(f"the device name is longer than {MAX_TEXT} bytes", p)


def decode_device(p: object) -> DevicePayload:
    """Validate device wire bytes and return them as a :class:`DevicePayload`."""
    validate_device(p)
    assert isinstance(p, bytes)
    version, uuid, flags, ordinal, pid = HEADER.unpack_from(p)
    host, _, name = p[HEADER.size :].partition(b"\0")
    return DevicePayload(
        version,
        uuid,
        flags,
        ordinal,
        pid,
        host.decode("utf-8", errors="replace"),
        name.decode("utf-8", errors="replace"),
    )


ADDRESS_MAX = 100
IPC_DESCRIPTOR_BYTES = 64  # cuMemPoolExportPointer's opaque data: the driver reads all 64


def validate_pool(p: object) -> tuple:
    """Check a memory-pool payload ``(1, device payload, boot_id, broker address, token, pool)``;
    the device payload is None for a pinned host pool.

    Raises:
        PayloadError: anything else.
    """
    if type(p) is not tuple or len(p) != 6:
        raise _fail("a pool payload is a tuple of 6 fields", p)
    version, dev, boot, address, token, pool = p
    if type(version) is not int or version != VERSION:
        raise _fail(f"pool payload version {_safe_repr(version)} is not understood", p)
    if dev is not None:
        validate_device(dev)
    validate_exporter(boot, address, p)
    if type(token) is not bytes or len(token) != 16 or type(pool) is not bytes or len(pool) != 16:
        raise _fail("the token and the pool id must be 16 bytes each", p)
    return p


def validate_exporter(boot: object, address: object, p: object) -> None:
    """Check the exporter's host (``boot_id``) and broker address fields of payload ``p``.

    Raises:
        PayloadError: either is malformed.
    """
    if type(boot) is not bytes or len(boot) != 16:
        raise _fail("the host's boot id must be 16 bytes", p)
    if (
        type(address) is not str
        or not address.startswith("@")
        or not address.isascii()
        or len(address) > ADDRESS_MAX
    ):
        raise _fail("the broker address must be '@name' (ASCII, at most 100 characters)", p)


def validate_buffer(p: object) -> tuple:
    """Check a buffer payload ``(1, pool payload, IPC descriptor bytes, size, token)``.

    Raises:
        PayloadError: anything else.
    """
    if type(p) is not tuple or len(p) != 5:
        raise _fail("a buffer payload is a tuple of 5 fields", p)
    version, pool, reserved, size, token = p
    if type(version) is not int or version != VERSION:
        raise _fail(f"buffer payload version {_safe_repr(version)} is not understood", p)
    validate_pool(pool)
    if type(reserved) is not bytes or len(reserved) != IPC_DESCRIPTOR_BYTES:
        raise _fail(f"the IPC descriptor must be {IPC_DESCRIPTOR_BYTES} bytes", p)
    if type(size) is not int or not 0 < size < 1 << 62:
        raise _fail("the size must be a positive int", p)
    if type(token) is not bytes or len(token) != 16:
        raise _fail("the token must be 16 bytes", p)
    return p


MAX_PEERS = 64
_OPTION_TEXT = 32  # longest enum value accepted in VMM options


def _word(value: object) -> bool:
    return value is None or (
        type(value) is str and value.isascii() and 0 < len(value) <= _OPTION_TEXT
    )


def _address_int(value: object, low: int) -> bool:
    return value is None or (type(value) is int and low <= value < 1 << 64)


def validate_options(p: object) -> tuple:
    """Check a ``VirtualMemoryResourceOptions`` payload ``(1, allocation_type, location_type,
    handle_type, granularity, gpu_direct_rdma, addr_hint, addr_align, peers, self_access,
    peer_access)``: enum fields as short strings or None, peers a tuple of device payloads.

    Raises:
        PayloadError: anything else.
    """
    if type(p) is not tuple or len(p) != 11:
        raise _fail("a VirtualMemoryResourceOptions payload is a tuple of 11 fields", p)
    version, *words1, rdma, hint, align, peers, own, peer = p
    if type(version) is not int or version != VERSION:
        raise _fail(f"options payload version {_safe_repr(version)} is not understood", p)
    if not all(_word(w) for w in (*words1, own, peer)):
        raise _fail(f"option values must be strings of at most {_OPTION_TEXT} characters", p)
    if type(rdma) is not bool or not _address_int(hint, 0) or not _address_int(align, 1):
        raise _fail("gpu_direct_rdma must be a bool, addr_hint and addr_align ints or None", p)
    if type(peers) is not tuple or len(peers) > MAX_PEERS:
        raise _fail(f"peers must be a tuple of at most {MAX_PEERS} device payloads", p)
    for d in peers:
        validate_device(d)
    return p


def validate_vmm(p: object) -> tuple:
    """Check a ``VirtualMemoryResource`` payload ``(1, device payload or None, options payload)``.

    Raises:
        PayloadError: anything else.
    """
    if type(p) is not tuple or len(p) != 3:
        raise _fail("a VirtualMemoryResource payload is a tuple of 3 fields", p)
    version, dev, options = p
    if type(version) is not int or version != VERSION:
        raise _fail(f"VirtualMemoryResource payload version {_safe_repr(version)} is unknown", p)
    if dev is not None:
        validate_device(dev)
    validate_options(options)
    return p


def validate_vbuf(p: object) -> tuple:
    """Check a VMM buffer payload ``(1, VirtualMemoryResource payload, boot_id, broker address,
    hold token, size, descriptor token)``.

    Raises:
        PayloadError: anything else.
    """
    if type(p) is not tuple or len(p) != 7:
        raise _fail("a VMM buffer payload is a tuple of 7 fields", p)
    version, res, boot, address, hold, size, fd_token = p
    if type(version) is not int or version != VERSION:
        raise _fail(f"VMM buffer payload version {_safe_repr(version)} is not understood", p)
    validate_vmm(res)
    if res[1] is None:
        raise _fail("a VMM buffer payload names its device", p)
    validate_exporter(boot, address, p)
    if type(size) is not int or not 0 < size < 1 << 62:
        raise _fail("the size must be a positive int", p)
    if any(type(t) is not bytes or len(t) != 16 for t in (hold, fd_token)):
        raise _fail("the tokens must be 16 bytes each", p)
    return p
