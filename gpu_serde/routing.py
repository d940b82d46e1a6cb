"""Routing: which GPU a piece of work is for, the shared half of ``gpu_serde.dask.on`` and
``gpu_serde.ray.on``.

:func:`target_uuid` turns what a user hands to ``on()`` (a ``Device``, a placeholder, a pool, a
buffer, or a list of them) into one canonical GPU UUID. The engine modules
(:mod:`gpu_serde.dask.placement`, :mod:`gpu_serde.ray.placement`) then find where that GPU is.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from cuda.core import Buffer, Device, MemoryResource

from gpu_serde.errors import DeviceNotVisibleError, OtherHostError, PlacementError
from gpu_serde.format.device import decode_device
from gpu_serde.identity import canonical_uuid, uuid_bytes
from gpu_serde.inventory import inventory
from gpu_serde.placeholders import UnresolvedDevice, UnresolvedObject, placeholder_uuid
from gpu_serde.text import quoted

ACCEPTED = (
    "a GPU's UUID ('GPU-...'), a cuda.core Device, a gpu_serde.UnresolvedDevice placeholder, a "
    "device memory resource (DeviceMemoryResource, VirtualMemoryResource, ArenaMemoryResource), "
    "a Buffer from one, a CUDA torch tensor or CuPy array (or what gpu_serde.share made of one, "
    "or a placeholder of one sent from a GPU not seen here), or a list or tuple of them"
)

#: The rebuilds of tensors and arrays whose placeholder names the GPU it was sent from.
_TENSOR_WIRES = ("tval", "tipc", "tshr")

#: The reasons of a tensor's placeholder that routing answers: it is the GPU that is not here.
#: Any other (a gone exporter, a refused token, a malformed payload) is raised as it is.
_ROUTABLE = (DeviceNotVisibleError, OtherHostError)


def _sent_from(placeholder: UnresolvedObject) -> str | None:
    """The canonical UUID of the GPU a tensor's or array's placeholder was sent from, when its
    reason is that this process does not see that GPU (or is on another host); else None."""
    from gpu_serde.format import tensor as formats

    rebuild = placeholder._rebuild
    name = getattr(rebuild, "__name__", "")
    if getattr(rebuild, "__module__", "") != "gpu_serde.wire" or name not in _TENSOR_WIRES:
        return None
    if not isinstance(placeholder._error_, _ROUTABLE) or len(placeholder._args) != 1:
        return None
    try:
        p = getattr(formats, f"decode_{name}")(placeholder._args[0])
        device = p.block.region.device if name == "tshr" else p.device
        return decode_device(device).canonical_uuid
    except Exception:  # malformed: its own error says so
        return None


def _tensor_uuid(obj: Any) -> str | None:
    """The canonical UUID of the GPU a torch tensor, CuPy array or ``Shared`` lives on, or None
    for anything else (neither library is imported here: only one already in use is asked).

    Raises:
        TypeError: a tensor or array that is not on a CUDA GPU.
    """
    sharing = sys.modules.get("gpu_serde.tensors.sharing")  # a Shared exists only once it is
    if sharing is not None and isinstance(obj, sharing.Shared):
        return _local_uuid(obj.ordinal, f"this shared {obj.library} object")
    torch, cupy = sys.modules.get("torch"), sys.modules.get("cupy")
    if torch is not None and isinstance(obj, torch.Tensor):
        device = obj.device
        if device.type != "cuda":
            raise TypeError(
                f"this {type(obj).__name__} is on {device}, not a CUDA GPU: it has no GPU to "
                "send work to"
            )
        return _local_uuid(int(device.index), f"this {type(obj).__name__}")
    if cupy is not None and isinstance(obj, cupy.ndarray):
        return _local_uuid(int(obj.device.id), "this cupy.ndarray")
    return None


def _named_uuid(text: str) -> str:
    """The canonical form of a GPU named by its UUID: ``GPU-...`` or ``MIG-...``, or cuda.core's
    bare hex (``Device.uuid``) of a GPU this process sees, which says whether it is a MIG
    instance. No process's numbering is involved.

    Raises:
        TypeError: ``text`` is no UUID (an ordinal, ``"cuda:1"``): it names another GPU in each
            process.
        ValueError: it starts as a UUID does but is not a complete one, or is bare hex of no
            GPU this process sees (it cannot tell a GPU from a MIG instance).
    """
    head = text.strip()[:4].upper()
    try:
        canonical = canonical_uuid(text)
    except ValueError:
        if head in ("GPU-", "MIG-"):
            raise ValueError(
                f"on() was given {quoted(text)}, which is not a GPU UUID: 'GPU-' or 'MIG-' and "
                "32 hex digits (8-4-4-4-12)"
            ) from None
        raise TypeError(
            f"on() takes a GPU by its UUID ('GPU-' and 32 hex digits, as "
            f"gpu_serde.visible_devices() and nvidia-smi -L show it), not {quoted(text)}: a "
            "string that is not a UUID (an ordinal, 'cuda:1') names another GPU in each process"
        ) from None
    if head in ("GPU-", "MIG-"):
        return canonical
    inv = inventory()  # bare hex: this process's own GPU (cuda.core's Device.uuid) or nothing
    ordinal = inv.by_uuid.get(uuid_bytes(canonical))
    if ordinal is None:
        raise ValueError(
            f"on() was given {quoted(text)}, a UUID without its 'GPU-' or 'MIG-' prefix, and "
            "this process sees no GPU with it: write the UUID with its prefix"
        )
    return inv.devices[ordinal].uuid


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
    if isinstance(obj, UnresolvedObject):
        sent_from = _sent_from(obj)  # a tensor sent by value or shared: where it was sent from
        if sent_from is not None:
            return sent_from
        # memory's error may name a peer's GPU, not where it lives: route by its Device instead
        raise obj._error()
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
    if isinstance(obj, str):
        return _named_uuid(obj)
    tensor = _tensor_uuid(obj)
    if tensor is not None:
        return tensor
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
        obj: a GPU's UUID (a str: ``GPU-...``, ``MIG-...``, or cuda.core's bare hex as
            ``Device.uuid`` gives it, of a GPU this process sees), a ``cuda.core.Device`` (of
            this process), an :class:`~gpu_serde.UnresolvedDevice` (a Device whose GPU this
            process cannot see), a device memory resource
            (``mr.device_id``), a ``Buffer`` (its memory resource's device), a CUDA torch
            tensor or CuPy array (its device), what :func:`gpu_serde.share` made of one, a
            placeholder of a tensor or array sent by value or shared from a GPU this process
            does not see (the GPU it was sent from), or a non-empty list or tuple of those, all
            on one GPU.

    Raises:
        TypeError: ``obj`` is none of those (an int ordinal or another str included), or is
            host memory (a CPU tensor too).
        ValueError: ``obj`` is a closed ``Buffer``, a str that starts as a UUID does but is not
            a complete one, or bare hex of no GPU this process sees.
        PlacementError: a list is empty, or holds objects on different GPUs.
        DeviceNotVisibleError: a Device or memory names an ordinal this process does not see.
        DeviceNotVisibleError, PayloadError, HandoffError: ``obj`` is an
            :class:`~gpu_serde.UnresolvedObject` of memory (not a tensor's), or a malformed
            one: its own error (a GPU not visible here, a gone exporter, ...); route by a
            Device of its GPU instead.
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
