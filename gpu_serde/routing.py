"""Routing: which GPU a piece of work is for, the shared half of ``gpu_serde.dask.on`` and
``gpu_serde.ray.on``.

:func:`target_uuid` turns what a user hands to ``on()`` (a ``Device``, a placeholder, a pool, a
buffer, or a list of them) into one canonical GPU UUID. The engine modules
(:mod:`gpu_serde.dask.placement`, :mod:`gpu_serde.ray.placement`) then find where that GPU is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cuda.core import Buffer, Device, MemoryResource

from gpu_serde.errors import DeviceNotVisibleError, PlacementError
from gpu_serde.inventory import inventory
from gpu_serde.placeholders import UnresolvedDevice, UnresolvedObject, placeholder_uuid

ACCEPTED = (
    "a cuda.core Device, a gpu_serde.UnresolvedDevice placeholder, a device memory resource "
    "(DeviceMemoryResource, VirtualMemoryResource, ArenaMemoryResource), a Buffer from one, or a "
    "list or tuple of them"
)


def _local_uuid(ordinal: int, what: str) -> str:
    """The canonical UUID of this process's CUDA device ``ordinal``."""
    inv = inventory()
    if 0 <= ordinal < len(inv.devices):
        return inv.devices[ordinal].uuid
    raise DeviceNotVisibleError(
        f"{what} is on CUDA device {ordinal} of this process, which sees no such GPU:\n"
        f"{inv.describe()}",
        visible=inv.devices,
    )


def _one_uuid(obj: Any) -> str:
    if isinstance(obj, UnresolvedDevice):
        return placeholder_uuid(obj)
    if isinstance(obj, UnresolvedObject):  # (its GPU may be a peer's, not where it lives)
        raise obj._error()  # why it could not be rebuilt here: route by its Device instead
    if isinstance(obj, Device):
        return _local_uuid(obj.device_id, f"Device({obj.device_id})")
    if isinstance(obj, Buffer):
        mr = obj.memory_resource
        if mr is None and int(obj.handle) == 0:  # cuda.core's closed Buffer says no more
            raise ValueError(
                "on() was given a closed Buffer: it has no memory, and so no GPU; route by its "
                "Device or memory resource, or before you close it"
            )
        ordinal = mr.device_id if mr is not None else obj.device_id
        what = "this Buffer"
        if not obj.is_device_accessible or ordinal < 0:
            raise TypeError(f"{what} is host memory: it has no GPU to send work to")
        return _local_uuid(ordinal, what)
    if isinstance(obj, MemoryResource):
        what = f"this {type(obj).__name__}"
        if not obj.is_device_accessible or obj.device_id < 0:
            raise TypeError(f"{what} is host memory: it has no GPU to send work to")
        return _local_uuid(obj.device_id, what)
    if isinstance(obj, bool | int):
        raise TypeError(
            f"on() takes {ACCEPTED}, not an ordinal ({obj!r}): an ordinal means another GPU in "
            "each process; pass cuda.core.Device(ordinal)"
        )
    raise TypeError(f"on() takes {ACCEPTED}, not {type(obj).__name__}")


#: What the routing resources' names start with: a Dask worker publishes ``gpu_serde:GPU-<uuid>``
#: for its own GPU, and a Ray node declares it for ``on(exclusive=True)``. The prefix says whose
#: they are wherever resources are listed (``scheduler_info()``, dashboards, ``ray status``).
RESOURCE_PREFIX = "gpu_serde:"


def resource_name(uuid: str) -> str:
    """The name of the routing resource for the GPU with canonical UUID ``uuid``
    (``gpu_serde:GPU-...``): what ``on()`` asks for on Dask, and on Ray with ``exclusive=True``."""
    return RESOURCE_PREFIX + uuid


def target_uuid(obj: Any) -> str:
    """Return the canonical UUID (``GPU-...``/``MIG-...``) of the GPU that ``obj`` lives on.

    Args:
        obj: a ``cuda.core.Device`` (of this process), an :class:`~gpu_serde.UnresolvedDevice`
            (a Device whose GPU this process cannot see), a device memory resource
            (``mr.device_id``), a ``Buffer`` (its memory resource's device), or a non-empty list
            or tuple of those, all on one GPU.

    Raises:
        TypeError: ``obj`` is none of those (an int ordinal included), or is host memory.
        ValueError: ``obj`` is a closed ``Buffer``.
        PlacementError: a list is empty, or holds objects on different GPUs.
        DeviceNotVisibleError: a Device or memory names an ordinal this process does not see.
        DeviceNotVisibleError, PayloadError, HandoffError: ``obj`` is an
            :class:`~gpu_serde.UnresolvedObject`: its own error (a GPU not visible here, a
            malformed payload, a gone exporter, ...); route by a Device of its GPU instead.
    """
    if isinstance(obj, list | tuple):
        items: Iterable[Any] = obj
        uuids = {_one_uuid(x) for x in items}
        if not uuids:
            raise PlacementError("on() was given an empty list: there is no GPU to send work to")
        if len(uuids) > 1:
            raise PlacementError(
                f"on() was given objects on {len(uuids)} different GPUs "
                f"({', '.join(sorted(uuids))}): one task runs where one GPU is; split the work, "
                "or route by one of them"
            )
        return uuids.pop()
    return _one_uuid(obj)


def ownership_notes(gpus: list[tuple[int, str]], engine: str) -> list[str]:
    """Doctor's lines on where ``on()`` sends work, for one worker (Dask) or node (Ray) whose GPU
    map (ordinal, canonical UUID) is ``gpus``."""
    if not gpus:
        return []
    if engine == "dask":
        return [f"owns {gpus[0][1]} (its device 0): gpu_serde.dask.on() sends that GPU's work here"]
    listed = ", ".join(u for _, u in gpus)
    return [f"has {listed}: gpu_serde.ray.on() sends their work to this node"]
