"""Versioned plain-data payloads: what gpu_serde puts on the wire instead of an ordinal.

A device payload is a tuple of plain values, never a nested pickle::

    (VERSION, uuid: 16 bytes, flags: int, ordinal: int, pid: int, host: str, name: str)

``flags`` bit 0 marks a MIG instance. ``ordinal``, ``pid`` and ``host`` say where the sender had the
GPU and are used only in error messages. Decoders accept exactly the versions they know and raise
:class:`~gpu_serde.PayloadError` for anything else.
"""

from __future__ import annotations

import reprlib
from typing import NamedTuple

from gpu_serde.errors import PayloadError
from gpu_serde.identity import canonical_uuid

VERSION = 1
FLAG_MIG = 1
MAX_TEXT = 256
MAX_ORDINAL = 1 << 16
MAX_PID = 1 << 32


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


def encode_device(uuid: bytes, mig: bool, ordinal: int, pid: int, host: str, name: str) -> tuple:
    """Build the wire tuple for a device (arguments as in :class:`DevicePayload`)."""
    return (VERSION, uuid, FLAG_MIG if mig else 0, ordinal, pid, host[:MAX_TEXT], name[:MAX_TEXT])


_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60
_short.maxlevel = 2


def _fail(what: str, payload: object) -> PayloadError:
    return PayloadError(f"invalid gpu_serde device payload: {what} (got {_short.repr(payload)})")


def validate_device(p: object) -> tuple:
    """Check a device wire tuple and return it unchanged.

    Raises:
        PayloadError: not a tuple, wrong length, unknown version, or a field of the wrong type
            or size.
    """
    if type(p) is tuple and len(p) == 7:  # the fast path: locals, no allocation
        v, uuid, flags, ordinal, pid, host, name = p
        if (
            v.__class__ is int
            and v == VERSION
            and uuid.__class__ is bytes
            and len(uuid) == 16
            and flags.__class__ is int
            and 0 <= flags <= FLAG_MIG
            and ordinal.__class__ is int
            and 0 <= ordinal < MAX_ORDINAL
            and pid.__class__ is int
            and 0 <= pid < MAX_PID
            and host.__class__ is str
            and len(host) <= MAX_TEXT
            and name.__class__ is str
            and len(name) <= MAX_TEXT
        ):
            return p
    raise _explain(p)


def _explain(p: object) -> PayloadError:
    """Say what is wrong with a payload that failed :func:`validate_device`."""
    if type(p) is not tuple:
        return _fail(f"expected a tuple, not {type(p).__name__}", p)
    if len(p) == 0 or type(p[0]) is not int:
        return _fail("no version number", p)
    if p[0] != VERSION:
        return _fail(
            f"version {p[0]} is not understood by this gpu_serde (it reads version {VERSION}); "
            "install the same gpu_serde version on every process of the cluster",
            p,
        )
    if len(p) != 7:
        return _fail(f"version {VERSION} has 7 fields, this one has {len(p)}", p)
    _, uuid, flags, ordinal, pid, host, name = p
    if type(uuid) is not bytes or len(uuid) != 16:
        return _fail("the UUID must be 16 bytes", p)
    if type(flags) is not int or flags & ~FLAG_MIG:
        return _fail("unknown flags", p)
    if type(ordinal) is not int or not 0 <= ordinal < MAX_ORDINAL:
        return _fail("the ordinal must be an int in [0, 65536)", p)
    if type(pid) is not int or not 0 <= pid < MAX_PID:
        return _fail("the pid must be a non-negative int", p)
    if type(host) is not str or len(host) > MAX_TEXT:
        return _fail(f"the host must be a str of at most {MAX_TEXT} characters", p)
    if type(name) is not str or len(name) > MAX_TEXT:
        return _fail(f"the name must be a str of at most {MAX_TEXT} characters", p)
    return _fail("unknown problem", p)


def decode_device(p: object) -> DevicePayload:
    """Validate a device wire tuple and return it as a :class:`DevicePayload`."""
    return DevicePayload._make(validate_device(p))
