"""``cuda.core.Device`` by GPU UUID: its reduce and its rebuild, side by side.

The reducer sends a device payload (:mod:`gpu_serde.format.device`): the GPU's UUID and, for
messages only, where the sender had it. The rebuild finds the GPU with that UUID among the GPUs
this process sees (the driver's own enumeration, cached), and gives this process's ``Device`` for
it, or a placeholder that raises :class:`~gpu_serde.DeviceNotVisibleError` when used.
"""

from __future__ import annotations

import logging
import os

from cuda.core import Device

from gpu_serde import inventory as _inventory
from gpu_serde import registry, wire
from gpu_serde.format.device import encode_device, raw_uuid, validate_device
from gpu_serde.identity import uuid_bytes
from gpu_serde.inventory import inventory
from gpu_serde.placeholders import Unseen

_flags = registry.flags

_payloads: dict[int, bytes] = {}  # ordinal -> payload: a process's GPUs never change
os.register_at_fork(after_in_child=_payloads.clear)


def _payload_for(ordinal: int) -> bytes:
    inv = inventory()
    if ordinal < len(inv.devices):
        info = inv.devices[ordinal]
        raw, mig, name = uuid_bytes(info.uuid), info.uuid.startswith("MIG-"), info.name
    else:  # pragma: no cover - the driver showed cuda.core a device it did not show us
        d = Device(ordinal)
        raw, mig, name = uuid_bytes(d.uuid), False, d.name
    return encode_device(raw, mig, ordinal, os.getpid(), inv.host, name)


def device_payload(dev: Device) -> bytes:
    """The wire bytes that name ``dev``'s GPU (cached per ordinal)."""
    ordinal = dev.device_id
    p = _payloads.get(ordinal)
    if p is None:
        p = _payloads[ordinal] = _payload_for(ordinal)
    return p


def reduce_device(dev: Device) -> tuple[object, tuple[bytes]]:
    """Reducer for ``cuda.core.Device``: ``(gpu_serde.wire.dev, (payload,))``."""
    p = _payloads.get(dev.device_id)
    return (wire.dev, (p if p is not None else device_payload(dev),))


def local_device(payload: bytes) -> Device:
    """This process's ``Device`` for a validated device payload.

    Raises:
        Unseen: no visible GPU has its UUID (the guard makes the placeholder).
    """
    inv = _inventory.cached or inventory()
    ordinal = inv.by_uuid.get(raw_uuid(payload))  # inventory.local_ordinal, inlined: hot path
    if ordinal is None:
        raise Unseen(payload, inv)
    return Device(ordinal)


def rebuild_device(payload: object) -> Device:
    """Rebuild body of :func:`gpu_serde.wire.dev`. Receiving a Device installs gpu_serde here
    (unless :func:`~gpu_serde.uninstall` or :func:`~gpu_serde.install` was called), so that a
    Device that came by UUID leaves by UUID.

    Raises:
        PayloadError: the payload is malformed; Unseen: its GPU is not visible here.
    """
    p = validate_device(payload)
    if _flags.auto_install:
        try:
            registry.install(_flags.strict)
        except Exception as exc:  # the Device itself is good: resolve it all the same
            _flags.auto_install = False
            logging.getLogger("gpu_serde").warning(
                "gpu_serde received a Device but could not install itself here: %s", exc
            )
    return local_device(p)
