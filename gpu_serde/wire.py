"""What gpu_serde payloads are rebuilt by: reconstructors and placeholders.

Pickles name the functions here (``gpu_serde.wire.dev``), so these names are part of the wire
format: they stay as they are across releases. The names are short because they travel in every
payload.
"""

from __future__ import annotations

import os
from typing import Any

from cuda.core import Device

from gpu_serde import inventory as _inventory
from gpu_serde.errors import DeviceNotVisibleError, PayloadError
from gpu_serde.inventory import Inventory, inventory
from gpu_serde.payload import VERSION, DevicePayload, decode_device, validate_device

# Set by gpu_serde.reducers.install()/uninstall().
strict = False
auto_install = True


def not_visible_error(p: DevicePayload, inv: Inventory, what: str = "GPU") -> DeviceNotVisibleError:
    """Build the :class:`DeviceNotVisibleError` for a device payload that ``inv`` cannot resolve
    (``what`` names its role, e.g. a peer)."""
    uuid = p.canonical_uuid
    msg = (
        f"{what} {uuid} ({p.name or 'name unknown'}) is not visible in this process.\n"
        f"It was sent from host {p.host!r}, pid {p.pid}, where it was CUDA device {p.ordinal}.\n"
        f"Here: {_inventory.role + ', ' if _inventory.role else ''}host {inv.host!r}, "
        f"pid {os.getpid()}, {inv.describe()}\n"
        f"Run this work where that GPU is visible: on host {p.host!r}, in a worker whose "
        f"CUDA_VISIBLE_DEVICES includes {uuid} (Ray: a task or actor given that GPU; Dask: a "
        "worker started with it), or send a Device this worker can see."
    )
    return DeviceNotVisibleError(msg, uuid=uuid, host=p.host, visible=inv.devices)


class UnresolvedDevice:
    """Stands in for a received ``Device`` whose GPU this process cannot see.

    It re-pickles to the payload it came from (so a scheduler or a CPU-only hop passes it on
    unchanged); any public attribute, ``int()``, ``operator.index()`` or :func:`gpu_serde.resolve`
    raises :class:`DeviceNotVisibleError` saying which GPU was meant and what this process sees.
    """

    __slots__ = ("_inventory", "_payload")

    def __init__(self, payload: bytes, inv: Inventory) -> None:
        self._payload = payload
        self._inventory = inv

    def _error(self) -> DeviceNotVisibleError:
        return not_visible_error(decode_device(self._payload), self._inventory)

    def __reduce__(self):
        return (dev, (self._payload,))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise self._error()

    def __int__(self) -> int:
        raise self._error()

    def __index__(self) -> int:
        raise self._error()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UnresolvedDevice) and other._payload[1:17] == self._payload[1:17]

    def __hash__(self) -> int:
        return hash(self._payload[1:17])

    def __dask_tokenize__(self) -> tuple:
        return ("cuda.core.Device", self._payload[1:17])

    def __repr__(self) -> str:
        p = decode_device(self._payload)
        return (
            f"<UnresolvedDevice {p.canonical_uuid} ({p.name}) from host {p.host!r}: "
            "not visible in this process>"
        )


class UnresolvedObject:
    """Stands in for a received object that cannot be rebuilt in this process: memory from
    another host or a gone exporter, or a payload of a gpu_serde version this one does not read.

    It re-pickles to the payload it came from; any public attribute or :func:`gpu_serde.resolve`
    raises the reason (a ``HandoffError`` kind, ``DeviceNotVisibleError`` or ``PayloadError``).
    """

    __slots__ = ("_error_", "_kind", "_payload", "_rebuild")

    def __init__(self, kind: str, rebuild: Any, payload: object, error: Exception) -> None:
        self._kind, self._rebuild, self._payload, self._error_ = kind, rebuild, payload, error

    def _error(self) -> Exception:
        return self._error_

    def __reduce__(self):
        return (self._rebuild, (self._payload,))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise self._error_

    def __repr__(self) -> str:
        return f"<UnresolvedObject {self._kind}: {type(self._error_).__name__}: {self._error_}>"


def _other_version(kind: str, rebuild: Any, payload: object) -> UnresolvedObject | None:
    """A well-formed payload of another gpu_serde version: a placeholder, never a dead worker.

    Device payloads are ``bytes`` whose first byte is the version; memory payloads are tuples
    whose first field is. Anything else is left to the validator (a ``PayloadError``).
    """
    if kind == "Device":
        version = payload[0] if type(payload) is bytes and payload else None
    else:
        first = payload[0] if type(payload) is tuple and payload else None
        version = first if type(first) is int and 0 <= first < 256 else None
    if version is None or version == VERSION:
        return None
    error = PayloadError(
        f"this {kind} was sent by a gpu_serde that writes payload version {version}; this one "
        f"reads version {VERSION}: install the same gpu_serde version on every process"
    )
    if strict:
        raise error
    return UnresolvedObject(kind, rebuild, payload, error)


