"""GPU identity: canonical UUID strings, ``CUDA_VISIBLE_DEVICES`` and :class:`DeviceInfo`."""

from __future__ import annotations

import os
import re
from typing import NamedTuple

_HEX32 = re.compile(r"[0-9a-f]{32}")


class DeviceInfo(NamedTuple):
    """One GPU as this process sees it.

    Attributes:
        ordinal: the CUDA device ordinal in this process (``cuda.core.Device(ordinal)``).
        uuid: canonical UUID, ``GPU-<8-4-4-4-12 lowercase hex>`` (``MIG-...`` for a MIG instance).
        name: the device name reported by the driver.
        pci_bus_id: PCI bus id from the driver (``0000:19:00.0``), or ``""`` if unknown.
    """

    ordinal: int
    uuid: str
    name: str
    pci_bus_id: str


def _format(kind: str, raw: bytes) -> str:
    h = raw.hex()
    return f"{kind}-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def canonical_uuid(value: str | bytes | bytearray, *, mig: bool = False) -> str:
    """Return the canonical form ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` of a GPU UUID.

    Accepts cuda.core's bare hex (``80af18ad-db29-...``), NVML's ``GPU-...`` and ``MIG-...``,
    any letter case, and the driver's 16 raw bytes. ``mig=True`` gives ``MIG-`` to a UUID that
    carries no prefix of its own.

    Raises:
        ValueError: ``value`` is not a complete GPU or MIG UUID in one of those forms.
    """
    if isinstance(value, (bytes, bytearray)):
        if len(value) != 16:
            raise ValueError(f"a raw GPU UUID is 16 bytes, got {len(value)}")
        return _format("MIG" if mig else "GPU", bytes(value))
    if not isinstance(value, str):
        raise ValueError(f"a GPU UUID is a str or 16 bytes, got {type(value).__name__}")
    text = value.strip()
    kind = "MIG" if mig else "GPU"
    head = text[:4].upper()
    if head in ("GPU-", "MIG-"):
        kind, text = head[:3], text[4:]
    digits = text.replace("-", "").lower()
    groups = [len(g) for g in text.split("-")]
    if not _HEX32.fullmatch(digits) or groups not in ([32], [8, 4, 4, 4, 12]):
        raise ValueError(
            f"{value!r} is not a GPU UUID: expected 'GPU-' or 'MIG-' and 32 hex digits "
            "(8-4-4-4-12), cuda.core's bare hex, or 16 raw bytes"
        )
    return _format(kind, bytes.fromhex(digits))


def uuid_bytes(value: str | bytes | bytearray) -> bytes:
    """Return the 16 raw bytes of a GPU UUID given in any form :func:`canonical_uuid` accepts."""
    return bytes.fromhex(canonical_uuid(value)[4:].replace("-", ""))


def cuda_visible_devices() -> str | None:
    """Return this process's ``CUDA_VISIBLE_DEVICES``, or ``None`` when it is unset."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def describe_cuda_visible_devices(value: str | None) -> str:
    """Render a ``CUDA_VISIBLE_DEVICES`` value for messages (``unset``, ``""`` or the string)."""
    return "unset" if value is None else repr(value)


def mig_prefixes(cvd: str | None) -> list[str]:
    """Return the lowercase hex digits of each ``MIG-`` entry of ``CUDA_VISIBLE_DEVICES``."""
    if not cvd:
        return []
    return [
        e.strip()[4:].replace("-", "").lower()
        for e in cvd.split(",")
        if e.strip()[:4].upper() == "MIG-"
    ]
