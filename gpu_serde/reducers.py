"""Pickle registration for cuda.core objects: reducers, ``install``/``uninstall``, ``resolve``.

``install()`` registers a reducer for :class:`cuda.core.Device` in :mod:`copyreg` (used by stdlib
pickle, cloudpickle, Ray and Dask) and in :mod:`multiprocessing.reduction`. The reducer sends a
versioned plain-data payload (:mod:`gpu_serde.payload`) rebuilt by :func:`gpu_serde.wire.dev`.
"""

from __future__ import annotations

import copyreg
import logging
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
_saved: dict[tuple[str, type], Any] = {}
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


def device_payload(dev: Device) -> bytes:
    """The wire bytes that name ``dev``'s GPU (cached per ordinal)."""
    ordinal = dev.device_id
    p = _payloads.get(ordinal)
    if p is None:
        p = _payloads[ordinal] = _payload_for(dev, ordinal)
    return p


def reduce_device(dev: Device) -> tuple:
    """Reducer for ``cuda.core.Device``: ``(gpu_serde.wire.dev, (payload,))``."""
    p = _payloads.get(dev.device_id)
    return (wire.dev, (p if p is not None else device_payload(dev),))


def _reducers() -> dict[type, Any]:
    from cuda.core import (
        Buffer,
        DeviceMemoryResource,
        PinnedMemoryResource,
        VirtualMemoryResource,
        VirtualMemoryResourceOptions,
    )

    from gpu_serde import memory, vmm

    return {
        Device: reduce_device,
        DeviceMemoryResource: memory.reduce_pool,
        PinnedMemoryResource: memory.reduce_pool,
        Buffer: memory.reduce_buffer,
        VirtualMemoryResource: vmm.reduce_resource,
        VirtualMemoryResourceOptions: vmm.reduce_options,
    }


def install(strict: bool = False) -> None:
    """Make this process pickle ``cuda.core`` objects by GPU UUID.

    Registers reducers for ``Device``, ``DeviceMemoryResource`` and ``PinnedMemoryResource``
    (IPC-enabled pools), ``VirtualMemoryResource`` and ``VirtualMemoryResourceOptions`` (device
    and peers by UUID) and ``Buffer`` (from those resources) with :mod:`copyreg` (stdlib
    pickle, cloudpickle, Ray, Dask) and with :mod:`multiprocessing`'s ``ForkingPickler``
    (replacing cuda.core's own ordinal-based ones while installed). Idempotent: calling it
    again only sets ``strict``.

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
        for cls, reducer in _reducers().items():
            _saved[("copyreg", cls)] = copyreg.dispatch_table.get(cls)
            _saved[("mp", cls)] = ForkingPickler._extra_reducers.get(cls)
            copyreg.pickle(cls, reducer)
            ForkingPickler.register(cls, reducer)  # replaces cuda.core's ordinal reducers
        _installed = True


def ensure_installed(engine: str = "") -> None:
    """:func:`install`, keeping this process's ``strict`` setting: what the Ray and Dask adapters
    call, so that they never silently undo a user's ``install(strict=True)``. Under an
    ``engine`` ("Ray", "Dask") strict mode is logged as a warning, since it makes unpickling raise
    there."""
    strict = wire.strict
    install(strict)
    if engine and strict:
        logging.getLogger("gpu_serde").warning(
            "gpu_serde is installed with strict=True under %s: a payload this process cannot "
            "rebuild raises while unpickling (a Dask worker dies of it; Ray hides the error "
            "type). Call gpu_serde.install() without strict=True to get placeholders instead.",
            engine,
        )


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
        tables = {"copyreg": copyreg.dispatch_table, "mp": ForkingPickler._extra_reducers}
        for (name, cls), previous in list(_saved.items()):
            if previous is None:
                tables[name].pop(cls, None)
            else:
                tables[name][cls] = previous
        _saved.clear()
        _installed = False


def is_installed() -> bool:
    """True while the reducers are registered in this process."""
    return _installed


def resolve(obj: Any) -> Any:
    """Return a received object as the real thing, or raise if its GPU is not visible here.

    Raises:
        DeviceNotVisibleError: ``obj`` is a placeholder (:class:`~gpu_serde.UnresolvedDevice`);
            the message says which GPU was meant, where it lives, and what this process sees.
        HandoffError: ``obj`` is an :class:`~gpu_serde.UnresolvedObject` for memory: the
            subclass says why (``OtherHostError``, ``ExporterGoneError``, ``TokenRefusedError``),
            or it raises ``DeviceNotVisibleError`` for memory of a GPU not visible here.
        PayloadError: ``obj`` came from a gpu_serde that writes another payload version.

    A ``Device`` comes back as the calling thread's object for the same GPU (cuda.core keeps one
    per thread; call ``resolve`` in the thread that uses it). Lists, tuples (named ones too) and
    dicts are resolved item by item, nested ones too, and raise for the first placeholder in
    them; one that holds a ``Device`` comes back as a new container of the same type, any other
    as itself. Every other object is returned unchanged.
    """
    return _resolve(obj, set())


def _resolve(obj: Any, busy: set[int]) -> Any:
    if isinstance(obj, (wire.UnresolvedDevice, wire.UnresolvedObject)):
        raise obj._error()
    if isinstance(obj, Device):
        return Device(obj.device_id)  # this thread's object (Dask unpickles in another thread)
    kind = type(obj)
    if kind not in (list, tuple, dict) and not (isinstance(obj, tuple) and hasattr(kind, "_make")):
        return obj
    if id(obj) in busy:  # a container that holds itself
        return obj
    busy.add(id(obj))
    try:
        if kind is dict:
            items = {k: _resolve(v, busy) for k, v in obj.items()}
            same = all(items[k] is v for k, v in obj.items())
        else:
            items = [_resolve(v, busy) for v in obj]
            same = all(a is b for a, b in zip(items, obj, strict=True))
    finally:
        busy.discard(id(obj))
    if same:
        return obj
    return kind(items) if kind in (list, tuple, dict) else kind._make(items)  # a named tuple