def _rebuild_memory(kind: str, rebuild: Any, payload: object, validate: Any, body: Any) -> Any:
    """Shared path of the memory reconstructors: another version gives a placeholder, a malformed
    payload a ``PayloadError``; anything unexpected while rebuilding becomes a placeholder, never
    an exception in the unpickler (which would kill a Dask worker)."""
    from gpu_serde.errors import HandoffError

    other = _other_version(kind, rebuild, payload)
    if other is not None:
        return other
    validate(payload)
    try:
        return body(payload)
    except Exception as exc:
        if strict:
            raise
        error = (
            exc
            if isinstance(exc, HandoffError | DeviceNotVisibleError | PayloadError)
            else HandoffError(
                f"rebuilding a {kind} failed unexpectedly: {type(exc).__name__}: {exc}"
            )
        )
        return UnresolvedObject(kind, rebuild, payload, error)


def dev(payload: bytes) -> Device | UnresolvedDevice | UnresolvedObject:
    """Reconstructor of a device payload: the local ``Device`` whose UUID the payload names.

    Returns an :class:`UnresolvedDevice` when no visible GPU has that UUID (never raises for that,
    unless ``install(strict=True)``). Receiving a payload installs gpu_serde's reducers in this
    process (unless :func:`gpu_serde.uninstall` was called), so a Device that came by UUID leaves
    by UUID.

    Raises:
        PayloadError: the payload is malformed.
        DeviceNotVisibleError: in strict mode only.
    """
    if type(payload) is not bytes or not payload or payload[0] != VERSION:
        other = _other_version("Device", dev, payload)
        if other is not None:
            return other
    validate_device(payload)
    if auto_install:
        from gpu_serde.reducers import install

        install(strict)
    inv = _inventory.cached or inventory()
    ordinal = inv.by_uuid.get(payload[1:17])
    if ordinal is not None:
        return Device(ordinal)
    if strict:
        raise not_visible_error(decode_device(payload), inv)
    return UnresolvedDevice(payload, inv)


def pool(payload: tuple) -> Any:
    """Reconstructor of a memory-pool payload: the pool imported in this process (once), the
    original pool back in its exporter, or an :class:`UnresolvedObject` placeholder.

    Raises:
        PayloadError: the payload is malformed.
    """
    from gpu_serde import memory
    from gpu_serde.payload import validate_pool

    return _rebuild_memory(
        "DeviceMemoryResource", pool, payload, validate_pool, memory.rebuild_pool
    )


def buf(payload: tuple) -> Any:
    """Reconstructor of a buffer payload: the exporter's buffer mapped here without a copy, or an
    :class:`UnresolvedObject` placeholder.

    Raises:
        PayloadError: the payload is malformed.
    """
    from gpu_serde import memory
    from gpu_serde.payload import validate_buffer

    return _rebuild_memory("Buffer", buf, payload, validate_buffer, memory.rebuild_buffer)


def vmo(payload: tuple) -> Any:
    """Reconstructor of ``VirtualMemoryResourceOptions``: the options with their peers on this
    process's ordinals, or an :class:`UnresolvedObject` placeholder (a peer not visible here).

    Raises:
        PayloadError: the payload is malformed.
    """
    from gpu_serde import vmm
    from gpu_serde.payload import validate_options

    return _rebuild_memory(
        "VirtualMemoryResourceOptions", vmo, payload, validate_options, vmm.rebuild_options
    )


def vmm(payload: tuple) -> Any:
    """Reconstructor of a ``VirtualMemoryResource`` on this process's ordinal of the same GPU (peers
    too), or an :class:`UnresolvedObject` placeholder.

    Raises:
        PayloadError: the payload is malformed.
    """
    from gpu_serde import vmm as _vmm
    from gpu_serde.payload import validate_vmm

    return _rebuild_memory(
        "VirtualMemoryResource", vmm, payload, validate_vmm, _vmm.rebuild_resource
    )


def vbuf(payload: tuple) -> Any:
    """Reconstructor of a ``VirtualMemoryResource`` buffer: the exporter's allocation mapped here
    without a copy, or an :class:`UnresolvedObject` placeholder.

    Raises:
        PayloadError: the payload is malformed.
    """
    from gpu_serde import vmm
    from gpu_serde.payload import validate_vbuf

    return _rebuild_memory("Buffer", vbuf, payload, validate_vbuf, vmm.rebuild_buffer)
