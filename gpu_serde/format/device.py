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
(text is decoded with replacement characters, so odd bytes there cannot fail a receiver, and is
escaped by :func:`gpu_serde.text.safe` wherever it is shown). Memory payloads, which nest device
payloads, are in :mod:`gpu_serde.format.memory`. The decoder accepts exactly the versions it knows
and raises :class:`~gpu_serde.PayloadError` for anything else. One flat ``bytes`` keeps a payload
small and quick to unpickle. :func:`raw_uuid` is the one place that reads the UUID field of a
validated payload.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

from gpu_serde.errors import PayloadError
from gpu_serde.identity import canonical_uuid
from gpu_serde.text import describe, safe

VERSION = 1
FLAG_MIG = 1
MAX_TEXT = 255
HEADER = struct.Struct("<B16sBHI")
MIN_SIZE = HEADER.size + 1
MAX_BYTES = HEADER.size + 2 * MAX_TEXT + 1


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


def raw_uuid(p: bytes) -> bytes:
    """The 16 raw UUID bytes of a validated device payload (the field that names the GPU)."""
    return p[1:17]


def _safe_repr(value: object) -> str:
    return safe(describe(value))  # never the value's own repr: it may come from the sender


def fail(what: str, payload: object) -> PayloadError:
    """A :class:`PayloadError` saying ``what`` is wrong with ``payload`` (shown shortened and
    escaped)."""
    return PayloadError(f"invalid gpu_serde payload: {what} (got {_safe_repr(payload)})")


#: Versions above this are read as noise, not as a newer gpu_serde's payload.
LIKELY_VERSIONS = 64


def version_error(kind: str, version: object, payload: object) -> PayloadError:
    """The :class:`PayloadError` for a ``kind`` payload of a version this gpu_serde cannot read
    (or, for a version no gpu_serde would write, one that is no gpu_serde payload)."""
    if not (type(version) is int and 0 < version <= LIKELY_VERSIONS):
        return fail(
            f"not {_a(kind)} payload of any gpu_serde version (it starts with "
            f"{_safe_repr(version)}, not a version): the pickle was made by something else, or "
            "damaged on its way",
            payload,
        )
    return fail(
        f"{kind} payload version {_safe_repr(version)} is not understood by this gpu_serde (it "
        f"reads version {VERSION}); install the same gpu_serde version on every process of the "
        "cluster",
        payload,
    )


def _a(kind: str) -> str:
    """``kind`` with its article: "an arena buffer", "a pool"."""
    return ("an " if kind[:1] in "aeiou" else "a ") + kind


def fields(kind: str, p: object, n: int) -> tuple[Any, ...]:
    """``p`` as a tuple of ``n`` fields whose first is this version: how every tuple payload
    (memory, tensors) starts its validation.

    Raises:
        PayloadError: not a tuple, not of this version, or not ``n`` fields.
    """
    if type(p) is not tuple or not p:
        raise fail(f"{_a(kind)} payload is a tuple of {n} fields", p)
    if type(p[0]) is not int:
        raise fail(f"{_a(kind)} payload starts with its version, an int", p)
    if p[0] != VERSION:
        raise version_error(kind, p[0], p)
    if len(p) != n:
        raise fail(f"{_a(kind)} payload is a tuple of {n} fields", p)
    return p


def validate_device(p: object) -> bytes:
    """Check device wire bytes and return them unchanged.

    Raises:
        PayloadError: not bytes, too short or too long, an unknown version or flag, or a host or
            name field out of bounds.
    """
    if type(p) is bytes and MIN_SIZE <= len(p) <= MAX_BYTES and p[0] == VERSION and p[17] <= 1:
        sep = p.find(b"\0", 24)
        if 24 <= sep <= 24 + MAX_TEXT and len(p) - sep - 1 <= MAX_TEXT:
            return p
    raise _explain(p)


def _explain(p: object) -> PayloadError:
    """Say what is wrong with a payload that failed :func:`validate_device`."""
    if not isinstance(p, bytes) or type(p) is not bytes:
        return fail(f"expected bytes, not {type(p).__name__}", p)
    if len(p) == 0:
        return fail("empty", p)
    if p[0] != VERSION and len(p) < MIN_SIZE:  # no version's payload is that short
        return fail(
            f"not a device payload ({len(p)} bytes, not of this version, whose payloads have at "
            f"least {MIN_SIZE}): the pickle was made by something else, damaged on its way, or "
            "written by another gpu_serde version (install the same one on every process)",
            p,
        )
    if p[0] != VERSION:
        return version_error("device", p[0], p)
    if len(p) < MIN_SIZE:
        return fail(f"truncated: {len(p)} bytes, at least {MIN_SIZE} expected", p)
    if len(p) > MAX_BYTES:
        return fail(f"{len(p)} bytes, at most {MAX_BYTES} allowed", p)
    if p[17] & ~FLAG_MIG:
        return fail(f"unknown flags {p[17]:#x}", p)
    sep = p.find(b"\0", 24)
    if sep < 0:
        return fail("no separator between host and device name", p)
    if sep - 24 > MAX_TEXT:
        return fail(f"the host name is longer than {MAX_TEXT} bytes", p)
    return fail(f"the device name is longer than {MAX_TEXT} bytes", p)


def decode_device(p: object) -> DevicePayload:
    """Validate device wire bytes and return them as a :class:`DevicePayload`."""
    p = validate_device(p)
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
