"""Pickle registration for cuda.core objects: reducers, ``install``/``uninstall``, ``resolve``.

``install()`` registers a reducer for :class:`cuda.core.Device` in :mod:`copyreg` (used by stdlib
pickle, cloudpickle, Ray and Dask) and in :mod:`multiprocessing.reduction`. The reducer sends a
versioned plain-data payload (:mod:`gpu_serde.payload`) rebuilt by :func:`gpu_serde.wire.dev`.
"""

from __future__ import annotations

import copyreg
import os
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any

from cuda.core import Device

from gpu_serde import wire
from gpu_serde.identity import uuid_bytes
from gpu_serde.inventory import inventory
from gpu_serde.payload import encode_device

_lock = threading.Lock()
_installed = False
_saved: dict[str, Any] = {}
_payloads: dict[int, bytes] = {}
os.register_at_fork(after_in_child=_payloads.clear)


def _payload_for(dev: Device, ordinal: int) -> bytes:
    inv = inventory()
    if ordinal < len(inv.devices):
        info = inv.devices[ordinal]
        raw, mig, name = uuid_bytes(info.uuid), info.uuid.startswith("MIG-"), info.name
    else:  # pragma: no cover - the driver showed cuda.core a device it did not show us
        raw, mig, name = uuid_bytes(dev.uuid), False, dev.name
    return encode_device(raw, mig, ordinal, os.getpid(), inv.host, name)


def reduce_device(dev: Device) -> tuple:
    """Reducer for ``cuda.core.Device``: ``(gpu_serde.wire.dev, (payload,))``."""
    ordinal = dev.device_id
    p = _payloads.get(ordinal)
    if p is None:
        p = _payloads[ordinal] = _payload_for(dev, ordinal)
    return (wire.dev, (p,))


def install(strict: bool = False) -> None:
    """Make this process pickle ``cuda.core`` objects by GPU UUID.

    Registers the reducers with :mod:`copyreg` (stdlib pickle, cloudpickle, Ray, Dask) and with
    :mod:`multiprocessing`'s ``ForkingPickler``. Idempotent: calling it again only sets ``strict``.

    Args:
        strict: when True, unpickling a Device whose GPU is not visible here raises
            :class:`~gpu_serde.DeviceNotVisibleError` at once instead of returning a placeholder.
            For plain ``multiprocessing``; leave it False under Ray and Dask (a reconstructor that
            raises kills a Dask worker and hides the error type from Ray).
    """
    global _installed
    with _lock:
        wire.strict = bool(strict)
        wire.auto_install = False
        if _installed:
            return
        _saved["copyreg"] = copyreg.dispatch_table.get(Device)
        _saved["mp"] = ForkingPickler._extra_reducers.get(Device)
        copyreg.pickle(Device, reduce_device)
        ForkingPickler.register(Device, reduce_device)
        _installed = True


def uninstall() -> None:
    """Undo :func:`install`: ``cuda.core`` objects pickle as cuda.core itself does (by ordinal).

    gpu_serde payloads still unpickle afterwards, but no longer install the reducers by themselves.
    """
    global _installed
    with _lock:
        wire.strict = False
        wire.auto_install = False
        if not _installed:
            return
        for table, key in (
            (copyreg.dispatch_table, "copyreg"),
            (ForkingPickler._extra_reducers, "mp"),
        ):
            previous = _saved.pop(key, None)
            if previous is None:
                table.pop(Device, None)
            else:
                table[Device] = previous
        _installed = False


def is_installed() -> bool:
    """True while the reducers are registered in this process."""
    return _installed


def resolve(obj: Any) -> Any:
    """Return a received object as the real thing, or raise if its GPU is not visible here.

    Raises:
        DeviceNotVisibleError: ``obj`` is a placeholder (:class:`~gpu_serde.UnresolvedDevice`);
            the message says which GPU was meant, where it lives, and what this process sees.

    Every other object is returned unchanged.
    """
    if isinstance(obj, wire.UnresolvedDevice):
        raise obj._error()
    return obj
